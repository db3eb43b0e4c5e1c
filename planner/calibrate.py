"""The planner against Neuron's published trn1 throughput (trn1_training.csv, sources in it): the
estimate for each row (`python plan.py --validate` prints them) and the fit of the three constants
no datasheet gives.

    python -m planner.calibrate           # prints the fitted constants and the rows they came from
    python -m planner.calibrate --help    # this text; the command takes no other arguments

planner/cost.py prices a training step from datasheets and measurements (HBM and NeuronLink
bandwidth, the 128 x 128 TensorEngine, collective latency, each cited there) and leaves three numbers
that no datasheet gives: MATMUL_EFFICIENCY, the share of the bf16 peak a large matmul sustains in a
compiled step; MICROBATCH_OVERHEAD, the fixed seconds each microbatch costs on a stage (graph
launches and the host's syncs between them); SCORE_PASSES, how many times an unfused attention
moves its [heads, T, T] scores through HBM per layer and microbatch. They are fitted here to the
rows of trn1_training.csv marked `fit` (NxD Llama 2 7B and 13B, every release that lists them:
the 7B rows of 2.16-2.18 ran NxD's unfused CoreAttention, those of 2.20-2.21 its flash kernel)
and to no other: the 70B and Llama 3.1 rows are predicted (`python plan.py --validate`).

The fit minimizes the sum of squared relative step-time errors. For a given efficiency the step
time is linear in the other two (a stage runs microbatches + PP - 1 microbatches, each with its
score passes), so their best non-negative values have a closed form; the efficiency is then found
by golden-section search. The results are rounded (3 decimals, 0.1 ms, 0.1 pass) and are what
cost.py ships: tests/test_plan.py reruns this fit and compares.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import sys

from configs import check_layout, from_args
from planner.cost import MATMUL_EFFICIENCY, MICROBATCH_OVERHEAD, SCORE_PASSES, Estimate, Layout, estimate
from planner.instances import INSTANCES

# The model each published row names: our presets, with the config.json of NxD's example where there is
# none (Llama2-13B: tp_pp_llama2_hf_pretrain/13B_config, vocab_size 32016 in every release's copy; Llama 3.1 70B:
# 70B_config_llama3.1). tests/test_plan.py checks each against NxD's config.
PUBLISHED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trn1_training.csv")
MODELS = {
    "Llama2-7B": ["--preset=llama2_7b"],
    "Llama2-13B": ["--preset=llama2_7b", "--model.dim=5120", "--model.n_layers=40", "--model.n_heads=40",
                   "--model.n_kv_heads=40", "--model.ffn_dim=13824", "--model.vocab_size=32016"],
    "Llama2-70B": ["--preset=llama2_70b"],
    "Llama-3.1-8B": ["--preset=llama3_8b"],
    "Llama-3.1-70B": ["--preset=llama3_8b", "--model.dim=8192", "--model.n_layers=80", "--model.n_heads=64",
                      "--model.ffn_dim=28672"],
}


def published_rows(path: str = PUBLISHED) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def row_estimate(row: dict, calibration: tuple[float, float, float] | None = None) -> Estimate:
    """The estimate for one published row: its model, cores, layout, batch, sequence and kernel."""
    world = int(row["nodes"]) * INSTANCES["trn1"].cores
    cfg = from_args(MODELS[row["model"]] + [
        f"--parallel.cores={world}", f"--parallel.tp={row['tp']}", f"--parallel.pp={row['pp']}",
        f"--parallel.dp={row['dp']}", f"--parallel.zero1={row['zero1']}", f"--parallel.sp={row['sp']}",
        f"--data.global_batch={row['global_batch']}", f"--data.micro_batch={row['micro_batch']}",
        f"--data.seq_len={row['seq_len']}", "--optim.precision=mixed", "--model.checkpointing=selective"])
    check_layout(cfg, world)
    L = Layout(cfg.parallel.tp, cfg.parallel.pp, int(row["dp"]), cfg.parallel.sp, cfg.parallel.zero1,
               row["checkpointing"], cfg.data.micro_batch)
    return estimate(cfg, L, world, attention=row["attention"], calibration=calibration)


def validation(calibration: tuple[float, float, float] | None = None) -> list[tuple[dict, float, float]]:
    """(row, estimated seq/s, relative error) for every published row."""
    out = []
    for row in published_rows():
        est = int(row["global_batch"]) / row_estimate(row, calibration).step_s
        out.append((row, est, est / float(row["seq_per_s"]) - 1))
    return out


def matching_efficiency(row: dict, e: Estimate) -> float | None:
    """The MATMUL_EFFICIENCY at which this row's estimate would equal its published figure, all else
    as modelled: a diagnostic, never fitted. To first order the matmuls and attention (the bubble's
    share included) scale as 1 / efficiency; None where the rest alone outlasts the published step."""
    t = int(row["global_batch"]) / float(row["seq_per_s"])
    compute = e.compute_s * (e.microbatches + e.layout.pp - 1) / e.microbatches
    rest = e.step_s - compute
    return MATMUL_EFFICIENCY * compute / (t - rest) if t > rest else None


def validation_table() -> str:
    lines = [f"Neuron's published trn1 throughput (NxD, {os.path.relpath(PUBLISHED, os.path.dirname(os.path.dirname(PUBLISHED)))}) against this planner",
             f"(MATMUL_EFFICIENCY {MATMUL_EFFICIENCY}, MICROBATCH_OVERHEAD {MICROBATCH_OVERHEAD * 1e3:g} ms, "
             f"SCORE_PASSES {SCORE_PASSES:g}, "
             f"fitted on the 'fit' rows by planner/calibrate.py; the 'predict' rows are not fitted;",
             " 'eff.': the matmul efficiency at which the estimate would match the row, all else as modelled)", "",
             "  model          release  cores  TP PP  DP   seq  ckpt           attention  role     "
             "published  estimated   error   MFU  eff."]
    worst, notes = {}, []
    for row in published_rows():
        e = row_estimate(row)
        est = int(row["global_batch"]) / e.step_s
        err = est / float(row["seq_per_s"]) - 1
        need = matching_efficiency(row, e)
        if row.get("note"):
            notes.append(f"  [{len(notes) + 1}] {row['model']} {row['release']}: {row['note']}")
        lines.append(f"  {row['model']:14s} {row['release'].split()[0]:8s} {int(row['nodes']) * 32:5d} {row['tp']:>3s}"
                     f" {row['pp']:>2s} {row['dp']:>3s} {row['seq_len']:>5s}  {row['checkpointing']:14s} "
                     f"{row['attention']:9s}  {row['role']:7s} {float(row['seq_per_s']):9.2f} {est:10.2f} {err:+7.1%}"
                     f"  {e.mfu:4.0%}  {f'{need:.2f}' if need else '-':>4s}"
                     + (f"  [{len(notes)}]" if row.get("note") else ""))
        worst[row["role"]] = max(worst.get(row["role"], 0.0), abs(err))
    lines += ["", "  largest error: " + ", ".join(f"{k} rows {v:.1%}" for k, v in worst.items())]
    return "\n".join(lines + ([""] + notes if notes else []))


# ----------------------------------------------------------------------------- the fit
def _solve(a: list[float], b: list[float], r: list[float]) -> tuple[float, float]:
    """argmin over x, y >= 0 of sum((x * a_i + y * b_i - r_i)^2): a 2 x 2 non-negative least squares."""
    aa, bb, ab = sum(x * x for x in a), sum(x * x for x in b), sum(x * y for x, y in zip(a, b))
    ar, br = sum(x * y for x, y in zip(a, r)), sum(x * y for x, y in zip(b, r))
    det = aa * bb - ab * ab
    if det > 0:
        x, y = (ar * bb - br * ab) / det, (br * aa - ar * ab) / det
        if x >= 0 and y >= 0:
            return x, y
    candidates = [(max(0.0, ar / aa) if aa else 0.0, 0.0), (0.0, max(0.0, br / bb) if bb else 0.0)]
    return min(candidates, key=lambda c: sum((c[0] * u + c[1] * v - w) ** 2 for u, v, w in zip(a, b, r)))


def _objective(eff: float, rows: list[dict]) -> tuple[float, float, float]:
    """(sum of squared relative step-time errors, best overhead, best score passes) at this efficiency."""
    a, b, r = [], [], []
    for row in rows:
        base = row_estimate(row, calibration=(eff, 0.0, 0.0))
        t = int(row["global_batch"]) / float(row["seq_per_s"])
        a.append((base.microbatches + base.layout.pp - 1) / t)          # seconds of overhead per step
        b.append((row_estimate(row, calibration=(eff, 0.0, 1.0)).step_s - base.step_s) / t)  # per pass
        r.append(1 - base.step_s / t)
    c, p = _solve(a, b, r)
    return sum((c * u + p * v - w) ** 2 for u, v, w in zip(a, b, r)), c, p


def fit(rows: list[dict] | None = None) -> tuple[float, float, float]:
    """(MATMUL_EFFICIENCY, MICROBATCH_OVERHEAD, SCORE_PASSES), rounded as cost.py ships them."""
    rows = [r for r in (rows or published_rows()) if r["role"] == "fit"]
    lo, hi = 0.05, 1.0
    g = (math.sqrt(5) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = _objective(a, rows)[0], _objective(b, rows)[0]
    while hi - lo > 1e-6:
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = _objective(a, rows)[0]
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = _objective(b, rows)[0]
    eff = round((lo + hi) / 2, 3)
    _, overhead, passes = _objective(eff, rows)
    return eff, round(overhead, 4), round(passes, 1)


def main(argv: list[str] | None = None) -> None:
    # argparse for --help (this module's docstring); anything else is refused in one line before the fit runs
    parser = argparse.ArgumentParser(prog="python -m planner.calibrate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _, unknown = parser.parse_known_args(argv)
    if unknown:
        sys.exit(f"config error: python -m planner.calibrate takes no arguments (got {' '.join(unknown)}); "
                 "it fits the 'fit' rows of planner/trn1_training.csv: run it alone, or with --help")
    rows = [r for r in published_rows() if r["role"] == "fit"]
    fitted = fit()
    shipped = (MATMUL_EFFICIENCY, MICROBATCH_OVERHEAD, SCORE_PASSES)
    print(f"fitted on {len(rows)} rows: " + ", ".join(sorted({r['model'] for r in rows})))
    for name, value in zip(("MATMUL_EFFICIENCY", "MICROBATCH_OVERHEAD", "SCORE_PASSES"), fitted):
        print(f"{name} = {value}")
    if fitted != shipped:               # a failing status: `python -m planner.calibrate` can gate a change
        sys.exit(f"planner/cost.py ships {shipped}, not these: copy them into it")


if __name__ == "__main__":
    main()
