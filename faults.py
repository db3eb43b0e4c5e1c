"""Faults on purpose, for the tests of recovery: NANOTRN_FAULT makes a rank die, hang or blow up
where a test asks, so that resume, the watchdog and the non-finite policy run on a real failure.
The product calls two hooks, Faults.step (train.py) and Faults.file (a save's writes); with
NANOTRN_FAULT unset, both do nothing.

    NANOTRN_FAULT=1:7           rank 1 dies (SIGKILL to itself, like a dead node) once 7 steps are done
    NANOTRN_FAULT=0:4:save      rank 0 dies halfway through writing its largest file of step 4's save
    NANOTRN_FAULT=p=0.01        every rank, every step, dies with probability 0.01
    NANOTRN_FAULT=p=0.05,seed=3,max=2   ... with a seed, and at most 2 deaths in this ckpt.dir
    NANOTRN_FAULT=nan:5         the step after 5 gets NaN gradients on every rank (--log.on_nonfinite)
    NANOTRN_FAULT=hang:1:5      rank 1 waits, once 5 steps are done, in a barrier no other rank joins
                                (alone in the run: for ever)
    NANOTRN_FAULT=any:7, hang:any:5   ... whichever rank this process is: set on one pod or node only
                                (the rendezvous, not the pod, decides the rank: torchrun orders nodes
                                by address and pid), it fires once in the whole run

Steps count as the log and the checkpoints count them: 1:7 fires after the line "step 7" (and
step 7's save), as the step logged "step 8" begins.

Each death is first appended (fsynced) to <ckpt.dir>/faults.log, and a fixed fault fires only if
it is not there yet: the restarted run goes through the step that killed it (torchrun
--max-restarts would otherwise restart into the same crash). A random death draws from (seed,
rank, step, deaths so far), so a restart re-running a step draws anew.
"""
from __future__ import annotations

import contextlib
import os
import random
import signal
import sys
import threading
from pathlib import Path

import torch.distributed as dist

from configs import ConfigError


class Faults:
    def __init__(self, spec: str, rank: int, root: Path, host_group=None):
        self.spec, self.rank, self.log = spec.strip(), rank, Path(root) / "faults.log"
        self.host_group = host_group     # the hang's barrier: gloo on XLA (the xla backend's returns at once)
        self.p, self.seed, self.max, self.at, self.in_save = 0.0, 0, None, None, False
        self.nan_step = self.hang_at = None
        self.any_rank = self.spec.startswith(("any:", "hang:any:"))    # this process, whatever its rank
        rank_of = lambda s: self.rank if s == "any" else int(s)     # noqa: E731
        if not self.spec:
            return
        try:
            if self.spec.startswith("nan:"):
                self.nan_step = int(self.spec[4:])
            elif self.spec.startswith("hang:"):
                rank, step = self.spec[5:].split(":")
                self.hang_at = (rank_of(rank), int(step))
            elif self.spec.startswith("p="):
                opts = dict(kv.split("=", 1) for kv in self.spec.split(","))
                self.p, self.seed = float(opts["p"]), int(opts.get("seed", 0))
                self.max = int(opts["max"]) if "max" in opts else None
                if set(opts) - {"p", "seed", "max"} or not 0 <= self.p <= 1:
                    raise ValueError
            else:
                parts = self.spec.split(":")
                if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "save"):
                    raise ValueError
                self.at, self.in_save = (rank_of(parts[0]), int(parts[1])), len(parts) == 3
        except (ValueError, KeyError):
            raise ConfigError(f"NANOTRN_FAULT={spec!r} is not understood; use RANK:STEP, "
                              f"RANK:STEP:save, p=PROB[,seed=N][,max=N], nan:STEP or hang:RANK:STEP (RANK: a number "
                              f"or any)") from None
        self.fired = self.log.read_text().splitlines() if self.log.exists() else []

    def die(self, what: str):
        line = f"rank {self.rank} {what} ({self.spec})"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        print(f"NANOTRN_FAULT: {line}: SIGKILL", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def _fired_before(self) -> bool:     # faults.log has this rank's fault of this spec (any rank's, for 'any')
        return any((self.any_rank or l.startswith(f"rank {self.rank} ")) and f"({self.spec})" in l for l in self.fired)

    def _fixed(self, step: int, in_save: bool) -> bool:
        return self.at == (self.rank, step) and self.in_save == in_save and not self._fired_before()

    def maybe_crash(self, step: int):
        if self._fixed(step, in_save=False):
            self.die(f"step {step}")
        if self.p > 0 and (self.max is None or len(self.fired) < self.max):
            if random.Random(f"{self.seed}|{self.rank}|{step}|{len(self.fired)}").random() < self.p:
                self.die(f"step {step} at random")

    def maybe_hang(self, step: int):
        if self.hang_at != (self.rank, step) or self._fired_before():
            return
        with open(self.log, "a") as f:
            f.write(f"rank {self.rank} hangs at step {step} ({self.spec})\n")
        print(f"NANOTRN_FAULT: rank {self.rank} hangs at step {step} in a barrier no other rank joins",
              file=sys.stderr, flush=True)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier(group=self.host_group)     # the others wait in their step's collectives
        else:                   # one process: a barrier would return (or raise, with no group)
            threading.Event().wait()

    @contextlib.contextmanager
    def step(self, step: int, model):
        """Around a training step: a death or a hang as it begins; NaN gradients out of backward."""
        self.maybe_crash(step)
        self.maybe_hang(step)
        poison = [p.register_hook(lambda g: g * float("nan")) for p in model.parameters()
                  ] if step == self.nan_step else []
        try:
            yield
        finally:
            for h in poison:
                h.remove()

    def file(self, step: int, name: str, sizes: dict):
        """For a save's write of file `name` (sizes: every file's bytes): None, or how to wrap the
        open file so that this rank dies halfway through it (the largest file of step's save)."""
        if not self._fixed(step, in_save=True) or name != max(sizes, key=sizes.get):
            return None
        return lambda raw: _DiesHalfway(raw, sizes[name] // 2, lambda: self.die(f"writing {name} of step {step}"))


class _DiesHalfway:
    """A file that dies once `at` bytes have passed: the kill lands in the middle of a real write."""

    def __init__(self, f, at: int, die):
        self.f, self.n, self.at, self.die = f, 0, at, die

    def write(self, b) -> int:
        if self.n >= self.at:
            self.f.flush()
            self.die()
        n = self.f.write(b)
        self.n += n
        return n
