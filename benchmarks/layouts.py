"""Parallel layouts on CPU against one process (gloo; `bench.py parallel`: TP=2, TP=2 + SP, DP=2;
`bench.py pp`: PP=2 1F1B and GPipe). Each layout runs as its own group of processes: bench.py
re-run as every rank with BENCH_LAYOUT set to its flags (a torchrun-like environment)."""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

import torch

from benchmarks.common import launch_ranks, median_spread, spread_text, table, take_turns, write_json


def _rank(flags: list[str], steps: int, warmup: int, out: str) -> None:
    """One rank of a layout: train.train_step (the pipeline's schedule under PP) on random batches of the
    tiny preset with `flags`; writes its step time and, under PP, the schedule's idle share, peak
    live activations and bubble to out.RANK."""
    import configs
    import parallel
    import pipeline
    import train
    cfg = configs.from_args(["--device=cpu", *flags])
    grid = parallel.init_distributed(cfg, torch.device("cpu"))
    build = pipeline.build_model if grid.pp > 1 else parallel.build_model
    model = parallel.init_weights(build(cfg, grid, torch.device("cpu")), cfg, grid)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    d, g = cfg.data, torch.Generator().manual_seed(grid.dp_rank)

    def batches():
        out = []
        for _ in range(configs.grad_accum_steps(cfg, grid.dp)):
            t = torch.randint(0, cfg.model.vocab_size, (d.micro_batch, d.seq_len + 1), generator=g)
            pos = torch.arange(d.seq_len).expand(d.micro_batch, -1)
            out.append({"tokens": t[:, :-1], "targets": t[:, 1:], "positions": pos, "doc_ids": None})
        return out

    idle = max_live = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            parallel.barrier(grid)
            t0 = time.perf_counter()
        r = train.train_step(model, opt, batches(), grid, cfg)
        if i >= warmup:
            idle += r.get("idle", 0.0) / steps
            max_live = max(max_live, r.get("max_live", 0))
    parallel.barrier(grid)
    write_json(f"{out}.{grid.rank}", {"step_s": (time.perf_counter() - t0) / steps, "idle": idle,
                                      "max_live": max_live, "bubble": r.get("bubble", 0.0)})
    parallel.destroy(grid)


def _run_layouts(which: str, layouts: list, steps: int, warmup: int, rounds: int) -> dict | None:
    """name -> [(step seconds, the ranks' reports) per round] of each layout (name, world, threads,
    flags). Rounds alternate over the layouts (common.take_turns), so that load from other processes on
    this shared machine does not land on one layout only; a report takes each round's ratios. In a rank (BENCH_LAYOUT set): run it, return None."""
    if "BENCH_LAYOUT" in os.environ:
        _rank(json.loads(os.environ["BENCH_LAYOUT"]), steps, warmup, os.environ["BENCH_OUT"])
        return None
    with tempfile.TemporaryDirectory() as tmp:
        def run(name, world, threads, flags):
            out = os.path.join(tmp, "result.json")
            launch_ranks(which, name, world, threads, steps, BENCH_LAYOUT=json.dumps(flags), BENCH_OUT=out)
            ranks = []
            for rank in range(world):
                with open(f"{out}.{rank}") as f:
                    ranks.append(json.load(f))
            return max(r["step_s"] for r in ranks), ranks
        return take_turns({name: (lambda lay=lay: run(*lay)) for lay in layouts for name in lay[:1]}, rounds)


def bench_parallel(args):
    """Training tokens/s of TP=2, TP=2 with SP, and DP=2 (two gloo processes of one thread each)
    against one process (one thread, and two threads: both cores), same global batch and tokens per
    step, the tiny preset, train.train_step."""
    import configs
    steps, warmup, rounds = args.steps or 3, 1, 3
    layouts = [("1 process x 1 thread", 1, 1, []), ("1 process x 2 threads", 1, 2, []),
               ("TP=2 (2 x 1 thread)", 2, 1, ["--tp=2"]), ("TP=2 + SP (2 x 1 thread)", 2, 1, ["--tp=2", "--sp"]),
               ("DP=2 (2 x 1 thread)", 2, 1, ["--dp=2"])]
    cfg = configs.tiny()
    if "BENCH_LAYOUT" not in os.environ:
        print(f"tiny preset: {cfg.model.dim} dim, {cfg.model.n_layers} layers, global batch "
              f"{cfg.data.global_batch} x {cfg.data.seq_len} tokens per step (micro {cfg.data.micro_batch}), "
              f"{warmup} warm-up + {steps} timed steps, {rounds} alternating rounds, gloo on CPU")
    runs = _run_layouts("parallel", layouts, steps, warmup, rounds)
    if runs is None:
        return
    tokens = cfg.data.global_batch * cfg.data.seq_len
    step = {name: [step_s for step_s, _ in r] for name, r in runs.items()}
    one, two = step["1 process x 1 thread"], step["1 process x 2 threads"]
    # tokens/s ratio = the reference's step time / the layout's, round by round; median (lowest-highest round)
    table(["layout", "tok/s (median round)", "rounds", "vs 1 thread", "vs 2 threads"],
          [[name, f"{tokens / statistics.median(t):.0f}", ", ".join(f"{tokens / x:.0f}" for x in t),
            spread_text(median_spread(one, t)), spread_text(median_spread(two, t))] for name, t in step.items()])
    return {name: {"vs_1_thread": median_spread(one, t), "vs_2_threads": median_spread(two, t)}
            for name, t in step.items()}


def bench_pp(args):
    """Step time of PP=2 (two gloo processes of one thread each) with the 1F1B and GPipe schedules
    (and 1F1B over the all-gather point-to-point NxD uses on XLA) against one process (one thread,
    and two threads: both cores) running the same model on the same global batch with
    train.train_step. Tiny preset, 8 microbatches of 2 sequences per step (bubble 1/9); 3 alternating
    rounds, each ratio the median of the rounds' (a shared machine), with the lowest and highest."""
    import configs
    steps, warmup, rounds = args.steps or 4, 2, 3
    mb = ["--data.micro_batch=2"]                                     # 16 / 2 = 8 microbatches
    pp = mb + ["--pp=2"]
    layouts = [("1 process x 1 thread", 1, 1, mb), ("1 process x 2 threads", 1, 2, mb),
               ("PP=2 1F1B (2 x 1 thread)", 2, 1, pp),
               ("PP=2 GPipe (2 x 1 thread)", 2, 1, pp + ["--parallel.pp_schedule=gpipe"]),
               ("PP=2 1F1B allgather p2p", 2, 1, pp + ["--parallel.pp_p2p=allgather"])]
    cfg = configs.from_args(mb)
    if "BENCH_LAYOUT" not in os.environ:
        print(f"tiny preset: {cfg.model.dim} dim, {cfg.model.n_layers} layers, global batch {cfg.data.global_batch} "
              f"x {cfg.data.seq_len} tokens = 8 microbatches of {cfg.data.micro_batch}; {warmup} warm-up + {steps} "
              f"timed steps, {rounds} alternating rounds, gloo on CPU ({os.cpu_count()} cores, load average "
              f"{os.getloadavg()[0]:.1f})")
    runs = _run_layouts("pp", layouts, steps, warmup, rounds)
    if runs is None:
        return
    step = {name: [step_s for step_s, _ in r] for name, r in runs.items()}
    # each layout's ranks (bubble, idle, peak live) from its median round
    ranks = {name: sorted(r, key=lambda x: x[0])[len(r) // 2][1] for name, r in runs.items()}
    one, two = step["1 process x 1 thread"], step["1 process x 2 threads"]
    table(["layout", "step (median round)", "speed-up vs 1 thread", "vs 2 threads", "bubble",
           "measured idle (stage 0, 1)", "peak live"],
          [[name, f"{statistics.median(t) * 1e3:.0f} ms", spread_text(median_spread(one, t)),
            spread_text(median_spread(two, t))]
           + ([f"{rk[0]['bubble']:.3f}", ", ".join(f"{r['idle']:.3f}" for r in rk),
               ", ".join(str(int(r["max_live"])) for r in rk)] if len(rk) > 1 else ["", "", ""])
           for (name, t), rk in zip(step.items(), ranks.values())])
    fo, gp = step["PP=2 1F1B (2 x 1 thread)"], step["PP=2 GPipe (2 x 1 thread)"]
    ratios = {"1f1b_over_gpipe": median_spread(fo, gp), "1f1b_over_2_threads": median_spread(fo, two),
              "1f1b_over_1_thread": median_spread(fo, one)}
    print("step time ratios, median of the rounds' (lowest-highest): 1F1B / GPipe "
          f"{spread_text(ratios['1f1b_over_gpipe'], unit='')}; 1F1B / one process (2 threads): "
          f"{spread_text(ratios['1f1b_over_2_threads'], unit='')}; (1 thread): "
          f"{spread_text(ratios['1f1b_over_1_thread'], unit='')}")
    res = {"ratios": ratios, "layouts": {k: {"step_s": step[k], "ranks": ranks[k]} for k in step}}
    write_json(os.path.join(args.out, "pp.json"), res)
    return res
