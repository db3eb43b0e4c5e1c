"""Run train.py with every step watched by torch-xla's metrics: graphs compiled, host transfers,
step times, losses. On Trainium a new graph costs minutes of neuronx-cc and a host transfer
stalls the device, so a healthy run compiles a few graphs in its first steps and then none, and
reads nothing back except at log, eval and checkpoint steps.

    PJRT_DEVICE=CPU python scripts/xla_check.py --json out/xla.json -- --device=xla --steps=24
    python scripts/xla_check.py --eager-steps=3 --json out/xla.json -- --device=xla ...  # + an eager CPU run
    PJRT_DEVICE=NEURON python scripts/xla_check.py -- --preset llama2_7b ...               # one NeuronCore

It runs train.main() itself, unchanged, with two of its functions wrapped: train_step (the step
begins) and sync (the step ends). Windows: "step" = from train_step's call to the sync after it;
"after" = from that sync to the next train_step call (logging, eval, checkpoint, next batch).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

COUNTERS = ("UncachedCompile", "CachedCompile", "xla::_to_cpu", "aten::_local_scalar_dense")


def snapshot() -> dict:
    """The counters that matter, now. TransferFromDevice = device-to-host reads (host syncs)."""
    import torch_xla.debug.metrics as met
    s = {name: met.counter_value(name) or 0 for name in COUNTERS}
    data = met.metric_data("TransferFromDeviceTime")
    s["TransferFromDevice"] = data[0] if data else 0
    return s


def watched_run(argv: list[str]) -> dict:
    """train.main(argv) with each step's counters, times and loss tensors recorded."""
    import train
    events = []                        # (kind, step, time, counters)
    losses = []                        # loss tensors, read only after the run (no extra syncs)
    step_fn, sync_fn = train.train_step, train.sync

    def train_step(*args, **kwargs):
        events.append(("begin", len(losses) + 1, time.perf_counter(), snapshot()))
        out = step_fn(*args, **kwargs)
        losses.append(out["loss"])
        return out

    def sync(device):
        sync_fn(device)
        events.append(("end", len(losses), time.perf_counter(), snapshot()))

    train.train_step, train.sync = train_step, sync
    try:
        t0 = time.perf_counter()
        train.main(argv)
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
    return {"steps": steps, "losses": [float(x) for x in losses], "total_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="", help="write the report here")
    ap.add_argument("--eager-steps", type=int, default=0,
                    help="first run the same config this many steps on the eager CPU (loss reference)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then train.py's arguments")
    args = ap.parse_args()
    train_args = [a for a in args.train_args if a != "--"]
    os.environ.setdefault("PJRT_DEVICE", "CPU")
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
    report["xla"] = watched_run(train_args + ["--device=xla"])
    for name in ("eager", "xla"):
        if name in report:
            steps = report[name]["steps"]
            compiles = [s["in_step"]["UncachedCompile"] + s["after"]["UncachedCompile"] for s in steps]
            print(f"xla_check {name}: {len(steps)} steps, graphs compiled per step {compiles}, "
                  f"first losses {[round(x, 5) for x in report[name]['losses'][:3]]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
