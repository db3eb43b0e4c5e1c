"""The trn1 code path on XLA:CPU (torch-xla, PJRT_DEVICE=CPU, one process).

On Trainium every new graph costs minutes of neuronx-cc and every host read stalls the device.
These tests run train.py itself (scripts/xla_check.py wraps its train_step and sync to read
torch-xla's counters around every step) in a subprocess, so that PJRT_DEVICE and the metrics
never leak into other tests:
  - the tiny model trains 24 steps through log, eval and checkpoint steps; after the warm-up
    (the first two steps, the first log, eval and save) no graph is compiled, the later logs,
    evals and saves and the steps after them included (aws-neuron-sdk #813: recompiling after a
    checkpoint);
  - no step reads anything back to the host, and neither does the loop between steps except at
    log, eval and checkpoint steps;
  - the first losses equal eager CPU's within 1e-4 (fp32).
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STEPS, LOG, EVAL, SAVE, EAGER = 24, 4, 10, 10, 3
TINY = ["--model.n_layers=2", "--model.dim=64", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.ffn_dim=176", "--data.seq_len=32", "--data.global_batch=4", "--data.micro_batch=2",
        "--optim.warmup_steps=5", "--log.eval_windows=2", "--log.sample_tokens=4", "--precision=fp32",
        "--model.attention=explicit"]           # what the trn1 presets run
HOST_READS = ("TransferFromDevice", "xla::_to_cpu", "aten::_local_scalar_dense")

pytest.importorskip("torch_xla")


def child_env():
    return {**os.environ, "PJRT_DEVICE": "CPU", "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One XLA run of train.py (and an eager CPU reference of its first steps), watched."""
    out = tmp_path_factory.mktemp("xla")
    report = out / "report.json"
    args = [*TINY, f"--optim.max_steps={STEPS}", f"--log.interval={LOG}", f"--log.eval_interval={EVAL}",
            f"--ckpt.interval={SAVE}", f"--out_dir={out}/out", f"--ckpt.dir={out}/out/ckpt", "--log.tensorboard="]
    cmd = [sys.executable, str(ROOT / "scripts" / "xla_check.py"), f"--eager-steps={EAGER}",
           f"--json={report}", "--", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=child_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    rep = json.loads(report.read_text())
    rep["stdout"], rep["ckpt_dir"] = r.stdout, out / "out" / "ckpt"
    return rep


def compiles(s, window):
    return s[window]["UncachedCompile"]


def test_xla_run_reaches_log_eval_and_checkpoint_steps(run):
    steps = run["xla"]["steps"]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    xla_out = run["stdout"].split("xla_check eager")[0].rsplit("nanotrn:", 1)[-1]    # the XLA run's log
    assert xla_out.count("val loss") == STEPS // EVAL, xla_out[-2000:]
    saved = sorted(p.name for p in run["ckpt_dir"].glob("step_*"))
    assert {f"step_{SAVE:08d}", f"step_{2 * SAVE:08d}"} <= set(saved), saved


def test_no_graph_compiled_after_warmup(run):
    """Graphs may be compiled only for a new kind of work: the first two training steps (the
    optimizer state appears in the first), the first log step (parameter norm, reading the
    metrics) and the first eval and checkpoint save. Every later step, log, eval and save included
    (a log right after a save, the steps after an eval and after a save: aws-neuron-sdk #813),
    must find its graph in the cache."""
    steps = run["xla"]["steps"]
    per_step = {s["step"]: (compiles(s, "in_step"), compiles(s, "after")) for s in steps}
    print("graphs compiled (in the step, after it):", per_step)
    allowed = {(1, 0), (2, 0), (LOG, 1), (EVAL, 1), (SAVE, 1)}
    late = {(k, "in step" if w == 0 else "after it"): n for k, v in per_step.items() for w, n in enumerate(v)
            if n and (k, w) not in allowed and k < STEPS}       # after the last step: the final export
    assert not late, f"graphs compiled after warm-up (step, window): {late}; all: {per_step}"
    assert per_step[1][0] >= 1                            # the counters do see compiles


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


ATTENTION_HLO = textwrap.dedent("""
    import json, re
    import torch, torch_xla
    import model as llama
    dev = torch_xla.device()
    out = {}
    for explicit in (False, True):
        q, k, v = (torch.randn(2, 2, 16, 8, dtype=torch.bfloat16, device=dev, requires_grad=True) for _ in range(3))
        y = llama.attention_core(q, k, v, None, explicit)
        y.backward(torch.ones_like(y))
        hlo = torch_xla._XLAC._get_xla_tensors_hlo([y, q.grad, k.grad, v.grad])
        out[str(explicit)] = {"dots": sorted(set(re.findall(r"= (\\w+)\\[[^\\]]*\\]\\{[^}]*\\} dot\\(", hlo))),
                              "f32_reduce": bool(re.search(r"= f32\\[[^\\]]*\\]\\{[^}]*\\} reduce\\(", hlo))}
    print(json.dumps(out))
""")


def test_explicit_attention_keeps_bf16_matmuls_on_xla():
    """Why the trn1 presets use explicit attention: torch-xla lowers SDPA to the math path, which
    upcasts bf16 q, k, v and runs every attention matmul in fp32 (4x slower on the TensorEngine).
    The explicit path's matmuls stay bf16, and its softmax reduces in fp32, not XLA's bf16 reduce."""
    r = subprocess.run([sys.executable, "-c", ATTENTION_HLO], capture_output=True, text=True, timeout=300,
                       cwd=ROOT, env=child_env())
    assert r.returncode == 0, r.stderr[-3000:]
    hlo = json.loads(r.stdout.strip().splitlines()[-1])
    assert hlo["False"]["dots"] == ["f32"], hlo
    assert hlo["True"]["dots"] == ["bf16"] and hlo["True"]["f32_reduce"], hlo


OPTIMIZER_PROBE = textwrap.dedent("""
    import sys
    import torch, torch_xla, torch_xla.debug.metrics as met
    import configs, optim, parallel
    cfg = configs.from_args(["--model.n_layers=1", "--model.dim=32", "--model.n_heads=2", "--model.n_kv_heads=1",
                             "--model.ffn_dim=64", "--model.vocab_size=64", "--seq_len=8", "--global_batch=2",
                             "--micro_batch=2"])
    dev = torch_xla.device()
    model = parallel.build_model(cfg, parallel.Grid(), dev)
    opt = optim.build_optimizer(model, cfg, parallel.Grid())
    tokens = torch.randint(0, 64, (2, 8)).to(dev)
    def step(t):
        opt.step_count = t - 1
        opt.set_lr(optim.lr_at(t - 1, cfg.optim))
        model(tokens).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
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


def test_optimizer_graph_does_not_change_over_a_long_run():
    """The optimizer's graph must not depend on the step number: at step ~325 (beta2 = 0.95) a
    7B run on trn1 would stop for minutes of neuronx-cc, outside the pre-compiled graphs. Python
    floats (lr, bias corrections) enter the graph as constants when they hit a special value
    (sqrt(1 - 0.95^t) rounds to 1.0 in fp32 from t = 326): optim.AdamW sends them as a tensor."""
    r = subprocess.run([sys.executable, "-c", OPTIMIZER_PROBE], capture_output=True, text=True, timeout=300,
                       cwd=ROOT, env={**child_env(), "PYTHONPATH": str(ROOT)})
    print(r.stdout[-2000:])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]


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
        model = parallel.build_model(cfg, grid, device)
        if xla_ckpt:
            llama.use_xla_checkpointing(model)
        opt = optim.build_optimizer(model, cfg, grid)
        losses, compiles, barrier, host_reads = [], [], None, []
        if device.type == "xla":              # the backward graph's text (nothing runs), then drop it
            b = {k: v.to(device) for k, v in batches[0].items()}
            model(b["tokens"], b["positions"], b["doc_ids"], b["targets"]).backward()
            barrier = "opt-barrier" in torch_xla._XLAC._get_xla_tensors_hlo([p.grad for p in model.parameters()])
            opt.zero_grad(set_to_none=True)
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
def checkpointing_runs():
    r = subprocess.run([sys.executable, "-c", CHECKPOINTING_PROBE], capture_output=True, text=True, timeout=300,
                       cwd=ROOT, env={**child_env(), "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    out = {}
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            _, mode, rest = line.split(" ", 2)
            out[mode] = json.loads(rest)
    print(out)
    return out
