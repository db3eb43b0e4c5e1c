"""The trn1 code path on XLA:CPU (torch-xla, PJRT_DEVICE=CPU, one process).

On Trainium every new graph costs minutes of neuronx-cc and every host read stalls the device.
These tests run train.py itself (scripts/xla_check.py wraps its train_step and sync to read
torch-xla's counters and every graph run) in a subprocess, so that PJRT_DEVICE and the metrics
never leak into other tests:
  - the tiny model trains 24 steps through log, eval and checkpoint steps, then resumes from its
    last checkpoint for 4 more; after the warm-up (the first step, the first log, eval and
    save) no graph is compiled, the later logs, evals and saves, the steps after them and the
    resumed steps included, the first one too (aws-neuron-sdk #813: recompiling after a checkpoint);
  - the graph census: a step is a token-count graph, one graph per microbatch (the first creates
    the gradients, the later ones add to them) and the reduce/clip/update graph, as NxD cuts it;
    their HLO sizes are the same at 2 and at 8 microbatches (one graph for the whole step would
    hold every microbatch's model copy);
  - no step reads anything back to the host, and neither does the loop between steps except at
    log, eval and checkpoint steps;
  - the pipeline step's census (scripts/pp_graphs.py: PP=2 1F1B, both stages in this one process,
    the pair all-gather of the point-to-point stood in for): a graph per forward, backward and
    exchange, the same graphs at 2, 4 and 8 microbatches, no compile after the first step or
    after a resume, no host read, no weight written out transposed;
  - the first losses equal eager CPU's within 1e-4 (fp32) with functionalization on (what
    scripts/env.sh sets, as NxD's 70B scripts); off (Neuron's default: train.py refuses it) the forward differs;
  - the HLO of a bf16 step: every matmul in bf16 on the explicit attention path, and no infinity
    in any tensor (only as a max-reduction's start value);
  - every graph of the run keeps to what neuronx-cc computes as written (neuron_violations: no f64
    tensor, no integer matmul, scatter-add, power or reduction, no int64 input but the batch's).
"""
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import cache_arg

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow         # each test runs train.py on XLA:CPU in a subprocess
STEPS, LOG, EVAL, SAVE, EAGER, RESUME = 24, 4, 10, 10, 3, 4
TINY = ["--model.n_layers=2", "--model.dim=64", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.ffn_dim=176", "--data.seq_len=32", "--data.global_batch=4", "--data.micro_batch=2",
        "--optim.warmup_steps=5", "--log.eval_windows=2", "--log.sample_tokens=4", "--precision=fp32",
        "--model.attention=explicit",           # what the trn1 presets run
        "--log.peak_tflops=1"]                  # as on a NeuronCore (its datasheet): XLA:CPU would otherwise
                                                # measure the model's matmul shapes, one setup graph each
HOST_READS = ("TransferFromDevice", "xla::_to_cpu", "aten::_local_scalar_dense")

# Looked up, not imported: its import (torch._dynamo, sympy; ~2 s CPU) at collection was paid by every session,
# the fast tier too, where no test here runs; every test runs torch_xla in its own child process.
if importlib.util.find_spec("torch_xla") is None:
    pytest.skip("torch_xla is not installed", allow_module_level=True)


def child_env(functionalization: bool = True):
    return {**os.environ, "PJRT_DEVICE": "CPU", "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
            "XLA_DISABLE_FUNCTIONALIZATION": "0" if functionalization else "1"}


def start(cmd: list[str], **env) -> subprocess.Popen:
    """cmd in XLA:CPU's environment (child_env, and env), started: the test takes its output with wait()."""
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**child_env(), **env})


def wait(p: subprocess.Popen, timeout: int = 600) -> subprocess.CompletedProcess:
    """What subprocess.run gives, of a process start() began; killed at the timeout, as run kills it."""
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise
    return subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)


def xla_check_start(out, args, **opts) -> tuple:
    """scripts/xla_check.py on train.py's args, every graph recorded, started (xla_check_report waits for it)."""
    cmd = [sys.executable, str(ROOT / "scripts" / "xla_check.py"), f"--json={out / 'report.json'}",
           f"--graphs={out}/graphs.txt", *[f"--{k.replace('_', '-')}={v}" for k, v in opts.items()], "--",
           *args, f"--out_dir={out}/out", f"--ckpt.dir={out}/out/ckpt", "--log.tensorboard=", cache_arg()]
    return out, start(cmd)


def xla_check_report(started: tuple) -> dict:
    """Its report, once it ended well."""
    out, p = started
    r = wait(p)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    print(r.stdout[-3000:])
    rep = json.loads((out / "report.json").read_text())
    rep["stdout"], rep["ckpt_dir"], rep["graphs"] = r.stdout, out / "out" / "ckpt", out / "graphs.txt.0"
    return rep


def xla_check(out, args, **opts) -> dict:
    """scripts/xla_check.py on train.py's args, every graph recorded; its report."""
    return xla_check_report(xla_check_start(out, args, **opts))


@pytest.fixture(scope="module")
def started(request, tmp_path_factory):
    """The module's three long children (run, run_accum8, probes: one XLA process each, ~1 core each, most of
    this file's time), those the selected tests need, started at once: on 2 cores two run side by side, where
    one after another left a core idle. Each fixture below waits for its own; one still running at the end of
    the module (a failed test) is killed."""
    needed = {n for item in request.session.items if item.module is request.module for n in item.fixturenames}
    todo = {"run": lambda: xla_check_start(tmp_path_factory.mktemp("xla"), RUN_ARGS, eager_steps=EAGER,
                                           resume_steps=RESUME),
            "run_accum8": lambda: xla_check_start(tmp_path_factory.mktemp("xla8"), ACCUM8_ARGS),
            "probes": lambda: start_probes(tmp_path_factory.mktemp("probes"))}
    procs = {name: begin() for name, begin in todo.items() if name in needed}
    yield procs
    for _, p in procs.values():
        if p.poll() is None:
            p.kill()
            p.communicate()


RUN_ARGS = [*TINY, f"--optim.max_steps={STEPS}", f"--log.interval={LOG}", f"--log.eval_interval={EVAL}",
            f"--ckpt.interval={SAVE}"]
ACCUM8_ARGS = [*[a for a in TINY if not a.startswith("--data.global_batch")], "--data.global_batch=16",
               "--optim.max_steps=3", "--log.interval=100", "--log.eval_interval=0", "--log.sample_tokens=0"]


@pytest.fixture(scope="module")
def run(started):
    """One XLA run of train.py (and an eager CPU reference of its first steps, and a resumed run), watched."""
    return xla_check_report(started["run"])


@pytest.fixture(scope="module")
def run_accum8(started):
    """The same model at 8 microbatches per step (global batch 16), 3 steps, no log, eval or save
    but the last step's."""
    return xla_check_report(started["run_accum8"])


def compiles(s, window):
    return s[window]["UncachedCompile"]


def test_xla_run_reaches_log_eval_and_checkpoint_steps(run):
    steps = run["xla"]["steps"]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    xla_out = run["stdout"].split("xla_check eager")[0].split("nanotrn:")[-2]        # the XLA run's log
    assert xla_out.count("val loss") == len({*range(EVAL, STEPS + 1, EVAL), STEPS}), xla_out[-2000:]   # and the last
    saved = sorted(p.name for p in run["ckpt_dir"].glob("step_*"))     # the last 3 are kept
    assert {f"step_{2 * SAVE:08d}", f"step_{STEPS:08d}", f"step_{STEPS + RESUME:08d}"} <= set(saved), saved
    assert f"step_{STEPS:08d} (step {STEPS})" in run["stdout"]           # the resumed run started there


def test_no_graph_compiled_after_warmup(run):
    """Graphs may be compiled only for a new kind of work: the first training step, the first log
    step (parameter norm, reading the metrics) and the first eval and checkpoint save. Every later
    step (the second too), log, eval and save included
    (a log right after a save, the steps after an eval and after a save: aws-neuron-sdk #813),
    must find its graph in the cache."""
    steps = run["xla"]["steps"]
    per_step = {s["step"]: (compiles(s, "in_step"), compiles(s, "after")) for s in steps}
    print("graphs compiled (in the step, after it):", per_step)
    allowed = {(1, 0), (LOG, 1), (EVAL, 1), (SAVE, 1)}      # the second step too: it runs step 1's graphs
    late = {(k, "in step" if w == 0 else "after it"): n for k, v in per_step.items() for w, n in enumerate(v)
            if n and (k, w) not in allowed and k < STEPS}       # after the last step: the final export
    assert not late, f"graphs compiled after warm-up (step, window): {late}; all: {per_step}"
    assert per_step[1][0] >= 1                            # the counters do see compiles
    # Resumed from the last checkpoint (same process, so its graph cache stands in for the
    # persistent neuronx-cc cache): loading is one graph of its own, and then no step, log, eval
    # or save compiles anything (issue 26: the loaded moments used to reach the first update as
    # slices of the optimizer's buffers, one more graph; optim.AdamW.load_state_dict now moves
    # each state tensor to the device whole).
    resumed = {s["step"]: (compiles(s, "in_step"), compiles(s, "after")) for s in run["resume"]["steps"]}
    print("resumed, graphs compiled:", resumed)
    assert len(resumed) == RESUME and resumed[1] == (0, 0), resumed
    assert not any(sum(v) for k, v in resumed.items() if 1 < k < RESUME), resumed
    assert run["resume"]["census"]["resume"]["runs"] == 1, run["resume"]["census"]


def test_bf16_run_compiles_nothing_after_warmup_nor_at_its_export(tmp_path):
    """The trn1 presets' bf16 weights (the module run above is fp32): the same rule, a resume
    included, and the run's end too: the final export converted each bf16 weight to fp32 on the
    device, one convert graph per weight shape compiled after the last step (6 here: minutes of
    neuronx-cc as the run ends, for nothing); it converts on the host. --precision=bf16: on XLA
    bf16_sr's graphs are bf16's (the device rounds, optim.build_optimizer), and XLA:CPU refuses
    bf16_sr since it would round to nearest (optim.check_rounding)."""
    args = [*[a for a in TINY if not a.startswith("--precision")], "--precision=bf16", "--optim.max_steps=6",
            "--log.interval=2", "--log.eval_interval=3", "--ckpt.interval=3"]
    rep = xla_check(tmp_path, args, resume_steps=2)
    per_step = {s["step"]: (compiles(s, "in_step"), compiles(s, "after")) for s in rep["xla"]["steps"]}
    print("bf16, graphs compiled (in the step, after it):", per_step)
    late = {(k, w): n for k, v in per_step.items() for w, n in enumerate(v) if n and (k, w) not in {(1, 0), (2, 1), (3, 1)}}
    assert not late and per_step[1][0] >= 1, per_step
    assert [s["in_step"]["UncachedCompile"] + s["after"]["UncachedCompile"] for s in rep["resume"]["steps"]] == [0, 0]
    assert "saved the final model" in rep["stdout"] and rep["resume"]["census"]["resume"]["runs"] == 1


def test_precompile_pass_covers_a_resume(run, tmp_path):
    """Issue 25, item 4: scripts/launch.sh compile's pass (NEURON_EXTRACT_GRAPHS_ONLY, 10 steps, eval
    every 4, a save every 5) writes nothing, yet leaves in the graph cache every graph that a run
    resuming from a real checkpoint then runs: the load graph, the resumed steps, an eval, a save.
    Same process (its graph cache stands in for neuronx-cc's persistent one); the
    checkpoint is the module run's, made in another process."""
    import shutil
    shutil.copytree(run["ckpt_dir"], tmp_path / "out" / "ckpt")
    last = STEPS + RESUME
    rep = xla_check(tmp_path, [*TINY, f"--optim.max_steps={last + 2}", f"--log.interval={LOG}",
                               f"--log.eval_interval={EVAL}", f"--ckpt.interval={SAVE}", "--log.sample_tokens=0"],
                    precompile_steps=10)
    assert not rep["precompile"]["wrote"] and len(rep["precompile"]["steps"]) == 10
    assert sum(c["compiled"] for c in rep["precompile"]["census"].values()) > 0     # the counters see compiles
    # and the pass compiles the update once: after its stand-in load (the optimizer state alone) the
    # next update was a graph of its own, which no real run has (minutes of neuronx-cc for nothing)
    assert rep["precompile"]["census"]["reduce/clip/update"]["compiled"] == 1, rep["precompile"]["census"]
    assert f"resuming from {tmp_path}/out/ckpt/step_{last:08d}" in rep["stdout"]
    census = rep["xla"]["census"]
    assert census["resume"]["runs"] == 1 and "eval" in census, census
    assert {k: c["compiled"] for k, c in census.items() if c["compiled"]} == {}, census


STEP_GRAPHS = ("token count", "first microbatch", "later microbatch", "reduce/clip/update")


def steady_sizes(report, last_step):
    """label -> HLO instructions of the graphs run at last_step (the warmed-up step)."""
    out = {}
    for g in report["xla"]["graphs"]:
        if g["step"] == last_step and g["label"] in STEP_GRAPHS:
            out.setdefault(g["label"], set()).add(g["instructions"])
    return out


def test_graph_census(run, run_accum8):
    """One graph per microbatch, as NxD and the HLAT scripts run it: after warm-up a step runs
    the token count, the first microbatch, each later microbatch (the same graph, accumulating)
    and the reduce/clip/update; the whole run adds only setup, log and eval graphs (saves and
    the resume load transfer tensors, they compile no step graph). The sizes do not depend on
    the number of microbatches but the token count's (a compare and a sum per microbatch: 37
    instructions at 2, 115 at 8)."""
    census = run["xla"]["census"]
    print("graph census, accumulation 2:", json.dumps(census, indent=1))
    print("graph census, accumulation 8:", json.dumps(run_accum8["xla"]["census"], indent=1))
    assert set(census) <= {*STEP_GRAPHS, "setup", "log", "eval"}, set(census)
    assert set(STEP_GRAPHS) <= set(census)
    runs = {k: v["runs"] for k, v in census.items()}
    assert runs["token count"] == runs["first microbatch"] == runs["later microbatch"] == runs["reduce/clip/update"] == STEPS
    assert sum(v["compiled"] for v in census.values()) <= 12, census        # a fixed, small set
    two, eight = steady_sizes(run, STEPS), steady_sizes(run_accum8, 3)
    assert eight["later microbatch"] == two["later microbatch"] and len(two["later microbatch"]) == 1
    assert run_accum8["xla"]["census"]["later microbatch"]["runs"] == 3 * 7
    for label in ("first microbatch", "later microbatch", "reduce/clip/update"):
        assert eight[label] == two[label], (label, two, eight)
    (t2,), (t8,) = two["token count"], eight["token count"]
    assert t8 - t2 <= 16 * 6 and t8 < 200, (t2, t8)       # a compare and a sum per microbatch


# An HLO instruction: name, element type and dimensions (none for a tuple), opcode.
INSTR = re.compile(r"^\s*(?:ROOT )?(%\S+) = (?:\([^)]*\)|(\w+)\[([^\]]*)\]\S*) ([\w-]+)\(", re.M)


def neuron_violations(hlo: str, batch: str) -> list[str]:
    """What neuronx-cc would change or refuse in a graph (aws-neuron-sdk docs, 2.32: data-types.rst, the compiler's
    error pages): no f64 on a NeuronCore (torch-xla's dtype.cpp casts F64 to F32 on NEURON: a scalar only, to keep
    its meaning), no complex (NCC_EVRF004), no dynamic shape (EMOD025); dot, power, scatter-with-compute, all-reduce
    and reduce-scatter of integers run through f32, exact only to 2^24, or int64 power through int32 (EVRF035/060/
    061/062/063); every int64 is downcast to int32 on trn1 (data-types.rst), so the only int64 inputs are the
    batch's tokens, targets, positions and doc ids (below the vocabulary and seq_len) and scalars; no sort or topk
    (EVRF013: integer topk refused; aws-neuron-sdk#868: argsort crashed) and no random numbers on the device
    (weights are initialised on the host, no dropout; bf16_sr rounds in hardware)."""
    bad = []
    for name, dt, dims, op in INSTR.findall(hlo):
        what = f"{name} = {dt or 'tuple'}[{dims}] {op}"
        if dt in ("c64", "c128") or (dt == "f64" and dims) or "<=" in dims:
            bad.append(f"{what}: no complex, f64 array or dynamic shape on Neuron")
        elif op in ("dot", "power", "scatter", "all-reduce", "reduce-scatter") and dt[:1] in ("s", "u"):
            bad.append(f"{what}: integer {op} (computed in f32, or int64 downcast)")
        elif op in ("rng", "rng-bit-generator", "rng-get-and-update-state", "sort", "topk"):
            bad.append(f"{what}: not on the device")
        elif dt in ("s64", "u64") and op == "parameter" and dims not in ("", batch):
            bad.append(f"{what}: an int64 input other than the batch's (downcast to int32 on trn1)")
    return bad


def test_every_graph_keeps_to_neurons_types_and_ops(run):
    """Every graph the run and its resume ran (steps, logs, evals, saves, the load), by neuron_violations.
    The checker's own counter-examples (an f64 tensor, an integer matmul and power, an int64 counter,
    torch.randint and torch.sort on the device) are each caught."""
    text = run["graphs"].read_text()
    graphs = {g.split("## END_GRAPH")[0] for g in text.split("## BEGIN_GRAPH")[1:]}
    bad = sorted({v for g in graphs for v in neuron_violations(g, "2,32")})      # TINY's [micro_batch, seq_len]
    print(f"{len(graphs)} distinct graphs, {sum(len(INSTR.findall(g)) for g in graphs)} instructions")
    assert len(graphs) >= 6 and not bad, bad
    counter = textwrap.dedent("""
        %p3.1 = s64[1]{0} parameter(3)
        %broadcast.6 = f64[3,4]{1,0} broadcast(f64[] %c.5), dimensions={}
        %dot.13 = s64[3,3]{1,0} dot(s64[3,4]{1,0} %a.1, s64[4,3]{1,0} %b.2), lhs_contracting_dims={1}
        %power.46 = s64[1]{0} power(s64[1]{0} %x.44, s64[1]{0} %y.45)
        %rng-bit-generator.26 = (u64[2]{0}, u64[4]{0}) rng-bit-generator(u64[2]{0} %s.25), algorithm=rng_default
        %sort.86 = (f32[5]{0}, s32[5]{0}) sort(f32[5]{0} %v.1, s32[5]{0} %i.2), dimensions={0}
        ROOT %p0.2 = s64[2,32]{1,0} parameter(0)""")
    assert [v.split(" = ")[0] for v in neuron_violations(counter, "2,32")] == [
        "%p3.1", "%broadcast.6", "%dot.13", "%power.46", "%rng-bit-generator.26", "%sort.86"]


def test_no_host_sync_outside_log_eval_and_checkpoint_steps(run):
    steps = run["xla"]["steps"]
    reading = {k for k in range(1, STEPS + 1) if k % LOG == 0 or k % EVAL == 0 or k % SAVE == 0}
    for s in steps:
        inside = {k: s["in_step"][k] for k in HOST_READS if s["in_step"][k]}
        assert not inside, f"step {s['step']} reads from the device inside the step: {inside}"
        if s["step"] not in reading and s["step"] < STEPS:
            between = {k: s["after"][k] for k in HOST_READS if s["after"][k]}
            assert not between, f"after step {s['step']} (no log/eval/save) the loop reads from the device: {between}"
    # and the counters do see reads: every log step reads loss and grad norm
    assert all(steps[k - 1]["after"]["TransferFromDevice"] > 0 for k in range(LOG, STEPS, LOG))


def test_first_losses_equal_eager_cpu(run):
    xla, eager = run["xla"]["losses"][:EAGER], run["eager"]["losses"]
    assert len(eager) == EAGER
    assert xla == pytest.approx(eager, abs=1e-4), (xla, eager)


def test_the_mixture_line_counts_the_windows_trained_on_not_those_prefetched(tmp_path):
    """torch-xla's MpDeviceLoader pulls batches ahead of the step (4 + 2 here): the logged mixture, recounted
    from the loader's own position, said 'over 28 windows' at step 2 of global batch 4. It now sums the
    stats of the batch last handed out (train.run_total): what eager CPU says, 4 windows a step."""
    import sources
    text = [Path(f).read_text() for f in sources.stdlib_files()[:40]]
    (tmp_path / "a.txt").write_text("\n\n".join(text[:20]))
    (tmp_path / "b.txt").write_text("\n\n".join(text[20:]))
    args = [*TINY, f"--data={tmp_path}/a.txt:0.7,{tmp_path}/b.txt:0.3", "--optim.max_steps=4", "--log.interval=2",
            "--log.eval_interval=2", "--ckpt.interval=0", "--log.tensorboard=", cache_arg()]
    lines = {}
    procs = {device: start([sys.executable, "train.py", *args, f"--device={device}", f"--out_dir={tmp_path}/{device}"])
             for device in ("xla", "cpu")}              # side by side: one core each
    for device, p in procs.items():
        r = wait(p)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        lines[device] = [x for x in r.stdout.splitlines() if "data mixture" in x]
    assert [x.split(":")[0] for x in lines["xla"]] == ["step      2 | data mixture over 8 windows",
                                                       "step      4 | data mixture over 16 windows"], lines
    assert lines["xla"] == lines["cpu"]


FORWARD = textwrap.dedent("""
    import json
    import torch, torch_xla
    import configs, parallel
    cfg = configs.from_args(["--model.n_layers=2", "--model.dim=64", "--model.n_heads=4", "--model.n_kv_heads=2",
                             "--model.ffn_dim=176", "--seq_len=32", "--global_batch=2", "--micro_batch=2",
                             "--precision=fp32", "--model.attention=explicit"])
    model = parallel.init_weights(parallel.build_model(cfg, parallel.Grid(), "cpu"), cfg, parallel.Grid())
    g = torch.Generator().manual_seed(0)
    tokens, targets = torch.randint(0, cfg.model.vocab_size, (2, 2, 32), generator=g)
    positions = torch.arange(32).expand(2, 32)
    with torch.no_grad():
        cpu = model(tokens, positions, None, targets).item()
        dev = torch_xla.device()
        xla = parallel.move_model(model, dev)(tokens.to(dev), positions.to(dev), None, targets.to(dev)).item()
    print(json.dumps({"cpu": cpu, "xla": xla}))
""")


def test_functionalization_off_computes_another_forward():
    """Why scripts/env.sh sets XLA_DISABLE_FUNCTIONALIZATION=0 (NxD's 70B scripts do too) and
    hardware.check_functionalization refuses it off (Neuron's default): with it off (read when torch_xla
    is imported: its own process), torch-xla 2.9 computes another forward of this model than eager CPU,
    on XLA:CPU already (a summed loss of 533.94 vs 533.13); with it on, eager CPU's. The model splits qkv
    and gate_up along the last dimension and writes through views, the pattern of pytorch/xla#8640. If
    this starts to pass, torch-xla has fixed it: the setting can then follow Neuron's default."""
    out = {}
    procs = {off: start([sys.executable, "-c", FORWARD], XLA_DISABLE_FUNCTIONALIZATION=off, PYTHONPATH=str(ROOT))
             for off in ("0", "1")}                     # side by side: one core each
    for off, p in procs.items():
        r = wait(p, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        out[off] = json.loads(r.stdout.strip().splitlines()[-1])
    print("functionalization on / off:", out)
    assert out["0"]["xla"] == pytest.approx(out["0"]["cpu"], rel=1e-5), out
    assert abs(out["1"]["xla"] - out["1"]["cpu"]) > 1e-4 * abs(out["1"]["cpu"]), out


STEP_HLO = textwrap.dedent("""
    import json, re
    import torch, torch_xla
    import configs, parallel, train
    dev = torch_xla.device()
    # Python numbers (a mask's fill value) would enter the graph as parameters, not constants:
    # make them constants, so an infinity shows in the HLO.
    torch_xla._XLAC._set_xla_all_numbers_special_scalars(True)
    out = {}
    for attention in ("explicit", "sdpa"):
        cfg = configs.from_args(["--model.n_layers=1", "--model.dim=32", "--model.n_heads=2", "--model.n_kv_heads=1",
                                 "--model.ffn_dim=64", "--model.vocab_size=64", "--seq_len=16", "--global_batch=2",
                                 "--micro_batch=2", "--precision=bf16", f"--model.attention={attention}"])
        model = parallel.init_weights(parallel.build_model(cfg, parallel.Grid(), dev), cfg, parallel.Grid())
        model = parallel.move_model(model, dev).to(torch.bfloat16)
        doc = (torch.arange(16) >= 6).long().expand(2, 16)          # two packed documents
        b = {"tokens": torch.randint(0, 64, (2, 16)), "targets": torch.randint(0, 64, (2, 16)),
             "positions": torch.arange(16) - 6 * doc, "doc_ids": doc}
        b = {k: v.to(dev) for k, v in b.items()}
        loss = model(b["tokens"], b["positions"], b["doc_ids"], b["targets"])
        loss.backward()                                  # one microbatch's graph: forward and backward
        hlo = torch_xla._XLAC._get_xla_tensors_hlo([loss] + [p.grad for p in model.parameters()])
        lines = re.findall(r"^\\s*(?:ROOT )?(%\\S+) = (\\w+)\\[[^\\]]*\\](?:\\{[^}]*\\})? (\\S+?)\\((.*)$", hlo, re.M)
        infs = {name for name, _, op, args in lines if op == "constant" and "inf" in args}
        # Follow each infinity: through broadcasts, reshapes and converts it is still itself; a
        # comparison with it (x == -inf) and a reduction's start value (max) are fine; any other
        # use puts an infinity into a tensor that arithmetic (or a transpose) would meet.
        tainted, uses = set(infs), []
        for name, _, op, args in lines:
            refs = re.findall(r"%[\\w.\\-]+", args)
            if not tainted.intersection(refs):
                continue
            if op in ("broadcast", "reshape", "convert", "copy", "bitcast"):
                tainted.add(name)
            elif op != "compare" and not (op == "reduce" and not tainted.intersection(refs[:len(refs) // 2])):
                uses.append(f"{op}({args[:100]}")
        out[attention] = {"dots": sorted({dt for _, dt, op, _ in lines if op == "dot"}),
                          "n_dots": sum(op == "dot" for _, _, op, _ in lines),
                          "inf_constants": len(infs), "inf_uses": uses}
    print(json.dumps(out))
""")


def test_step_hlo_has_bf16_matmuls_and_no_infinity(probes):
    """The HLO of one bf16 microbatch (forward and backward), read as neuronx-cc would get it.
    Explicit attention (the trn1 presets): every dot in bf16 (torch-xla lowers SDPA to the math
    path, which upcasts q, k, v and runs its matmuls in fp32: the counter-example). Both paths: an
    infinity appears only as a max-reduction's start value or in a comparison (SDPA's x == -inf),
    never in a tensor arithmetic uses, so no matmul or compiler-made transpose meets one
    (inf * 0 = NaN on trn1; the masks are finite)."""
    hlo = json.loads(probe(probes, "step_hlo").strip().splitlines()[-1])
    print(hlo)
    assert hlo["explicit"]["dots"] == ["bf16"] and hlo["explicit"]["n_dots"] >= 10, hlo
    assert "f32" in hlo["sdpa"]["dots"], hlo                      # the SDPA upcast
    for path in ("explicit", "sdpa"):
        assert hlo[path]["inf_constants"] >= 1, hlo                # the max-reductions' start values
        assert not hlo[path]["inf_uses"], (path, hlo[path]["inf_uses"])


OPTIMIZER_PROBE = textwrap.dedent("""
    import sys
    import torch, torch_xla, torch_xla.debug.metrics as met
    import configs, optim, parallel
    cfg = configs.from_args(["--model.n_layers=1", "--model.dim=32", "--model.n_heads=2", "--model.n_kv_heads=1",
                             "--model.ffn_dim=64", "--model.vocab_size=64", "--seq_len=8", "--global_batch=2",
                             "--micro_batch=2"])
    dev = torch_xla.device()
    model = parallel.init_weights(parallel.build_model(cfg, parallel.Grid(), dev), cfg, parallel.Grid())
    model = parallel.move_model(model, dev)
    opt = optim.build_optimizer(model, cfg, parallel.Grid())
    tokens = torch.randint(0, 64, (2, 8)).to(dev)
    def step(t):
        opt.step_count = t - 1
        opt.set_lr(optim.lr_at(t - 1, cfg.optim))
        model(tokens).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        torch_xla.sync()
    for t in (1, 2, 3):
        step(t)
    new = []
    for t in (4, 5, 50, 100, 200, 300, 320, 325, 326, 330, 400, 1000, 10**5):   # sqrt(1 - 0.95**t) == 1.0f from 326
        before = met.counter_value("UncachedCompile")
        step(t)
        if met.counter_value("UncachedCompile") > before:
            new.append(t)
    print("recompiled at optimizer steps", new)
    sys.exit(1 if new else 0)
""")


def test_optimizer_graph_does_not_change_over_a_long_run(probes):
    """The optimizer's graph must not depend on the step number: at step ~325 (beta2 = 0.95) a
    7B run on trn1 would stop for minutes of neuronx-cc, outside the pre-compiled graphs. Python
    floats (lr, bias corrections) enter the graph as constants when they hit a special value
    (sqrt(1 - 0.95^t) rounds to 1.0 in fp32 from t = 326): optim.AdamW sends them as a tensor."""
    print(probe(probes, "optimizer")[-2000:])


CHECKPOINTING_PROBE = textwrap.dedent("""
    import json
    import torch, torch_xla, torch_xla.debug.metrics as met
    import configs, model as llama, optim, parallel, train
    xla = torch_xla.device()              # before any backward (see scripts/xla_check.py)
    torch.manual_seed(0)
    T = 16
    doc_ids = (torch.arange(T) >= 6).long().expand(2, T)            # two packed documents
    batches = [{"tokens": torch.randint(0, 64, (2, T)), "targets": torch.randint(0, 64, (2, T)),
                "positions": torch.arange(T) - 6 * doc_ids, "doc_ids": doc_ids} for _ in range(4)]

    def reads():
        return (met.metric_data("TransferFromDeviceTime") or [0])[0]

    def run(mode, device, xla_ckpt, steps=5):
        cfg = configs.from_args(["--model.n_layers=2", "--model.dim=32", "--model.n_heads=4",
                                 "--model.n_kv_heads=2", "--model.ffn_dim=64", "--model.vocab_size=64",
                                 f"--seq_len={T}", "--global_batch=2", "--micro_batch=2", "--precision=fp32",
                                 f"--model.checkpointing={mode}"])
        grid = parallel.Grid()
        model = parallel.move_model(parallel.init_weights(parallel.build_model(cfg, grid, device), cfg, grid), device)
        if xla_ckpt:
            llama.use_xla_checkpointing(model)
        opt = optim.build_optimizer(model, cfg, grid)
        losses, compiles, barrier, host_reads = [], [], None, []
        if device.type == "xla":              # the backward graph's text (nothing runs), then drop it
            b = {k: v.to(device) for k, v in batches[0].items()}
            model(b["tokens"], b["positions"], b["doc_ids"], b["targets"]).backward()
            barrier = "opt-barrier" in torch_xla._XLAC._get_xla_tensors_hlo([p.grad for p in model.parameters()])
            opt.zero_grad()
            torch_xla.sync()
        for step in range(steps):
            opt.set_lr(optim.lr_at(step, cfg.optim))
            micro = [{k: v.to(device) for k, v in batches[step % 4].items()}]
            before, read = met.counter_value("UncachedCompile") or 0, reads()
            losses.append(train.train_step(model, opt, micro, grid, cfg)["loss"])
            train.sync(device)
            compiles.append((met.counter_value("UncachedCompile") or 0) - before)
            host_reads.append(reads() - read)
        return {"losses": [float(x) for x in losses], "compiles": compiles, "host_reads": host_reads,
                "barrier": barrier}

    without = run("none", xla, True, steps=0)["barrier"]          # the counter-example: no barrier
    for mode in ("selective", "full"):
        r = run(mode, xla, True)
        r.update(eager=run(mode, torch.device("cpu"), False)["losses"], barrier_without=without)
        print("RESULT", mode, json.dumps(r))
""")


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_checkpointing_on_xla(checkpointing_runs, mode):
    """model.use_xla_checkpointing (torch-xla's checkpoint: an optimization barrier before the
    recomputation, or XLA merges it with the forward and keeps the activations after all): the
    backward graph holds the barrier (without checkpointing it has none), the losses equal eager
    CPU's, and after two warm-up steps no graph is compiled. (torch's own non-reentrant checkpoint
    does not run on XLA in torch 2.9: AttributeError, torch has no attribute xla.)"""
    r = checkpointing_runs[mode]
    assert r["barrier"] and not r["barrier_without"], r
    assert r["losses"] == pytest.approx(r["eager"], abs=1e-4), r
    assert all(n == 0 for n in r["compiles"][2:]) and r["compiles"][0] >= 1, r["compiles"]
    assert not any(r["host_reads"]), f"host reads inside the steps: {r['host_reads']}"


@pytest.fixture(scope="module")
def checkpointing_runs(probes):
    out = {}
    for line in probe(probes, "checkpointing").splitlines():
        if line.startswith("RESULT "):
            _, mode, rest = line.split(" ", 2)
            out[mode] = json.loads(rest)
    print(out)
    return out


SKIP_CHILD = textwrap.dedent('''
    import json, sys
    import torch, torch_xla
    import torch_xla.debug.metrics as met
    sys.path.insert(0, ROOT)
    import configs, monitor, optim, parallel, train
    cfg = configs.from_args(["--model.n_layers=2", "--model.dim=32", "--model.n_heads=4", "--model.n_kv_heads=2",
                             "--model.ffn_dim=64", "--model.vocab_size=97", "--data.seq_len=16",
                             "--data.global_batch=4", "--data.micro_batch=2", "--log.on_nonfinite=skip",
                             "--log.interval=100", "--optim.warmup_steps=1", "--log.tensorboard="])   # no out/tb in the repository
    dev = torch_xla.device()
    model = parallel.init_weights(parallel.build_model(cfg, parallel.Grid(), dev), cfg, parallel.Grid())
    model = parallel.move_model(model, dev)
    opt = optim.build_optimizer(model, cfg)
    mon = monitor.Monitor(cfg, flops_per_token=1.0, peak_flops=0.0, device=dev, print_fn=lambda *a: None)
    reads = lambda: (met.metric_data("TransferFromDeviceTime") or [0])[0]
    sync = torch_xla.sync
    g = torch.Generator().manual_seed(0)
    transfers, weights, compiles = [], [], []
    for step in range(1, 7):
        toks = torch.randint(0, 97, (4, 17), generator=g)
        b = {"tokens": toks[:, :-1], "targets": toks[:, 1:], "positions": torch.arange(16).expand(4, 16),
             "doc_ids": torch.zeros(4, 16, dtype=torch.long)}
        micro = [{k: v[i:i + 2].to(dev) for k, v in b.items()} for i in (0, 2)]
        sync()
        poison = [p.register_hook(lambda x: x * float("nan")) for p in model.parameters()] if step == 3 else []
        before, compiled = reads(), met.counter_value("UncachedCompile") or 0
        out = train.train_step(model, opt, micro, parallel.Grid(), cfg, cut=sync,
                               guard=lambda loss, gnorm: mon.check_finite(step, loss, gnorm))
        sync()
        compiles.append((met.counter_value("UncachedCompile") or 0) - compiled)
        mon.step(step, loss=out["loss"], grad_norm=out["grad_norm"], lr=1e-3, tokens=64, skipped=out["skipped"])
        transfers.append(reads() - before)
        for h in poison:
            h.remove()
        weights.append(model.layers[0].attn.qkv_proj.weight.detach().clone())
        sync()
    mon.flush()                                   # the batched read: the verdicts come with the metrics
    w = [t.cpu() for t in weights]
    json.dump({"transfers": transfers, "compiles": compiles, "skipped": mon.skipped, "finite": bool(torch.isfinite(w[-1]).all()),
               "moved": [not torch.equal(a, b) for a, b in zip(w, w[1:])]}, open(OUT, "w"))
''')


def test_skip_nonfinite_decides_on_device(probes):
    """--log.on_nonfinite=skip on XLA:CPU: six steps of train.train_step, the third with NaN
    gradients: no step reads anything back (torch_xla's TransferFromDevice count stays put; the
    host check read the loss and norm every step), the third update does not land (a select on
    the device), the others do, and the flush reports exactly one skip. Only the first step and
    the poisoned one (its NaN hooks) compile graphs: step 2's update used to be a graph of its own."""
    probe(probes, "skip")
    res = json.loads(probes["skip_out"].read_text())
    print(res)
    assert res["transfers"] == [0] * 6, f"device-to-host transfers per step: {res['transfers']}"
    assert res["moved"] == [True, False, True, True, True], res["moved"]     # steps 2->3 unchanged
    assert res["compiles"][0] > 0 and res["compiles"][1] == 0 and res["compiles"][3:] == [0] * 3, res["compiles"]
    assert res["skipped"] == 1 and res["finite"]


# The four probes above share one child: each torch_xla start-up costs ~7 s of CPU, and each probe
# builds models of its own shapes (no graph of one is in another's cache: the compile counts hold).
# The device comes up before any backward (see scripts/xla_check.py); STEP_HLO runs last, as it
# sets a global (every Python number a special scalar). One probe's failure is its test's alone.
PROBE_DRIVER = textwrap.dedent("""
    import contextlib, io, json, sys, traceback
    import torch_xla
    torch_xla.device()
    results = {}
    for name, code, names in json.load(open(sys.argv[1])):
        out, rc, err = io.StringIO(), 0, ""
        try:
            with contextlib.redirect_stdout(out):
                exec(compile(code, name, "exec"), {"__name__": "__main__", **names})
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except BaseException:
            rc, err = 1, traceback.format_exc()
        results[name] = {"rc": rc, "stdout": out.getvalue(), "error": err}
    json.dump(results, open(sys.argv[2], "w"))
""")


def start_probes(tmp: Path) -> tuple:
    """PROBE_DRIVER over the four probes, in one XLA process, started (the fixture probes waits for it)."""
    names = {"ROOT": str(ROOT), "OUT": str(tmp / "skip.json")}
    todo = [("skip", SKIP_CHILD, names), ("optimizer", OPTIMIZER_PROBE, {}),
            ("checkpointing", CHECKPOINTING_PROBE, {}), ("step_hlo", STEP_HLO, {})]
    (tmp / "todo.json").write_text(json.dumps(todo))
    return tmp, start([sys.executable, "-c", PROBE_DRIVER, str(tmp / "todo.json"), str(tmp / "results.json")],
                      PYTHONPATH=str(ROOT))


@pytest.fixture(scope="module")
def probes(started):
    tmp, p = started["probes"]
    r = wait(p)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-5000:]
    return {**json.loads((tmp / "results.json").read_text()), "skip_out": tmp / "skip.json"}


def probe(probes: dict, name: str) -> str:
    """A probe's stdout, once it ended well."""
    r = probes[name]
    assert r["rc"] == 0, f"{name} probe: exit {r['rc']}\n{r['stdout'][-2000:]}\n{r['error'][-5000:]}"
    return r["stdout"]


PP_STEPS, PP_RESUMED, PP_MICROBATCHES = 3, 2, (2, 4, 8)
PP_GRAPHS = {0: {"setup", "token count", "forward", "p2p send activation", "p2p send activation + recv gradient",
                 "backward", "p2p recv gradient", "reduce/clip/update", "resume"},
             1: {"setup", "token count", "p2p recv activation", "forward", "backward",
                 "p2p send gradient + recv activation", "p2p send gradient", "reduce/clip/update", "resume"}}


def test_pipeline_graph_census(tmp_path):
    """The pipeline step's graphs (scripts/pp_graphs.py: PP=2, 1F1B, the all-gather point-to-point,
    both stages built and trained in this one process as their ranks run them, the pair all-gather
    stood in for): each stage runs a token count, one graph per forward, per backward and per
    exchange, and the reduce/clip/update, as NxD's pipeline engine cuts them. At 2, 4 and 8
    microbatches the same graphs (by HLO hash) run; only their number of runs grows (one per task),
    and a run at 4 or 8 microbatches after one at 2 compiles only its token count. Graphs compile in
    the first step only, none after it, none after a resume, and no step reads anything back to
    the host (TransferFromDevice). No graph writes a transposed weight (model.LinearFunction: with
    F.linear each forward graph wrote all 8 of a stage's weights transposed, for its backward, and
    the second step compiled every forward and backward again: [9, 4, 0, 0, 0] / [7, 3, 0, 0, 0])."""
    out = tmp_path / "pp.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "pp_graphs.py"), f"--json={out}", f"--graphs={tmp_path}/g",
           f"--steps={PP_STEPS}", f"--resume-steps={PP_RESUMED}", "--microbatches=" + ",".join(map(str, PP_MICROBATCHES))]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=child_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    print(r.stdout)
    runs = json.loads(out.read_text())["runs"]
    distinct = {}
    for run_ in runs:
        m, census = run_["microbatches"], run_["census"]
        for s, labels in PP_GRAPHS.items():
            assert {k.split(": ", 1)[1] for k in census if k.startswith(f"stage {s}:")} == labels, (m, s, census.keys())
            compiles = run_["compiles_per_step"][str(s)]
            assert len(compiles) == PP_STEPS + PP_RESUMED and not any(compiles[1:]), (m, s, compiles)
            assert not any(run_["host_reads_per_step"][str(s)]), (m, s, run_["host_reads_per_step"])
            steps = PP_STEPS + PP_RESUMED
            assert census[f"stage {s}: forward"]["runs"] == census[f"stage {s}: backward"]["runs"] == m * steps
            steady = "p2p send activation + recv gradient" if s == 0 else "p2p send gradient + recv activation"
            assert census[f"stage {s}: {steady}"]["runs"] == (m - 1) * steps, (m, s)
        for label, c in census.items():
            assert c["weight_copies"] == 0, (m, label, c)
            if not label.endswith("token count"):
                distinct.setdefault(label, []).append(sorted(c["distinct"]))
        if m != PP_MICROBATCHES[0]:       # every graph but the token count is in the cache already
            assert {k: c["compiled"] for k, c in census.items() if c["compiled"]} == {"stage 0: token count": 1}, census
    for label, per_m in distinct.items():
        assert all(d == per_m[0] for d in per_m) and len(per_m[0]) <= 2, (label, per_m)   # backward: first, later
    assert runs[0]["compiles_per_step"]["0"][0] >= 9         # the counters do see compiles
