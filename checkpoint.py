"""Checkpoints: asynchronous, atomic, verified, resumable after a crash at any moment and at another
parallel layout.

The blog's automatic fault recovery raised the cluster's effective use from 77.83% to 98.81%: at
100+ nodes something fails every day, so a run must save often without slowing down, and come back
by itself. Here a save costs the step only a copy into host memory; a writer thread does the I/O.

On disk, one directory per saved step, in NxD's layout:

    <ckpt.dir>/
      latest                        "step_00000200": a hint for people; loading never trusts it
      faults.log                    what NANOTRN_FAULT killed, and when (see FaultInjector)
      step_00000200/
        meta.json                   step, config, parallel layout, user content (tokens seen)  rank 0
        model_tp00_pp00.pt          the (tp 0, pp 0) rank's shard of the model            one DP replica
        optim_tp00_pp00.pt          that rank's optimizer state                           another one
        optim_dp001_tp00_pp00.pt    ... or, with ZeRO-1, the shard of every DP rank       that DP rank
        rank00000.pt                RNG streams and data-loader state                       every rank
        rank00000.done              completion marker: size and crc32 of each file rank 0 wrote

Who writes a file that DP replicas hold alike (the model, the optimizer without ZeRO-1): one replica
per file, spread over the DP group (writer_dp_rank), as NxD spreads its saves over the DP ranks
(trainer/checkpoint.py, _xser_save_data bins the tensors over the DP group). 7B at TP=8 on 16 nodes:
the 16 shared files come from 16 ranks on 16 nodes, not all from ranks 0-7 on node 0. The layout is
NxD-like (per-rank files, the same names for the same roles), but NxD cannot read it: NxD keeps one
file per tensor (xser) or its own keys, and its loaders expect its own directory tree.

Why NxD's per-rank files and not torch.distributed.checkpoint (DCP): DCP reshards only DTensor
models, and ours are plain tensors split by parallel.py. Per-rank files need no collective to save,
every rank writes its part in parallel, and at the same layout each rank reads back only its own
file (at 7B: 1/8 of the model per TP rank). At another layout, reshard.py reads them back: the
model and the optimizer state resume at any TP / PP / DP / ZeRO-1 layout, each rank reading only
the tensors it holds.

A save, on every rank (the training step waits only for step 1):
  1. copy this rank's state into host buffers (reused between saves) and return to training;
  2. a writer thread writes each file into step_N/.tmp-rankR/, fsyncs it, renames it into step_N/;
  3. then writes its marker rankR.done the same way (temp file, fsync, rename, fsync the directory);
  4. rank 0's writer waits for every rank's marker, points `latest` at step_N and deletes the
     checkpoints older than the newest `keep` complete ones.
A checkpoint is complete when every rank's marker exists, and valid when every file has the size
and crc32 its marker records. A crash at any moment leaves at worst an incomplete directory, which
loading skips (and sets aside as step_N.bad); nothing complete is ever written to again.
"""
from __future__ import annotations

import copy
import errno
import fcntl
import json
import os
import random
import re
import shutil
import signal
import socket
import sys
import threading
import time
import zlib
from pathlib import Path

if __name__ == "__main__":      # Ctrl-C while the imports below load (seconds): end quietly, not
    signal.signal(signal.SIGINT, signal.SIG_DFL)   # with a traceback from inside torch; main() restores it

import numpy as np
import torch
import torch.distributed as dist

from configs import Config, ConfigError, ModelConfig, check_dir, path_kind
from parallel import Grid
import reshard
# CheckpointError is defined in reshard.py, which reads checkpoints back and must not import this
# module; callers keep using checkpoint.CheckpointError.
from reshard import CheckpointError, Loaded

STEP_DIR = re.compile(r"^step_(\d{8})(\.bad\d*)?$")     # step_00000200, or set aside: step_00000200.bad<time>
MODEL_FIELDS_FREE = {"checkpointing", "attention"}       # may change on resume: they do not touch weights


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def _marker(rank: int) -> str:
    return f"rank{rank:05d}.done"


def read_marker(path: Path) -> dict:
    """A completion marker, checked field by field: a marker that parses as JSON but lacks a key or
    holds a wrong type is damage like any other (ValueError naming it), never a KeyError that would
    stop every restart although an older checkpoint is valid."""
    m = json.loads(path.read_text())            # JSONDecodeError is a ValueError
    if not isinstance(m, dict):
        raise ValueError("not a JSON object")
    for key in ("step", "rank", "world", "files"):
        want = dict if key == "files" else int
        if not isinstance(m.get(key), want) or isinstance(m.get(key), bool):
            raise ValueError(f"{key!r} is {'missing' if key not in m else type(m[key]).__name__}, expected {want.__name__}")
    for name, rec in m["files"].items():
        if "/" in name or name.startswith(".") or not isinstance(rec, dict) or not all(
                isinstance(rec.get(k), int) for k in ("bytes", "crc32")):
            raise ValueError(f"its record of {name!r} is damaged")
    if m["world"] < 1:
        raise ValueError(f"world {m['world']}")
    return m


# ----------------------------------------------------------------------------- RNG streams

def rng_state(device: torch.device | str | None = None) -> dict:
    """Every random stream this rank draws from: Python, numpy, torch CPU, and the device's own
    (CUDA, or XLA's seed). The stochastic-rounding stream is in the optimizer's state_dict."""
    s = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    dev = torch.device(device or "cpu")
    if dev.type == "cuda":
        s["cuda"] = torch.cuda.get_rng_state(dev)
    elif dev.type == "xla":
        import torch_xla.core.xla_model as xm
        s["xla"] = xm.get_rng_state(dev)
    return s


def seed_all(seed: int) -> None:
    """Seed every stream rng_state() captures (Python and numpy seed themselves at random otherwise,
    and then two runs of the same config could never be compared bit for bit)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def set_rng_state(s: dict, device: torch.device | str | None = None) -> None:
    """Restore what rng_state() captured."""
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if "cuda" in s:
        torch.cuda.set_rng_state(s["cuda"], device)
    if "xla" in s:
        import torch_xla.core.xla_model as xm
        xm.set_rng_state(s["xla"], device)


# ----------------------------------------------------------------------------- fault injection

class FaultInjector:
    """Crash this process on purpose (SIGKILL to itself: no cleanup, no flush, like a dead node), so
    that the recovery path runs on purpose. Set by the environment variable NANOTRN_FAULT:

        NANOTRN_FAULT=1:7           rank 1 dies as step 7 begins (steps count from 0)
        NANOTRN_FAULT=0:4:save      rank 0 dies halfway through writing the checkpoint of step 4
        NANOTRN_FAULT=p=0.01        every rank, every step, dies with probability 0.01
        NANOTRN_FAULT=p=0.05,seed=3,max=2   ... with a seed, and at most 2 deaths in this ckpt.dir
        NANOTRN_FAULT=nan:5         not a crash: step 5's gradients become NaN on every rank, to
                                    exercise --log.on_nonfinite (train.py applies it)

    Each death is first appended (fsynced) to <ckpt.dir>/faults.log. A fixed fault fires only if
    faults.log does not hold it yet, so the restarted run goes through the step that killed it
    (otherwise `torchrun --max-restarts` would restart into the same crash until it gives up).
    The random fault draws from (seed, rank, step, deaths so far): a restart re-running a step
    draws anew, so a run always makes progress."""

    def __init__(self, spec: str, rank: int, root: Path):
        self.spec, self.rank, self.log = spec.strip(), rank, Path(root) / "faults.log"
        self.p, self.seed, self.max, self.at, self.in_save = 0.0, 0, None, None, False
        self.nan_step = None
        if not self.spec:
            return
        try:
            if self.spec.startswith("nan:"):
                self.nan_step = int(self.spec[4:])
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
                self.at, self.in_save = (int(parts[0]), int(parts[1])), len(parts) == 3
        except (ValueError, KeyError):
            raise CheckpointError(f"NANOTRN_FAULT={spec!r} is not understood; use RANK:STEP, "
                                  f"RANK:STEP:save, p=PROB[,seed=N][,max=N] or nan:STEP") from None
        self.fired = self.log.read_text().splitlines() if self.log.exists() else []

    @classmethod
    def from_env(cls, rank: int, root: Path) -> "FaultInjector":
        return cls(os.environ.get("NANOTRN_FAULT", ""), rank, root)

    def _die(self, what: str):
        line = f"rank {self.rank} {what} ({self.spec})"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        print(f"NANOTRN_FAULT: {line}: SIGKILL", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def _fixed(self, step: int, in_save: bool) -> bool:
        return (self.at == (self.rank, step) and self.in_save == in_save
                and not any(l.startswith(f"rank {self.rank} ") and f"({self.spec})" in l for l in self.fired))

    def maybe_crash(self, step: int):
        """Call at the start of every training step."""
        if self._fixed(step, in_save=False):
            self._die(f"step {step}")
        if self.p > 0 and (self.max is None or len(self.fired) < self.max):
            draw = random.Random(f"{self.seed}|{self.rank}|{step}|{len(self.fired)}").random()
            if draw < self.p:
                self._die(f"step {step} at random")

    def dies_in_save(self, step: int) -> bool:
        return self._fixed(step, in_save=True)


# ----------------------------------------------------------------------------- files

class _CrcFile:
    """A write-only file that checksums what passes through it (one pass over the bytes), and can
    die halfway (fault injection: the kill lands in the middle of a real file write)."""

    def __init__(self, f, die_at: int | None = None, die=None):
        self.f, self.n, self.crc, self.die_at, self.die = f, 0, 0, die_at, die

    def write(self, b) -> int:
        if self.die_at is not None and self.n >= self.die_at:
            self.f.flush()
            self.die()
        n = self.f.write(b)
        self.crc, self.n = zlib.crc32(b, self.crc), self.n + n
        return n

    def flush(self):
        self.f.flush()


def _write_file(path: Path, obj, die_at: int | None = None, die=None) -> dict:
    """Write obj (bytes as they are, anything else with torch.save), fsync; return size and crc32."""
    with open(path, "wb") as raw:
        f = _CrcFile(raw, die_at, die)
        if isinstance(obj, bytes):
            f.write(obj)
        else:
            torch.save(obj, f)
        raw.flush()
        os.fsync(raw.fileno())
    return {"bytes": f.n, "crc32": f.crc}


def _fsync_dir(path: Path):          # makes the renames inside it durable
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def _atomic_write(path: Path, data: bytes):
    tmp = path.with_name("." + path.name + ".tmp")
    _write_file(tmp, data)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _crc_of(path: Path) -> int:
    crc, buf = 0, bytearray(1 << 24)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(memoryview(buf)[:n], crc)
    return crc


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, bytes):
        return len(obj)
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return sum(_tensor_bytes(v) for v in items)


def _diff(saved: dict, now: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(saved) | set(now)):
        a, b = saved.get(k, "<absent>"), now.get(k, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += _diff(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: checkpoint {a!r}, now {b!r}")
    return out


# ----------------------------------------------------------------------------- who writes what

def writer_dp_rank(kind: int, g: Grid, zero1: bool) -> int:
    """The DP replica that writes file `kind` (0: model, 1: optimizer without ZeRO-1) of the
    (tp_rank, pp_rank) position of g. The n = kinds x TP x PP such files are numbered k = 0..n-1 and
    file k goes to replica k * DP // n: evenly over the DP group, and since replicas fill the nodes
    in order (parallel.rank_groups), evenly over the nodes too. Costs nothing at 4096 ranks: every
    rank decides for itself, from its own coordinates."""
    kinds = 1 if zero1 else 2
    n = kinds * g.tp * g.pp
    k = kind * g.tp * g.pp + g.pp_rank * g.tp + g.tp_rank
    return k * g.dp // n


# ----------------------------------------------------------------------------- the checkpointer

class Checkpointer:
    """Saves and loads this rank's part of a checkpoint. Create one on every rank:

        ckpt = Checkpointer(cfg, grid, device)
        loaded = ckpt.load_latest()            # None: nothing to resume, starting fresh
        ckpt.fault.maybe_crash(step)           # at the start of every step (NANOTRN_FAULT)
        ckpt.save(step, model.state_dict(), opt.state_dict(), data=loader.state_dict(), extra={...})
        ckpt.close()                           # waits for the save in flight
    """

    def __init__(self, cfg: Config, grid: Grid | None = None, device: torch.device | str | None = None,
                 log=print, marker_timeout_s: float = 600.0):
        self.cfg, self.c, self.grid = cfg, cfg.ckpt, grid or Grid()
        self.root, self.device, self.marker_timeout_s = Path(cfg.ckpt.dir), device, marker_timeout_s
        self._log = log
        g = self.grid
        # ZeRO-1 shards exist only when there is more than one DP rank (optim.build_optimizer).
        self.layout = {"world": g.world, "tp": g.tp, "pp": g.pp, "dp": g.dp,
                       "zero1": bool(cfg.parallel.zero1 and g.dp > 1)}
        self.fault = FaultInjector.from_env(g.rank, self.root)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._buffers: dict[tuple, torch.Tensor] = {}   # host staging buffers, reused between saves
        self._newest = -1                                # newest step saved or resumed from
        self._lock: int | None = None                    # rank 0's flock on run.lock (claim)
        self.stats: dict = {}
        if not self.c.resume and self._scan():
            raise CheckpointError(f"--ckpt.resume=false but {self.root} already holds checkpoints, which this "
                                  f"run would overwrite; resume (--ckpt.resume=true), or start the new run in "
                                  f"another --ckpt.dir")

    def say(self, msg: str):
        if self.grid.rank == 0:
            self._log(f"ckpt: {msg}")

    # --------------------------------------------------------------- save
    def save(self, step: int, model: dict | None, optim: dict | None = None, data=None,
             extra: dict | None = None):
        """Save this rank's part of the state after `step` optimizer steps.

        model: this rank's model.state_dict() (its TP shard of its pipeline stage).
        optim: this rank's optimizer.state_dict() (its ZeRO-1 shard when sharded).
        data:  this rank's data-loader state (any picklable object).
        extra: JSON-able run state kept in meta.json by rank 0 (tokens seen, ...).
        The RNG streams of this rank are captured here. With async_save, returns once everything
        is copied to host memory; the previous save in flight is waited for first."""
        t0 = time.perf_counter()
        self.wait()
        t1 = time.perf_counter()
        if step <= self._newest:
            self.say(f"step {step} is already saved (newest is step {self._newest}); not saving it again")
            return
        files = self._files(step, model, optim, data, extra)
        # Stage into host memory for a background write, and always off a device: torch.save of an
        # XLA tensor pickles the device itself and ignores map_location at load.
        if self.c.async_save or (self.device is not None and torch.device(self.device).type != "cpu"):
            # One thread: a copy is bound by memory bandwidth, and a busy host (32 ranks per trn1)
            # makes OpenMP's thread barriers slow it down many times over (measured: 20x on 2 cores).
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                files = {n: o if isinstance(o, bytes) else self._stage(o, (n,)) for n, o in files.items()}
            finally:
                torch.set_num_threads(threads)
            if self.device is not None and torch.device(self.device).type == "cuda":
                torch.cuda.synchronize()
        self.stats = {"step": step, "wait_s": t1 - t0, "blocked_s": time.perf_counter() - t0,
                      "bytes": sum(_tensor_bytes(o) for o in files.values())}
        self._newest = step
        if self.c.async_save:
            self._thread = threading.Thread(target=self._write_in_background, args=(step, files),
                                            name=f"ckpt-writer-{step}")
            self._thread.start()
        else:
            self._write(step, files)
            self.stats["blocked_s"] = time.perf_counter() - t0

    def _files(self, step, model, optim, data, extra) -> dict:
        """This rank's files: name -> bytes or a torch-saveable object."""
        g = self.grid
        tag = f"tp{g.tp_rank:02d}_pp{g.pp_rank:02d}"
        files = {}
        if g.rank == 0:
            meta = {"step": step, "time": time.time(), "layout": self.layout, "config": self.cfg.to_dict(),
                    "extra": extra or {}, "torch": torch.__version__}
            try:
                files["meta.json"] = json.dumps(meta, indent=1).encode()
            except TypeError as e:
                raise CheckpointError(f"save(extra=...) must be JSON-able (ints, floats, strings, lists, "
                                      f"dicts): {e}") from None
        zero1 = self.layout["zero1"]
        # DP replicas hold the same model (and, without ZeRO-1, the same optimizer state): one copy
        # of each, written by the replica writer_dp_rank picks, so the writes spread over the nodes.
        if model is not None and g.dp_rank == writer_dp_rank(0, g, zero1):
            files[f"model_{tag}.pt"] = model
        if optim is not None and (zero1 or g.dp_rank == writer_dp_rank(1, g, zero1)):
            files[reshard.optim_name(g.dp_rank, tag, zero1)] = optim
        files[f"rank{g.rank:05d}.pt"] = {"rank": g.rank, "dp_rank": g.dp_rank, "tp_rank": g.tp_rank,
                                         "pp_rank": g.pp_rank, "rng": rng_state(self.device), "data": data}
        return files

    def _stage(self, obj, key: tuple):
        """A host copy of obj that training can no longer change: tensors are copied into buffers
        kept from the previous save (a fresh allocation would page-fault every byte: ~10x slower),
        other objects deep-copied. On XLA/CUDA the copy_ is the device-to-host transfer."""
        if isinstance(obj, torch.Tensor):
            buf = self._buffers.get(key)
            if buf is None or buf.shape != obj.shape or buf.dtype != obj.dtype:
                buf = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=obj.is_cuda)
                self._buffers[key] = buf
            buf.copy_(obj.detach(), non_blocking=obj.is_cuda)
            return buf
        if isinstance(obj, dict):
            return {k: self._stage(v, key + (k,)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [self._stage(v, key + (i,)) for i, v in enumerate(obj)]
            return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        return copy.deepcopy(obj)

    def _write_in_background(self, step: int, files: dict):
        try:
            if hasattr(os, "setpriority"):     # Linux: lower this thread only, training keeps the CPU
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
            self._write(step, files)
        except BaseException as e:        # kept, and raised in the training thread by wait()
            self._error = e

    def _write(self, step: int, files: dict):
        try:
            self._write_files(step, files)
        except (OSError, RuntimeError) as e:     # torch.save's zip writer turns ENOSPC into a RuntimeError
            need = sum(map(_tensor_bytes, files.values()))
            free = shutil.disk_usage(self.root).free if self.root.exists() else 0     # before cleaning up
            shutil.rmtree(step_dir(self.root, step) / f".tmp-rank{self.grid.rank:05d}", ignore_errors=True)
            if getattr(e, "errno", None) == errno.ENOSPC or free < need:
                raise CheckpointError(
                    f"disk full: no space left on the device of {self.root} writing the checkpoint of step {step} "
                    f"(this rank's part needs {need / 2**20:,.1f} MiB, {free / 2**20:,.1f} MiB were free); free "
                    f"space, lower --ckpt.keep, or point --ckpt.dir at a larger disk") from None
            raise CheckpointError(f"could not write the checkpoint of step {step} to {self.root}: {e}") from None

    def _write_files(self, step: int, files: dict):
        t0 = time.perf_counter()
        r = self.grid.rank
        final = step_dir(self.root, step)
        tmp = final / f".tmp-rank{r:05d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        # NANOTRN_FAULT=R:S:save: die halfway through this rank's largest file.
        victim = max(files, key=lambda n: _tensor_bytes(files[n])) if self.fault.dies_in_save(step) else None
        record = {}
        for name, obj in files.items():
            die_at = _tensor_bytes(obj) // 2 if name == victim else None
            record[name] = _write_file(tmp / name, obj, die_at, lambda: self.fault._die(f"writing {name} of step {step}"))
        for name in files:
            os.replace(tmp / name, final / name)
        tmp.rmdir()
        _fsync_dir(final)
        marker = {"step": step, "rank": r, "world": self.grid.world, "files": record}
        _atomic_write(final / _marker(r), json.dumps(marker, indent=1).encode())
        if r == 0:
            self._publish(step)
        self.stats["write_s"] = time.perf_counter() - t0

    def _publish(self, step: int):
        """Rank 0, in the background: once every rank's marker is there, point `latest` at the step
        and drop old checkpoints. Polls the file system: no collective in a background thread."""
        d, deadline = step_dir(self.root, step), time.monotonic() + self.marker_timeout_s
        while missing := [r for r in range(self.grid.world) if not (d / _marker(r)).exists()]:
            if time.monotonic() > deadline:
                raise CheckpointError(f"{d.name}: rank(s) {missing[:8]} did not finish writing within "
                                      f"{self.marker_timeout_s:.0f} s; it stays incomplete and will be skipped")
            time.sleep(0.02)
        try:
            _atomic_write(self.root / "latest", d.name.encode())
        except OSError as e:      # the checkpoint is complete: resume finds it by scanning, not by `latest`
            self.say(f"warning: {d.name} is complete but `latest` could not be updated ({e.strerror or e}); "
                     f"resuming finds checkpoints without it")
            (self.root / ".latest.tmp").unlink(missing_ok=True)
        self._prune()

    def _prune(self):
        # After a good save, the half-written checkpoints set aside as step_N.bad<time> have served
        # their purpose (being looked at): they only take space.
        for p in self.root.iterdir():
            if (m := STEP_DIR.match(p.name)) and m.group(2):
                shutil.rmtree(p, ignore_errors=True)
        if self.c.keep <= 0:
            return
        complete = [s for s, d in self._scan() if self._complete(d)[0] is None]
        if len(complete) <= self.c.keep:
            return
        oldest_kept = complete[self.c.keep - 1]
        for p in self.root.iterdir():
            m = STEP_DIR.match(p.name)
            if m and int(m.group(1)) < oldest_kept:
                shutil.rmtree(p, ignore_errors=True)

    @property
    def in_flight(self) -> bool:
        """A save is still being written in the background."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self):
        """Block until the save in flight (if any) is on disk; raise if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            if isinstance(e, CheckpointError):   # already says what failed (a full disk, a lost rank)
                raise e
            raise CheckpointError(f"the background save of step {self.stats.get('step')} failed: {e!r}") from e

    def check(self):
        """Raise now if the save in flight has failed (call every step): a full disk is named at
        once, not one interval later when the next save waits for it."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def close(self):
        """At exit: the save in flight must be on disk; then the directory is free for another run."""
        try:
            self.wait()
        finally:
            if self._lock is not None:
                os.close(self._lock)           # releases the flock
                self._lock = None

    def claim(self):
        """Before any work, on every rank: the checkpoint directory must be a directory (created if
        absent), writable, and this run's alone. Rank 0 holds an exclusive flock on <dir>/run.lock
        for the run's lifetime, with who holds it written inside. The kernel drops it when the
        process dies, so a killed run never leaves a stale lock (torchrun restarts take it again).
        On a shared file system flock must reach every node (NFSv4, Lustre mounted with -o flock,
        as FSx for Lustre is). All ranks agree before going on."""
        problem = self._claim() if self.grid.rank == 0 else None
        if not self._agree(problem is None):
            raise CheckpointError(problem or f"rank 0 could not claim {self.root} (see its message)")

    def _claim(self) -> str | None:
        root = self.root
        if root.exists() and not root.is_dir():
            return f"--ckpt.dir {root} is a file, not a directory; remove it or give another --ckpt.dir"
        try:
            root.mkdir(parents=True, exist_ok=True)
            fd = os.open(root / "run.lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            what = {errno.EROFS: "is on a read-only file system", errno.ENOSPC: "is on a full disk",
                    errno.EACCES: "is not writable"}.get(e.errno, f"cannot be written ({e.strerror})")
            return f"--ckpt.dir {root} {what}: checkpoints could not be saved; give a writable --ckpt.dir"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            return (f"{root} is in use by another run ({holder}): two runs in one directory resume each "
                    f"other's checkpoints and write the same step folders. Wait for it to end or stop it, "
                    f"or give this run its own --out_dir or --ckpt.dir")
        try:
            me = f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"
            os.ftruncate(fd, 0)
            os.pwrite(fd, (me + ", command: " + " ".join(sys.argv))[:4000].encode() + b"\n", 0)
        except OSError as e:
            os.close(fd)
            return (f"--ckpt.dir {root} cannot be written ({'disk full' if e.errno == errno.ENOSPC else e.strerror}): "
                    f"checkpoints could not be saved; free space or give another --ckpt.dir")
        self._lock = fd
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.wait()

    # --------------------------------------------------------------- load
    def _scan(self) -> list[tuple[int, Path]]:
        """Step directories (not the set-aside ones), newest first."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir()
                 if (m := STEP_DIR.match(p.name)) and not m.group(2) and p.is_dir()]
        return sorted(found, reverse=True)

    def _complete(self, d: Path, share: tuple[int, int] = (0, 1)) -> tuple[str | None, dict]:
        """(problem or None, {file: {bytes, crc32}} of the markers looked at). Cheap: markers and
        file sizes only. share (i, n): only the markers of ranks i, i+n, i+2n, ... and the files
        they list. On resume every rank takes its own 1/world share and the ranks then agree
        (load_latest): at 4096 ranks each rank reads rank 0's marker and its own, not all 4096
        (16M marker reads of the shared file system if every rank read every marker)."""
        try:
            world = read_marker(d / _marker(0))["world"]
        except FileNotFoundError:
            return "no completion marker from rank 0: the save was interrupted", {}
        except (ValueError, OSError) as e:
            return f"rank 0's completion marker is damaged ({e})", {}
        ranks = range(share[0], world, share[1])
        missing = [r for r in ranks if not (d / _marker(r)).exists()]
        if missing:
            return (f"incomplete: no completion marker from rank(s) {missing[:8]} of {world}: "
                    f"the save was interrupted"), {}
        files = {}
        for r in ranks:
            try:
                m = read_marker(d / _marker(r))
            except (ValueError, OSError) as e:
                return f"rank {r}'s completion marker is damaged ({e})", {}
            if m["step"] != int(d.name[5:13]) or m["world"] != world:
                return f"rank {r}'s completion marker belongs to another save", {}
            files.update(m["files"])
        for name, rec in files.items():
            if not (d / name).exists():
                return f"{name} is missing", {}
            if (size := (d / name).stat().st_size) != rec["bytes"]:
                return f"{name} is {size} bytes, its marker says {rec['bytes']} (truncated or damaged)", {}
        return None, files

    def _agree(self, ok: bool) -> bool:
        """True only if every rank says ok (so that all ranks fall back together)."""
        if self.grid.world == 1 or not dist.is_initialized():
            return ok
        # Host-side agreement: over the gloo host group on XLA (no device graph to compile for it).
        t = torch.tensor([int(ok)], device="cuda" if self.grid.backend == "nccl" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.grid.host_group)
        return bool(t.item())

    def _barrier(self):
        if self.grid.world > 1 and dist.is_initialized():
            import parallel                     # on xla, a gloo group: xla's own barrier is a no-op
            parallel.barrier(self.grid)

    def _verify(self, d: Path, files: dict) -> str | None:
        """The first file of `files` whose crc32 differs from its marker's, or None."""
        for name in sorted(files):
            if (crc := _crc_of(d / name)) != files[name]["crc32"]:
                return f"{name}: crc32 {crc:08x}, its marker says {files[name]['crc32']:08x} (corrupted)"
        return None

    def _check_model(self, meta: dict, d: Path):
        saved, now = meta["config"]["model"], self.cfg.to_dict()["model"]
        diffs = [x for x in _diff(saved, now, "model.") if x.split(":")[0][6:] not in MODEL_FIELDS_FREE]
        if diffs:
            raise CheckpointError(f"{d} holds another model than this run's:\n  " + "\n  ".join(diffs) +
                                  f"\nresume with the checkpoint's --model.* settings, or start a new run "
                                  f"in another --ckpt.dir")
        saved_precision = meta["config"]["optim"]["precision"]
        if saved_precision != self.cfg.optim.precision:
            raise CheckpointError(f"{d} was trained with --optim.precision={saved_precision} and this run asks "
                                  f"for {self.cfg.optim.precision}: its optimizer state is kept in the other "
                                  f"precision; resume with --optim.precision={saved_precision}, or start a new "
                                  f"run in another --ckpt.dir")
        other = [x for x in _diff(meta["config"], self.cfg.to_dict())
                 if not x.startswith(("model.", "ckpt.", "out_dir", "device", "log."))]
        if other:
            self.say("resuming with settings that differ from the checkpoint's: " + "; ".join(other))

    def load_latest(self, load_optim: bool = True, set_aside: bool = True, names=None) -> Loaded | None:
        """The newest complete, valid checkpoint, or None to start fresh (saying why). Call on every
        rank. Incomplete or corrupt checkpoints are skipped with the reason, and (set_aside)
        renamed step_N.bad so that a new save of step N starts in an empty directory. names: this
        rank's model state keys (model.state_dict()); at another layout only those are built."""
        self.wait()
        if not self.c.resume:
            self.say("--ckpt.resume=false: starting fresh")
            return None
        if not (candidates := self._scan()):
            self.say(f"no checkpoint directory {self.root}: starting fresh" if not self.root.is_dir() else
                     f"{self.root} holds no checkpoint: starting fresh")
            return None
        skipped, loaded = [], None
        share = (self.grid.rank, self.grid.world) if self.grid.world > 1 and dist.is_initialized() else (0, 1)
        for step, d in candidates:
            # Each rank checks a 1/world share of the markers, and the sizes and crc32 of the files
            # they list; all ranks then agree, so that they fall back to an older step together.
            problem, files = self._complete(d, share)
            problem = problem or self._verify(d, files)
            if problem is not None and self.grid.world > 1:
                self._log(f"ckpt: [rank {self.grid.rank}] {d.name}: {problem}")
            if not self._agree(problem is None):
                problem = problem or "a marker or file checked by another rank is damaged (see its message)"
                self.say(f"skipping {d.name}: {problem}")
                skipped.append(d)
                continue
            meta = json.loads((d / "meta.json").read_text())
            self._check_model(meta, d)
            loaded = reshard.read(d, meta, self.grid, self.layout, self.cfg.model, load_optim, names, self.say)
            break
        if set_aside and skipped:
            self._barrier()                  # every rank is done looking at them
            if self.grid.rank == 0:
                for d in skipped:
                    os.replace(d, d.with_name(f"{d.name}.bad{time.time_ns()}"))
            self._barrier()
        if loaded is None:
            self.say(f"no complete, valid checkpoint in {self.root} ({len(skipped)} skipped): starting fresh")
            return None
        self._newest = loaded.step
        self.say(f"resuming from {loaded.path} (step {loaded.step})")
        return loaded

# ----------------------------------------------------------------------------- command line: ls, export

def _cli(argv: list[str]):
    """python checkpoint.py ls DIR           each checkpoint: ok, or why loading would skip it
    python checkpoint.py export [--dtype=auto|fp32|bf16] [--overwrite] DIR OUT
                                            the newest valid one as a complete Hugging Face folder
                                            (weights, config, generation config, the run's tokenizer)
    In one process, whatever layout wrote the checkpoint. Every argument is checked before a
    checkpoint is read; export never writes into a non-empty OUT without --overwrite."""
    import hf
    usage = "usage: python checkpoint.py ls CKPT_DIR | export [--dtype=auto|fp32|bf16] [--overwrite] CKPT_DIR HF_OUT_DIR"
    flags = [a for a in argv if a.startswith("--")]
    argv = [a for a in argv if not a.startswith("--")]
    dtype = next((f.split("=", 1)[1] for f in flags if f.startswith("--dtype=")), "auto")
    bad = [f for f in flags if f != "--overwrite" and not f.startswith("--dtype=")]
    if argv and argv[0] not in ("ls", "export"):
        raise CheckpointError(f"unknown command {argv[0]!r}; {usage}")
    if not argv or bad or dtype not in ("auto", "fp32", "bf16") or len(argv) != {"ls": 2, "export": 3}[argv[0]]:
        raise CheckpointError(usage)
    root = argv[1]
    if (kind := path_kind(root)) != "a directory":
        raise CheckpointError(f"{root} is {'missing' if kind == 'nothing' else kind}: give a checkpoint "
                              f"directory (the --ckpt.dir of a run)")
    if argv[0] == "export":
        out = argv[2]
        try:
            check_dir("HF_OUT_DIR", out)
        except ConfigError as e:
            raise CheckpointError(str(e).replace("--HF_OUT_DIR=", "")) from None
        if os.path.isdir(out) and os.listdir(out) and "--overwrite" not in flags:
            raise CheckpointError(f"{out} is not empty: export into a new folder, or pass --overwrite to "
                                  f"replace what is there")
    cfg = Config()
    cfg.ckpt.dir = root
    ck = Checkpointer(cfg, Grid())
    found = ck._scan()
    if not found:
        raise CheckpointError(f"{root} holds no checkpoint (no step_* directory): is it a run's --ckpt.dir?")
    for _, d in found:
        problem, files = ck._complete(d)
        problem = problem or ck._verify(d, files)
        if argv[0] == "ls":
            print(f"{d.name}  {'ok' if problem is None else 'BAD: ' + problem}")
        elif problem is None:
            import data
            m = ModelConfig(**json.loads((d / "meta.json").read_text())["config"]["model"])
            tok_dir = Path(root) / "tokenizer"
            tok = data.load_tokenizer(str(tok_dir)) if tok_dir.is_dir() else None
            hf.save_hf(reshard.full_model_state(d, m), m, out, hf.export_dtype(dtype, m), tok, "--overwrite" in flags)
            return print(f"exported {d} to {out}" + ("" if tok else " (no tokenizer/ beside the checkpoints: none exported)"))
    if argv[0] == "export":
        raise CheckpointError(f"no complete, valid checkpoint in {root}")


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _cli(argv)
    except (CheckpointError, ConfigError) as e:                # ConfigError: hf.HFError, data.DataError
        sys.exit(f"checkpoint error: {e}" if not str(e).startswith("usage") else str(e))
    except KeyboardInterrupt:
        sys.exit("interrupted")


if __name__ == "__main__":
    main(sys.argv[1:])
