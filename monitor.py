"""Watching a run: metrics and MFU, the blog's gradient-spike detector, non-finite steps, replica drift, TensorBoard
and console lines, the curves PNG, and the hang watchdog. The blog caught divergence early by watching the loss, the
gradient L2 norm and the parameter L2 norm (about 1,600 at initialization for 7B): logged here beside the throughput
(train.py makes the calls). Lazy on XLA: `step` keeps the tensors, read at log intervals in one transfer (a read
would cut the lazy graph and wait for the device)."""
from __future__ import annotations

import collections
import contextlib
import faulthandler
import functools
import logging
import math
import os
import re
import statistics
import sys
import tempfile
import threading
import time

import torch

from configs import Config, path_kind
import hardware


# ----------------------------------------------------------------------------- gradient spikes

class SpikeDetector:
    """The blog's gradient-norm spike detector: a spike is a norm above r + margin (r: the mean of
    the previous `window` norms) and lasts until the norm is back at or below it; over 86% last one
    step (benign). It warns of the blog's signs of divergence: a spike longer than `persist` steps,
    and a running mean above `growth` times its lowest (the mean: one benign spike is no growth)."""

    def __init__(self, window: int = 20, margin: float = 0.1, growth: float = 3.0, persist: int = 5):
        self.window, self.margin, self.growth, self.persist = window, margin, growth, persist
        self.history = collections.deque(maxlen=window)
        self.counts = (0, 0, 0)       # this process's finished spikes: how many, one-step ones, the longest
        self.current: list[int] | None = None       # [first step, length so far] of an open spike
        self.lowest_mean = math.inf
        self.growing = False
        self.earlier = (0, 0, 0)      # spikes, one-step spikes, longest: of the run before a resume

    def update(self, step: int, norm: float) -> list[str]:
        if not math.isfinite(norm):
            return []
        warnings = []
        if len(self.history) == self.window:
            r = sum(self.history) / self.window
            if norm > r + self.margin:
                if self.current is None:
                    self.current = [step, 0]
                self.current[1] += 1
                if self.current[1] == self.persist + 1:
                    warnings.append(f"step {step}: gradient-norm spike persists for {self.current[1]} steps "
                                    f"(norm {norm:.3f} > running mean {r:.3f} + {self.margin}); benign spikes "
                                    f"last one step: watch the loss for divergence")
            elif self.current is not None:        # counted, not kept: a flush's summary costs the same at any step
                n, one, longest = self.counts
                self.counts = (n + 1, one + (self.current[1] == 1), max(longest, self.current[1]))
                self.current = None
        self.history.append(norm)
        if len(self.history) == self.window:
            mean = sum(self.history) / self.window
            self.lowest_mean = min(self.lowest_mean, mean)
            if mean > self.growth * self.lowest_mean and not self.growing:
                warnings.append(f"step {step}: gradient norm (mean of {self.window} steps) {mean:.3f} has grown "
                                f"over {self.growth:g}x its lowest {self.lowest_mean:.3f}: a sign of divergence")
            self.growing = mean > self.growth * self.lowest_mean
        return warnings

    def totals(self) -> tuple[int, int, int]:
        """Spikes, one-step spikes, the longest: this process's and the run's before a resume."""
        (n, one, longest), (n0, one0, longest0) = self.counts, self.earlier
        return n0 + n, one0 + one, max(longest0, longest)

    def summary(self) -> dict:
        n, one, longest = self.totals()
        return {"spikes": n, "one_step_share": one / n if n else None,      # (no spikes: no share; JSON null)
                "longest": longest, "open": self.current[1] if self.current else 0}

    def state_dict(self) -> dict:
        """JSON for a checkpoint: a resumed run goes on with the running mean, an open spike and the
        totals (the finished spikes as three counts: a fixed size however long the run)."""
        return {"history": list(self.history), "current": self.current, "growing": self.growing,
                "lowest_mean": self.lowest_mean if math.isfinite(self.lowest_mean) else None,
                "earlier": list(self.totals())}

    def load_state_dict(self, state: dict) -> None:
        self.history.extend(state["history"])
        self.current, self.growing, self.earlier = state["current"], state["growing"], tuple(state["earlier"])
        self.lowest_mean = math.inf if state["lowest_mean"] is None else state["lowest_mean"]


# ----------------------------------------------------------------------------- non-finite steps

class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient norm under --log.on_nonfinite=stop."""


def _back(saved: int | None) -> str:
    """Where a stopped run goes on from: the newest checkpoint, or (none saved) the start."""
    return (f"the newest checkpoint, step {saved}, is the last good one: resume from it" if saved is not None else
            "no checkpoint was saved before it (--ckpt.interval): run again")


def _nonfinite_message(step: int, loss: float, grad_norm: float, saved: int | None) -> str:
    return (f"step {step}: non-finite loss {loss} / gradient norm {grad_norm}. Stopped before any checkpoint of this "
            f"state was written; {_back(saved)} (maybe with a lower --optim.lr), or pass --log.on_nonfinite=skip "
            f"to skip such steps")


# ----------------------------------------------------------------------------- the monitor

class Monitor:
    """Per-step metrics, console lines and TensorBoard. Every rank makes one and applies the
    non-finite policy to the globally reduced values (all skip or stop together); the main rank
    prints and writes. peak_flops: every device's (a rate above it replaces it: MFU <= 100%).
    resume: the checkpoint's extra (meta.json), state_dict() when saved: the run goes on as if never stopped."""

    def __init__(self, cfg: Config, flops_per_token: float, peak_flops: float, is_main: bool = True,
                 device: torch.device | str = "cpu", start_step: int = 0, resume: dict | None = None,
                 print_fn=print, max_consecutive_skips: int = 20):
        self.flops_per_token, self.peak_flops, self.device = flops_per_token, peak_flops, torch.device(device)
        self.lazy = self.device.type == "xla"
        self.policy = cfg.log.on_nonfinite
        self.interval = max(1, cfg.log.interval)
        resume = resume or {}
        self.tokens_seen = resume.get("tokens_seen", 0)
        self.print = print_fn if is_main else (lambda *a, **k: None)
        self.spikes = SpikeDetector()
        self.pending: list[dict] = []
        self.skipped = self.consecutive_skips = 0
        self.saved = start_step or None     # the newest checkpoint's step (a resume's, then train.py's saves)
        self.max_consecutive_skips = max_consecutive_skips
        if "monitor" in resume:         # (a checkpoint saved before the monitor's state was: a fresh detector)
            state = resume["monitor"]
            self.spikes.load_state_dict(state["spikes"])
            self.skipped, self.consecutive_skips = state["skipped"], state["consecutive_skips"]
        self._peak_raised = False
        self._t_flush, self._tokens_since = time.perf_counter(), 0
        self.writer, self.tb_dir = None, cfg.log.tensorboard
        if is_main and cfg.log.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            if getattr(threading.excepthook, "func", None) is not _quiet_writer_thread:     # once per process
                threading.excepthook = functools.partial(_quiet_writer_thread, then=threading.excepthook)
            # purge_step: after a restart (from a checkpoint or from scratch), TensorBoard hides what a
            # crashed run logged past it: every step from the first one this run logs.
            self.writer = self._write(lambda _: SummaryWriter(self.tb_dir, purge_step=start_step + 1), new=True)

    def state_dict(self) -> dict:
        """The run's state for the checkpoint of the step just flushed (a save comes after
        off_the_clock's flush), JSON: the tokens seen, the spike detector, the skipped steps."""
        mine = {"spikes": self.spikes.state_dict(), "skipped": self.skipped, "consecutive_skips": self.consecutive_skips}
        return {"tokens_seen": self.tokens_seen, "monitor": mine}

    # -------------------------------------------------------------- non-finite policy
    def check_finite(self, step: int, loss, grad_norm) -> bool:
        """Before the optimizer's update: True to go on, False to skip it (on_nonfinite=skip); raises
        NonFiniteError (stop). On XLA nothing is read: stop is checked at the next flush (before
        every save: a poisoned state is never saved), skip returns a boolean tensor for the update's
        select on the device (optim.guarded_step), counted at the flush."""
        if self.lazy:
            return True if self.policy == "stop" else torch.isfinite(loss) & torch.isfinite(grad_norm)
        loss_v, gn_v = float(loss), float(grad_norm)
        if math.isfinite(loss_v) and math.isfinite(gn_v):
            self.consecutive_skips = 0
            return True
        if self.policy == "stop":
            raise NonFiniteError(_nonfinite_message(step, loss_v, gn_v, self.saved))
        self._count_skip(step, loss_v, gn_v)
        return False

    def _count_skip(self, step: int, loss_v: float, gn_v: float) -> None:
        self.skipped += 1
        self.consecutive_skips += 1
        self.print(f"step {step}: non-finite loss {loss_v} / gradient norm {gn_v}: update skipped "
                   f"({self.skipped} skipped so far)")
        if self.consecutive_skips >= self.max_consecutive_skips:
            raise NonFiniteError(f"step {step}: {self.consecutive_skips} consecutive non-finite steps; skipping cannot "
                                 f"recover this run: {_back(self.saved)} with a lower --optim.lr")

    # -------------------------------------------------------------- per step
    def step(self, step: int, *, loss, grad_norm, lr: float, tokens, data_wait: float = 0.0,
             param_norm=None, param_spread=None, skipped: bool = False):
        """One optimizer step; tensors are read at the log interval. tokens: the global batch's (a
        tensor is read as fp32: exact to 2**24). param_spread: parallel.replica_spread's."""
        self.pending.append({"step": step, "loss": loss, "grad_norm": grad_norm, "param_norm": param_norm,
                             "param_spread": param_spread, "lr": lr, "tokens": tokens,
                             "data_wait": data_wait, "skipped": skipped, "on_device": torch.is_tensor(skipped)})
        if step % self.interval == 0:
            self.flush()

    def flush(self):
        """Read the pending steps' values (one transfer), write TensorBoard, print one line."""
        if not self.pending:
            return
        keys = ("loss", "grad_norm", "param_norm", "param_spread", "lr", "tokens", "skipped")
        tensors = [r[k].detach() for r in self.pending for k in keys if torch.is_tensor(r[k])]
        if self.lazy and tensors:
            # One transfer of the finished values, and no graph: a torch.stack over a varying number
            # of pending steps (a flush before a save reads fewer) would compile one graph per count.
            # torch-xla's own batched read (xm.save uses it); it has no public name in 2.9.
            import torch_xla.core.xla_model as xm
            values = iter([float(t) for t in xm._maybe_convert_to_cpu(tensors)])
        else:
            dev = tensors[0].device if tensors else None
            values = iter(torch.stack([t.float().reshape(()).to(dev) for t in tensors]).cpu().tolist()
                          if tensors else [])
        # the same order as `tensors` was built in
        rows = [dict(r, **{k: next(values) for k in keys if torch.is_tensor(r[k])}) for r in self.pending]
        self.pending = []
        for r in rows:
            if r.pop("on_device", False):           # XLA skip mode: the verdict is read only now
                r["skipped"] = bool(r["skipped"])
                if r["skipped"]:
                    self._count_skip(r["step"], r["loss"], r["grad_norm"])
                else:
                    self.consecutive_skips = 0
            finite = math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
            if self.policy == "stop" and not r["skipped"] and not finite:
                raise NonFiniteError(_nonfinite_message(r["step"], r["loss"], r["grad_norm"], self.saved))
            for warning in self.spikes.update(r["step"], r["grad_norm"]):
                self.print("warning: " + warning)
            # DP replicas hold identical weights: their norms agree exactly, so a spread above fp32's
            # 1e-6 is drift (bf16_sr without ZeRO-1 needs every replica to round alike).
            spread, norm = r["param_spread"], r["param_norm"]
            if spread is not None and norm is not None and spread > 1e-6 * abs(norm):
                self.print(f"warning: step {r['step']}: the data-parallel replicas diverge: their parameter "
                           f"norms differ by {spread:.3g} (norm {norm:.6g}). They must "
                           f"stay identical; with bf16_sr every rank needs the same "
                           f"NEURON_RT_STOCHASTIC_ROUNDING_SEED (scripts/env.sh), or use ZeRO-1")
            self.tokens_seen += int(r["tokens"])
            self._tokens_since += int(r["tokens"])
            self._scalars(r["step"], {"train/loss": r["loss"], "train/grad_norm": r["grad_norm"],
                                      "train/param_norm": r["param_norm"], "train/lr": r["lr"],
                                      "stability/param_norm_spread": r["param_spread"],
                                      "train/tokens_seen": self.tokens_seen, "perf/data_wait_s": r["data_wait"]})
        now = time.perf_counter()
        dt, last = now - self._t_flush, rows[-1]
        tok_s = self._tokens_since / dt if dt > 0 else 0.0
        achieved = tok_s * self.flops_per_token
        if self.peak_flops and achieved > self.peak_flops:
            # A rate above the peak proves the peak wrong (measured while the machine was busier, or
            # a stated figure too low): it becomes the best rate this run has shown, said once.
            if not self._peak_raised:
                self.print(f"note: {achieved / 1e12:.4g} TFLOP/s achieved is above the peak "
                           f"{self.peak_flops / 1e12:.4g} the MFU divides by; MFU is now relative to "
                           f"the best rate this run has shown")
            self.peak_flops, self._peak_raised = achieved, True
        mfu = achieved / self.peak_flops if self.peak_flops else float("nan")
        wait = sum(r["data_wait"] for r in rows) / dt if dt > 0 else 0.0
        mem = hardware.device_memory_gib(self.device)
        s = self.spikes.summary()
        self._scalars(last["step"], {"perf/tokens_per_s": tok_s, "perf/mfu": mfu, "perf/data_wait_share": wait,
                                     "perf/memory_gib": mem, "stability/spikes": s["spikes"],
                                     "stability/one_step_spike_share": s["one_step_share"],
                                     "stability/skipped_steps": self.skipped})
        self.print(f"step {last['step']:6d} | loss {last['loss']:.4f} | lr {last['lr']:.2e} | "
                   f"grad norm {last['grad_norm']:.3f}"
                   + (f" | param norm {last['param_norm']:.1f}" if last["param_norm"] is not None else "")
                   + f" | {tok_s:,.0f} tok/s | MFU {mfu:.1%} | data wait {wait:.0%}"
                   + (f" | mem {mem:.2f} GiB" if mem is not None else ""))
        self._t_flush, self._tokens_since = now, 0
        self._write(lambda w: w.flush())

    @contextlib.contextmanager
    def off_the_clock(self):
        """Evaluation and checkpoint saves are not training: tok/s and MFU leave them out (Megatron
        stops its interval timer around evaluate and save_checkpoint). The flush ends the steps'
        interval once the device has finished them (it reads their values; a poisoned state raises)."""
        self.flush()
        try:
            yield
        finally:
            self._t_flush = time.perf_counter()

    def eval(self, step: int, val_loss):
        v = float(val_loss)
        ppl = math.exp(min(v, 50.0))
        self._scalars(step, {"val/loss": v, "val/perplexity": ppl})
        self.print(f"step {step:6d} | val loss {v:.4f} | val ppl {ppl:.2f}")
        self._write(lambda w: w.flush())

    def close(self):
        self.flush()
        s = self.spikes.summary()
        if s["spikes"]:
            self.print(f"gradient-norm spikes: {s['spikes']}, {s['one_step_share']:.0%} lasted one step "
                       f"(the blog: over 86%), longest {s['longest']} steps")
        if s["open"]:       # counted once it ends: a run that stops inside one (diverging?) says so
            self.print(f"gradient-norm spike still open at the end: the last {s['open']} steps, not counted above")
        self._write(lambda w: w.close())
        self.writer = None

    def _scalars(self, step: int, values: dict):
        self._write(lambda w: [w.add_scalar(tag, v, step) for tag, v in values.items()
                               if v is not None and math.isfinite(v)])

    def _write(self, call, new: bool = False):
        """call(writer) on rank 0's event writer (new: call makes it). Event files are a view of the run: ones that
        cannot be written (a full disk, the folder removed) cost themselves, not the run: said once."""
        if self.writer is None and not new:
            return None
        try:
            return call(self.writer)
        except OSError as e:
            writer, self.writer = self.writer, None
            self.print(f"warning: could not write TensorBoard events to {self.tb_dir} ({e.strerror or e}): the run "
                       f"goes on without them, the console lines go on")
            with contextlib.suppress(Exception):
                writer and writer.close()


def _quiet_writer_thread(args, then) -> None:
    """threading.excepthook: tensorboard's writer thread re-raises a failed write (Python prints its traceback)."""
    if type(args.thread).__name__ != "_AsyncWriterThread" or not issubclass(args.exc_type, OSError):
        then(args)     # Monitor._write meets it at the next call, in one line


# ----------------------------------------------------------------------------- curves

def read_scalars(tb_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the TensorBoard event files of tb_dir: tag -> [(step, value)], by step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(tb_dir, size_guidance={"scalars": 0})     # 0: keep every point
    # After a resume the reader drops what the crashed run logged past the checkpoint, as designed
    # (purge_step), and warns of "a TensorFlow restart": alarm about nothing, so its warnings are muted.
    log = logging.getLogger("tensorboard")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        acc.Reload()
    finally:
        log.setLevel(level)
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def plot_curves(tb_dir: str, png: str) -> str:
    """The blog's three stability plots from a run's event files: loss (with validation loss),
    gradient norm, parameter norm. Writes png and returns its path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = read_scalars(tb_dir)
    panels = [("loss", ["train/loss", "val/loss"]), ("gradient L2 norm", ["train/grad_norm"]),
              ("parameter L2 norm", ["train/param_norm"])]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (title, tags) in zip(axes, panels):
        for tag in tags:
            if s.get(tag):
                steps, values = zip(*s[tag])
                ax.plot(steps, values, label=tag, marker="o" if tag.startswith("val") or len(steps) == 1 else None,
                        markersize=3, linewidth=1)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(tags) > 1:
            ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


# ----------------------------------------------------------------------------- a refusal, said once

def say_once(message: str, wait_s: float = 30.0, where=None, out=None) -> int:
    """Print a refusal every rank reaches (the same corpus, the same checkpoint) once, not 4096
    times at 4096 ranks: rank 0 prints and posts it in the store; another rank prints its own only if
    rank 0 posted another or none within wait_s, unless it only points at rank 0's ("(see its
    message)"). Rank 0 stays until all have read it (at most wait_s: multi-node, the store lives in
    its process). 3 store requests per refusing rank. Returns the exit status, 1."""
    import datetime
    import torch.distributed as dist
    store, rank, world = where or (dist.distributed_c10d._get_default_store(), dist.get_rank(),
                                   dist.get_world_size())
    out, wait = out or sys.stderr, datetime.timedelta(seconds=wait_s)
    if rank == 0:
        print(message, file=out, flush=True)
    try:
        if rank == 0:
            store.set("nanotrn/refusal", message)
            store.wait(["nanotrn/refusal_read"], wait)
            return 1
        store.wait(["nanotrn/refusal"], wait)
        said = store.get("nanotrn/refusal").decode() == message or message.endswith("(see its message)")
        if store.add("nanotrn/refusal_readers", 1) == world - 1:
            store.set("nanotrn/refusal_read", "1")
    except (Exception, KeyboardInterrupt):      # no post in time, the store gone: say it here
        said = rank == 0
    if not said:
        print(message, file=out, flush=True)
    return 1


# ----------------------------------------------------------------------------- gloo's lines on each group

@contextlib.contextmanager
def quiet_gloo():
    """Build process groups in here. gloo (torch 2.9) prints on stdout, for every group a rank joins, 'Rank r is
    connected to n peer ranks' and, connecting lazily (TORCH_GLOO_LAZY_INIT: env.sh, the XLA host group), 'Rank r
    is NOT connected to: [...]' naming every other rank: about 24 KB a rank at 4096 ranks, 100 MB of a job's log
    each start, for connections made later as needed (a failed one raises). Those lines go; the rest stays."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with tempfile.TemporaryFile() as tmp:
            os.dup2(tmp.fileno(), 1)
            try:
                yield
            finally:
                os.dup2(saved, 1)
                tmp.seek(0)
                lines = tmp.read().decode(errors="replace").splitlines(keepends=True)
                sys.stdout.write("".join(x for x in lines if not re.match(r"\[Gloo\] Rank \d+ is (NOT )?connected", x)))
                sys.stdout.flush()
    finally:
        os.close(saved)


# ----------------------------------------------------------------------------- the hang watchdog

EXIT_HUNG = 124        # as GNU timeout: the launcher sees a failure and restarts the run


def _secs(s: float) -> str:
    """A limit as the hang's line says it: whole seconds from 10 s, 3 digits below (0.274 s was said '0 s')."""
    return f"{s:.0f}" if s >= 10 else f"{s:.3g}"


class Watchdog:
    """A hung run ends with every thread's stack and exit status EXIT_HUNG instead of waiting forever (a crash restarts
    from the newest checkpoint; a rank stuck in a collective never exits, and xla's device collectives have no timeout):
    once no step_done() came for factor x the median step time (at least min_s; startup_s before the first steps and in
    a phase()). A faulthandler timer at twice the limit (5 s after it at least) is the backstop if C code holds the GIL.
    Per step: a median of 100 numbers, nothing that grows with the ranks. factor 0: every call does nothing."""

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
        if len(self.times) < 3:
            self._arm(self.startup_s, f"no training step finished in {_secs(self.startup_s)} s")
            return
        med = statistics.median(self.times)     # once a step: limit() would sort the 100 times again
        limit = max(self.min_s, self.factor * med)
        self._arm(limit, f"no training step finished in {_secs(limit)} s ({self.factor:g} x the median step time, "
                         f"{med:.3g} s)")

    @contextlib.contextmanager
    def phase(self, what: str):
        """Not a step (an evaluation, a save, a resume): allowed startup_s, not timed as a step."""
        self._since = None
        self._arm(self.startup_s, f"{what} did not finish in {_secs(self.startup_s)} s")
        try:
            yield
        finally:
            self._since = time.monotonic()
            self._arm(self.limit(), f"no training step finished in {_secs(self.limit())} s after {what}")

    def _arm(self, seconds: float, why: str) -> None:
        if self.factor <= 0:
            return
        seconds = min(seconds, 1e9)     # factor x median may pass what the timer and wait() take (~9.2e9 s)
        with self._cv:
            self.deadline, self.why = time.monotonic() + seconds, why
            self._cv.notify()
        # The backstop, 5 s after the limit at least: the watchdog's thread must have time to say why (at 2 x 1 ms it
        # fired first, while a starting run held the GIL: stacks, status 1, no watchdog line)
        faulthandler.dump_traceback_later(max(2 * seconds, seconds + 5), exit=True, file=self.out)

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


if __name__ == "__main__":
    # python monitor.py plot out/tb out/curves.png
    usage = ("usage: python monitor.py plot [--overwrite] TB_DIR PNG   (the run's --log.tensorboard folder, default "
             "<out_dir>/tb; --overwrite replaces an existing PNG)")
    argv = [a for a in sys.argv[1:] if a != "--overwrite"]
    if {"-h", "--help"} & set(argv):
        print(usage)
    elif len(argv) == 3 and argv[0] == "plot":
        from matplotlib.backend_bases import FigureCanvasBase
        png, kind = argv[2], path_kind(argv[2])
        if kind not in ("nothing", "a file"):       # savefig("d") writes d.png beside a directory d, says d
            sys.exit(f"error: {png!r} is {kind}, not an image file: give a file path such as "
                     f"{os.path.join(png, 'curves.png') if kind == 'a directory' else 'curves.png'}")
        if os.path.splitext(png)[1][1:].lower() not in FigureCanvasBase.get_supported_filetypes():
            sys.exit(f"error: {png!r} does not end in an image format matplotlib writes: give e.g. curves.png "
                     f"(or .svg, .pdf)")
        if kind == "a file" and "--overwrite" not in sys.argv:     # a figure the user keeps (nothing is overwritten unasked)
            sys.exit(f"error: {png!r} exists: give another path, or pass --overwrite to replace it")
        if not os.path.isdir(tb := argv[1]) or not os.access(tb, os.R_OK | os.X_OK):     # (0300: was a traceback)
            sys.exit(f"error: {tb} is not {'readable by this user' if os.path.isdir(tb) else 'a directory of TensorBoard event files'}"
                     " (the run's --log.tensorboard)")
        if not read_scalars(tb).get("train/loss"):      # else a blank figure, silently
            sys.exit(f"error: {tb} holds no train/loss scalars: give the run's --log.tensorboard folder (default <out_dir>/tb)")
        try:
            print(plot_curves(tb, png))
        except OSError as e:                        # a parent that is a file, a full disk
            sys.exit(f"error: could not write {png!r}: {e.strerror or e}; give another path")
    else:
        sys.exit(usage)
