"""Fit the planner's three free constants to Neuron's published trn1 throughput.

    python scripts/fit_plan.py            # prints the fitted constants and the rows they came from

plan.py prices a training step from datasheets and measurements (HBM and NeuronLink bandwidth,
the 128 x 128 TensorEngine, collective latency, each cited there) and leaves three numbers that
no datasheet gives: MATMUL_EFFICIENCY, the share of the bf16 peak a large matmul sustains in a
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
plan.py ships: tests/test_plan.py reruns this fit and compares.
"""
from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import plan  # noqa: E402


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
        base = plan.row_estimate(row, calibration=(eff, 0.0, 0.0))
        t = int(row["global_batch"]) / float(row["seq_per_s"])
        a.append((base.microbatches + base.layout.pp - 1) / t)          # seconds of overhead per step
        b.append((plan.row_estimate(row, calibration=(eff, 0.0, 1.0)).step_s - base.step_s) / t)  # per pass
        r.append(1 - base.step_s / t)
    c, p = _solve(a, b, r)
    return sum((c * u + p * v - w) ** 2 for u, v, w in zip(a, b, r)), c, p


def fit(rows: list[dict] | None = None) -> tuple[float, float, float]:
    """(MATMUL_EFFICIENCY, MICROBATCH_OVERHEAD, SCORE_PASSES), rounded as plan.py ships them."""
    rows = [r for r in (rows or plan.published_rows()) if r["role"] == "fit"]
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


def main() -> None:
    rows = [r for r in plan.published_rows() if r["role"] == "fit"]
    fitted = fit()
    shipped = (plan.MATMUL_EFFICIENCY, plan.MICROBATCH_OVERHEAD, plan.SCORE_PASSES)
    print(f"fitted on {len(rows)} rows: " + ", ".join(sorted({r['model'] for r in rows})))
    for name, value in zip(("MATMUL_EFFICIENCY", "MICROBATCH_OVERHEAD", "SCORE_PASSES"), fitted):
        print(f"{name} = {value}")
    if fitted != shipped:
        print(f"plan.py ships {shipped}: copy these into it")


if __name__ == "__main__":
    main()
