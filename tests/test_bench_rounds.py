"""Every benchmark a median of alternating rounds (benchmarks/common.take_turns): `bench.py parallel` and `pp` kept the
best of 2 rounds, and `bench.py ckpt` timed each restart variant once, one after the other (it said building the model
empty 'saves -19.9 s' per restart when the same first step took 20.4 s in one run and 33.4 s in the other). These
tests check the structure (who runs when, what is reported), never a time."""
import json
import os
import sys
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks import common, layouts  # noqa: E402


def test_median_spread_is_the_median_and_extremes_of_the_rounds_ratios():
    m = common.median_spread([2.0, 9.0, 3.0], [1.0, 3.0, 1.0])           # ratios 2, 3, 3
    assert m == (3.0, 2.0, 3.0)
    assert common.median_ratio([2.0, 9.0, 3.0], [1.0, 3.0, 1.0]) == 3.0
    assert common.spread_text((0.8123, 0.75, 0.88)) == "0.81x (0.75-0.88)"


def test_take_turns_rotates_and_returns_what_each_function_returns():
    calls = []
    fns = {name: (lambda name=name: calls.append(name) or f"{name}{len(calls)}") for name in "ab"}
    out = common.take_turns(fns, rounds=4)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]              # no warm-up; the order rotates
    assert out == {"a": ["a1", "a4", "a5", "a8"], "b": ["b2", "b3", "b6", "b7"]}


def _launches(monkeypatch, step_s):
    """The gloo launcher, replaced: each launch records its layout and writes the ranks' reports with the next of
    that layout's `step_s` numbers (what a rank measured; the real launches run in `bench.py parallel/pp`)."""
    order, seen = [], {}

    def launch(which, name, world, threads, steps, BENCH_LAYOUT, BENCH_OUT):
        order.append(name)
        s = step_s[name][seen.get(name, 0)]
        seen[name] = seen.get(name, 0) + 1
        for rank in range(world):
            common.write_json(f"{BENCH_OUT}.{rank}", {"step_s": s, "idle": 0.1, "max_live": 3, "bubble": 0.11})
    monkeypatch.setattr(layouts, "launch_ranks", launch)
    return order


def _alternated(order, names, rounds):
    assert len(order) == rounds * len(names)
    per_round = [order[i:i + len(names)] for i in range(0, len(order), len(names))]
    assert all(sorted(r) == sorted(names) for r in per_round), per_round      # every layout once a round
    assert per_round[0][0] != per_round[1][0], per_round                     # and the order rotates


def test_pp_alternates_its_layouts_and_reports_the_median_ratio_and_its_spread(monkeypatch, tmp_path, capsys):
    names = ["1 process x 1 thread", "1 process x 2 threads", "PP=2 1F1B (2 x 1 thread)",
             "PP=2 GPipe (2 x 1 thread)", "PP=2 1F1B allgather p2p"]
    # the 1F1B / GPipe ratios per round: 0.5, 2.0, 1.5; the best rounds' ratio (the old report) was 1.0 / 2.0 = 0.5
    step_s = {n: [2.0, 2.0, 2.0] for n in names}
    step_s["PP=2 1F1B (2 x 1 thread)"] = [1.0, 4.0, 3.0]
    order = _launches(monkeypatch, step_s)
    res = layouts.bench_pp(SimpleNamespace(steps=0, out=str(tmp_path)))
    _alternated(order, names, 3)
    assert res["ratios"]["1f1b_over_gpipe"] == (1.5, 0.5, 2.0)
    assert res["ratios"]["1f1b_over_2_threads"] == (1.5, 0.5, 2.0)
    assert res["layouts"]["PP=2 1F1B (2 x 1 thread)"]["step_s"] == [1.0, 4.0, 3.0]
    out = capsys.readouterr().out
    assert "1F1B / GPipe 1.50 (0.50-2.00)" in out and "best of" not in out, out
    assert "| PP=2 1F1B (2 x 1 thread) | 3000 ms | 0.67x (0.50-2.00) |" in out, out      # median step, 1-thread/1F1B
    assert json.load(open(tmp_path / "pp.json"))["ratios"]["1f1b_over_gpipe"] == [1.5, 0.5, 2.0]


def test_parallel_alternates_its_layouts_and_reports_the_median_ratio_and_its_spread(monkeypatch, capsys):
    names = ["1 process x 1 thread", "1 process x 2 threads", "TP=2 (2 x 1 thread)", "TP=2 + SP (2 x 1 thread)",
             "DP=2 (2 x 1 thread)"]
    step_s = {n: [1.0, 1.0, 1.0] for n in names}
    step_s["TP=2 (2 x 1 thread)"] = [0.5, 2.0, 4.0]                         # tokens/s vs 1 process: 2, 0.5, 0.25
    order = _launches(monkeypatch, step_s)
    res = layouts.bench_parallel(SimpleNamespace(steps=0))
    _alternated(order, names, 3)
    assert res["TP=2 (2 x 1 thread)"]["vs_2_threads"] == (0.5, 0.25, 2.0)
    out = capsys.readouterr().out
    assert "| TP=2 (2 x 1 thread) |" in out and "0.50x (0.25-2.00)" in out and "best" not in out, out


@pytest.mark.slow      # ~30-60 s: 4 kills and 4 restarts of a small model, each a fresh interpreter
def test_ckpt_restarts_alternate_the_variants_and_report_the_median_ratio(monkeypatch, tmp_path, capsys):
    import configs
    from benchmarks import ckpt
    order = []

    def spy(fns, rounds):                                   # the real rotation, recording who ran when
        return common.take_turns({k: (lambda k=k, f=f: order.append(k) or f()) for k, f in fns.items()}, rounds)
    monkeypatch.setattr(ckpt, "take_turns", spy)
    cfg = configs.Config(model=configs.ModelConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2, n_kv_heads=1,
                                                   ffn_dim=32, max_seq_len=256))
    res = {}
    ckpt.restarts(cfg, str(tmp_path), 1, res, rounds=2)
    assert order == ["init_then_load", "empty_then_load", "empty_then_load", "init_then_load"]
    empty, init = (res[v]["rounds"] for v in ("empty_then_load", "init_then_load"))
    assert len(empty) == len(init) == 2
    key = "restart_to_first_step_s"
    assert res["restart_empty_over_init"] == common.median_spread([x[key] for x in empty], [x[key] for x in init])
    assert res[key] == res["empty_then_load"][key]
    out = capsys.readouterr().out
    assert "median of 2 rounds" in out and "empty / initialized, median of the rounds' ratios" in out, out
    assert "saves" not in out, out
