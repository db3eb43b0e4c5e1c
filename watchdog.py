"""The hang watchdog: a run that stops making progress ends, with every thread's stack, instead of
waiting forever.

A crash ends a run and its launcher (torchrun --max-restarts, the sbatch loop, Kubernetes) starts
it again from the newest checkpoint. A hang does not: a rank stuck in a collective (a dead peer,
a wedged device, a mismatched collective) waits forever, and no orchestrator restarts a run that
never exits. Two things end a hang here:

  1. torch.distributed's collective timeout (--parallel.timeout_s), where the backend has one:
     gloo and nccl raise in the waiting rank. The xla backend has none (its collectives are
     device graphs); its gloo host group gets the timeout.
  2. This watchdog, on every rank and every backend: a thread that notices that no training step
     has finished for --log.hang_factor times the median step time (at least --log.hang_min_s),
     prints this rank's stacks (faulthandler: every thread, the C-level frames included) and exits
     with EXIT_HUNG. Before the first steps, and around a phase that may compile a new graph on
     XLA (the first evaluation, a save), the allowance is --log.hang_startup_s instead.

Every rank runs one, so every rank of a hung run prints its stacks: they all stopped finishing
steps at the same moment. A Python thread needs the GIL, which C code may hold forever; so the
C-level faulthandler timer is armed as well, at twice the limit: it dumps the stacks and exits
without the GIL. Cost per step: one median over at most 100 numbers and re-arming that timer (a
thread start, ~0.1 ms); nothing is communicated, so nothing grows with the number of ranks.
"""
from __future__ import annotations

import collections
import contextlib
import faulthandler
import os
import statistics
import sys
import threading
import time

EXIT_HUNG = 124        # as GNU timeout: the launcher sees a failure and restarts the run


class Watchdog:
    """watchdog = Watchdog(rank, cfg.log.hang_factor, cfg.log.hang_min_s, cfg.log.hang_startup_s)
    watchdog.step_done()             after every training step
    with watchdog.phase("saving"):   around anything that is not a step (may compile on XLA)
    watchdog.close()                 at the end (also stops the C-level timer)
    factor 0: off (every call does nothing)."""

    def __init__(self, rank: int, factor: float, min_s: float, startup_s: float, out=None):
        self.rank, self.factor, self.min_s, self.startup_s = rank, factor, min_s, startup_s
        self.out = out or sys.__stderr__         # the process's own stderr: faulthandler writes to its fd
        self.times: collections.deque[float] = collections.deque(maxlen=100)   # recent step durations
        self._cv = threading.Condition()
        self._closed = False
        self._since = None                      # start of the step in progress (None: not in a step)
        self._arm(startup_s, "the run did not finish its first step")
        self._thread = None
        if factor > 0:
            self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
            self._thread.start()

    def limit(self) -> float:
        """Seconds a step may take before the run counts as hung."""
        if len(self.times) < 3:                 # the first steps compile (XLA) and warm up
            return self.startup_s
        return max(self.min_s, self.factor * statistics.median(self.times))

    def step_done(self) -> None:
        now = time.monotonic()
        if self._since is not None:
            self.times.append(now - self._since)
        self._since = now
        n = len(self.times)
        median = f" ({self.factor:g} x the median step time, {statistics.median(self.times):.3g} s)" if n >= 3 else ""
        self._arm(self.limit(), f"no training step finished in {self.limit():.0f} s{median}")

    @contextlib.contextmanager
    def phase(self, what: str):
        """Something other than a step (an evaluation, a save, a resume): allowed startup_s, and
        not counted as a step duration."""
        self._since = None
        self._arm(self.startup_s, f"{what} did not finish in {self.startup_s:.0f} s")
        try:
            yield
        finally:
            self._since = time.monotonic()
            self._arm(self.limit(), f"no training step finished in {self.limit():.0f} s after {what}")

    def _arm(self, seconds: float, why: str) -> None:
        if self.factor <= 0:
            return
        with self._cv:
            self.deadline, self.why = time.monotonic() + seconds, why
            self._cv.notify()
        # The backstop without the GIL: dumps every thread and exits (status 1) if even the thread
        # below could not run.
        faulthandler.dump_traceback_later(2 * seconds, exit=True, file=self.out)

    def _watch(self) -> None:
        with self._cv:
            while not self._closed:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    self._fire()
                self._cv.wait(timeout=left)

    def _fire(self) -> None:
        print(f"[rank {self.rank}] watchdog: {self.why}: the run is hung. This rank's threads follow "
              f"(the main thread is where it waits); exiting with status {EXIT_HUNG} so that the launcher "
              f"restarts the run from its newest complete checkpoint", file=self.out, flush=True)
        faulthandler.dump_traceback(file=self.out, all_threads=True)
        self.out.flush()
        os._exit(EXIT_HUNG)

    def close(self) -> None:
        if self.factor <= 0:
            return
        faulthandler.cancel_dump_traceback_later()
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()
