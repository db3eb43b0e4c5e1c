"""The blog's stability lessons at tiny scale, each a set of runs trained in lockstep on the same
batches: precision (`bench.py precision`: fp32 / mixed / bf16 / bf16_sr) and init (`bench.py init`:
default vs scaled init of a deep model at a high learning rate)."""
from __future__ import annotations

import math
import os
import statistics
import time

import torch

from benchmarks.common import table, write_json


def _tiny_study_config(steps: int, *extra: str):
    """The tiny preset shrunk (dim 128, seq 128, one microbatch of 8) so that enough steps of
    several runs fit in minutes on 2 cores; lr, schedule shape, AdamW and clip are the preset's."""
    import configs
    warmup = max(1, round(steps * 20 / 300))              # the preset's 20 of 300 steps, scaled
    return configs.from_args(["--model.dim=128", "--model.n_heads=4", "--model.n_kv_heads=2",
                              "--model.ffn_dim=352", "--model.max_seq_len=128", "--seq_len=128",
                              "--micro_batch=8", "--global_batch=8", f"--steps={steps}",
                              f"--optim.warmup_steps={warmup}", f"--optim.decay_steps={steps - warmup}", *extra])


def _lockstep(runs: dict, cfg, steps: int):
    """Train every run of `runs` (name -> {"cfg", "model", "opt"}) on the same `steps` batches of
    the stdlib stream, one step of each in turn, so a busy machine slows them all alike. Records
    per run the losses, the gradient norms (before clipping) and the time spent in its steps."""
    import data
    import optim
    import parallel
    import train
    grid = parallel.Grid()
    tok = data.build_tokenizer(cfg.data, vocab_size=cfg.model.vocab_size)
    loader = data.PackedLoader(cfg.data, tok, dp_rank=0, dp_size=1, split="train")
    batches = [next(loader) for _ in range(steps)]        # the very same batches for every run
    loader.close()
    for r in runs.values():
        r.update(loss=[], grad_norm=[], time=0.0)
    for step in range(steps):
        for r in runs.values():
            r["opt"].set_lr(optim.lr_at(step, r["cfg"].optim))
            t = time.perf_counter()
            out = train.train_step(r["model"], r["opt"], [batches[step]], grid, r["cfg"])
            r["loss"].append(out["loss"].item())
            r["time"] += time.perf_counter() - t
            r["grad_norm"].append(float(out["grad_norm"]))
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step:4d} | " + " | ".join(f"{m} {r['loss'][-1]:.3f}" for m, r in runs.items()), flush=True)


def _smooth(xs: list[float], window: int) -> list[float]:
    return [sum(xs[max(0, i - window + 1):i + 1]) / len(xs[max(0, i - window + 1):i + 1]) for i in range(len(xs))]


def _figure():
    """A two-panel figure (matplotlib without a display)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt.subplots(1, 2, figsize=(12, 4.5))


def _save(out: str, name: str, fig, axes, result: dict) -> None:
    """The figure as out/NAME.png and the numbers as out/NAME.json."""
    for a in axes:
        a.legend()
        a.grid(alpha=0.3)
    fig.tight_layout()
    png = os.path.join(out, f"{name}.png")
    os.makedirs(out, exist_ok=True)
    fig.savefig(png, dpi=110)
    write_json(os.path.join(out, f"{name}.json"), result)
    print(f"wrote {png} and {name}.json")


def bench_precision(args):
    """The blog's precision study at tiny scale: fp32, mixed, bf16 and bf16_sr train the same model
    from the same init on the same batches, in lockstep, so the tokens/s ratios stay fair."""
    import configs
    import model as llama
    import optim
    import parallel

    steps = args.steps or 400
    cfg = _tiny_study_config(steps)
    tokens_per_step = cfg.data.global_batch * cfg.data.seq_len
    runs = {}
    for mode in optim.PRECISIONS:
        c = configs.from_args([])
        c.model, c.data, c.optim = cfg.model, cfg.data, configs.OptimConfig(**{**vars(cfg.optim), "precision": mode})
        m = llama.Llama(c.model).init_weights(c.seed).to(optim.param_dtype(mode))
        runs[mode] = {"cfg": c, "model": m, "opt": optim.build_optimizer(m, c, parallel.Grid())}
    print(f"bench precision: {steps} steps x {tokens_per_step} tokens, {llama.num_params(cfg.model) / 1e6:.2f}M "
          f"params (tiny preset, dim {cfg.model.dim}, seq {cfg.data.seq_len}), {torch.get_num_threads()} threads")
    _lockstep(runs, cfg, steps)

    tail = max(1, steps // 10)
    results = {}
    for mode, r in runs.items():
        results[mode] = {"final_loss": sum(r["loss"][-tail:]) / tail,
                         "tokens_per_s": steps * tokens_per_step / r["time"],
                         "optimizer_state_bytes": r["opt"].state_bytes(),
                         "param_bytes": sum(p.numel() * p.element_size() for p in r["model"].parameters())}
    ref_loss, ref_speed = results["mixed"]["final_loss"], results["fp32"]["tokens_per_s"]
    print(f"\nfinal loss = mean train loss of the last {tail} steps (same batches for every mode)")
    table(["mode", "final loss", "vs mixed", "tokens/s", "vs fp32", "opt state", "params"],
          [[mode, f"{row['final_loss']:.4f}", f"{100 * (row['final_loss'] / ref_loss - 1):+.2f}%",
            f"{row['tokens_per_s']:.0f}", f"{row['tokens_per_s'] / ref_speed:.2f}x",
            f"{row['optimizer_state_bytes'] / 2**20:.2f} MiB", f"{row['param_bytes'] / 2**20:.2f} MiB"]
           for mode, row in results.items()])

    window = max(1, steps // 40)
    fig, (ax, dx) = _figure()
    mixed = _smooth(runs["mixed"]["loss"], window)
    for mode, r in runs.items():
        ax.plot(_smooth(r["loss"], window), label=f"{mode} ({results[mode]['final_loss']:.3f})")
        dx.plot([a - b for a, b in zip(_smooth(r["loss"], window), mixed)], label=mode)
    ax.set(xlabel="step", ylabel=f"train loss (moving mean of {window})", title="tiny Llama, same data and init",
           ylim=(min(min(r["loss"]) for r in runs.values()) - 0.1, runs["fp32"]["loss"][0] + 0.2))
    dx.set(xlabel="step", ylabel="loss minus mixed-precision loss", title="difference to mixed precision")
    dx.axhline(0, color="gray", lw=0.5)
    print(f"\nbf16_sr vs mixed final loss: {100 * (results['bf16_sr']['final_loss'] / ref_loss - 1):+.2f}%; "
          f"bf16 vs mixed: {100 * (results['bf16']['final_loss'] / ref_loss - 1):+.2f}%; "
          f"bf16_sr tokens/s vs fp32: {results['bf16_sr']['tokens_per_s'] / ref_speed:.2f}x on this CPU")
    _save(args.out, "precision", fig, (ax, dx), {"steps": steps, "tokens_per_step": tokens_per_step, "table": results,
                                                 "loss": {m: r["loss"] for m, r in runs.items()}})


def bench_init(args):
    """The blog's second stability lesson at tiny scale: a deep, narrow model at a high learning
    rate from Llama's default init (every matmul weight at std 0.02) and from scaled init (the
    attention and MLP output projections at 0.02 / sqrt(2 * n_layers), model.init_param), same
    data, same seed, in lockstep. The default-init model is the scaled one with those two weights
    multiplied back by sqrt(2 * n_layers): the same random draws, only their scale differs."""
    import model as llama
    import monitor
    import optim
    import parallel

    steps = args.steps or 150
    cfg = _tiny_study_config(steps, f"--model.n_layers={args.layers}", "--model.dim=64", "--model.ffn_dim=176",
                             "--model.max_seq_len=64", "--seq_len=64", f"--optim.lr={args.lr}",
                             f"--optim.min_lr={args.lr / 10}", "--precision=fp32")
    runs = {}
    for name in ("default init", "scaled init"):
        m = llama.Llama(cfg.model).init_weights(cfg.seed)
        if name == "default init":
            with torch.no_grad():
                for n, p in m.named_parameters():
                    if n.endswith(("o_proj.weight", "down_proj.weight")):
                        p.mul_(math.sqrt(2.0 * cfg.model.n_layers))
        runs[name] = {"cfg": cfg, "model": m, "opt": optim.build_optimizer(m, cfg, parallel.Grid())}
    print(f"bench init: {steps} steps x {cfg.data.global_batch * cfg.data.seq_len} tokens, {cfg.model.n_layers} "
          f"layers, dim {cfg.model.dim}, {llama.num_params(cfg.model) / 1e6:.2f}M params, lr {cfg.optim.lr:g} "
          f"(warmup {cfg.optim.warmup_steps}, clip {cfg.optim.grad_clip}), {torch.get_num_threads()} threads")
    _lockstep(runs, cfg, steps)

    tail, results = max(1, steps // 10), {}
    for name, r in runs.items():
        det = monitor.SpikeDetector()
        warnings = [w for s, g in enumerate(r["grad_norm"], 1) for w in det.update(s, g)]
        s = det.summary()
        # The divergence this study looks for ends in NaN, which the detector skips and max() may pass over:
        # said as the first step of a loss or norm not finite, and the largest norm is over the finite ones.
        bad = [i for i, (x, g) in enumerate(zip(r["loss"], r["grad_norm"]), 1) if not math.isfinite(x + g)]
        finite = [g for g in r["grad_norm"] if math.isfinite(g)]
        results[name] = {"final_loss": sum(r["loss"][-tail:]) / tail, "min_loss": min(r["loss"]),
                       "loss_at_half": statistics.fmean(r["loss"][steps // 2 - tail // 2:steps // 2 + tail // 2 + 1]),
                       "max_grad_norm": max(finite, default=math.nan), "diverged_at": bad[0] if bad else None,
                       "spikes": s["spikes"] + bool(s["open"]), "one_step_share": s["one_step_share"],
                       "longest_spike": max(s["longest"], s["open"]), "warnings": len(warnings)}
    print(f"\nfinal loss = mean train loss of the last {tail} steps; spikes: the blog's detector (monitor.py); "
          f"diverged: the first step of a loss or gradient norm not finite")
    table(["init", "final loss", "at half", "max grad norm", "spikes", "1-step", "longest", "warnings", "diverged"],
          [[name, f"{row['final_loss']:.4f}", f"{row['loss_at_half']:.4f}", f"{row['max_grad_norm']:.3f}",
            row["spikes"], "-" if row["one_step_share"] is None else f"{row['one_step_share']:.0%}",
            row["longest_spike"], row["warnings"], "-" if row["diverged_at"] is None else f"step {row['diverged_at']}"]
           for name, row in results.items()])

    window = max(1, steps // 40)
    fig, (ax, gx) = _figure()
    for name, r in runs.items():
        ax.plot(_smooth(r["loss"], window), label=f"{name} ({results[name]['final_loss']:.3f})")
        gx.plot(r["grad_norm"], label=f"{name} (max {results[name]['max_grad_norm']:.2f})", lw=0.8)
    ax.set(xlabel="step", ylabel=f"train loss (moving mean of {window})",
           title=f"{cfg.model.n_layers} layers, lr {cfg.optim.lr:g}, same data and seed")
    gx.set(xlabel="step", ylabel="gradient L2 norm (before clipping)", yscale="log", title="gradient norm")
    _save(args.out, "init", fig, (ax, gx), {"steps": steps, "layers": cfg.model.n_layers, "lr": cfg.optim.lr,
                                            "table": results, "loss": {n: r["loss"] for n, r in runs.items()},
                                            "grad_norm": {n: r["grad_norm"] for n, r in runs.items()}})
