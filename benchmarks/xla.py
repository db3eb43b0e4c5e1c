"""The trn1 code path on XLA:CPU (`bench.py xla`): graphs compiled per step type, the steady step
time against eager CPU, and the pipeline step's graph census."""
from __future__ import annotations

import json
import os
import shutil
import sys

from benchmarks.common import ROOT, run_child, write_json


def bench_xla(args):
    """The trn1 code path on XLA:CPU against the eager CPU, same config, same process: train.py runs
    twice under scripts/xla_check.py (eager CPU, then torch-xla with PJRT_DEVICE=CPU), the tiny preset
    shrunk to 2 layers. Reports the graphs compiled per step type and the steady step time ratio,
    then the pipeline step's census (scripts/pp_graphs.py: PP=2 at 2, 4 and 8 microbatches).
    XLA:CPU is not Trainium: the ratio says what lazy tracing costs on a CPU, not trn1 speed."""
    steps, log, ev, save = max(args.steps, 30), 10, 25, 25
    os.makedirs(args.out, exist_ok=True)
    report = os.path.join(args.out, "xla.json")
    train_args = ["--model.n_layers=2", "--data.global_batch=8", "--data.micro_batch=8", "--log.eval_windows=8",
                  f"--optim.max_steps={steps}", f"--log.interval={log}", f"--log.eval_interval={ev}",
                  f"--ckpt.interval={save}", f"--out_dir={args.out}/xla-run", f"--ckpt.dir={args.out}/xla-run/ckpt",
                  "--log.tensorboard=", "--log.sample_tokens=0", "--precision=fp32"]
    shutil.rmtree(os.path.join(args.out, "xla-run"), ignore_errors=True)
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "xla_check.py"),
           f"--eager-steps={steps}", f"--threads={args.threads}", f"--json={report}",
           f"--graphs={args.out}/xla-graphs.txt", "--", *train_args]
    run_child(cmd, "xla: the run", env={**os.environ, "PJRT_DEVICE": "CPU"})
    with open(report) as f:
        rep = json.load(f)

    def pace(run):
        # Steps 11-20: XLA runs a step asynchronously, so time a span that ends with a host read
        # (step 20's log waits for every queued step); no compile, eval or save inside it.
        s = run["steps"]
        return (s[2 * log]["begin_s"] - s[log]["begin_s"]) / log

    xs = rep["xla"]["steps"]
    kinds = {"step 1": xs[0]["in_step"]["UncachedCompile"], "step 2": xs[1]["in_step"]["UncachedCompile"],
             "later steps": sum(s["in_step"]["UncachedCompile"] for s in xs[2:]),
             f"first log step ({log})": xs[log - 1]["after"]["UncachedCompile"],
             f"first eval + save ({ev})": xs[ev - 1]["after"]["UncachedCompile"],
             "after every other step": sum(s["after"]["UncachedCompile"] for s in xs[:-1]
                                           if s["step"] not in (log, ev))}
    print(f"tiny preset, 2 layers, batch 8 x 256 tokens, {steps} steps, log every {log}, eval + save at {ev}")
    print("graphs compiled on XLA: " + ", ".join(f"{k}: {v}" for k, v in kinds.items()))
    # The census by graph (scripts/xla_check.py names them: token count, first microbatch, later
    # microbatch, reduce/clip/update inside a step; log, eval, save, resume, setup outside).
    for label, c in rep["xla"]["census"].items():
        print(f"  {label:20s} compiled {c['compiled']}, run {c['runs']}, HLO instructions "
              + ", ".join(f"{n} (from step {k})" for n, k in c["sizes"].items()))
    t_x, t_e = pace(rep["xla"]), pace(rep["eager"])
    diff = max(abs(a - b) for a, b in zip(rep["xla"]["losses"][:5], rep["eager"]["losses"][:5]))
    print(f"steady step time: XLA:CPU {t_x * 1e3:.0f} ms, eager CPU {t_e * 1e3:.0f} ms: ratio {t_x / t_e:.2f}x; "
          f"first 5 losses differ by at most {diff:.1e}; load average {os.getloadavg()[0]:.1f}")
    # The pipeline step's graphs (scripts/pp_graphs.py: PP=2, both stages in this one process, the
    # point-to-point's pair all-gather stood in for; XLA:CPU has no multi-process collectives).
    pp_report = os.path.join(args.out, "pp_graphs.json")
    r = run_child([sys.executable, os.path.join(ROOT, "scripts", "pp_graphs.py"), f"--json={pp_report}",
                   f"--graphs={args.out}/pp-graphs.txt", "--microbatches=2,4,8"],
                  "xla: the pipeline census", env={**os.environ, "PJRT_DEVICE": "CPU"})
    print("pipeline step graphs, PP=2 1F1B all-gather point-to-point, tiny model 4 layers (scripts/pp_graphs.py):")
    print("\n".join("  " + line for line in r.stdout.strip().splitlines()))
    write_json(report, {**rep, "compiles": kinds, "xla_step_s": t_x, "eager_step_s": t_e})
