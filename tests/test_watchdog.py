"""A hang ends the run (issue 25, item 5): a rank stuck in a collective that no other rank joins
(NANOTRN_FAULT=hang:RANK:STEP) under torchrun, with gloo. The watchdog prints every rank's stacks
and exits non-zero; with the watchdog off, torch.distributed's collective timeout ends it."""
from __future__ import annotations

import re
import sys
import threading
import time
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import monitor  # noqa: E402
from gloo_spawn import run_train  # noqa: E402
from test_resume import ARGS  # noqa: E402


def hung_run(tmp_path: Path, *extra) -> tuple[object, float]:
    t0 = time.monotonic()
    r = run_train([f"--out_dir={tmp_path}", *ARGS, "--optim.max_steps=50", "--ckpt.interval=0", "--dp=2", *extra],
                  nproc=2, env={"NANOTRN_FAULT": "hang:1:4"}, timeout=240)
    return r, time.monotonic() - t0


def single_hung_run(tmp_path: Path):
    return run_train([f"--out_dir={tmp_path}", *ARGS, "--optim.max_steps=50", "--ckpt.interval=0",
                      "--log.hang_factor=2", "--log.hang_min_s=4"], env={"NANOTRN_FAULT": "hang:0:4"}, timeout=240)


@pytest.fixture(scope="module")
def hung(tmp_path_factory) -> dict:
    """The three hung runs of the tests below, started together: each mostly waits (for its watchdog
    or its collective timeout: 8, 6 and 4 s, after its start-up), so one after another they left the
    cores idle. Each run's time is from its own start. A run's failure is raised by its test."""
    runs = {"watchdog": lambda d: hung_run(d, "--log.hang_factor=2", "--log.hang_min_s=8", "--parallel.timeout_s=120"),
            "timeout": lambda d: hung_run(d, "--log.hang_factor=0", "--parallel.timeout_s=6"),
            "single": single_hung_run}
    out = {}

    def run(name, f, d):
        try:
            out[name] = f(d)
        except BaseException as e:            # pytest.fail (a run past its timeout) included
            out[name] = e
    threads = [threading.Thread(target=run, args=(k, f, tmp_path_factory.mktemp(k))) for k, f in runs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def result(hung: dict, name: str):
    if isinstance(hung[name], BaseException):
        raise hung[name]
    return hung[name]


@pytest.mark.slow
def test_a_rank_hung_in_a_collective_ends_the_run_by_the_watchdog_with_its_stacks(hung):
    """Rank 1 enters a barrier at step 4 that rank 0 never joins; rank 0 waits in its step's
    all-reduce. A rank's watchdog (no step for 8 s: 2 x the median step, at least 8 s) prints why
    and its threads' stacks, and exits with EXIT_HUNG before the 120 s collective timeout. Each
    rank's fires 8 s after its own last step, and the first to exit fails its peer's collective
    (gloo) at once: a peer whose last step ended later (0.2 s on a loaded host) ends by its one
    error line before its own watchdog, so every rank ends by one or the other, and one at least
    by its watchdog (all ranks' stacks only where their watchdogs fire within ~0.1 s)."""
    r, took = result(hung, "watchdog")
    assert r.returncode != 0 and "NANOTRN_FAULT: rank 1 hangs at step 4" in r.stderr, r.stderr[-3000:]
    fired = {int(k) for k in re.findall(r"\[rank (\d)\] watchdog: no training step finished in 8 s \(2 x the "
                                        r"median step time", r.stderr)}
    failed = {int(k) for k in re.findall(r"error: \[rank (\d)\] a collective failed: another rank is gone", r.stderr)}
    assert fired and fired | failed == {0, 1}, r.stderr[-4000:]
    assert f"exitcode  : {monitor.EXIT_HUNG}" in r.stderr
    # The stacks: faulthandler's, every thread; the hung rank's main thread in its barrier, the
    # other's in its step's all-reduce (train.py's train_step).
    # Two ranks that fire together write to one stderr at the same moment, so their lines interleave:
    # count the dumps (faulthandler heads the dumping thread's stack "Current thread ...") rather than split.
    assert r.stderr.count("Current thread 0x") >= len(fired), r.stderr[-4000:]
    # faulthandler writes a frame in pieces (file, line, name), which the two ranks interleave:
    # look for the function names, each one write, after the first watchdog line.
    dumps = r.stderr.split("watchdog: no training step", 1)[1]
    assert (1 not in fired or "barrier" in dumps) and (0 not in fired or "train_step" in dumps), r.stderr[-4000:]
    assert took < 120, took                          # the watchdog, not the collective timeout
    assert "step      4 |" in r.stdout and "step      5 |" not in r.stdout


@pytest.mark.slow
def test_without_the_watchdog_the_collective_timeout_ends_the_hang(hung):
    """--log.hang_factor=0 (no watchdog): gloo's timeout (--parallel.timeout_s=6) raises in the
    waiting ranks, which exit non-zero with the stack of the collective that timed out."""
    r, took = result(hung, "timeout")
    assert r.returncode != 0 and "watchdog:" not in r.stderr, r.stderr[-3000:]
    assert re.search(r"[Tt]imed out", r.stderr), r.stderr[-3000:]
    assert took < 120, took


def test_watchdog_limit_follows_the_median_step_and_phases_get_the_startup_allowance(monkeypatch):
    """The limit is startup_s until three steps are timed, then factor x median (at least
    min_s); a phase (save, evaluation) gets startup_s and is not counted as a step."""
    now = [0.0]
    monkeypatch.setattr(monitor.time, "monotonic", lambda: now[0])
    armed = []
    monkeypatch.setattr(monitor.faulthandler, "dump_traceback_later", lambda s, **k: armed.append(s))
    monkeypatch.setattr(monitor.faulthandler, "cancel_dump_traceback_later", lambda: None)
    dog = monitor.Watchdog(0, factor=10, min_s=5, startup_s=1000)
    try:
        assert dog.limit() == 1000 and dog.deadline == 1000
        for t in (300.0, 301.0, 303.0, 304.0):       # a slow first step (compiling), then 1, 2, 1 s
            now[0] = t
            dog.step_done()
        assert list(dog.times) == [1.0, 2.0, 1.0] and dog.limit() == 10 and dog.deadline == 314
        with dog.phase("the checkpoint save of step 4"):
            assert dog.deadline == 304 + 1000 and "save of step 4 did not finish" in dog.why
            now[0] = 400.0
        now[0] = 400.5
        dog.step_done()
        assert list(dog.times) == [1.0, 2.0, 1.0, 0.5] and dog.deadline == 400.5 + 10
        assert armed[-1] == 20                       # the C-level backstop: twice the limit
    finally:
        dog.close()



@pytest.mark.slow     # three subprocesses (7 s)
def test_a_near_zero_limit_still_ends_by_the_watchdog_line_and_its_status(monkeypatch):
    """--log.hang_startup_s=0.001: the faulthandler backstop (then at twice the limit, 2 ms) fired before or while
    the watchdog's thread said why, so the run ended with stacks and status 1, without the watchdog's line (train.py
    at 1e-6, 0.001, 0.01: rc 1 each; the line in two of three). The backstop now leaves the watchdog 5 s at least."""
    import subprocess
    armed = []
    monkeypatch.setattr(monitor.faulthandler, "dump_traceback_later", lambda s, **k: armed.append(s))
    monkeypatch.setattr(monitor.faulthandler, "cancel_dump_traceback_later", lambda: None)
    dog = monitor.Watchdog(0, factor=0, min_s=5, startup_s=1e-3)     # factor 0: nothing armed, no thread
    dog.factor = 2
    dog._arm(1e-3, "test")
    dog.factor = 0
    assert armed == [1e-3 + 5]
    # The main thread busy in Python, as a starting run is: the watchdog's thread waits for the GIL (up to 5 ms)
    code = ("import time, monitor\nmonitor.Watchdog(0, factor=2, min_s=1, startup_s=1e-3)\nt = time.time()\n"
            "while time.time() - t < 30:\n    sum(range(10**5))\n")
    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode == monitor.EXIT_HUNG, (r.returncode, r.stderr[-2000:])
        assert "[rank 0] watchdog: the run did not finish its first step: the run is hung" in r.stderr


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    """The watchdog's clock, set by the test (now[0] = t), and no stack dump armed for real."""
    now = [0.0]
    monkeypatch.setattr(monitor.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(monitor.faulthandler, "dump_traceback_later", lambda s, **k: None)
    monkeypatch.setattr(monitor.faulthandler, "cancel_dump_traceback_later", lambda: None)
    return now


def test_a_sub_second_limit_is_said_as_it_is_not_as_0_s(clock):
    """The line a hang ends with names its limit: sub-second ones were said "in 0 s" (train.py --log.hang_min_s=0.001
    --log.hang_factor=2: "no training step finished in 0 s (2 x the median step time, 0.137 s)"). Whole seconds stay."""
    now = clock
    dog = monitor.Watchdog(0, factor=2, min_s=0.001, startup_s=0.5)
    try:
        for t in (0.0, 0.137, 0.274, 0.5):
            now[0] = t
            dog.step_done()
        assert dog.why == "no training step finished in 0.274 s (2 x the median step time, 0.137 s)"
        with dog.phase("the checkpoint save of step 4"):
            assert dog.why == "the checkpoint save of step 4 did not finish in 0.5 s"
        assert dog.why == "no training step finished in 0.274 s after the checkpoint save of step 4"
        dog.startup_s = 7200.0
        with dog.phase("evaluation"):
            assert dog.why == "evaluation did not finish in 7200 s"
    finally:
        dog.close()


def test_a_phase_before_three_timed_steps_leaves_the_startup_allowance(clock):
    """An evaluation or save after the first step (one step timed, the next ones may still compile on XLA):
    the step after the phase gets startup_s, as step_done gives it, not factor x the one time seen."""
    now = clock
    dog = monitor.Watchdog(0, factor=10, min_s=5, startup_s=1000)
    try:
        for t in (300.0, 301.0):                    # the first step done, the second timed at 1 s
            now[0] = t
            dog.step_done()
        with dog.phase("evaluation at step 2"):
            now[0] = 320.0
        assert list(dog.times) == [1.0] and dog.limit() == 1000 and dog.deadline == 320 + 1000
    finally:
        dog.close()


@pytest.mark.slow
def test_a_hang_in_a_single_process_run_ends_by_the_watchdog_too(hung):
    """NANOTRN_FAULT=hang:0:STEP in `python train.py` (no process group, or a world of one, where a
    barrier returns at once): the rank waits for ever and its watchdog ends the run (was
    dist.barrier()'s "Default process group has not been initialized" traceback)."""
    r = result(hung, "single")
    assert r.returncode == monitor.EXIT_HUNG and "Traceback (most recent call last)" not in r.stderr, r.stderr[-3000:]
    assert "NANOTRN_FAULT: rank 0 hangs at step 4" in r.stderr
    assert "[rank 0] watchdog: no training step finished in 4 s" in r.stderr, r.stderr[-3000:]
    assert "step      4 |" in r.stdout and "step      5 |" not in r.stdout
