"""Run train.py with every step watched by torch-xla's metrics: graphs compiled, host transfers,
step times, losses. On Trainium a new graph costs minutes of neuronx-cc and a host transfer
stalls the device, so a healthy run compiles a few graphs in its first steps and then none, and
reads nothing back except at log, eval and checkpoint steps.

    PJRT_DEVICE=CPU python scripts/xla_check.py --json out/xla.json -- --device=xla --steps=24
    python scripts/xla_check.py --eager-steps=3 --json out/xla.json -- --device=xla ...  # + an eager CPU run
    (NANOTRN_PRECISION=bf16_sr; source scripts/env.sh; python scripts/xla_check.py -- --preset llama2_7b ...)
                                                       # one NeuronCore, in the environment launch.sh gives a run

It runs train.main() itself, unchanged, with two of its functions wrapped: train_step (the step
begins) and sync (the cuts inside the step, then the step ends). Windows: "step" = from
train_step's call to the loop's sync after it; "after" = from that sync to the next train_step
call (logging, eval, checkpoint, next batch). With --graphs every graph run is recorded and named:
token count, first microbatch, later microbatch, reduce/clip/update (by the cut that ended it), or
log, eval, save, resume, other (by the code on its Python stack); "census" lists the distinct ones
with their HLO instruction counts.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

COUNTERS = ("UncachedCompile", "CachedCompile", "xla::_to_cpu", "aten::_local_scalar_dense")
# torch-xla writes every graph it runs, as HLO with the Python frames that ran it, to this file
# (plus a ".0" suffix) when the variable is set before it is imported.
GRAPH_FILE = "XLA_SAVE_TENSORS_FILE"


def snapshot() -> dict:
    """The counters that matter, now. TransferFromDevice = device-to-host reads (host syncs)."""
    import torch_xla.debug.metrics as met
    s = {name: met.counter_value(name) or 0 for name in COUNTERS}
    data = met.metric_data("TransferFromDeviceTime")
    s["TransferFromDevice"] = data[0] if data else 0
    return s


class GraphLog:
    """Reads the graphs torch-xla has run since the last call: for each, its size (HLO
    instructions, every computation counted), a hash of its HLO text and the functions on its
    Python stack."""

    def __init__(self, path: str | None):
        self.path, self.offset, self.buf = path, 0, ""

    def new(self) -> list[dict]:
        if not self.path or not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            f.seek(self.offset)
            self.buf += f.read()
            self.offset = f.tell()
        out = []
        while "## END_GRAPH" in self.buf:
            record, self.buf = self.buf.split("## END_GRAPH", 1)
            head, _, hlo = record.partition("## BEGIN_GRAPH")
            body = hlo.strip().split("\n", 1)[1]            # without the module's numbered name
            out.append({"instructions": len(re.findall(r"^\s*(?:ROOT )?%\S+ = ", body, re.M)),
                        "hash": hashlib.sha1(body.encode()).hexdigest()[:12],     # the same graph, the same text
                        "weight_copies": weight_copies(body),
                        "frames": re.findall(r"^\s+(\w+) \(([^:)]+)", head, re.M)})
        return out


def weight_copies(body: str) -> int:
    """How many outputs of a graph are a transpose of one of its inputs (a weight written out
    transposed: a saved W^T, model.LinearFunction's reason)."""
    entry = body[body.find("ENTRY"):]
    defs = dict(re.findall(r"^\s*(?:ROOT )?(%\S+) = (.*)$", entry, re.M))
    root = next((line for line in entry.splitlines() if line.lstrip().startswith("ROOT")), "")
    outs = re.findall(r"%[\w.\-]+", root.split(" tuple(", 1)[1]) if " tuple(" in root else []
    def is_transposed_input(name):
        d = defs.get(name, "")
        src = re.findall(r"%[\w.\-]+", d)
        return " transpose(" in d and bool(src) and " parameter(" in defs.get(src[0], "")
    return sum(map(is_transposed_input, outs))


def label_by_frames(frames) -> str:
    """A graph run outside a training step, named by the code that ran it."""
    names = {(fn, os.path.basename(path)) for fn, path in frames}
    for label, fn, file in (("eval", "evaluate", None), ("eval", "eval", "monitor.py"),
                            ("save", "save", "checkpoint.py"), ("resume", "load_latest", "checkpoint.py"),
                            ("log", "param_norm", "parallel.py"), ("log", "flush", "monitor.py"),
                            ("log", "check_finite", "monitor.py"), ("setup", "device_peak_flops", "hardware.py"),
                            ("setup", "__next__", "parallel_loader.py")):
        if any(n == fn and (file is None or f == file) for n, f in names):
            return label
    return "other"


GRAPHS = GraphLog(None)


def watched_run(argv: list[str]) -> dict:
    """train.main(argv) with each step's counters, times, loss tensors and graphs recorded."""
    import train
    import torch_xla.debug.metrics as met
    events = []                        # (kind, step, time, counters)
    losses = []                        # loss tensors, read only after the run (no extra syncs)
    graphs = []                        # {label, step, instructions, compiled}: every graph run, in order
    state = {"in_step": False, "cuts": 0, "update": False, "compiles": met.counter_value("UncachedCompile") or 0}
    step_fn, sync_fn = train.train_step, train.sync

    def collect(label):
        """The graphs run since the last call; the compiles since then go to the first of them."""
        compiles = (met.counter_value("UncachedCompile") or 0) - state["compiles"]
        state["compiles"] += compiles
        for g in GRAPHS.new():
            graphs.append({"label": label or label_by_frames(g["frames"]), "step": len(losses) + state["in_step"],
                           "instructions": g["instructions"], "compiled": compiles})
            compiles = 0

    def train_step(*args, **kwargs):
        collect(None)
        events.append(("begin", len(losses) + 1, time.perf_counter(), snapshot()))
        state.update(in_step=True, cuts=0)
        try:
            out = step_fn(*args, **kwargs)
        finally:
            state.update(in_step=False, update=True)
        losses.append(out["loss"])
        return out

    def sync(device):
        sync_fn(device)
        if state["in_step"]:           # a cut inside the step: the token count, then one per microbatch
            collect(("token count", "first microbatch")[state["cuts"]] if state["cuts"] < 2 else "later microbatch")
            state["cuts"] += 1
        elif state["update"]:          # the loop's sync after the step
            collect("reduce/clip/update")
            state["update"] = False
            events.append(("end", len(losses), time.perf_counter(), snapshot()))
        else:                          # before the first step: the resumed state; after: evaluation's cuts
            collect(None if events else "resume")

    train.train_step, train.sync = train_step, sync
    try:
        t0 = time.perf_counter()
        train.main(argv)
        collect(None)
        events.append(("exit", len(losses), time.perf_counter(), snapshot()))
    finally:
        train.train_step, train.sync = step_fn, sync_fn
    steps = []
    for i, (kind, step, t, c) in enumerate(events):
        if kind != "begin":
            continue
        end = next(e for e in events[i + 1:] if e[0] == "end" and e[1] == step)
        nxt = next((e for e in events[i + 1:] if e[0] in ("begin", "exit") and e[2] > end[2]), end)
        steps.append({"step": step, "begin_s": t - t0, "end_s": end[2] - t0,
                      "in_step": {k: end[3][k] - c[k] for k in c},
                      "after": {k: nxt[3][k] - end[3][k] for k in c}})
    return {"steps": steps, "losses": [float(x) for x in losses], "graphs": graphs,
            "total_s": time.perf_counter() - t0}


def census(graphs: list[dict]) -> dict:
    """{label: {"compiled": graphs compiled, "runs": graphs run, "sizes": {HLO instructions: first step}}}."""
    out: dict = {}
    for g in graphs:
        d = out.setdefault(g["label"], {"compiled": 0, "runs": 0, "sizes": {}})
        d["compiled"] += g["compiled"]
        d["runs"] += 1
        d["sizes"].setdefault(g["instructions"], g["step"])
    return out


def check_args(train_args: list[str]) -> None:
    """train.py's checks of its arguments, at this process's world size on the xla backend, before
    torch-xla's import (~10 s): a bad flag is one line at once. train.main checks them again."""
    import configs
    if configs.wants_help(train_args):      # train.main prints the keys
        return
    cfg = configs.from_args(train_args + ["--device=xla"])
    if cfg.init_from:                       # the folder's model is the one checked (hf imports torch: 3 s)
        import hf
        hf.apply_init_from(cfg, train_args)
    world = os.environ.get("WORLD_SIZE", "1")
    if cfg.parallel.pp > 1 and world == "1":     # one process cannot hold two stages: pp_graphs.py can
        raise configs.ConfigError(f"--parallel.pp={cfg.parallel.pp}: xla_check.py runs one process; the pipeline "
                                  f"step's graphs are checked by scripts/pp_graphs.py (every stage in one process)")
    configs.validate(cfg, int(world) if world.isdigit() else 1, "xla")   # (a bad WORLD_SIZE: train.py says it)


def check_out_file(flag: str, path: str) -> None:
    """A file the run writes (--json at its end): refused now, not with a traceback after the run, its
    report lost. A missing folder is made when the file is written."""
    import configs
    configs.check_dir(flag[2:], os.path.dirname(os.path.abspath(path)))     # its folder: a directory or makeable
    if (kind := configs.path_kind(path)) not in ("nothing", "a file"):
        raise configs.ConfigError(f"{flag} {path!r} is {kind}, not a file: give a file path")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="", help="write the report here")
    ap.add_argument("--eager-steps", type=int, default=0,
                    help="first run the same config this many steps on the eager CPU (loss reference) "
                         "(default: %(default)s)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of this process (1 to 1024) (default: %(default)s)")
    ap.add_argument("--graphs", default="", help="record every graph run (HLO) in this file: the census")
    ap.add_argument("--resume-steps", type=int, default=0,
                    help="then run train.py again, resuming from the XLA run's last checkpoint, this many more steps"
                         " (default: %(default)s)")
    ap.add_argument("--precompile-steps", type=int, default=0,
                    help="first run scripts/launch.sh compile's pass (NEURON_EXTRACT_GRAPHS_ONLY, eval every 4 "
                         "steps, a save every 5) this many steps, in this process: its graphs are in the cache"
                         " (default: %(default)s)")
    ap.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then train.py's arguments")
    args = ap.parse_args()
    train_args = [a for a in args.train_args if a != "--"]
    # --threads at most 1024, as bench.py: torch's pool hangs near 3,000 threads (5000 took 4 min a step)
    for k, least, most in (("threads", 1, 1024), ("eager_steps", 0, None), ("resume_steps", 0, None),
                           ("precompile_steps", 0, None)):
        if not least <= getattr(args, k) <= (most or getattr(args, k)):
            sys.exit(f"error: --{k.replace('_', '-')} {getattr(args, k)}: give a whole number >= {least}"
                     + (f" and <= {most}" if most else ""))
    for flag in ("json", "graphs"):
        if getattr(args, flag):
            check_out_file(f"--{flag}", getattr(args, flag) + (".0" if flag == "graphs" else ""))
    check_args(train_args)
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    if args.graphs:
        os.makedirs(os.path.dirname(os.path.abspath(args.graphs)), exist_ok=True)
        os.environ[GRAPH_FILE], os.environ["XLA_SAVE_TENSORS_FMT"] = args.graphs, "hlo"
        GRAPHS.path = args.graphs + ".0"
    import torch
    import torch_xla
    torch.set_num_threads(args.threads)
    # Bring the XLA device up before any backward: autograd sizes its per-device queues once,
    # on the first backward, and would not know the XLA device after an eager run.
    torch_xla.device()
    report = {"argv": train_args}
    if args.eager_steps:
        # its own output and checkpoint directories: the XLA run must not resume from it
        import configs
        side = os.path.join(configs.from_args(train_args).out_dir, "eager-reference")
        report["eager"] = watched_run(train_args + ["--device=cpu", f"--optim.max_steps={args.eager_steps}",
                                                    f"--out_dir={side}", f"--ckpt.dir={side}/ckpt",
                                                    "--log.tensorboard="])
    if args.precompile_steps:
        import configs
        side = os.path.join(configs.from_args(train_args).out_dir, "precompile")
        os.environ["NEURON_EXTRACT_GRAPHS_ONLY"] = "1"
        try:
            report["precompile"] = watched_run(train_args + [
                "--device=xla", f"--optim.max_steps={args.precompile_steps}", "--log.eval_interval=4",
                "--ckpt.interval=5", "--log.interval=5", f"--ckpt.dir={side}/ckpt", f"--out_dir={side}", "--log.tensorboard="])
        finally:
            del os.environ["NEURON_EXTRACT_GRAPHS_ONLY"]
        report["precompile"]["wrote"] = os.path.exists(side)
    report["xla"] = watched_run(train_args + ["--device=xla"])
    if args.resume_steps:
        # the same process: its graph cache holds the first run's graphs, which the resumed steps
        # must find (on trn1 the persistent neuronx-cc cache plays that part across processes)
        import configs
        total = configs.from_args(train_args).optim.max_steps + args.resume_steps
        report["resume"] = watched_run(train_args + ["--device=xla", f"--optim.max_steps={total}"])
    for name in ("precompile", "xla", "resume"):
        if name in report and report[name]["graphs"]:
            report[name]["census"] = census(report[name]["graphs"])
            for label, c in report[name]["census"].items():
                print(f"xla_check {name} graphs: {label}: {c['compiled']} compiled, {c['runs']} run; HLO "
                      f"instructions " + ", ".join(f"{n} (from step {k})" for n, k in c["sizes"].items()))
    for name in ("eager", "precompile", "xla", "resume"):
        if name in report:
            steps = report[name]["steps"]
            compiles = [s["in_step"]["UncachedCompile"] + s["after"]["UncachedCompile"] for s in steps]
            print(f"xla_check {name}: {len(steps)} steps, graphs compiled per step {compiles}, "
                  f"first losses {[round(x, 5) for x in report[name]['losses'][:3]]}")
    if args.json:                       # strict JSON (a diverged run's loss: null), as bench.py writes it
        from benchmarks.common import write_json
        write_json(args.json, report)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from configs import ConfigError
    try:
        main()
    except ConfigError as e:            # a bad train.py argument: one line, as train.py says it, not a traceback
        sys.exit(f"error: {e}")
    except RuntimeError as e:           # and what else train.cli says in one line (the run imported both modules)
        from ckptdir import CheckpointError
        from monitor import NonFiniteError
        if not isinstance(e, (CheckpointError, NonFiniteError)):
            raise
        sys.exit(f"error: {e}")
