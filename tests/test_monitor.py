"""Monitoring: the blog's spike detector finds exactly the known spikes, non-finite steps skip or
stop as configured, metrics stay lazy on XLA, TensorBoard files read back, curves."""
import json
import logging
import math
import os
import pickle
import re
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import configs  # noqa: E402
import hardware  # noqa: E402
import monitor  # noqa: E402
from monitor import Monitor, NonFiniteError, SpikeDetector  # noqa: E402


def feed(detector, norms, spikes=None):
    """The detector's warnings; spikes: gets (first step, length) of each spike as it ends (its open spike closed)."""
    warnings = []
    for step, g in enumerate(norms, start=1):
        was = tuple(detector.current or ())
        warnings += [(step, w) for w in detector.update(step, g)]
        if was and detector.current is None and spikes is not None:
            spikes.append(was)
    return warnings


def test_spike_detector_finds_the_planted_spikes():
    # Base: 1.0 with a wiggle of +-0.03 (well under the 0.1 margin). Planted: one-step spikes at
    # steps 40 and 70, a 3-step spike at 100-102, a 7-step spike at 150-156 (persists: > 5 steps).
    norms = [1.0 + 0.03 * math.sin(0.7 * i) for i in range(1, 201)]
    for first, length, height in ((40, 1, 0.5), (70, 1, 0.3), (100, 3, 0.4), (150, 7, 0.4)):
        for s in range(first, first + length):
            norms[s - 1] += height
    d, spikes = SpikeDetector(), []
    warnings = feed(d, norms, spikes)
    assert spikes == [(40, 1), (70, 1), (100, 3), (150, 7)]
    assert d.summary() == {"spikes": 4, "one_step_share": 0.5, "longest": 7, "open": 0}
    # exactly one warning: the 7-step spike, on its 6th step
    assert [s for s, _ in warnings] == [155] and "persists for 6 steps" in warnings[0][1]


def test_the_spike_detector_holds_the_same_after_100_or_10000_spikes():
    """Each flush (every --log.interval steps) summarizes the spikes: it walked a list of every spike the
    process had seen, which only grew (the blog's 2T tokens are ~477k steps of 4M tokens; at one spike in 10
    steps, 8 ms a flush at 100k spikes). The totals are kept as counts now, the same for any run length."""
    sizes = []
    for n in (100, 10000):
        d = SpikeDetector()
        feed(d, [1.0] * 20 + [1.5, 1.0] * n)        # a one-step spike every other step
        assert d.summary() == {"spikes": n, "one_step_share": 1.0, "longest": 1, "open": 0}
        sizes.append(len(pickle.dumps(d)))
    assert sizes[1] < 1.5 * sizes[0], sizes        # (larger step numbers); before: 70x


def test_a_run_without_spikes_has_no_one_step_share():
    # The share of one-step spikes among none is no number: None (JSON null), not NaN, which
    # `bench.py init` wrote into its JSON for a run with no spikes (jq and strict parsers refuse it).
    d = SpikeDetector()
    feed(d, [1.0] * 50)
    assert d.summary() == {"spikes": 0, "one_step_share": None, "longest": 0, "open": 0}


def test_a_norm_at_the_mean_plus_the_margin_is_no_spike():
    # The blog's spike is a norm that EXCEEDS the running mean of 20 plus 0.1: at it exactly, none
    # (1.0 + 0.1 == 1.1 in floats); just above it, one.
    spikes = []
    feed(SpikeDetector(), [1.0] * 20 + [1.1, 1.0, 1.2, 1.0], spikes)
    assert spikes == [(23, 1)]


def test_a_run_that_ends_inside_a_spike_says_so():
    """The closing line counts finished spikes. A run that ended inside one (the norm still high: the
    sign of divergence the detector is for) printed nothing about it, or nothing at all if it was the
    only spike."""
    lines = []
    mon = Monitor(small_cfg(None, interval=1), 1e6, 1e18, print_fn=lines.append)
    for s, g in enumerate([0.5] * 20 + [2.0] + [0.5] * 3 + [3.0] * 8, start=1):
        mon.step(s, loss=torch.tensor(3.0), grad_norm=torch.tensor(g), lr=1e-3, tokens=64)
    mon.close()
    closing = [x for x in lines if not x.startswith(("step ", "warning: "))]
    assert closing == ["gradient-norm spikes: 1, 100% lasted one step (the blog: over 86%), longest 1 steps",
                       "gradient-norm spike still open at the end: the last 8 steps, not counted above"], closing


def test_growth_warning_when_mean_triples():
    norms = [1.0] * 40 + [1.0 + 0.05 * k for k in range(1, 81)]       # lowest mean 1.0, then a ramp to 5.0
    first_over = next(t for t in range(20, len(norms) + 1) if sum(norms[t - 20:t]) / 20 > 3.0)
    warnings = [(s, w) for s, w in feed(SpikeDetector(), norms) if "grown" in w]
    assert [s for s, _ in warnings] == [first_over]       # once, when it first crosses 3x


def reference_spikes(norms, window=20, margin=0.1):
    """The blog's definition, written out literally: r = mean of the previous 20 norms; a spike
    starts when norm > r + 0.1 and lasts until a step where norm <= r + 0.1 again."""
    spikes, start = [], None
    for i in range(window, len(norms)):
        above = norms[i] > sum(norms[i - window:i]) / window + margin
        if above and start is None:
            start = i
        elif not above and start is not None:
            spikes.append((start + 1, i - start))      # steps are 1-based
            start = None
    return spikes


def test_spike_detector_on_a_recorded_run_matches_the_definition():
    path = os.path.join(ROOT, "tests", "data", "monitor_grad_norms.txt")
    norms = [float(line) for line in open(path) if not line.startswith("#")]
    d, spikes = SpikeDetector(), []
    feed(d, norms, spikes)
    expected = reference_spikes(norms)
    assert len(expected) > 20                     # the recording does have spikes to find
    assert spikes == expected
    assert d.summary()["spikes"] == len(expected) and d.summary()["longest"] == max(n for _, n in expected)
    one = sum(length == 1 for _, length in expected) / len(expected)
    assert d.summary()["one_step_share"] == pytest.approx(one)
    print(f"recorded run: {len(expected)} spikes, {one:.0%} lasted one step")


def small_cfg(tmp_path, **log):
    cfg = configs.tiny()
    cfg.log.tensorboard = str(tmp_path / "tb") if tmp_path else ""
    for k, v in log.items():
        setattr(cfg.log, k, v)
    return cfg


def test_nonfinite_skip_and_stop(tmp_path):
    lines = []
    mon = Monitor(small_cfg(None, on_nonfinite="skip"), 1e6, 1e12, print_fn=lines.append, max_consecutive_skips=3)
    assert mon.check_finite(1, torch.tensor(2.0), torch.tensor(0.5))
    assert not mon.check_finite(2, torch.tensor(float("nan")), torch.tensor(0.5))
    assert not mon.check_finite(3, torch.tensor(2.0), torch.tensor(float("inf")))
    assert mon.skipped == 2 and "update skipped" in lines[-1]
    assert mon.check_finite(4, 2.0, 0.5) and mon.consecutive_skips == 0
    for s in (5, 6):
        assert not mon.check_finite(s, float("nan"), 1.0)
    with pytest.raises(NonFiniteError, match="3 consecutive non-finite"):
        mon.check_finite(7, float("nan"), 1.0)

    stop = Monitor(small_cfg(None, on_nonfinite="stop"), 1e6, 1e12, print_fn=lines.append)
    with pytest.raises(NonFiniteError, match=r"step 9: non-finite loss nan.*no checkpoint.*on_nonfinite=skip"):
        stop.check_finite(9, torch.tensor(float("nan")), torch.tensor(1.0))


def test_a_nonfinite_stop_names_the_checkpoint_to_resume_from_or_says_there_is_none():
    # A stop said "the newest checkpoint is the last good one. Resume from it" in a run that had saved none (the tiny
    # preset saves only at its end): the same command again starts over and meets the same NaN at the same step.
    nan = float("nan")
    fresh = Monitor(small_cfg(None, on_nonfinite="stop"), 1e6, 1e12, print_fn=lambda *a: None)
    with pytest.raises(NonFiniteError) as e:
        fresh.check_finite(3, nan, 1.0)
    assert "no checkpoint was saved before it" in str(e.value) and "resume" not in str(e.value).lower(), e.value
    resumed = Monitor(small_cfg(None, on_nonfinite="stop"), 1e6, 1e12, print_fn=lambda *a: None, start_step=4)
    with pytest.raises(NonFiniteError, match=r"^step 5: .*the newest checkpoint, step 4, is the last good one: resume"):
        resumed.check_finite(5, nan, 1.0)
    resumed.saved = 6                                     # train.py's save of step 6
    with pytest.raises(NonFiniteError, match=r"the newest checkpoint, step 6, is the last good one"):
        resumed.check_finite(8, nan, 1.0)
    skips = Monitor(small_cfg(None, on_nonfinite="skip"), 1e6, 1e12, print_fn=lambda *a: None, max_consecutive_skips=1)
    with pytest.raises(NonFiniteError, match=r"1 consecutive non-finite steps; .*no checkpoint was saved before it"):
        skips.check_finite(2, nan, 1.0)


@pytest.mark.slow
def test_metrics_are_lazy_on_xla_and_stop_is_caught_at_flush():
    # In a subprocess: PJRT_DEVICE must not leak into the other tests' device choice.
    code = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {ROOT!r})
        import torch_xla, torch_xla.debug.metrics as met
        import configs, monitor
        dev = torch_xla.device()
        cfg = configs.tiny(); cfg.log.tensorboard = ""; cfg.log.interval = 5; cfg.log.on_nonfinite = "stop"
        mon = monitor.Monitor(cfg, 1e6, 1e12, device=dev, print_fn=lambda *a: None)
        reads = lambda: (met.metric_data("TransferFromDeviceTime") or [0])[0]
        w = torch.ones(4, device=dev)
        seen = []
        try:
            for s in range(1, 11):
                loss = (w * s).sum() if s != 7 else (w * float("nan")).sum()
                assert mon.check_finite(s, loss, w.norm())        # stop mode on XLA: nothing read here
                mon.step(s, loss=loss, grad_norm=w.norm() * s, lr=1e-3, tokens=64)
                torch_xla.sync()
                seen.append(reads())
        except monitor.NonFiniteError as e:
            print("STOPPED", s, "|", e)
        print("READS", seen)
    """)
    env = dict(os.environ, PJRT_DEVICE="CPU")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    # one device-to-host transfer per log interval (steps 5 and 10), none in between
    assert "READS [0, 0, 0, 0, 1, 1, 1, 1, 1]" in out.stdout, out.stdout
    assert "STOPPED 10 | step 7: non-finite loss nan" in out.stdout, out.stdout


def test_tensorboard_scalars_read_back_and_curves(tmp_path):
    cfg = small_cfg(tmp_path, interval=4)
    lines = []
    mon = Monitor(cfg, flops_per_token=2e6, peak_flops=1e18, print_fn=lines.append)
    losses = [5.0 - 0.1 * s for s in range(1, 13)]
    for s in range(1, 13):
        mon.step(s, loss=torch.tensor(losses[s - 1]), grad_norm=torch.tensor(0.5 + 0.01 * s), lr=1e-3 * s,
                 tokens=torch.tensor(4096), data_wait=0.002, param_norm=torch.tensor(100.0 + s))
    mon.eval(12, torch.tensor(4.0))
    mon.close()
    assert len([l for l in lines if l.startswith("step")]) == 4           # 3 log intervals + 1 eval
    assert "param norm 112.0" in lines[2] and "val ppl 54.60" in lines[3]
    s = monitor.read_scalars(cfg.log.tensorboard)
    assert [v for _, v in s["train/loss"]] == pytest.approx(losses)
    assert [st for st, _ in s["train/grad_norm"]] == list(range(1, 13))
    assert s["train/lr"][-1] == (12, pytest.approx(12e-3))
    assert s["train/param_norm"][0] == (1, pytest.approx(101.0))
    assert s["train/tokens_seen"][-1] == (12, 12 * 4096)
    assert s["val/loss"] == [(12, 4.0)] and s["val/perplexity"][0][1] == pytest.approx(math.exp(4.0), rel=1e-6)
    assert [st for st, _ in s["perf/tokens_per_s"]] == [4, 8, 12]
    assert s["perf/mfu"][-1][1] == pytest.approx(s["perf/tokens_per_s"][-1][1] * 2e6 / 1e18, rel=1e-5)
    png = monitor.plot_curves(cfg.log.tensorboard, str(tmp_path / "curves.png"))
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(png) > 10_000


def test_a_verdict_read_at_the_flush_resets_the_consecutive_skips():
    """XLA's skip mode: each step's verdict is a device tensor, read at the flush (on the host here, the same
    path). A step that was not skipped ends a run of skips there too: 2 skips, a good step, 2 skips, ... never
    reach 3 in a row, and do not stop the run."""
    cfg = small_cfg(None, interval=10, on_nonfinite="skip")
    lines = []
    mon = Monitor(cfg, 1e6, 1e12, print_fn=lines.append, max_consecutive_skips=3)
    for s in range(1, 31):
        skip = s % 3 != 0
        loss = torch.tensor(float("nan") if skip else 2.0)
        mon.step(s, loss=loss, grad_norm=torch.tensor(1.0), lr=1e-3, tokens=64, skipped=torch.tensor(skip))
    mon.close()
    assert mon.skipped == 20 and mon.consecutive_skips == 0
    assert sum("update skipped" in line for line in lines) == 20


def test_a_diverged_evaluation_is_logged_not_an_overflow(tmp_path):
    """A val loss past 709.8 (a diverged run: logits in the thousands) has a perplexity beyond a float's
    range: math.exp raises OverflowError there, which ended the run at its evaluation. It is logged, its
    perplexity capped at exp(50)."""
    cfg = small_cfg(tmp_path)
    lines = []
    mon = Monitor(cfg, flops_per_token=2e6, peak_flops=1e18, print_fn=lines.append)
    mon.eval(7, torch.tensor(1000.0))
    mon.close()
    assert lines == [f"step      7 | val loss 1000.0000 | val ppl {math.exp(50.0):.2f}"]
    assert monitor.read_scalars(cfg.log.tensorboard)["val/loss"] == [(7, 1000.0)]


@pytest.mark.parametrize("restart_from", [0, 3])
def test_tensorboard_hides_what_a_crashed_run_logged_past_the_restart(tmp_path, restart_from):
    """A run killed after step 6 restarts from its checkpoint of step 3, or from scratch (it died
    before any checkpoint was complete): the event files then show each step once, the restarted
    run's. From scratch the crashed run's steps 1-6 stayed beside the new ones (start_step 0 asked
    for no purge), so TensorBoard and `monitor.py plot` drew both."""
    cfg = small_cfg(tmp_path, interval=1)
    for start, end, loss in ((0, 6, 9.0), (restart_from, 8, 5.0)):
        mon = Monitor(cfg, 1e6, 1e12, print_fn=lambda *a: None, start_step=start)
        for s in range(start + 1, end + 1):
            mon.step(s, loss=torch.tensor(loss), grad_norm=torch.tensor(0.5), lr=1e-3, tokens=torch.tensor(64))
        mon.close()
    got = monitor.read_scalars(cfg.log.tensorboard)["train/loss"]
    assert got == [(s, 9.0) for s in range(1, restart_from + 1)] + [(s, 5.0) for s in range(restart_from + 1, 9)], got


def test_a_resumed_run_watches_as_one_never_stopped(tmp_path):
    """The monitor's state goes into the checkpoint (JSON, meta.json's extra) and back: a run resumed
    at step 79, inside a 3-step spike, finds the recorded run's spikes and counts its skipped step as
    one never stopped does. Before, the resumed monitor started empty: blind for 20 steps (no running
    mean yet), the spikes and skipped steps in TensorBoard fell back to 0, and the closing line
    counted only the steps after the resume."""
    path = os.path.join(ROOT, "tests", "data", "monitor_grad_norms.txt")
    norms = [float(line) for line in open(path) if not line.startswith("#")][:120]
    norms[29] = float("nan")                # step 30: skipped (--log.on_nonfinite=skip)

    def run(tb, first, last, state=None):
        cfg, lines = small_cfg(tmp_path / tb, interval=1, on_nonfinite="skip"), []
        mon = Monitor(cfg, 1e6, 1e12, print_fn=lines.append, start_step=first - 1, resume=state)
        for s in range(first, last + 1):
            g = torch.tensor(norms[s - 1])
            go = mon.check_finite(s, torch.tensor(2.0), g)
            mon.step(s, loss=torch.tensor(2.0), grad_norm=g, lr=1e-3, tokens=torch.tensor(64), skipped=not go)
        state = json.loads(json.dumps(mon.state_dict(), allow_nan=False))     # as meta.json holds it
        mon.close()
        return state, [x for x in lines if not x.startswith("step ")], monitor.read_scalars(cfg.log.tensorboard)

    _, straight, want = run("straight", 1, 120)
    state, _, _ = run("resumed", 1, 79)
    _, resumed, got = run("resumed", 80, 120, state)
    assert straight[-1].startswith("gradient-norm spikes: 21,") and resumed[-1] == straight[-1]
    for tag in ("stability/spikes", "stability/one_step_spike_share", "stability/skipped_steps"):
        assert got[tag] == want[tag], tag


def test_the_docs_name_every_tensorboard_tag_the_monitor_writes(tmp_path):
    """docs/monitoring.md's table of scalars is the list a user (or a check) reads the event files by:
    it names exactly the tags a run writes, with data parallelism, a spike and an evaluation."""
    cfg = small_cfg(tmp_path, interval=2)
    mon = Monitor(cfg, 1e6, 1e12, print_fn=lambda *a: None)
    for s in range(1, 23):              # a one-step spike at step 21: the one-step share has a value
        mon.step(s, loss=torch.tensor(3.0), grad_norm=torch.tensor(2.0 if s == 21 else 0.5), lr=1e-3, tokens=64,
                 data_wait=0.01, param_norm=torch.tensor(10.0), param_spread=torch.tensor(0.0))
    mon.eval(22, torch.tensor(3.0))
    mon.close()
    written = set(monitor.read_scalars(cfg.log.tensorboard))
    text = open(os.path.join(ROOT, "docs", "monitoring.md")).read()
    rows = re.findall(r"^\| (`[^|]+) \|", text, re.M)
    documented = {tag for row in rows for tag in re.findall(r"`([a-z_]+/[a-z_]+)`", row)}
    assert written == documented, (sorted(written - documented), sorted(documented - written))


def monitor_cli(argv, monkeypatch, capsys) -> tuple[int, str, str]:
    """`python monitor.py ARGV` run in this process (its __main__, by runpy: 0.1 s where a process that
    loads torch took ~3 s): (exit status, stdout, stderr as the interpreter writes it). An exception
    other than SystemExit, a traceback in a process, fails the test here."""
    import runpy
    monkeypatch.setattr(sys, "argv", [os.path.join(ROOT, "monitor.py"), *map(str, argv)])
    try:
        runpy.run_path(os.path.join(ROOT, "monitor.py"), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    if isinstance(code, str):               # sys.exit("message"): the interpreter prints it, exit status 1
        return 1, out, err + code + "\n"
    return code or 0, out, err


def plot_cli(tb, png, monkeypatch, capsys) -> tuple[int, str]:
    """`python monitor.py plot TB PNG`: (exit status, stderr)."""
    code, _, err = monitor_cli(["plot", tb, png], monkeypatch, capsys)
    return code, err


def test_help_prints_the_usage_and_succeeds(monkeypatch, capsys):
    """`python monitor.py --help` (or -h, also after plot) is a request for help: the usage on stdout, exit 0
    (was: the usage as an error, exit 1); no arguments, or wrong ones, stay an error."""
    for argv in (["--help"], ["-h"], ["plot", "--help"]):
        code, out, err = monitor_cli(argv, monkeypatch, capsys)
        assert code == 0 and out.startswith("usage: python monitor.py plot [--overwrite] TB_DIR PNG") and not err, (argv, out, err)
    for argv in ([], ["plot", "out/tb"], ["plots", "a", "b"]):
        code, out, err = monitor_cli(argv, monkeypatch, capsys)
        assert code == 1 and err.startswith("usage: python monitor.py plot [--overwrite] TB_DIR PNG") and not out, (argv, out, err)


def test_plot_of_a_folder_without_the_runs_scalars_is_refused(tmp_path, monkeypatch, capsys):
    """`python monitor.py plot out curves.png` (the run's folder, not its out/tb), or an empty one:
    one line naming the folder to give, and no empty figure written (was: a blank PNG, exit 0)."""
    (tmp_path / "out" / "tb").mkdir(parents=True)
    code, err = plot_cli(tmp_path / "out", tmp_path / "c.png", monkeypatch, capsys)
    assert code != 0 and "Traceback" not in err and not (tmp_path / "c.png").exists(), err
    assert err.startswith(f"error: {tmp_path / 'out'} holds no train/loss") and err.count("\n") == 1, err


def _drift_worker(rank, ports, out_dir):
    import torch.distributed as dist
    import model as llama
    import parallel
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=2)
    try:
        grid = parallel.new_grid(2, rank, 1, 1, 1, "gloo")                  # DP=2
        cfg = small_cfg(None, interval=2)
        m = llama.Llama(configs.ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                            ffn_dim=64, max_seq_len=16)).init_weights(0)
        lines = []
        mon = Monitor(cfg, 1e6, 1e12, is_main=True, print_fn=lines.append)
        spreads = []
        for step in (1, 2, 3, 4):
            if step == 3 and rank == 1:              # plant a drift on one replica: 0.1% on one matrix
                with torch.no_grad():
                    m.layers[1].mlp.down_proj.weight.mul_(1.001)
            pn = parallel.param_norm(m, grid)
            spread = parallel.replica_spread(pn, grid)
            spreads.append(float(spread))
            mon.step(step, loss=torch.tensor(3.0), grad_norm=torch.tensor(1.0), lr=1e-3, tokens=64,
                     param_norm=pn, param_spread=spread)
        (Path(out_dir) / f"{rank}.txt").write_text("\n".join([repr(spreads)] + lines))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_replica_drift_is_seen(tmp_path):
    """DP=2 over gloo: identical replicas show a spread of exactly 0 and no warning; after one
    replica's weights drift (planted at step 3), the flush at step 4 warns on every rank."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from gloo_spawn import spawn_and_wait
    spawn_and_wait(_drift_worker, 1, 2, str(tmp_path), timeout_s=300)
    for rank in (0, 1):
        spreads, *lines = (tmp_path / f"{rank}.txt").read_text().splitlines()
        spreads = eval(spreads)
        assert spreads[:2] == [0.0, 0.0] and spreads[2] > 0 and spreads[2] == spreads[3]
        warnings = [line for line in lines if line.startswith("warning")]
        assert len(warnings) == 2, lines            # steps 3 and 4, read at the step-4 flush
        assert "step 3: the data-parallel replicas diverge" in warnings[0]
        assert "NEURON_RT_STOCHASTIC_ROUNDING_SEED" in warnings[0]


def test_a_refusal_all_ranks_share_is_said_once():
    """Ranks (threads here) on one TCPStore, as torchrun's: a refusal every rank reaches alike is
    printed by rank 0 only (was once per rank: 4096 copies at 4096 ranks); a different one is said
    too, one pointing at rank 0's is not; a rank refusing alone says it after the wait. The status
    is 1 on every rank and nothing waits longer than asked."""
    import io
    import threading
    import time
    from torch.distributed import TCPStore
    from gloo_spawn import free_ports
    port = free_ports(1)[0]
    server = TCPStore("127.0.0.1", port, 5, is_master=True, wait_for_workers=False)
    alone, t = io.StringIO(), time.monotonic()     # nobody else refuses: nothing is posted
    assert monitor.say_once("error: rank 1 alone", 0.5, (server, 1, 5), alone) == 1
    assert alone.getvalue() == "error: rank 1 alone\n" and time.monotonic() - t < 5
    said = ["error: same", "error: same", "error: another", "error: rank 0 could not X (see its message)",
            "error: same"]
    outs, codes = [io.StringIO() for _ in said], {}

    def rank(r):
        store = TCPStore("127.0.0.1", port, 5, is_master=False) if r else server
        codes[r] = monitor.say_once(said[r], 20, (store, r, 5), outs[r])
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(5)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert [o.getvalue() for o in outs] == ["error: same\n", "", "error: another\n", "", ""]
    assert codes == dict.fromkeys(range(5), 1) and time.monotonic() - t < 15


def test_mfu_peak_is_the_models_own_matmuls_and_never_exceeded(tmp_path):
    # The measured shapes are exactly the model's weight matmuls: one layer's forward and both
    # backward matmuls, times the layers, plus the head, are flops_per_token less attention.
    import model as llama
    cfg = configs.from_args(["--model.n_layers=3", "--model.dim=64", "--model.n_heads=4", "--model.n_kv_heads=2",
                             "--model.ffn_dim=96", "--model.vocab_size=512", "--seq_len=32", "--micro_batch=2"])
    shapes = hardware.matmul_shapes(cfg)
    flops = [2 * m * k * n for m, k, n in shapes]
    rows, m = 2 * 32, cfg.model
    assert sum(flops[:12]) * m.n_layers + sum(flops[12:]) == pytest.approx(
        rows * (llama.flops_per_token(m, 32) - 6 * m.n_layers * 32 * m.dim))
    peak, how = hardware.device_peak_flops(torch.device("cpu"), torch.float32, shapes=shapes)
    n = torch.get_num_threads()         # 1 where a test before this one in the process set it so
    assert peak > 0 and how.startswith("measured: the model's"), how
    assert f"{n} threads" in how if n > 1 else how.endswith(", 1 thread"), how     # (busy: "1 thread (the run's 2 threads")
    assert hardware.device_peak_flops(torch.device("cpu"), torch.float32, 12.5)[1] == "stated: --log.peak_tflops=12.5"
    # A run that goes faster than the peak (here: a peak far too low) reports 100% and says why.
    lines, cfg = [], small_cfg(tmp_path, interval=2)
    mon = Monitor(cfg, flops_per_token=1e6, peak_flops=1.0, print_fn=lines.append)
    for s in range(1, 5):
        mon.step(s, loss=torch.tensor(3.0), grad_norm=torch.tensor(1.0), lr=1e-3, tokens=1000)
    mon.close()
    assert sum("is above the peak" in l for l in lines) == 1, lines
    mfu = [v for _, v in monitor.read_scalars(cfg.log.tensorboard)["perf/mfu"]]
    assert len(mfu) == 2 and mfu[0] == 1.0 and max(mfu) <= 1.0, mfu


def test_the_documented_flops_per_token_are_the_products():
    """docs/monitoring.md gives the FLOPs per token an outside check computes MFU with, and the convention
    (causal attention at half the square; PaLM and torchtitan count it whole): its figures for llama2_7b
    and llama3_8b (GQA) are model.flops_per_token's."""
    import model
    text = " ".join(open(os.path.join(ROOT, "docs", "monitoring.md")).read().split())
    for name, seq in (("llama2_7b", 4096), ("llama3_8b", 8192)):
        m = getattr(configs, name)().model
        ours, attention = model.flops_per_token(m, seq), 6 * m.n_layers * seq * m.n_heads * m.head_dim
        assert f"{(ours - attention) / 1e9:.2f} + {attention / 1e9:.2f} = {ours / 1e9:.2f}" in text, name
    m = configs.llama2_7b().model
    assert f"theirs {(model.flops_per_token(m, 4096) + 6 * m.n_layers * 4096 * m.dim) / 1e9:.2f}" in text


@pytest.mark.slow
def test_the_measured_cpu_peak_is_not_a_busy_hosts_accident():
    """Two busy processes on the cores (a shared host; the 2-core machine under other work): the
    run's two threads measured the model's matmuls at 0.002-0.004x of one thread's rate (the
    OpenMP team waits for a descheduled thread), so the same run printed MFU 0.2% or 56% by luck.
    The run's threads do at least what one of them does: one thread's rate is the floor."""
    shapes = [(256, 64, 192)]                       # a small model's qkv_proj (mb 4 x seq 64)
    threads = torch.get_num_threads()
    hogs = []
    try:
        torch.set_num_threads(1)
        quiet = hardware.measure_matmul_flops(torch.device("cpu"), torch.float32, shapes)
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
        torch.set_num_threads(2)
        peak, how = hardware.device_peak_flops(torch.device("cpu"), torch.float32, shapes=shapes)
        assert torch.get_num_threads() == 2
    finally:
        for h in hogs:
            h.kill()
            h.wait()
        torch.set_num_threads(threads)
    assert peak > quiet / 4, (peak / 1e9, quiet / 1e9)
    # the words name the threads whose rate it is (the floor's: one thread, above the team's)
    said = re.fullmatch(r".* on cpu, (?:2 threads|1 thread \(the run's 2 threads measured (\S+) GFLOP/s: a busy host\))", how)
    assert said and (said[1] is None or float(said[1]) * 1e9 < peak), how


def test_the_cpu_peak_names_the_threads_that_measured_it():
    # One thread's rate, the floor on a busy host, was described as the run's "2 threads"
    assert hardware.thread_floor(1.2e9, 110e9, 2) == (110e9, ", 1 thread (the run's 2 threads measured 1.2 GFLOP/s: "
                                                            "a busy host)")
    assert hardware.thread_floor(150e9, 110e9, 2) == (150e9, ", 2 threads")
    assert hardware.thread_floor(90e9, 0.0, 1) == (90e9, ", 1 thread")          # (was "1 threads")


def test_plot_of_a_missing_event_folder_is_one_line_not_a_traceback(tmp_path, monkeypatch, capsys):
    code, err = plot_cli(tmp_path / "no_tb", tmp_path / "c.png", monkeypatch, capsys)
    assert code == 1 and "Traceback" not in err, err
    assert err.strip() == f"error: {tmp_path / 'no_tb'} is not a directory of TensorBoard event files " \
                          "(the run's --log.tensorboard)"
    assert not (tmp_path / "c.png").exists()


def test_plot_of_a_resumed_run_says_only_the_png(tmp_path, monkeypatch, capsys, caplog):
    """A resumed run's event files hold what the crashed run logged past the checkpoint, which the
    reader drops (purge_step) as designed. It also logged 'Detected out of order event.step likely
    caused by a TensorFlow restart. Purging expired events ...', twice, on stderr of the documented
    `python monitor.py plot` after every resume: alarm about nothing."""
    cfg = small_cfg(tmp_path, interval=1)
    for start, end in ((0, 6), (3, 8)):
        # The resume starts in a later second, as a new process does: the reader orders the event files by name,
        # events.out.tfevents.<second>.<host>.<pid>.<n>, and n counts this process's writers, so within one second
        # ...9 and ...10 sort the resumed run first (its steps then purged: [1..6]; a flake at the 9th/99th writer).
        time.sleep(1.01 - time.time() % 1 if start else 0)
        mon = Monitor(cfg, 1e6, 1e12, print_fn=lambda *a: None, start_step=start)
        for s in range(start + 1, end + 1):
            mon.step(s, loss=torch.tensor(2.0), grad_norm=torch.tensor(0.5), lr=1e-3, tokens=64)
        mon.close()
    code, out, err = monitor_cli(["plot", cfg.log.tensorboard, tmp_path / "c.png"], monkeypatch, capsys)
    assert (code, out, err) == (0, f"{tmp_path / 'c.png'}\n", "")
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]   # (pytest takes the log)
    assert [s for s, _ in monitor.read_scalars(cfg.log.tensorboard)["train/loss"]] == list(range(1, 9))


def test_plot_over_an_existing_file_is_refused_unless_overwrite(tmp_path, monkeypatch, capsys):
    """A PNG already there (the user's figure, an earlier plot) is kept: one line naming it and --overwrite, before
    any reading (was: replaced in silence, exit 0); with --overwrite it is replaced, the path printed."""
    cfg = small_cfg(tmp_path, interval=1)
    mon = Monitor(cfg, 1e6, 1e12, print_fn=lambda *a: None)
    mon.step(1, loss=torch.tensor(2.0), grad_norm=torch.tensor(0.5), lr=1e-3, tokens=torch.tensor(64))
    mon.close()
    (png := tmp_path / "mine.png").write_bytes(b"the user's figure")
    code, err = plot_cli(cfg.log.tensorboard, png, monkeypatch, capsys)
    assert (code, err) == (1, f"error: {str(png)!r} exists: give another path, or pass --overwrite to replace it\n")
    assert png.read_bytes() == b"the user's figure"
    code, out, err = monitor_cli(["plot", "--overwrite", cfg.log.tensorboard, png], monkeypatch, capsys)
    assert (code, out, err) == (0, f"{png}\n", "") and png.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("out,says", [("c.txt", "c.txt' does not end in an image format"),
                                      ("c", "c' does not end in an image format"),
                                      ("adir", "adir' is a directory")])
def test_plot_to_a_path_that_is_no_image_file_is_one_line(tmp_path, monkeypatch, capsys, out, says):
    """The PNG argument a directory, without an extension, or one matplotlib cannot write: one line
    naming it and the fix, before any reading. Was: matplotlib's ValueError traceback for .txt, and
    exit 0 with c.png / adir.png written beside (and the wrong name printed) for the other two."""
    tb = str(tmp_path / "tb")
    mon = Monitor(small_cfg(tmp_path, interval=1), 1e6, 1e12, print_fn=lambda *a: None)
    mon.step(1, loss=torch.tensor(2.0), grad_norm=torch.tensor(0.5), lr=1e-3, tokens=torch.tensor(64))
    mon.close()
    (tmp_path / "adir").mkdir()
    before = sorted(os.listdir(tmp_path))
    code, err = plot_cli(tb, tmp_path / out, monkeypatch, capsys)
    assert code == 1 and "Traceback" not in err and err.count("\n") == 1, err
    assert says in err and "curves.png" in err, err
    assert sorted(os.listdir(tmp_path)) == before and not os.listdir(tmp_path / "adir")


def test_evaluation_and_saves_are_off_the_clock(monkeypatch):
    """tok/s and MFU count the training steps' time only: an evaluation or a save inside a log
    interval (here 30 s of it on a fake clock) leaves the interval's rate as if it had not run."""
    now = [0.0]
    monkeypatch.setattr(monitor, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    lines = []
    mon = Monitor(small_cfg(None, interval=2), flops_per_token=1.0, peak_flops=0.0, print_fn=lines.append)
    for s in range(1, 5):
        now[0] += 1.0                       # a step: 1 s for 1,000 tokens
        mon.step(s, loss=torch.tensor(2.0), grad_norm=torch.tensor(0.5), lr=1e-3, tokens=1000)
        if s == 3:
            with mon.off_the_clock():       # flushes step 3 (its own line), then 30 s of evaluation
                now[0] += 30.0
    rates = [part for line in lines for part in line.split(" | ") if part.endswith("tok/s")]
    assert rates == ["1,000 tok/s"] * 3, lines


def test_the_data_wait_share_is_the_intervals_waits_over_its_time(monkeypatch):
    """"data wait X%" (and perf/data_wait_share): the share of the log interval's time the steps waited for their
    batches, every step's wait added, not the last one's alone: 4 steps of 1 s, waiting 0.5, 0, 0 and 0 s, is 12%."""
    now = [0.0]
    monkeypatch.setattr(monitor, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    lines = []
    mon = Monitor(small_cfg(None, interval=4), flops_per_token=1.0, peak_flops=0.0, print_fn=lines.append)
    for s, wait in zip(range(1, 9), (0.5, 0, 0, 0, 0, 0, 0, 0.25)):
        now[0] += 1.0
        mon.step(s, loss=torch.tensor(2.0), grad_norm=torch.tensor(0.5), lr=1e-3, tokens=1000, data_wait=wait)
    waits = [part for line in lines for part in line.split(" | ") if part.startswith("data wait")]
    assert waits == ["data wait 12%", "data wait 6%"], lines


@pytest.mark.parametrize("how", ["full", "removed"])
def test_an_event_folder_that_cannot_be_written_costs_the_events_not_the_run(tmp_path, capfd, monkeypatch, how):
    """TensorBoard is a view of the run: a disk that fills up under the event files (an 8 KiB tmpfs,
    a simulated ENOSPC where mounting is not allowed) or a folder removed while the run goes on is one
    warning naming the folder and why, then the console lines alone. Was: tensorboard's writer
    thread printed its OSError's traceback and the next add_scalar raised it again, ending the run
    at the next log line with a traceback (a checkpoint interval's steps lost, and a restart failing
    again at once)."""
    import shutil
    small = tmp_path / "small"
    small.mkdir()
    mounted = how == "full" and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(small)],
                                               capture_output=True).returncode == 0
    cfg, lines = small_cfg(small, interval=1), []
    mon = Monitor(cfg, 1e6, 1e12, print_fn=lines.append)
    try:
        for s in range(1, 41):
            if s == 5 and how == "removed":
                shutil.rmtree(small / "tb")
            if s == 5 and how == "full" and not mounted:
                from tensorboard.compat.tensorflow_stub.io import gfile

                def full(*a, **k):
                    raise OSError(28, "No space left on device")
                monkeypatch.setattr(gfile.LocalFileSystem, "_write", full)      # the writer's way to the disk
            mon.step(s, loss=torch.tensor(2.0), grad_norm=torch.tensor(0.5), lr=1e-3, tokens=64)
        mon.eval(40, torch.tensor(2.0))
        mon.close()
    finally:
        if mounted:
            subprocess.run(["umount", str(small)])
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err, out + err
    assert len([x for x in lines if x.startswith("step ")]) == 41, lines       # every step and the evaluation
    warned = [x for x in lines if "TensorBoard" in x]
    assert len(warned) == 1 and warned[0].startswith(f"warning: could not write TensorBoard events to {small / 'tb'}"), lines
    assert ("No space left" if how == "full" else "No such file") in warned[0], warned


def test_gloos_lines_on_each_group_are_dropped_and_the_rest_of_stdout_kept(capfd):
    """gloo (torch 2.9) prints on stdout, for every group each rank builds, '[Gloo] Rank r is connected to n peer
    ranks...' and, connecting lazily (env.sh's TORCH_GLOO_LAZY_INIT, the XLA host group), '[Gloo] Rank r is NOT
    connected to: [...]' with every other rank: about 24 KB a rank at 4096 ranks, 100 MB of a job's log at each start,
    saying that connections made later, as needed, are not made yet. train.py and the health check build their
    groups inside monitor.quiet_gloo: those lines go, anything else printed meanwhile stays, in order."""
    import datetime
    import torch.distributed as dist
    with monitor.quiet_gloo():
        print("before", flush=True)
        dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=10))    # a real group of one
        os.write(1, b"[Gloo] Rank 7 is NOT connected to: [0, 1, 2]\nafter\n")
    print("outside", flush=True)
    assert capfd.readouterr().out == "before\nafter\noutside\n"

