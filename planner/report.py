"""The cluster planner: what one NeuronCore holds, computes and sends for a layout, and which
layouts fit, fastest first. Arithmetic on the config only: no model is built, nothing is launched.

    python plan.py                                        # the blog's run: llama2_7b on 128 trn1
    python plan.py --preset llama2_70b --parallel.cores=2048
    python plan.py --preset llama2_7b --instance trn2      # trn2.48xlarge: 64 logical cores each
    python plan.py --validate                             # step time against Neuron's trn1 figures
"""
from __future__ import annotations

import math
import os
import sys

import hf
from configs import Config, ConfigError, check_layout, check_values, from_args, help_text, wants_help
from model import flops_per_token, num_params
from planner.calibrate import validation_table
from planner.cost import RESERVE, STATED_MFU, Layout, cannot_run, estimate, layouts
from planner.instances import INSTANCES, check_instances, tp_degrees


# A bound past the largest Trainium cluster (Project Rainier: about 500,000 Trainium2 chips, 4 logical
# cores each at LNC=2) that keeps every divisor search below a few million tries.
MOST_CORES = 2**21


def plan(cfg: Config, world: int | None = None, top: int = 10) -> str:
    """The report `python plan.py` prints."""
    m, d = cfg.model, cfg.data
    hw = INSTANCES[cfg.parallel.instance]
    world = world or cfg.parallel.cores or 128 * hw.cores
    gib = lambda b: f"{b / 2**30:6.2f}"
    e = estimate(cfg, world=world)
    L, fpt, tokens = e.layout, flops_per_token(m, d.seq_len), d.global_batch * d.seq_len
    peak = hw.fp32_flops if cfg.optim.precision == "fp32" else hw.bf16_flops
    lines = [
        f"plan: {cfg.init_from or cfg.preset or 'custom'} on {world} NeuronCores ({world / hw.cores:g} {hw.name}), "
        f"seq {d.seq_len}, global batch {d.global_batch}, precision {cfg.optim.precision}",
        f"model: {num_params(m) / 1e9:.2f}B parameters, {fpt / 1e9:.2f} GFLOP per token (6N + attention), "
        f"{tokens / 1e6:.2f}M tokens per step",
        f"step time at {STATED_MFU:.0%} MFU ({peak / 1e12:g} TFLOPS per core): "
        f"{fpt * tokens / (world * peak * STATED_MFU):.2f} s",
        "", f"configured layout: {L}, {e.microbatches} microbatch{'es' * (e.microbatches != 1)} per step"
        + (f" (cannot run: {r})" if (r := cannot_run(cfg, world, L.tp, L.pp, L.micro_batch)) else ""),
        f"  per NeuronCore ({'every core' if L.pp == 1 else e.stage + ' stage, the fuller'})      GiB",
        f"  weights      {e.params / 1e6:8.1f}M params  {gib(e.weights)}",
        f"  gradients                       {gib(e.grads)}",
        f"  optimizer    {'sharded over DP' if L.zero1 else 'replicated'.ljust(15)}   {gib(e.optimizer)}",
        f"  activations  {L.checkpointing + (' + SP' if L.sp else '')}".ljust(34) + gib(e.activations),
        f"  logits/loss                     {gib(e.loss)}",
        *([f"  ZeRO-1 bucket (one in flight)   {gib(e.bucket)}"] if L.zero1 else []),
        *([f"  loss freed before recompute     {gib(-e.overlap)}"] if e.overlap >= 0.005 * 2**30 else []),
        f"  total                           {gib(e.total)} of {(hw.hbm - RESERVE) / 2**30:.0f} usable "
        f"({hw.hbm / 2**30:.0f} GiB - {RESERVE / 2**30:.0f} GiB reserve): {'fits' if e.fits else 'DOES NOT FIT'}",
        f"  traffic per core per step: TP {e.tp_bytes / 1e9:.2f} GB NeuronLink, PP {e.pp_bytes / 1e9:.2f} GB "
        f"{e.pp_link}, DP {e.dp_bytes / 1e9:.2f} GB {e.dp_link}",
        f"  estimated step {e.step_s:.2f} s = compute {e.compute_s:.2f} + bubble {e.bubble_s:.2f} + TP "
        f"{e.tp_s:.2f} + PP {e.pp_s:.2f} + DP {e.dp_s:.2f} + update {e.opt_s:.2f} + launches {e.overhead_s:.2f}: "
        f"{d.global_batch / e.step_s:.1f} seq/s, MFU {e.mfu:.0%} (calibrated on Neuron's trn1 figures: --validate)",
        "", f"  activations per core (GiB) at TP={L.tp} PP={L.pp}:",
        "  checkpointing " + "".join(f"  mb={b}: SP off  SP on" for b in (1, 2, 4))]
    for ckpt in ("none", "selective", "full"):
        row = [estimate(cfg, Layout(L.tp, L.pp, L.dp, sp, L.zero1, ckpt, mb), world).activations
               for mb in (1, 2, 4) for sp in (False, L.tp > 1)]
        lines.append(f"  {ckpt:13s}" + "".join(f"       {gib(row[i])} {gib(row[i + 1])}" for i in range(0, 6, 2)))
    lines += ["", "  same settings on other layouts:   TP  PP   DP  states  activ.   total  (GiB per core)"]
    for tp in tp_degrees(m, hw):
        for pp in sorted({1, L.pp}):
            if world % (tp * pp) == 0 and (m.n_layers % pp == 0 or pp == cfg.parallel.pp and cfg.parallel.pp_cuts):
                # memory even where the batch cannot split; PP as configured even when stage cuts make it fit the layers
                dp = world // (tp * pp)
                x = Layout(tp, pp, dp, L.sp and tp > 1, L.zero1 and dp > 1, L.checkpointing, L.micro_batch)
                y = estimate(cfg, x, world)
                why = f" (and {r})" if (r := cannot_run(cfg, world, tp, pp, d.micro_batch)) else ""
                lines.append(f"  {'':33s}{tp:3d} {pp:3d} {dp:4d}  {gib(y.weights + y.grads + y.optimizer)} "
                             f"{gib(y.activations)}  {gib(y.total)}  {'fits' if y.fits else 'no'}" + why)
    every = [estimate(cfg, y, world) for y in layouts(cfg, world)]
    fit = sorted((x for x in every if x.fits), key=lambda x: x.step_s)
    lines += ["", f"layouts that fit, fastest first ({len(fit)} of {len(every)}):",
              "   TP  PP   DP  SP  ZeRO-1 ckpt       mb    GiB  step s  MFU   TP GB  PP GB  DP GB"]
    for x in fit[:top]:
        y = x.layout
        lines.append(f"  {y.tp:3d} {y.pp:3d} {y.dp:4d}  {'yes' if y.sp else 'no ':3s} {'yes' if y.zero1 else 'no ':6s} "
                     f"{y.checkpointing:9s} {y.micro_batch:3d} {gib(x.total)} {x.step_s:7.2f} {x.mfu:4.0%} "
                     f"{x.tp_bytes / 1e9:7.2f} {x.pp_bytes / 1e9:6.2f} {x.dp_bytes / 1e9:6.2f}")
    if fit:                             # to copy into the launch line
        y = fit[0].layout
        lines.append(f"  the fastest as flags: --tp={y.tp} --pp={y.pp} --sp={str(y.sp).lower()} --zero1={str(y.zero1).lower()} "
                     f"--model.checkpointing={y.checkpointing} --micro_batch={y.micro_batch}")
    if not fit and every:               # layouts that run, none in memory: the batch is not why
        lines.append(f"  none: the smallest needs {min(x.total for x in every) / 2**30:.2f} GiB per core of "
                     f"{(hw.hbm - RESERVE) / 2**30:.0f} usable; give more cores (--parallel.cores): more pipeline "
                     f"stages, fewer layers on each")
    elif not fit:
        lines.append(f"  none: give more cores (--parallel.cores), or a global batch ({d.global_batch}) that "
                     f"splits into micro-batches over the data-parallel ranks")
    return "\n".join(lines)



def cores_that_run(cfg: Config, world: int) -> int | None:
    """The most cores below `world` on which the configured layout runs (whole instances past one):
    the planner's other fix when the batch or --parallel.dp does not fit the cores."""
    p, d, hw = cfg.parallel, cfg.data, INSTANCES[cfg.parallel.instance]
    # DP divides the micro-batches of a step and needs no more cores than planned: the divisors of q up
    # to most, in min(most, sqrt(q)) tries (every DP below 10^9 cores, or sqrt(10^18 sequences), never ended)
    q = d.global_batch // d.micro_batch if d.global_batch % d.micro_batch == 0 else 0
    most = world // (p.tp * p.pp)
    split = {x for i in range(1, min(most, math.isqrt(q)) + 1) if q % i == 0 for x in (i, q // i) if x <= most}
    for dp in sorted(split & {p.dp} if p.dp > 0 else split, reverse=True):
        n = p.tp * p.pp * dp
        if n < world and (n <= hw.cores or n % hw.cores == 0) and q // dp >= p.pp and hw.cores % p.tp == 0:
            return n
    return None


def main(argv: list[str]) -> None:
    try:
        _main(argv)
    except BrokenPipeError:             # `python plan.py --help | head`: the reader left; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)


def _main(argv: list[str]) -> None:
    if "--validate" in argv:                # the published trn1 rows: their own layouts, nothing to override
        if argv != ["--validate"]:
            sys.exit(f"config error: --validate takes no other arguments (got {' '.join(argv)}); "
                     "run `python plan.py --validate` alone")
        print(validation_table())
        return
    if not any(a == "--preset" or a.startswith("--preset=") for a in argv):
        argv = ["--preset", "llama2_7b", *argv]    # the tiny CPU preset cannot be planned on 4096 cores
    try:
        if wants_help(argv):              # every key, its value under the preset and its comment
            print(help_text("\n\n".join(__doc__.split("\n\n")[:2]), argv))
            return
        cfg = from_args(argv)
        hf.apply_init_from(cfg, argv)       # --init_from: the folder's model (config.json), as train.py trains it
        check_values(cfg)                   # the keys' domains and the model: what train.py refuses
        world = cfg.parallel.cores or 128 * INSTANCES[cfg.parallel.instance].cores
        if world > MOST_CORES:              # cores_that_run's divisor search at 10^18 cores and sequences: 10^9 tries
            raise ConfigError(f"--parallel.cores={world} is past any Trainium cluster: plan at most {MOST_CORES:,} "
                              f"NeuronCores ({MOST_CORES // 64:,} trn2.48xlarge at 64 logical cores each)")
        check_instances(cfg, world)         # whole instances first: a batch that splits over 1000 cores runs on none
        try:                                # the configured layout must be one a launch could run
            check_layout(cfg, world)
        except ConfigError as e:
            fits = cores_that_run(cfg, world)
            raise ConfigError(f"{e} (planning for --parallel.cores={world}"
                              + (f"; --parallel.cores={fits} runs this layout)" if fits else ")")) from None
    except ConfigError as e:
        sys.exit(f"config error: {e}")
    try:
        print(plan(cfg))
    except KeyboardInterrupt:
        sys.exit("interrupted")


