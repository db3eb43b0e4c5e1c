"""bench.py's own plumbing (benchmarks/common.py, cli.py): what every benchmark writes, its help. The figures themselves
are ratios measured by `python bench.py WHICH`, never asserted here."""
import json
import math
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.common import write_json  # noqa: E402


def test_results_are_strict_json(tmp_path):
    # `bench.py init` wrote NaN (Python's json default) for the one-step share of a run with no spikes;
    # a diverged run's losses are NaN or inf. jq, JavaScript's JSON.parse and Go refuse those tokens.
    path = tmp_path / "sub" / "r.json"
    write_json(str(path), {"loss": [2.5, math.nan, math.inf], "table": {"init": {"share": math.nan, "n": 0}},
                           "pair": (1.0, -math.inf), "name": "nan"})

    def refuse(token):
        raise ValueError(f"not JSON: {token}")
    assert json.loads(path.read_text(), parse_constant=refuse) == {
        "loss": [2.5, None, None], "table": {"init": {"share": None, "n": 0}}, "pair": [1.0, None], "name": "nan"}


def test_help_names_the_command_and_says_what_every_argument_is(capsys):
    # `python bench.py --help` said "usage: bench.py" and left WHICH, --threads and --out unexplained
    from benchmarks import cli
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("usage: python bench.py"), out
    args = out.split("positional arguments:")[1]
    for name in ("WHICH", "-h, --help", "--threads THREADS", "--steps STEPS", "--out OUT", "--layers LAYERS", "--lr LR"):
        line = next(x for x in args.splitlines() if x.strip().startswith(name))
        assert line.strip() != name, f"{name} has no help: {out}"


def test_help_gives_every_flags_default(capsys):
    # `python bench.py --help` gave the default of --threads and --out only: --layers (16), --lr (1e-2),
    # --dtype, --step_tokens (4096) and the data flags left a user to read benchmarks/cli.py for theirs
    from benchmarks import cli
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    options = capsys.readouterr().out.split("options:")[1]
    flags = re.split(r"\n  (?=-)", options)[1:]             # one block per flag, its help's wrapped lines included
    assert len(flags) >= 12, options
    for block in flags:
        if not block.startswith("-h"):
            assert " ".join(block.split()).count("(default: ") == 1, f"no default, or two, in: {block}"


@pytest.mark.slow      # ~4 s: transformers' import
def test_the_steps_compared_run_the_models_loss_as_the_trainer_does(monkeypatch):
    # benchmarks/step.py's "ours" and "bare step" called the model without grad_scale: in bf16 the fused
    # loss then takes the path the trainer never runs (rounded twice, no fp32 scale), so the step compared
    # with transformers', and the trainer's difference from the bare step, were not the trainer's model step.
    import torch
    import model
    from benchmarks.step import step_fns
    from configs import ModelConfig
    seen, forward = {}, model.Llama.forward

    def record(self, *args, **kwargs):
        scale = kwargs.get("grad_scale", args[4] if len(args) > 4 else None)
        seen[name] = None if scale is None else float(scale)
        return forward(self, *args, **kwargs)
    monkeypatch.setattr(model.Llama, "forward", record)
    cfg = ModelConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32, max_seq_len=8)
    for name, step in step_fns(cfg, 2, 8, torch.bfloat16, ("ours", "bare step", "trainer")).items():
        step()
    assert seen == {"ours": 1 / 16, "bare step": 1 / 16, "trainer": 1 / 16}


def test_step_tokens_is_checked_only_where_it_is_used(monkeypatch):
    """--step_tokens sizes the CPU's second pair of trainer rows; on a GPU the trainer pair runs at the 1B body only,
    yet a GPU run refused a value it never uses ('--step_tokens=3: give a multiple of 4'). Checked on the CPU only."""
    import argparse
    import torch
    from benchmarks import step
    if torch.cuda.is_available():
        pytest.skip("with a GPU here, the GPU case would run the whole bench")
    args = argparse.Namespace(steps=1, device=torch.device("cuda"), step_tokens=3, dtype="bfloat16")
    with pytest.raises(Exception) as e:     # past the check, the GPU path needs the GPU this machine lacks
        step.bench_step(args)
    assert "--step_tokens" not in str(e.value)
    args.device = torch.device("cpu")
    with pytest.raises(SystemExit, match="--step_tokens=3: give a multiple of 4"):
        step.bench_step(args)
    # Unbounded, 2^40 tokens ran every other row first (minutes), then failed building a step no memory holds
    monkeypatch.setattr(step.multiprocessing, "get_context", lambda *a: pytest.fail("past the check"))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    most = ram // (256 << 10) // 4 * 4
    for tokens in (2**40, most + 4):
        args.step_tokens = tokens
        with pytest.raises(SystemExit, match=rf"^--step_tokens={tokens}: give a multiple of 4 up to {most} \(the "
                                             rf"trainer and the bare step hold ~100 KiB a token each; this machine "
                                             rf"has {ram / 2**30:.0f} GiB\)"):
            step.bench_step(args)


@pytest.mark.slow      # ~4 s: transformers' import
def test_the_step_bench_compares_a_tied_model_with_transformers_tied_too():
    # bench.py step's GPU shapes are Llama 3.2 1B's, whose head is the embedding: loading our state into
    # LlamaForCausalLM failed with 'Missing key(s) in state_dict: "lm_head.weight"' (the export writes the
    # embedding only), so the bench could not run its first row.
    import torch
    from benchmarks.step import GPU_SHAPES, step_fns
    from configs import ModelConfig
    assert GPU_SHAPES["Llama 3.2 1B, vocab 128256"]["tie_embeddings"]
    cfg = ModelConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32, max_seq_len=8,
                      tie_embeddings=True)
    for step in step_fns(cfg, 2, 8, torch.float32, ("ours", "transformers")).values():
        step()


@pytest.mark.slow      # ~2-4 s: matplotlib draws and saves the study's figure
def test_the_init_study_says_a_run_that_diverged(tmp_path, monkeypatch, capsys):
    # `bench.py init` at a learning rate where a run goes to NaN printed that run's largest gradient norm
    # as the one before the NaN (max() passes over NaN after the first value) and 0 spikes (the detector
    # skips NaN): the divergence the study exists to show was nowhere in its table or JSON.
    import argparse
    from benchmarks import studies
    trajectories = {"default init": ([8.3, 7.9, math.nan, math.nan], [1.1, 3.0, math.nan, math.nan]),
                    "scaled init": ([8.3, 7.8, 7.5, 7.2], [0.9, 1.2, 1.0, 0.8])}

    def lockstep(runs, cfg, steps):         # the trajectories as if trained: the study's own table and JSON
        for name, r in runs.items():
            r.update(loss=trajectories[name][0], grad_norm=trajectories[name][1], time=1.0)
    monkeypatch.setattr(studies, "_lockstep", lockstep)
    studies.bench_init(argparse.Namespace(steps=4, layers=2, lr=1e-2, out=str(tmp_path)))
    rows = json.loads((tmp_path / "init.json").read_text())["table"]
    assert rows["default init"]["diverged_at"] == 3 and rows["scaled init"]["diverged_at"] is None, rows
    assert math.isclose(rows["default init"]["max_grad_norm"], 3.0), rows
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| default init"))
    assert row.endswith("| step 3 |") and "| 3.000 |" in row, row


def _peak_in_a_fresh_process(shape, name):
    import multiprocessing
    from benchmarks.step import peak_memory
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(peak_memory, (shape, name, "float32", 1))


@pytest.mark.slow      # three fresh processes, each importing torch and transformers (~5 s each)
def test_a_steps_peak_memory_holds_no_one_time_import():
    # benchmarks/step.peak_memory took its baseline before torch.optim.AdamW's constructor imported torch._dynamo
    # (~100 MiB resident) and before transformers' lazy module loaded its Llama: every step built with torch's AdamW
    # (ours, transformers, the bare step) counted the first in its peak, transformers' alone the second, our AdamW
    # (the trainer) neither. `bench.py step` printed the trainer at 0.43x the bare step's memory (80 vs 184 MiB) and
    # ours at 0.93x transformers' at vocab 512 (184 vs 198 MiB), where each pair holds the same (59-60 MiB). On a
    # model of a few kilobytes a step's peak is its buffers: a few MiB, whatever the step.
    shape = dict(vocab_size=64, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32, batch=2, seq=8)
    for name in ("ours", "transformers", "trainer"):
        assert _peak_in_a_fresh_process(shape, name) < 16 * 2**20, name


def test_alternating_rounds_rotate_which_step_runs_first():
    # benchmarks/common.alternate ran the steps in the same order every round: transformers' step always right after
    # ours freed its buffers (glibc's adaptive mmap threshold and the caches carry one step's state into the next:
    # common.no_page_fault_churn saw 25% on transformers' step from what ran before it), and `bench.py train`'s
    # docstring said its three steps rotate where they did not. Now each runs in each position equally often.
    from benchmarks.common import alternate
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    times = alternate(fns, rounds=6)
    assert calls[:3] == ["a", "b", "c"]                        # the warm-up
    rounds = [calls[i:i + 3] for i in range(3, len(calls), 3)]
    assert len(rounds) == 6 and all(sorted(r) == ["a", "b", "c"] for r in rounds), rounds
    for position in range(3):
        assert sorted(r[position] for r in rounds) == ["a", "a", "b", "b", "c", "c"], rounds
    assert {k: len(v) for k, v in times.items()} == {"a": 6, "b": 6, "c": 6}


@pytest.mark.parametrize("argv", [["ckpt", "--steps", "10"], ["data", "--steps", "3"], ["train", "--dtype", "bfloat16"],
                                  ["train", "--device", "cpu"], ["step", "--layers", "4"], ["precision", "--lr", "0.1"],
                                  ["pp", "--data_part", "memory"], ["xla", "--step_tokens", "0"]])
def test_a_flag_the_benchmark_does_not_read_is_refused(argv, monkeypatch, capsys):
    # `bench.py ckpt --steps 10` ran its fixed 4 rounds, `bench.py train --dtype bfloat16` its fp32 and bf16 rows as
    # always, `bench.py step --layers 4` the same shapes: the run measured something else than asked, and said nothing
    from benchmarks import cli
    monkeypatch.setitem(cli.BENCHES, argv[0], lambda args: pytest.fail(f"bench.py {' '.join(argv)} ran"))
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and err.startswith(f"python bench.py: error: {argv[1]}=") and "drop it" in err, err


def test_the_flags_a_benchmark_reads_pass_the_check(monkeypatch):
    import torch
    from benchmarks import cli
    ran, threads = [], torch.get_num_threads()
    for argv in (["init", "--lr", "0.1", "--layers", "4", "--steps", "2"], ["data", "--data_part", "memory"],
                 ["step", "--dtype", "bfloat16", "--step_tokens", "0", "--device", "cpu", "--steps", "1"],
                 ["parallel", "--threads", "1", "--steps", "3"], ["pp", "--threads", "1", "--steps", "3"]):  # each rank's
        monkeypatch.setitem(cli.BENCHES, argv[0], lambda args: ran.append(args.which))     # (common.launch_ranks)
        cli.main(argv)
        torch.set_num_threads(threads)      # cli.main sets the benchmark's --threads: this process's tests keep theirs
    assert ran == ["init", "data", "step", "parallel", "pp"]
