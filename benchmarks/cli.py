"""Benchmarks: every speed or memory figure nanotrn reports, measured as a ratio against a
reference run side by side in the same process, on this machine.

    python bench.py step        # our step vs transformers' at issue 27's shapes, trainer vs bare step
    python bench.py train       # our Llama vs transformers' LlamaForCausalLM, fp32 and bf16
    python bench.py data        # packed tokens/s vs the raw tokenizer; memory and start-up at 1M-16M documents
    python bench.py precision   # fp32 / mixed / bf16 / bf16_sr loss curves and throughput
    python bench.py init        # default vs scaled init: a deep tiny model at a high learning rate
    python bench.py parallel    # TP=2 and DP=2 against one process (gloo, CPU)
    python bench.py pp          # PP=2 1F1B vs GPipe vs one process
    python bench.py ckpt        # async vs synchronous checkpoint save, recovery time
    python bench.py xla         # the trn1 path on XLA:CPU: graphs per step type and pipeline task, step vs eager
"""
from __future__ import annotations

import argparse

import torch

from configs import ConfigError, check_dir
from hardware import pick_device

from benchmarks.ckpt import bench_ckpt
from benchmarks.layouts import bench_parallel, bench_pp
from benchmarks.step import bench_step, bench_train
from benchmarks.stream import CORPORA, DATA_SHAPES, bench_data
from benchmarks.studies import bench_init, bench_precision
from benchmarks.xla import bench_xla

BENCHES = {"step": bench_step, "train": bench_train, "data": bench_data, "precision": bench_precision,
           "init": bench_init, "parallel": bench_parallel, "pp": bench_pp, "ckpt": bench_ckpt, "xla": bench_xla}


# The flags only some benchmarks read: given to another, it would run as if they were not there.
READ_BY = {"step_tokens": ("step",), "device": ("step",), "dtype": ("step",), "layers": ("init",), "lr": ("init",),
           "data_shapes": ("data",), "data_part": ("data",), "data_corpora": ("data",),
           "steps": ("step", "train", "precision", "init", "parallel", "pp", "xla")}


def check_args(parser: argparse.ArgumentParser, args) -> None:
    """Every flag's domain, before a benchmark builds a corpus or a model (parser.error: one line, exit 2)."""
    for flag, readers in READ_BY.items():
        if args.which not in readers and getattr(args, flag) != parser.get_default(flag):
            parser.error(f"--{flag}={getattr(args, flag)}: bench.py {args.which} does not read it (only "
                         f"{', '.join(readers)}); drop it")
    # --threads: torch's pool hangs near 3,000 threads and segfaults at 4,096 (set_num_threads, torch 2.9 on CPU)
    for flag, ok, what in (("threads", 1 <= args.threads <= 1024, ">= 1 and <= 1024"),
                           ("steps", args.steps >= 0, ">= 0 (0: the default)"),
                           # init: its dim-64 model, ~46k parameters a layer, two of them with AdamW's state
                           ("layers", 1 <= args.layers <= 1000, ">= 1 and <= 1000 (1000: ~1.5 GB)"),
                           ("lr", 0 < args.lr <= 1, "> 0 and at most 1, as --optim.lr")):
        if not ok:
            parser.error(f"--{flag}={getattr(args, flag)}: give {what}")
    for flag, names in (("data_shapes", DATA_SHAPES), ("data_corpora", CORPORA)):
        bad = [n for n in getattr(args, flag).split(",") if n not in names]
        if bad:
            parser.error(f"--{flag}: unknown {bad[0]!r}; give a comma-separated list of {', '.join(names)}")
    try:
        check_dir("out", args.out)
        auto = "cuda" if torch.cuda.is_available() else "cpu"      # never xla: transformers' step runs eagerly
        args.device = pick_device(auto if args.device == "auto" else args.device)
    except ConfigError as e:
        parser.error(str(e))


class HelpFormat(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The docstring's lines as written, and every flag's default after its help."""


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python bench.py", description=__doc__, formatter_class=HelpFormat)
    parser.add_argument("which", choices=list(BENCHES), metavar="WHICH", help=", ".join(BENCHES) + " (above)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each measured process")
    parser.add_argument("--steps", type=int, default=0, help="0 = the benchmark's default")
    parser.add_argument("--out", default="out/bench", help="the JSON, figures and corpora go here")
    parser.add_argument("--step_tokens", type=int, default=4096, help="step: tokens per step of the second "
                        "trainer-vs-bare rows (batch 4 x step_tokens/4; 0 = only the 512-token rows)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="step: where the steps run (auto: a GPU if one is visible, else the CPU)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="step: the weights' dtype")
    parser.add_argument("--layers", type=int, default=16, help="init: the model's depth")
    parser.add_argument("--lr", type=float, default=1e-2, help="init: the (high) peak learning rate")
    parser.add_argument("--data_shapes", default="arrow", help="data: the memory part's corpus shapes, of "
                        "arrow (131k-row record batches), arrow_1000 (1,000-row batches), jsonl")
    parser.add_argument("--data_part", default="all", choices=["all", "memory", "packing"], help="data: one part only")
    parser.add_argument("--data_corpora", default="files,paragraphs,paragraphs_b1000,paragraphs_b8", help="data: the "
                        "packing part's corpora (paragraphs_bN: the paragraphs in N-row record batches)")
    args = parser.parse_args(argv)
    check_args(parser, args)
    torch.set_num_threads(args.threads)
    BENCHES[args.which](args)
