"""The planner (`python plan.py`): it reproduces the blog's and HLAT's layout choices from
per-core memory, and its memory model matches a real training step measured on this CPU."""
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import configs  # noqa: E402
import plan  # noqa: E402
from plan import Layout, estimate  # noqa: E402
import model as llama  # noqa: E402

WORLD = 128 * 32       # the blog's cluster: 128 trn1.32xlarge


def fits(cfg, tp, pp, sp=True, zero1=False, ckpt="selective", mb=1):
    layout = Layout(tp, pp, WORLD // (tp * pp), sp and tp > 1, zero1, ckpt, mb)
    return estimate(cfg, layout, WORLD).fits


def test_7b_fits_at_tp8_only_as_the_blog_found():
    # seq 4096, micro-batch 1, selective checkpointing, bf16 + SR (the preset = the blog's table)
    c = configs.llama2_7b()
    assert fits(c, 8, 1)
    for tp in (1, 2):
        assert not fits(c, tp, 1)
        assert not fits(c, tp, 1, zero1=True)          # not even with the optimizer states sharded
    e = estimate(c, world=WORLD)                        # the configured layout: TP=8 PP=1 SP
    assert e.layout == Layout(8, 1, 512, True, False, "selective", 1) and e.microbatches == 2
    print(f"7B TP=8: {e.total / 2**30:.2f} GiB per core; TP=2: "
          f"{estimate(c, Layout(2, 1, 2048, True, False, 'selective', 1), WORLD).total / 2**30:.2f} GiB")


def test_70b_fits_at_tp32_pp8_with_zero1_not_at_tp8_pp1():
    c = configs.llama2_70b()
    assert fits(c, 32, 8, zero1=True)
    assert not fits(c, 8, 1, zero1=True) and not fits(c, 8, 1, zero1=False)
    e = estimate(c, world=WORLD)
    assert e.layout.tp == 32 and e.layout.pp == 8 and e.layout.zero1 and e.fits and e.stage == "first"


def test_planner_counts_every_parameter():
    for c in (configs.tiny(), configs.llama2_7b(), configs.llama2_70b()):
        e = estimate(c, Layout(1, 1, 1, False, False, "none", 1), world=1)
        assert e.params == llama.num_params(c.model)
        assert e.weights == e.params * plan.PRECISION_BYTES[c.optim.precision][0]
    c = configs.llama2_70b()                            # mixed: fp32 gradients unless told otherwise
    assert estimate(c, world=WORLD).grads == 4 * estimate(c, world=WORLD).params
    c.optim.fp32_grad_acc = False
    assert estimate(c, world=WORLD).grads == 2 * estimate(c, world=WORLD).params


def test_plan_command_prints_the_tables():
    out = subprocess.run([sys.executable, "plan.py", "--preset", "llama2_70b"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "configured layout: TP=32 PP=8 DP=16 SP ZeRO-1 selective mb=1" in text
    assert "layouts that fit, fastest first" in text and "GFLOP per token" in text and "EFA" in text
    steps = [float(line.split()[8]) for line in text.split("fastest first")[1].splitlines()[2:] if line.strip()]
    assert steps and steps == sorted(steps)


def measured_peak_bytes(cfg) -> int:
    """Peak bytes held by PyTorch's CPU allocator during one real training step (train.train_step:
    two microbatches of 8 x 256 with gradient accumulation, clipping, fp32 AdamW) of the tiny model,
    from the profiler's allocation events. The weights exist before profiling starts; the Adam moments
    are created by the first profiled step, so the measured (second) step includes them."""
    from torch.profiler import ProfilerActivity, profile, record_function
    import optim
    import parallel
    import train
    torch.manual_seed(0)
    m, d = cfg.model, cfg.data
    grid = parallel.Grid()
    t = torch.randint(0, m.vocab_size, (2, d.micro_batch, d.seq_len + 1))
    docs = (torch.arange(d.seq_len) >= d.seq_len // 3).long().expand(d.micro_batch, -1)   # packed: 2 documents
    batches = [{"tokens": x[:, :-1], "targets": x[:, 1:], "doc_ids": docs,
                "positions": torch.arange(d.seq_len).expand(d.micro_batch, -1)} for x in t]
    assert len(batches) == configs.grad_accum_steps(cfg, 1)
    model = parallel.build_model(cfg, grid, "cpu")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        opt = optim.build_optimizer(model, cfg, grid)
        train.train_step(model, opt, batches, grid, cfg)
        with record_function("measured_step"):
            train.train_step(model, opt, batches, grid, cfg)
    events = list(prof.profiler.kineto_results.events())
    mark = next(e for e in events if e.name() == "measured_step")
    lo, hi = mark.start_ns(), mark.start_ns() + mark.duration_ns()
    live = peak = 0
    for e in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        live += e.nbytes()
        if lo <= e.start_ns() <= hi:
            peak = max(peak, live)
    return weights + peak


@pytest.mark.parametrize("ckpt", ["none", "full"])
def test_tiny_memory_estimate_matches_a_measured_step(ckpt):
    torch.set_num_threads(1)
    cfg = configs.from_args([f"--model.checkpointing={ckpt}"])          # the tiny preset, fp32
    measured = measured_peak_bytes(cfg)
    # CPU PyTorch runs SDPA (with the document mask too) as its flash kernel, which keeps the
    # output and logsumexp instead of the probabilities XLA's math path keeps: tell the planner.
    planned = estimate(cfg, world=1, attention="flash").total
    print(f"tiny, checkpointing {ckpt}: planner {planned / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB")
    assert abs(planned - measured) <= 0.25 * measured


def test_trn2_is_one_row_of_the_instance_table():
    # trn2.48xlarge at LNC=2: 64 ranks per instance, 24 GiB and 166.75 bf16 TFLOPS per logical core.
    # 7B at TP=4 (one Trainium2 chip) fits there and not on trn1's 16 GiB cores; 70B still needs
    # model parallelism beyond one chip.
    c1, c2 = configs.llama2_7b(), configs.from_args(["--preset", "llama2_7b", "--instance", "trn2"])
    four = Layout(4, 1, 1024, True, False, "selective", 1)
    e1, e2 = estimate(c1, four, 4096), estimate(c2, four, 4096)
    assert e1.total == e2.total and not e1.fits and e2.fits      # same bytes, a bigger core
    assert e2.peak == configs.INSTANCES["trn2"].bf16_flops and e2.compute_s < e1.compute_s
    assert estimate(c2).layout.dp == 128 * 64 // 8               # default: 128 instances of 64 ranks
    c70 = configs.from_args(["--preset", "llama2_70b", "--instance", "trn2"])
    assert not estimate(c70, Layout(4, 1, 2048, True, True, "selective", 1), 8192).fits
    assert estimate(c70).fits


def test_plan_command_on_trn2():
    out = subprocess.run([sys.executable, "plan.py", "--preset", "llama2_7b", "--instance", "trn2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "on 8192 NeuronCores (128 trn2.48xlarge)" in out.stdout and "of 22 usable (24 GiB" in out.stdout
    assert "166.75 TFLOPS per core" in out.stdout


def test_plan_with_no_arguments_plans_the_blogs_run():
    out = subprocess.run([sys.executable, "plan.py"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("plan: llama2_7b on 4096 NeuronCores (128 trn1.32xlarge)"), out.stdout[:200]
