"""Benchmarks: every speed or memory figure nanotrn reports, measured as a ratio against a
reference run side by side in the same process, on this machine.

    python bench.py train       # our Llama vs transformers' LlamaForCausalLM, fp32 and bf16
    python bench.py data        # packed tokens/s vs raw sentencepiece encoding
    python bench.py precision   # fp32 / mixed / bf16 / bf16_sr loss curves and throughput
    python bench.py parallel    # TP=2 and DP=2 against one process (gloo, CPU)
    python bench.py pp          # PP=2 1F1B vs GPipe vs one process
    python bench.py ckpt        # async vs synchronous checkpoint save, recovery time
"""
from __future__ import annotations

import argparse
import sys
import time

import torch


def matmul_peak_gflops(dtype: torch.dtype, n: int = 1024, reps: int = 20) -> float:
    """Measured matmul throughput of this machine: the 'peak' MFU is quoted against."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n ** 3 * reps / (time.perf_counter() - t) / 1e9


def bench_train(args):
    raise SystemExit("bench.py train: not written yet (issue 3)")


def bench_data(args):
    raise SystemExit("bench.py data: not written yet (issue 7)")


def bench_precision(args):
    raise SystemExit("bench.py precision: not written yet (issue 6)")


def bench_parallel(args):
    raise SystemExit("bench.py parallel: not written yet (issue 4)")


def bench_pp(args):
    raise SystemExit("bench.py pp: not written yet (issue 5)")


def bench_ckpt(args):
    raise SystemExit("bench.py ckpt: not written yet (issue 8)")


BENCHES = {"train": bench_train, "data": bench_data, "precision": bench_precision,
           "parallel": bench_parallel, "pp": bench_pp, "ckpt": bench_ckpt}

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", choices=list(BENCHES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=0, help="0 = the benchmark's default")
    parser.add_argument("--out", default="out/bench")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    BENCHES[args.which](args)
