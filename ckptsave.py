"""Saving a checkpoint: this rank's files (checkpoint.py decides what they are) staged into host
buffers kept from the previous save, then written in a background thread while training goes on: on
a CPU host the weights and moments are copied in that thread during the next forward and backward
(before_update() waits for the copy). Each file goes into step_N/.tmp-rankR/ in one pass that
serializes and checksums it, fsynced, renamed into step_N/; then the rank's completion marker. A
crash leaves at worst an interrupted save.
"""
from __future__ import annotations

import copy
import errno
import functools
import json
import os
import shutil
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

import ckptdir
from ckptdir import CheckpointError


class SaveFailed(CheckpointError):
    """This rank's own write failed (a full disk): no other rank meets it, so train.cli says it at once, not
    through monitor.say_once, which waits up to 30 s for rank 0 to say the same (and rank 0 for the others)."""


class _CrcFile:
    """A write-only file that checksums what passes through it (one pass over the bytes). error: the
    write's own OSError, which torch.save's zip writer turns into a RuntimeError without its errno."""

    def __init__(self, f):
        self.f, self.n, self.crc, self.error = f, 0, 0, None

    def write(self, b) -> int:
        try:
            n = self.f.write(b)
        except OSError as e:
            self.error = e
            raise
        self.crc, self.n = ckptdir.crc32(b, self.crc), self.n + n
        return n

    def flush(self):
        self.f.flush()


def write_file(path: Path, obj, wrap=None) -> dict:
    """Write obj (bytes as they are, anything else with torch.save), fsync; return size and crc32.
    wrap: a test's fault around the open file (faults.Faults.file)."""
    with open(path, "wb") as raw:
        f = _CrcFile(wrap(raw) if wrap else raw)
        if isinstance(obj, bytes):
            f.write(obj)
        else:
            try:
                torch.save(obj, f)
            except RuntimeError:        # "[enforce fail ...] unexpected pos": the cause (a quota, a full disk) is f's
                if f.error is None:
                    raise
                raise f.error from None
        raw.flush()
        os.fsync(raw.fileno())
    return {"bytes": f.n, "crc32": f.crc}


def tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, bytes):
        return len(obj)
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return sum(tensor_bytes(v) for v in items)


def map_tree(obj, fn, key: tuple = ()):
    """obj with fn(leaf, key: its path) for each leaf of its mappings (lazy ones read), lists, tuples."""
    if isinstance(obj, Mapping):
        return {k: map_tree(v, fn, key + (k,)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [map_tree(v, fn, key + (i,)) for i, v in enumerate(obj)]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return fn(obj, key)


def map_tensors(obj, fn, key: tuple = ()):
    """obj with fn(tensor, key) in place of each tensor, every other value deep-copied."""
    return map_tree(obj, lambda x, k: fn(x, k) if isinstance(x, torch.Tensor) else copy.deepcopy(x), key)


def to_host(obj):
    """obj with every tensor copied to host memory (on XLA: the device-to-host transfer)."""
    return map_tensors(obj, lambda t, _: t.detach().to("cpu", copy=True))


# ----------------------------------------------------------------------------- the writer's priority

@functools.cache
def _can_raise() -> bool:
    """Whether this process may set a thread back from SCHED_IDLE (probed once, on a thread of its
    own: the probe changes the calling thread's policy)."""
    ok = []

    def probe():
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            ok.append(True)
        except OSError:
            ok.append(False)
    t = threading.Thread(target=probe, name="ckpt-priority-probe")
    t.start()
    t.join()
    return ok[0]


def background_priority() -> int | None:
    """Lower the writer thread so that it takes only CPU time the step leaves idle (2 busy cores
    here: a 1.6 GB write at nice 10 slowed them 22%, at SCHED_IDLE not measurably). SCHED_IDLE
    only where Writer.wait() can raise it back (a starved thread on a busy host), else nice 10.
    Returns the thread's id when it is at SCHED_IDLE."""
    if not hasattr(os, "sched_setscheduler"):
        return None
    tid = threading.get_native_id()
    try:
        if _can_raise():
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            return tid
        os.setpriority(os.PRIO_PROCESS, tid, max(10, os.getpriority(os.PRIO_PROCESS, tid)))
    except OSError:
        pass
    return None


def runqueue_wait_s() -> float:
    """Seconds the calling thread has waited for a CPU so far (Linux schedstat; 0 elsewhere)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


# ----------------------------------------------------------------------------- the writer

class Writer:
    """This rank's files of one checkpoint at a time, in a background thread (async_save) or the
    caller's. write() returns once the files are in host memory; wait() until they are on disk
    (raising what went wrong); on rank 0, finish(step) runs in the writer thread after its marker."""

    def __init__(self, root: Path, rank: int, world: int, faults, async_save: bool, device=None, finish=None,
                 keep: int = 0):
        self.root, self.rank, self.world, self.faults, self.async_save = Path(root), rank, world, faults, async_save
        self.keep = keep                                # --ckpt.keep: for the advice when the disk is full
        self.device, self.finish = device, finish
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._buffers: dict[tuple, torch.Tensor] = {}   # host staging buffers, reused between saves
        self._staged: threading.Event | None = None     # set once the save in flight is all in host memory
        self._tid: int | None = None                    # the writer thread's, while it runs at SCHED_IDLE
        self._hurry = False                             # wait() is waiting for the write
        self.stats: dict = {}

    def write(self, step: int, files: dict, t0: float, to_disk: bool = True, defer: tuple = ()):
        """files: name -> bytes or a torch-saveable object. t0: when save() began. to_disk=False:
        only the staging (the pre-compile pass traces the transfers, writes nothing). defer: the
        files copied in the writer thread (a CPU host with async_save; before_update() waits)."""
        host = self.device is None or torch.device(self.device).type == "cpu"
        defer = tuple(n for n in defer if n in files) if self.async_save and to_disk and host else ()
        # Always off a device: torch.save of an XLA tensor pickles the device and ignores map_location
        # at load. On XLA the copy is the device-to-host transfer, in this thread, as NxD does
        # (trainer/checkpoint.py, _xser_save_data: t.cpu() per tensor; only writes go to its pool).
        if self.async_save or not to_disk or not host:
            files = {n: map_tensors(o, lambda t, _: t) if n in defer else o   # tensors still training's
                     for n, o in files.items()}
            files = {**files, **self._stage_all({n: o for n, o in files.items()
                                                  if not isinstance(o, bytes) and n not in defer})}
            if self.device is not None and torch.device(self.device).type == "cuda":
                torch.cuda.synchronize()
        self.stats.update(blocked_s=time.perf_counter() - t0, bytes=sum(tensor_bytes(o) for o in files.values()))
        if not to_disk:
            return
        if self.async_save:
            self._staged, self._hurry = threading.Event(), False
            self._thread = threading.Thread(target=self._write_in_background, args=(step, files, defer, self._staged),
                                            name=f"ckpt-writer-{step}")
            self._thread.start()
        else:
            self._write(step, files)
            self.stats["blocked_s"] = time.perf_counter() - t0

    def _stage_all(self, files: dict) -> dict:
        # One thread: a copy is bound by memory bandwidth, and on a busy host (32 ranks per trn1)
        # OpenMP's barriers slow it many times over (measured: 20x on 2 cores).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return {n: map_tensors(o, self._copy, (n,)) for n, o in files.items()}
        finally:
            torch.set_num_threads(threads)

    def _copy(self, obj: torch.Tensor, key: tuple) -> torch.Tensor:
        """A host copy that training can no longer change, into a buffer kept from the previous save
        (a fresh allocation would page-fault every byte: ~10x slower)."""
        buf = self._buffers.get(key)
        if buf is None or buf.shape != obj.shape or buf.dtype != obj.dtype:
            buf = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=obj.is_cuda)
            self._buffers[key] = buf
        if threading.current_thread() is self._thread:
            # The writer thread (deferred files, CPU): numpy's copy runs in this thread alone with
            # the GIL released; torch's copy_ would start an OpenMP team of its own here.
            src = obj.detach()
            if src.dtype in (torch.bfloat16, torch.float16):
                src, buf = src.view(torch.int16), buf.view(torch.int16)
            np.copyto(buf.numpy(), src.numpy())
            return self._buffers[key]
        buf.copy_(obj.detach(), non_blocking=obj.is_cuda)
        return buf

    def _write_in_background(self, step: int, files: dict, defer: tuple, staged: threading.Event):
        try:
            if defer:       # at normal priority: the next update waits for this copy (before_update)
                t0 = time.perf_counter()
                files = {**files, **{n: map_tensors(files[n], self._copy, (n,)) for n in defer}}
                self.stats["deferred_copy_s"] = time.perf_counter() - t0
            staged.set()
            self._tid = background_priority()
            if self._hurry:                    # wait() came first: it could not raise this thread
                self._raise_priority()
            self._write(step, files)
        except BaseException as e:        # kept, and raised in the training thread by wait()
            self._error = e
        finally:
            staged.set()

    def before_update(self):
        """Returns once the save's deferred copy is in host memory (its wait counts as blocked)."""
        if self._staged is not None and not self._staged.is_set():
            t0 = time.perf_counter()
            self._staged.wait()
            self.stats["blocked_s"] = self.stats.get("blocked_s", 0.0) + time.perf_counter() - t0
        self._staged = None

    def _write(self, step: int, files: dict):
        try:
            self._write_files(step, files)
        except (OSError, RuntimeError) as e:     # torch.save's zip writer turns ENOSPC into a RuntimeError
            need = sum(map(tensor_bytes, files.values()))
            free = shutil.disk_usage(self.root).free if self.root.exists() else 0     # before cleaning up
            shutil.rmtree(ckptdir.step_dir(self.root, step) / f".tmp-rank{self.rank:05d}", ignore_errors=True)
            # at keep=1 only the newest is beside a save (pruned once it is complete): nothing to lower
            fewer = (f"lower --ckpt.keep ({self.keep}), " if self.keep > 1 else
                     "set --ckpt.keep (0 keeps them all), " if self.keep == 0 else "")
            if getattr(e, "errno", None) == errno.EDQUOT:      # FSx for Lustre's and NFS's quotas: df shows room
                raise SaveFailed(
                    f"disk quota exceeded on {self.root} writing the checkpoint of step {step} (rank {self.rank}'s "
                    f"part needs {need / 2**20:,.1f} MiB): free space under the quota, {fewer}raise the quota, or point "
                    f"--ckpt.dir at another disk") from None
            if getattr(e, "errno", None) == errno.ENOSPC or free < need:
                raise SaveFailed(
                    f"disk full: no space left on the device of {self.root} writing the checkpoint of step {step} "
                    f"(rank {self.rank}'s part needs {need / 2**20:,.1f} MiB, {free / 2**20:,.1f} MiB were free); free "
                    f"space, {fewer}or point --ckpt.dir at a larger disk") from None
            raise SaveFailed(f"could not write the checkpoint of step {step} to {self.root}: {e}") from None

    def _write_files(self, step: int, files: dict):
        t0, q0 = time.perf_counter(), runqueue_wait_s()
        final = ckptdir.step_dir(self.root, step)
        tmp = final / f".tmp-rank{self.rank:05d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        # every file's bytes, for a test's fault halfway through the largest (faults.py): only when one is armed
        sizes = {name: tensor_bytes(obj) for name, obj in files.items()} if self.faults.in_save else {}
        record = {name: write_file(tmp / name, obj, self.faults.file(step, name, sizes))
                  for name, obj in files.items()}
        for name in files:
            os.replace(tmp / name, final / name)
        tmp.rmdir()
        ckptdir.fsync_dir(final)
        marker = {"format": ckptdir.FORMAT, "step": step, "rank": self.rank, "world": self.world, "files": record}
        ckptdir.atomic_write(final / ckptdir.marker_name(self.rank), json.dumps(marker, indent=1).encode())
        if self.finish is not None:
            self.finish(step)
        # starved_s: the write's wait for a CPU at SCHED_IDLE; a stop's write runs without it (checkpoint.stop_budget)
        idle = self._tid is not None and threading.current_thread() is self._thread
        self.stats.update(write_s=time.perf_counter() - t0, starved_s=runqueue_wait_s() - q0 if idle else 0.0)

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _raise_priority(self):
        if self._tid is not None:
            try:
                os.sched_setscheduler(self._tid, os.SCHED_OTHER, os.sched_param(0))
            except OSError:                    # the thread has just ended
                pass

    def wait(self):
        """Block until the save in flight (if any) is on disk; raise if it failed."""
        if self._thread is not None:
            self._hurry = True                 # the run waits for this write now: normal priority
            self._raise_priority()
            self._thread.join()
            self._staged = self._tid = None
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            if isinstance(e, CheckpointError):   # already says what failed (a full disk, a lost rank)
                raise e
            raise CheckpointError(f"the background save of step {self.stats.get('step')} failed: {e!r}") from e

    def check(self):
        """Raise now if the save in flight has failed (every step: a full disk is named at once)."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()
