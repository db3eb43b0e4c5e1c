"""The planner (`python plan.py`): it reproduces the blog's and HLAT's layout choices from
per-core memory, and its memory model matches a real training step measured on this CPU."""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import configs  # noqa: E402
import plan  # noqa: E402  (the entry point: plan.main)
from conftest import seeded_model  # noqa: E402
from planner import calibrate, cost, instances, report  # noqa: E402
from planner.cost import Layout, estimate  # noqa: E402
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
        assert e.weights == e.params * cost.PRECISION_BYTES[c.optim.precision][0]
    c = configs.llama2_70b()                            # mixed: fp32 gradients unless told otherwise
    assert estimate(c, world=WORLD).grads == 4 * estimate(c, world=WORLD).params
    c.optim.fp32_grad_acc = False
    assert estimate(c, world=WORLD).grads == 2 * estimate(c, world=WORLD).params


# The plan command in-process, through plan.main (`python plan.py ARGS` is plan.main(ARGS)): 0.05 s
# each, where a process that loads torch took ~3 s.
def test_plan_command_prints_the_tables(capsys):
    plan.main(["--preset", "llama2_70b"])
    text = capsys.readouterr().out
    assert "configured layout: TP=32 PP=8 DP=16 SP ZeRO-1 selective mb=1" in text
    assert "layouts that fit, fastest first" in text and "GFLOP per token" in text and "EFA" in text
    table, flags = text.split("fastest first")[1].split("  the fastest as flags: ")
    steps = [float(line.split()[8]) for line in table.splitlines()[2:] if line.strip()]
    assert steps and steps == sorted(steps)
    plan.main(["--preset", "llama2_70b", *flags.split()])     # the flags line, copied: that layout, that step
    assert f"estimated step {steps[0]:.2f} s" in capsys.readouterr().out


def test_issue_10s_spelling_configs_py_plan_is_the_planner(capsys):
    # issue 10 names `python configs.py plan --preset llama2_7b`: it printed the usage and exited 1
    configs.main(["plan", "--preset", "llama2_7b"])
    ours = capsys.readouterr().out
    plan.main(["--preset", "llama2_7b"])
    assert ours == capsys.readouterr().out and "configured layout: TP=8 PP=1" in ours


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
    model = seeded_model(cfg, grid)
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
    cfg = configs.from_args([f"--model.checkpointing={ckpt}"])          # the tiny preset, fp32
    threads = torch.get_num_threads()
    torch.set_num_threads(1)              # one thread's buffers; restored: the tests after this one keep theirs
    try:
        measured = measured_peak_bytes(cfg)
    finally:
        torch.set_num_threads(threads)
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
    assert e2.peak == instances.INSTANCES["trn2"].bf16_flops and e2.compute_s < e1.compute_s
    # NeuronLink inside a trn2.48xlarge: 1,024 GB/s a chip of 4 ranks (Neuron's trn2-arch.rst, "Intra-instance
    # NeuronLink-v3 bandwidth"); the 1.28 TB/s of trainium2.rst counts the links only an UltraServer connects
    assert instances.INSTANCES["trn2"].link_bw == 1.024e12 / 4
    assert estimate(c2).layout.dp == 128 * 64 // 8               # default: 128 instances of 64 ranks
    c70 = configs.from_args(["--preset", "llama2_70b", "--instance", "trn2"])
    assert not estimate(c70, Layout(4, 1, 2048, True, True, "selective", 1), 8192).fits
    assert estimate(c70).fits


def test_plan_command_on_trn2(capsys):
    plan.main(["--preset", "llama2_7b", "--instance", "trn2"])
    out = capsys.readouterr().out
    assert "on 8192 NeuronCores (128 trn2.48xlarge)" in out and "of 22 usable (24 GiB" in out
    assert "166.75 TFLOPS per core" in out
    assert "TP=8 PP=1 DP=1024 SP selective mb=1, 1 microbatch per step\n" in out, out     # (was "1 microbatches")


def test_plan_with_no_arguments_plans_the_blogs_run(capsys):
    plan.main([])
    out = capsys.readouterr().out
    assert out.startswith("plan: llama2_7b on 4096 NeuronCores (128 trn1.32xlarge)"), out[:200]


# ----------------------------------------------------------------------------- step time
ISSUE_7B = ["--preset=llama2_7b", "--parallel.cores=512", "--parallel.tp=8", "--parallel.dp=64",
            "--data.global_batch=1024", "--optim.precision=mixed", "--parallel.zero1=true"]


def test_shipped_constants_are_the_fits_output(capsys, monkeypatch):
    # The fitted constants are what planner/calibrate.py computes from the 'fit' rows today.
    fitted = calibrate.fit()
    assert fitted == (cost.MATMUL_EFFICIENCY, cost.MICROBATCH_OVERHEAD, cost.SCORE_PASSES)
    assert 0.2 < cost.MATMUL_EFFICIENCY <= 1.0 and 0.0 <= cost.MICROBATCH_OVERHEAD < 0.1
    # `python -m planner.calibrate` says so, and fails (it exited 0) when cost.py ships other numbers;
    # the fit's result above stands in for its second run (3 s).
    monkeypatch.setattr(calibrate, "fit", lambda rows=None: fitted)
    calibrate.main([])
    assert f"MATMUL_EFFICIENCY = {cost.MATMUL_EFFICIENCY}" in capsys.readouterr().out
    monkeypatch.setattr(calibrate, "MATMUL_EFFICIENCY", 0.5)
    with pytest.raises(SystemExit) as e:
        calibrate.main([])
    assert f"ships (0.5, {cost.MICROBATCH_OVERHEAD}, {cost.SCORE_PASSES}), not these" in str(e.value)


def test_published_rows_are_consistent():
    rows = calibrate.published_rows()
    assert {r["role"] for r in rows} == {"fit", "predict"}
    assert {r["model"] for r in rows if r["role"] == "fit"} == {"Llama2-7B", "Llama2-13B"}
    for r in rows:
        tp, pp, dp = int(r["tp"]), int(r["pp"]), int(r["dp"])
        assert tp * pp * dp == int(r["nodes"]) * 32, r                 # the table's topology uses every core
        assert int(r["global_batch"]) % (dp * int(r["micro_batch"])) == 0, r
        assert r["source"].startswith("aws-neuron/aws-neuron-sdk@") and len(r["source"].split("@")[1]) == 40


# The model of each published row as NxD's example configs give it (config.json beside each script the CSV
# names): vocab_size, hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size.
# Llama2-13B: tp_pp_llama2_hf_pretrain/13B_config (a80091de, 4596e71) and tp_pp_llama_hf_pretrain/13B_config_llama2
# (0598cd8) all say vocab_size 32016; Llama-3.1-70B: 70B_config_llama3.1 (0598cd8), 8 KV heads.
NXD_CONFIGS = {
    "Llama2-7B": (32000, 4096, 32, 32, 32, 11008),
    "Llama2-13B": (32016, 5120, 40, 40, 40, 13824),
    "Llama2-70B": (32000, 8192, 80, 64, 8, 28672),
    "Llama-3.1-8B": (128256, 4096, 32, 32, 8, 14336),
    "Llama-3.1-70B": (128256, 8192, 80, 64, 8, 28672),
}


def test_each_row_is_evaluated_in_the_configuration_neuron_published():
    # What the planner evaluates for a row is that row: NxD's model config, and the layout, batch and
    # sequence of the published table (TP, PP, DP, micro-batch 1, global batch 1024, microbatches per step).
    for r in calibrate.published_rows():
        m = configs.from_args(calibrate.MODELS[r["model"]]).model
        assert (m.vocab_size, m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim) == NXD_CONFIGS[r["model"]], r["model"]
        assert not m.tie_embeddings, r["model"]                          # tie_word_embeddings: false in every config
        e = calibrate.row_estimate(r)
        L = e.layout
        assert (L.tp, L.pp, L.dp, L.micro_batch) == (int(r["tp"]), int(r["pp"]), int(r["dp"]), int(r["micro_batch"]))
        assert e.microbatches == int(r["global_batch"]) // (L.dp * L.micro_batch)          # NUM_MICROBATCHES = GBS / DP
        assert (L.sp, L.zero1, L.checkpointing) == (r["sp"] == "true", r["zero1"] == "true", r["checkpointing"])


def test_validation_against_neuron_published_trn1_throughput():
    rows = calibrate.validation()
    print(calibrate.validation_table())
    assert max(abs(err) for r, _, err in rows if r["role"] == "fit") <= 0.10
    predicted = {}
    for r, _, err in rows:
        if r["role"] == "predict":
            predicted.setdefault(r["model"], []).append(err)
    mean = {k: sum(v) / len(v) for k, v in predicted.items()}
    # Predicted, not fitted: Llama 2 70B (TP=32, PP=4 and 8) and Llama 3.1 8B (TP=32, seq 8192)
    # within 15% on average over Neuron's releases (single rows: see --validate).
    assert abs(mean["Llama2-70B"]) <= 0.15 and abs(mean["Llama-3.1-8B"]) <= 0.15, mean
    # Known miss: Llama 3.1 70B (seq 8192, NxD recomputing the MLP) runs about a quarter faster
    # than the model predicts; the test pins the sign and size so a change to the model shows here.
    assert -0.35 <= mean["Llama-3.1-70B"] <= 0.0, mean


def test_every_miss_is_explained_and_the_efficiency_diagnostic_says_why():
    # A predicted row outside 15% must carry a `note` in the CSV (printed by --validate); the notes
    # do not change any estimate. The rows without a note are matched by a matmul efficiency near
    # the fitted one; Llama 3.1 70B (same layout and releases as Llama 2 70B) only far above it.
    for r, _, err in calibrate.validation():
        if r["role"] == "predict" and abs(err) > 0.15:
            assert r["note"], r
    needed = {}
    for r in calibrate.published_rows():
        needed.setdefault("3.1-70B" if r["model"] == "Llama-3.1-70B" else "noted" if r["note"] else "other",
                          []).append(calibrate.matching_efficiency(r, calibrate.row_estimate(r)))
    assert 0.4 <= min(needed["other"]) and max(needed["other"]) <= 0.65, needed
    assert min(needed["3.1-70B"]) >= 0.65, needed
    e = calibrate.row_estimate(calibrate.published_rows()[0])          # the diagnostic inverts the estimate:
    r = dict(calibrate.published_rows()[0], seq_per_s=str(1024 / e.step_s))
    assert calibrate.matching_efficiency(r, e) == pytest.approx(cost.MATMUL_EFFICIENCY)


def _per_layer(row, monkeypatch):
    """One layer's matmuls at 100% of peak, its modelled TP seconds, and its published seconds per
    microbatch (the published slot less the modelled head, embedding, DP, update and launches):
    from the row and the same row with one layer fewer per stage."""
    n_layers = configs.from_args(calibrate.MODELS[row["model"]]).model.n_layers
    pp = int(row["pp"])
    fewer = calibrate.MODELS[row["model"]] + [f"--model.n_layers={n_layers - pp}"]
    monkeypatch.setitem(calibrate.MODELS, "fewer", fewer)
    less_row = dict(row, model="fewer")
    b1, l1 = calibrate.row_estimate(row, (1.0, 0.0, 0.0)), calibrate.row_estimate(less_row, (1.0, 0.0, 0.0))
    b, less = calibrate.row_estimate(row), calibrate.row_estimate(less_row)
    mbs, layers = b.microbatches, n_layers // pp
    work, comp = [(x.compute_s - y.compute_s) / mbs for x, y in ((b1, l1), (b, less))]
    tp = (b.tp_s - less.tp_s) / mbs
    head = (b.compute_s + b.tp_s) / mbs - layers * (comp + tp)
    fixed = (b.dp_s + b.opt_s + b.pp_s) / (mbs + pp - 1) + cost.MICROBATCH_OVERHEAD
    return work, tp, (1024 / float(row["seq_per_s"]) / (mbs + pp - 1) - fixed - head) / layers


def test_llama31_70b_leaves_no_time_for_its_tp_collectives(monkeypatch):
    # Neuron 2.20, three TP=32 rows. Llama 2 70B and Llama 3.1 8B move the same TP bytes per layer
    # and microbatch (10 collectives of [4096 x 8192] or [8192 x 4096] bf16): their published
    # difference measures the marginal matmul efficiency independently of the 7B/13B fit, and what
    # is left of their layer time is their TP time. Both agree with the model; Llama 3.1 70B at that
    # efficiency leaves about a third of its modelled TP time: the miss the CSV note explains.
    rows = {r["model"]: r for r in calibrate.published_rows() if r["release"] == "2.20.0"}
    (w8, tp8, t8), (w70, tp70, t70), (w31, tp31, t31) = (
        _per_layer(rows[m], monkeypatch) for m in ("Llama-3.1-8B", "Llama2-70B", "Llama-3.1-70B"))
    assert tp8 == pytest.approx(tp70, rel=0.1)                        # equal TP traffic per layer
    eff = (w70 - w8) / (t70 - t8)
    print(f"marginal efficiency {eff:.3f}; TP left per layer: 8B {t8 - w8 / eff:.4f} s (model {tp8:.4f}), "
          f"2-70B {t70 - w70 / eff:.4f} (model {tp70:.4f}), 3.1-70B {t31 - w31 / eff:.4f} (model {tp31:.4f})")
    assert eff == pytest.approx(cost.MATMUL_EFFICIENCY, rel=0.05)
    for w, tp, t in ((w8, tp8, t8), (w70, tp70, t70)):
        assert t - w / eff == pytest.approx(tp, rel=0.2)
    assert t31 - w31 / eff < 0.4 * tp31


def test_llama31_70b_miss_is_its_mlp_recompute_not_its_head_or_launches(monkeypatch):
    # What the CSV note says was ruled out, measured on the model: the 4x vocabulary of the last
    # stage (Llama 2's 32000 instead) and every per-microbatch launch (none) together move the rows
    # under 6 points; priced without the MLP recompute they are within 15% (the script recomputes it).
    def err(row, calibration=None):
        return 1024 / calibrate.row_estimate(row, calibration).step_s / float(row["seq_per_s"]) - 1
    monkeypatch.setitem(calibrate.MODELS, "small head", calibrate.MODELS["Llama-3.1-70B"] + ["--model.vocab_size=32000"])
    for row in (r for r in calibrate.published_rows() if r["model"] == "Llama-3.1-70B"):
        light = err(dict(row, model="small head"), (cost.MATMUL_EFFICIENCY, 0.0, cost.SCORE_PASSES))
        assert 0 < light - err(row) < 0.06, row["release"]
        assert -0.15 <= err(dict(row, checkpointing="selective")) < 0, row["release"]


def test_calibrate_command_explains_itself_and_refuses_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        calibrate.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "usage: python -m planner.calibrate" in out and "golden-section" in out
    assert "fitted on" not in out                                        # --help does not run the fit
    with pytest.raises(SystemExit) as e:
        calibrate.main(["--rows=13B"])
    assert "takes no arguments (got --rows=13B)" in str(e.value) and "\n" not in str(e.value)


def test_collective_latency_is_the_trn1_measurement():
    # nccom-test guide (trn1 examples): 2-rank all-reduce (2 ring steps) 58 us, 32-rank all-gather
    # (31 steps) 151 us, both at 1-64 KiB.
    assert cost._latency(2) == pytest.approx(58e-6, rel=0.01)
    assert cost._latency(31) == pytest.approx(151e-6, rel=0.01)


def test_refitting_other_rows_changes_the_constants():
    # The fit reads its rows: fitting the 13B rows alone gives other constants than 7B + 13B.
    rows = [r for r in calibrate.published_rows() if r["model"] == "Llama2-13B"]
    assert calibrate.fit(rows)[0] != calibrate.fit()[0]


def test_issue_command_prints_the_estimated_step(capsys):
    plan.main(ISSUE_7B)
    line = next(x for x in capsys.readouterr().out.splitlines() if "estimated step" in x)
    step = float(line.split("estimated step")[1].split()[0])
    published = [float(r["seq_per_s"]) for r in calibrate.published_rows() if r["model"] == "Llama2-7B"]
    # Neuron's 7B rows at this layout: 92.9 to 101.3 seq/s (Neuron 2.16 to 2.21)
    assert min(published) * 0.9 <= 1024 / step <= max(published) * 1.1, line


def test_validate_command_prints_the_table(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)             # run from anywhere, it names the data file in the repository
    plan.main(["--validate"])
    out = capsys.readouterr().out
    assert "(NxD, planner/trn1_training.csv)" in out.splitlines()[0], out.splitlines()[0]
    assert "published  estimated   error" in out
    assert sum(x.startswith("  Llama") for x in out.splitlines()) == len(calibrate.published_rows())


def test_matmul_roofline_and_overlap():
    assert set(cost.HBM_BW) == set(instances.INSTANCES)                     # every instance type is priced
    # configs (which imports nothing of the project) names the choices: the same three the planner prices
    assert set(configs.CHOICES["parallel.instance"]) == set(instances.INSTANCES)
    hbm, peak = cost.HBM_BW["trn1"], instances.INSTANCES["trn1"].bf16_flops
    big = cost._matmul_s(4096, 4096, 4096, peak, hbm, 2, 0.5)
    assert big == pytest.approx(2 * 4096**3 / (0.5 * peak))                 # compute-bound
    thin = cost._matmul_s(8192, 128, 128, peak, hbm, 2, 0.5)
    assert thin == pytest.approx(2 * (8192 * 128 + 128 * 128 + 8192 * 128) / hbm)   # bandwidth-bound
    # a dimension of 8 occupies the 128-wide TensorEngine as 128 would: same compute time
    narrow, wide = (cost._matmul_s(4096, 4096, n, peak, hbm, 2, 0.5) for n in (8, 128))
    assert narrow == pytest.approx(wide)
    c = configs.from_args(ISSUE_7B)
    one = estimate(c, Layout(1, 1, 512, False, True, "selective", 1), 512)
    assert one.tp_s == 0 and one.tp_bytes == 0
    eight = estimate(c)
    assert eight.tp_s > 0 and eight.bubble_s == 0 and eight.dp_link == "EFA"
    # selective recompute costs time; the full square of scores (SDPA's math path on XLA, NxD's
    # CoreAttention) costs more than our causal query blocks or a flash kernel
    none = estimate(c, Layout(8, 1, 64, True, True, "none", 1), 512)
    assert none.compute_s < eight.compute_s
    assert estimate(c, attention="flash").compute_s <= eight.compute_s < estimate(c, attention="math").compute_s


def test_validate_refuses_other_arguments():
    with pytest.raises(SystemExit) as e:
        plan.main(["--validate", "--preset=llama2_70b"])
    assert "--validate takes no other arguments" in str(e.value)


@pytest.mark.parametrize("args, named", [
    (["--preset=llama2_70b", "--parallel.tp=64"], "--parallel.tp=64"),            # 2 trn1 instances per TP group
    (["--parallel.cores=104", "--data.global_batch=104"], "--parallel.cores=104"),  # 3.25 trn1.32xlarge
    (["--instance=trn2", "--parallel.cores=96", "--data.global_batch=96"], "--parallel.cores=96"),
])
def test_layouts_that_no_cluster_of_whole_instances_runs_are_refused(args, named):
    # TP is priced on NeuronLink, inside one instance, and every other collective by how the groups
    # fall on instances: a TP group spanning instances, or a fraction of an instance past the first,
    # was planned anyway (TP=64 on trn1: 871 GB "NeuronLink" per core and step). One line, the fix named.
    with pytest.raises(SystemExit) as e:
        plan.main(args)
    msg = str(e.value)
    assert msg.startswith("config error: ") and named in msg and "\n" not in msg, msg
    plan.main(["--preset=llama2_70b", "--parallel.tp=32"])                         # whole instances: planned
    plan.main(["--parallel.cores=8", "--parallel.tp=8", "--data.global_batch=8"])  # part of one instance


@pytest.mark.parametrize("args", [["--parallel.cores=1000"], ["--instance=trn2", "--parallel.cores=100"]])
def test_cores_of_no_whole_instances_are_refused_before_the_batch_that_does_not_split(args):
    # 32 trn1 nodes mistyped as 1000 cores: the refusal said "pick a global batch that is a multiple of
    # 125", and following it (--global_batch=1000) met the next: 31.25 trn1.32xlarge. The cores come first.
    with pytest.raises(SystemExit) as e:
        plan.main(args)
    assert "plan whole instances, e.g. --parallel.cores=" in str(e.value) and "global batch" not in str(e.value), str(e.value)


def test_the_pipeline_fills_and_drains_through_the_other_stages_not_the_slowest():
    # 1F1B (NxD's Train1F1BSchedule, ours) with stage times t_s per microbatch: the slowest stage runs
    # its microbatches back to back, and the fill and drain pass every other stage once:
    # step = microbatches x t_max + sum of the others' t_s. Two stages of 7B at TP=8: the last holds
    # the head, so a larger vocabulary lengthens the pace but not the fill and drain (the first stage's
    # embedding is a lookup); it used to charge (PP - 1) slots of the slowest stage.
    def two_stages(vocab):
        cfg = configs.from_args(["--preset=llama2_7b", "--parallel.pp=2", f"--model.vocab_size={vocab}",
                                 "--data.global_batch=64", "--optim.precision=mixed"])
        return estimate(cfg, Layout(8, 2, 4, True, False, "selective", 1), 64)
    small, large = two_stages(32000), two_stages(128000)
    assert large.compute_s > small.compute_s * 1.05                     # the head on the last stage paces it
    assert large.bubble_s == pytest.approx(small.bubble_s, rel=1e-9)     # the first stage fills and drains
    per_slot = (small.compute_s + small.tp_s + small.pp_s + small.overhead_s) / small.microbatches
    assert small.bubble_s < per_slot                                    # one slot of the faster stage


def test_flash_attention_costs_seven_score_matmuls_recompute_eight_none_six():
    # Over the causal half of the scores, per head: our ExplicitAttention without checkpointing runs 2
    # matmuls forward (Q K^T, P V) and 4 backward (dV, dP, dQ, dK); selective checkpointing adds the
    # forward again (8). NxD's flash kernel (kernels/flash_attn.py -> neuronxcc's flash_attn_bwd, whose
    # docstring lists its steps) keeps no scores and recomputes only Q K^T in its backward: 2 + 5 = 7,
    # and NxD's selective checkpoint wraps CoreAttention, which the flash path never calls. Score
    # traffic aside (SCORE_PASSES 0), flash sits one matmul above `none` and one below `selective`.
    cfg = configs.from_args(["--preset=llama2_7b", "--data.seq_len=8192", "--optim.precision=mixed"])
    calib = (cost.MATMUL_EFFICIENCY, 0.0, 0.0)

    def compute(ckpt, kernel):
        return estimate(cfg, Layout(8, 1, 64, True, True, ckpt, 1), 512, attention=kernel, calibration=calib).compute_s
    none, selective, flash = compute("none", "explicit"), compute("selective", "explicit"), compute("selective", "flash")
    assert flash - none == pytest.approx(selective - flash, rel=1e-6) and selective > flash > none
    assert compute("none", "flash") == pytest.approx(flash, rel=1e-9)    # the kernel recomputes for itself


def test_a_recompute_ending_with_the_mlp_hides_the_backward_gather_and_its_own_reduce_scatter(monkeypatch):
    # NxD at seq 8192 checkpoints LlamaMLP (Llama 3.1 70B's rows). Its recompute waits for the MLP's
    # output gradient (torch_xla's optimization barrier) and runs beside the backward: the gather of that
    # gradient (token-free) beside the recomputed gate_up matmul, and the recomputed reduce-scatter (its
    # result only feeds the collectives' token) beside the backward's down_proj matmuls. Both collectives
    # still move their bytes; at 70B's shapes (2.4 ms each, beside 5 ms matmuls) no time shows.
    row = next(r for r in calibrate.published_rows() if r["model"] == "Llama-3.1-70B")
    mlp, sel = calibrate.row_estimate(row), calibrate.row_estimate(dict(row, checkpointing="selective"))
    layers, M = 10 * mlp.microbatches, int(row["seq_len"])
    one_bytes = M * 8192 * 2 * 31 / 32
    assert mlp.tp_bytes - sel.tp_bytes == pytest.approx(2 * layers * one_bytes)      # two more collectives
    assert mlp.tp_s == pytest.approx(sel.tp_s, rel=1e-9)                              # hidden: no time
    # A narrow MLP (ffn 1024: matmuls shorter than a collective): only what outlasts them shows.
    monkeypatch.setitem(calibrate.MODELS, "narrow", calibrate.MODELS["Llama-3.1-70B"] + ["--model.ffn_dim=1024"])
    narrow = dict(row, model="narrow")
    mlp, sel = calibrate.row_estimate(narrow), calibrate.row_estimate(dict(narrow, checkpointing="selective"))
    one = one_bytes / (instances.INSTANCES["trn1"].link_bw * cost.LINK_EFFICIENCY) + cost._latency(31)
    assert 0 < mlp.tp_s - sel.tp_s < 2 * one * layers


def test_gpipe_keeps_every_microbatch_on_the_last_stage_too():
    # pipeline.gpipe runs every forward before any backward, so every stage holds all m microbatches
    # (test_pipeline measures it: GPipe all m, 1F1B PP - s on stage s); the planner counted one on
    # the last stage, as 1F1B, and missed its activations and the fp32 softmax each microbatch keeps.
    c = configs.llama2_70b()                                          # PP=8, 64 microbatches, 1F1B
    g = configs.from_args(["--preset=llama2_70b", "--parallel.pp_schedule=gpipe"])
    one, every = estimate(c, world=WORLD), estimate(g, world=WORLD)
    assert one.stage == "first" and every.stage == "last"
    assert every.microbatches == 64 and every.activations == pytest.approx(64 / 8 * one.activations)
    assert every.loss >= 64 * 4096 * 4 * 32000 / 32                   # 64 fp32 softmaxes of [4096, 32000 / TP]


def _stage_params(cfg, stage: int) -> int:
    """Parameters pipeline.py puts on `stage` at TP=1: its layers by stage_bounds (and the embedding,
    the norm and the head by stage_of), counted on a real model (on the host: the meta device's first
    use costs ~2.5 s)."""
    import pipeline
    bounds = pipeline.stage_bounds(cfg)
    return sum(p.numel() for name, p in llama.Llama(cfg.model).named_parameters()
               if pipeline.stage_of(name, bounds) == stage)


def test_pipeline_stage_cuts_are_planned_as_configured():
    # --parallel.pp_cuts was ignored: every stage was priced with n_layers / PP layers. 40 of the 80
    # layers on the first of 8 stages (or on the third) is 4x the weights and activations the even
    # split plans, and that stage paces the step.
    even = configs.llama2_70b()
    small = ["--model.dim=64", "--model.n_heads=4", "--model.n_kv_heads=2", "--model.ffn_dim=128",
             "--model.vocab_size=256"]                                 # still 80 layers
    world, layout = 256 * 8, Layout(1, 8, 256, False, True, "selective", 1)
    for cuts, stage, name in (("40,45,50,55,60,65,70", 0, "first"), ("5,10,50,55,60,65,70", 2, "middle #2")):
        cut = configs.from_args(["--preset=llama2_70b", f"--parallel.pp_cuts={cuts}"])
        e = estimate(cut, layout, world)
        assert e.stage == name and e.compute_s > 3.5 * estimate(even, layout, world).compute_s, (cuts, e.stage)
        assert not estimate(cut).fits and estimate(even).fits        # TP=32: 23.6 GiB on that stage, 6.0 even
        cut = configs.from_args(["--preset=llama2_70b", f"--parallel.pp_cuts={cuts}", *small])
        assert estimate(cut, layout, world).params == _stage_params(cut, stage), cuts
    # A PP that does not divide the layers runs with cuts (llama2_7b's 32 layers on 3 stages): the
    # report's configured layout is runnable (it said "cannot run"), its last stage 10 layers and the head
    c = configs.from_args(["--preset=llama2_7b", "--parallel.pp=3", "--parallel.pp_cuts=11,22"])
    assert cost.runnable(c, 96, 8, 3, True, False, "selective", 1) == Layout(8, 3, 4, True, False, "selective", 1)
    assert cost.stage_layers(c, 3) == [(0, 11), (2, 10)]       # stage 1 (11) is never fuller than stage 0


@pytest.mark.parametrize("args", [["--preset=llama3_8b"], ["--preset=llama2_70b"],
                                  ["--preset=llama3_2_1b", "--model.checkpointing=full"]])
def test_the_memory_lines_add_up_to_the_total(capsys, args):
    # The per-core breakdown a reader adds up: ZeRO-1's bucket in flight (0.13 GiB at llama3_8b) and
    # full checkpointing's loss-before-recompute saving were in the total but on no line.
    plan.main(args)
    block = capsys.readouterr().out.split("GiB\n", 1)[1].split("  traffic")[0].splitlines()
    parts = [float(line.split()[-1]) for line in block[:-1]]
    total = float(block[-1].split()[1])
    assert len(parts) >= 6 and abs(sum(parts) - total) <= 0.005 * len(parts), block


@pytest.mark.parametrize("args, fix", [
    (["--preset=llama3_8b", "--instance=trn2"], "--parallel.cores=4096 runs this layout"),   # 512 sequences, DP 1024
    (["--parallel.tp=8", "--parallel.dp=64"], "--parallel.cores=512 runs this layout"),     # Neuron's 7B layout
])
def test_a_layout_the_default_cores_cannot_run_names_the_cores_that_can(args, fix):
    # The planner's own fix for a batch or DP that does not fit the cores planned for is fewer cores;
    # the message offered only the trainer's (another global batch, launch fewer processes).
    with pytest.raises(SystemExit) as e:
        plan.main(args)
    assert fix in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_configured_pipeline_with_stage_cuts_is_in_the_other_layouts_table(capsys):
    # llama2_7b's 32 layers on 3 stages (--parallel.pp_cuts=11,22): the table of the same settings on
    # other layouts left out every PP=3 row, the configured one too, as if 3 stages could not hold 32 layers.
    plan.main(["--preset=llama2_7b", "--parallel.pp=3", "--parallel.pp_cuts=11,22", "--parallel.cores=96"])
    table = capsys.readouterr().out.split("same settings on other layouts")[1].split("layouts that fit")[0]
    rows = [line.split()[:3] for line in table.splitlines()[1:] if line.strip()]
    assert ["8", "3", "4"] in rows and ["8", "1", "12"] in rows, rows


def test_the_other_layouts_table_says_why_a_layout_cannot_run(capsys):
    # 1024 sequences over DP 96 do not split, though 1024 > 96: the note said "global batch 1024 <
    # micro-batch x DP"; and too few microbatches for the stages got the same wrong note.
    plan.main(["--preset=llama2_7b", "--parallel.pp=3", "--parallel.pp_cuts=11,22", "--parallel.cores=96"])
    out = capsys.readouterr().out
    assert "1   1   96" in out and "(and global batch 1024 does not split over micro-batch x DP = 96)" in out
    plan.main(["--preset=llama2_70b", "--data.global_batch=128"])
    assert "(and 1 microbatch per step, fewer than 8 stages)" in capsys.readouterr().out


def test_when_no_layout_fits_in_memory_the_report_says_so(capsys):
    # 70B on one trn1: 540 layouts run and none fits in HBM; the report blamed the global batch
    plan.main(["--preset", "llama2_70b", "--parallel.cores=32", "--parallel.tp=32", "--parallel.pp=1"])
    out = capsys.readouterr().out
    assert "layouts that fit, fastest first (0 of 540)" in out and "global batch" not in out.split("(0 of 540)")[1]
    assert "none: the smallest needs 37.39 GiB per core of 14 usable; give more cores (--parallel.cores)" in out, out


@pytest.mark.timeout(30)
def test_the_cores_fix_for_a_billion_cores_ends(capsys):
    # Looking for the cores that run a layout tried every DP below the cores planned for: 1.25e8 of
    # them at 10^9 cores (minutes). Only the divisors of the step's micro-batches can be DP.
    with pytest.raises(SystemExit) as e:
        plan.main([f"--parallel.cores={report.MOST_CORES}"])
    assert "--parallel.cores=8192 runs this layout" in str(e.value), str(e.value)
    # Past any cluster, one line naming the bound: 10^18 cores and sequences (sqrt: 10^9 divisors to try) never ended
    with pytest.raises(SystemExit) as e:
        plan.main(["--parallel.cores=1000000000000000000", "--data.global_batch=999999999999999989"])
    assert str(e.value) == ("config error: --parallel.cores=1000000000000000000 is past any Trainium cluster: plan at "
                            "most 2,097,152 NeuronCores (32,768 trn2.48xlarge at 64 logical cores each)"), str(e.value)
    # Nor every divisor of a 10^18-sequence batch (isqrt: 10^9 tries): only those up to the cores' DP (512)
    with pytest.raises(SystemExit) as e:
        plan.main(["--data.global_batch=1000000000000000001"])
    assert "--parallel.cores=8 runs this layout" in str(e.value), str(e.value)


@pytest.mark.slow               # ~4 s alone: hf.save_hf's first call (0.05 s once test_hf has run)
def test_init_from_plans_the_folders_model(capsys, tmp_path):
    # --init_from=FOLDER trains the folder's model (config.json), as train.py reads it; the planner
    # ignored it and planned the preset's 6.74B llama2_7b, under its name.
    import hf
    cfg = configs.from_args(["--model.dim=128", "--model.n_layers=3", "--model.n_heads=4", "--model.n_kv_heads=2",
                             "--model.ffn_dim=352", "--model.vocab_size=1000"]).model
    hf.save_hf(llama.Llama(cfg).state_dict(), cfg, str(tmp_path / "hf"))
    plan.main([f"--init_from={tmp_path / 'hf'}", "--parallel.tp=2", "--parallel.cores=2", "--data.global_batch=8",
               "--data.seq_len=128"])
    out = capsys.readouterr().out
    assert out.startswith(f"plan: {tmp_path / 'hf'} on 2 NeuronCores"), out[:200]
    assert f"model: {llama.num_params(cfg) / 1e9:.2f}B parameters" in out and "configured layout: TP=2 PP=1 DP=1" in out
    assert f"{sum(cost._layer_params(cfg, 2) for _ in range(3)) / 1e6 + 2 * 500 * 128 / 1e6 + 128 / 1e6:8.1f}M params" in out
    with pytest.raises(SystemExit) as x:                          # no such folder: one line, as train.py says it
        plan.main([f"--init_from={tmp_path / 'none'}"])
    assert str(x.value).endswith("none does not exist: give a Hugging Face model folder (save_pretrained's output)")


def test_the_readmes_memory_table_is_the_planners():
    """Issue 10 asks for the 7B and 70B memory tables in the README: its rows are estimate()'s, in GiB
    per NeuronCore, and so are the totals of the layouts it names as not fitting. A ZeRO-1 bucket is in the
    total, so the optimizer cell says it (the 70B row's cells summed to 5.89 under a total of 6.02)."""
    rows = {line.split(",")[0]: line for line in open(os.path.join(ROOT, "README.md")).read().splitlines()
            if line.startswith(("| 7B,", "| 70B,"))}
    gib = lambda x: f"{x / 2**30:.2f}"                                               # noqa: E731
    tp1, tp2 = Layout(1, 1, 4096, False, False, "selective", 1), Layout(2, 1, 2048, True, False, "selective", 1)
    tp8_zero1 = Layout(8, 1, 512, True, True, "selective", 1)
    for name, c, others in (("| 7B", configs.llama2_7b(), {"TP=1": tp1, "TP=2": tp2}),
                            ("| 70B", configs.llama2_70b(), {"TP=8 PP=1": tp8_zero1})):
        e = estimate(c, world=WORLD)
        cells = [gib(x) for x in (e.weights, e.grads, e.optimizer, e.activations, e.loss)] + [f"**{gib(e.total)}**"]
        cells[2] += f" + {gib(e.bucket)} bucket" * (e.bucket > 0)
        assert e.fits and " | ".join(cells) in rows[name], (rows[name], cells)
        for label, layout in others.items():
            x = estimate(c, layout, WORLD)
            assert not x.fits and f"{label} ({gib(x.total)})" in rows[name], label


def test_the_docs_trn1_and_trn2_step_times_are_the_planners():
    # docs/planner.md's instance table quotes the presets' estimated step on 128 instances: the
    # estimate changes with the cost model, so the table is checked against it.
    rows = {line.split("|")[1].strip(): line for line in open(os.path.join(ROOT, "docs", "planner.md")).read().splitlines()
            if "preset on 128 instances" in line}
    for name, preset in (("7B preset on 128 instances (TP=8, 9.35 GiB)", "llama2_7b"),
                         ("70B preset on 128 instances (TP=32 PP=8)", "llama2_70b")):
        for cell, instance in zip(rows[name].split("|")[2:4], ("trn1", "trn2")):
            cfg = configs.from_args([f"--preset={preset}", f"--parallel.instance={instance}"])
            step = estimate(cfg, world=128 * instances.INSTANCES[instance].cores).step_s
            assert f"est. {step:.2f} s/step" in cell, (name, instance, cell, step)


def test_the_fused_loss_fp32_sum_of_many_chunks_is_in_the_plan():
    """In 16-bit weights the fused loss sums its weight gradient in an fp32 [vocab, dim] buffer past three chunks
    (model.LinearCrossEntropy): measured, the peak of its forward grows by that buffer from 3 to 4 chunks of the
    same rows; the planner's loss term (TP=1, one microbatch in flight) grows by it too."""
    from torch.profiler import ProfilerActivity, profile
    vocab, dim, rows = 1024, 512, 48

    def peak(chunk):
        h = torch.randn(rows, dim).bfloat16()
        w = torch.randn(vocab, dim).bfloat16().requires_grad_()
        t = torch.randint(0, vocab, (rows,))
        real = llama.LinearCrossEntropy.chunk_rows
        llama.LinearCrossEntropy.chunk_rows = staticmethod(lambda n, v, d: chunk)
        try:
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                llama.LinearCrossEntropy.apply(h, w, t, True, torch.tensor(1.0 / rows))
        finally:
            llama.LinearCrossEntropy.chunk_rows = real
        live = top = 0
        for e in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                        key=lambda e: e.start_ns()):
            live += e.nbytes()
            top = max(top, live)
        return top
    grown = peak(rows // 4) - peak(rows // 3)              # 4 chunks, then 3 (the chunk itself shrinks)
    assert grown >= 0.9 * 4 * vocab * dim, grown

    def loss_term(micro_batch):
        cfg = configs.from_args(["--model.n_layers=2", "--model.dim=256", "--optim.precision=bf16",
                                 "--data.seq_len=256", f"--data.micro_batch={micro_batch}", "--data.global_batch=64"])
        return cfg, estimate(cfg, world=1).loss
    (c3, three), (c4, four) = loss_term(12), loss_term(16)   # 3072 rows: 3 chunks of 1024; 4096: 4
    m = c4.model
    assert llama.LinearCrossEntropy.chunk_rows(4096, m.vocab_size, m.dim) * 3 < 4096
    assert llama.LinearCrossEntropy.chunk_rows(3072, m.vocab_size, m.dim) * 3 >= 3072
    per_row = (4 + 3 * 2) * m.dim                          # what grows with the rows alone (kept per row)
    assert four - three - 1024 * per_row >= 4 * m.vocab_size * m.dim, (four - three - 1024 * per_row)
