"""The checkpoint directory's rules: what its names mean, when a step folder is complete and valid,
and what a run may do to the folders in it (claim the directory, prune old checkpoints, set damaged
ones aside). checkpoint.py writes and reads checkpoints; everything that decides whether a folder
may be trusted, written or removed is here, in one place a reader can check.

    <ckpt.dir>/
      run.lock                      rank 0's flock for the run's lifetime: one run per directory
      latest                        "step_00000200": a hint for people; loading never trusts it
      step_00000200/                one saved step (checkpoint.py's docstring draws its files)
        rankRRRRR.done              rank R's completion marker: size and crc32 of each file it wrote
      step_00000100.bad<time>       a checkpoint set aside: skipped on resume, never written to

A step folder is complete when every rank's marker exists, and valid when every file has the size
and crc32 its marker records. Markers are written atomically (temp file, fsync, rename), so a
marker that is there is whole: a crash leaves at worst a missing one.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import socket
import sys
import time
import zlib
from pathlib import Path

STEP_DIR = re.compile(r"^step_(\d{8})(\.bad\d*)?$")     # step_00000200, or set aside: step_00000200.bad<time>


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def marker_name(rank: int) -> str:
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


# ----------------------------------------------------------------------------- durable small writes

def fsync_dir(path: Path):          # makes the renames inside it durable
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes):
    """path holds data, or (after a crash) what it held before: never a part."""
    tmp = path.with_name("." + path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def crc_of(path: Path) -> int:
    crc, buf = 0, bytearray(1 << 24)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(memoryview(buf)[:n], crc)
    return crc


# ----------------------------------------------------------------------------- complete, valid

def scan(root: Path) -> list[tuple[int, Path]]:
    """Step folders (not the set-aside ones), newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := STEP_DIR.match(p.name)) and not m.group(2) and p.is_dir()]
    return sorted(found, reverse=True)


def check(d: Path, share: tuple[int, int] = (0, 1)) -> tuple[str | None, dict]:
    """(problem or None, {file: {bytes, crc32}} of the markers looked at). Cheap: markers and file
    sizes only. share (i, n): only the markers of ranks i, i+n, i+2n, ... and the files they list.
    On resume every rank takes its own 1/world share and the ranks then agree: at 4096 ranks each
    rank reads rank 0's marker and its own, not all 4096 (16M marker reads of the shared file system
    if every rank read every marker)."""
    try:
        world = read_marker(d / marker_name(0))["world"]
    except FileNotFoundError:
        return "no completion marker from rank 0: the save was interrupted", {}
    except (ValueError, OSError) as e:
        return f"rank 0's completion marker is damaged ({e})", {}
    ranks = range(share[0], world, share[1])
    missing = [r for r in ranks if not (d / marker_name(r)).exists()]
    if missing:
        return (f"incomplete: no completion marker from rank(s) {missing[:8]} of {world}: "
                f"the save was interrupted"), {}
    files = {}
    for r in ranks:
        try:
            m = read_marker(d / marker_name(r))
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


def verify(d: Path, files: dict) -> str | None:
    """The first file of `files` whose crc32 differs from its marker's, or None."""
    for name in sorted(files):
        if (crc := crc_of(d / name)) != files[name]["crc32"]:
            return f"{name}: crc32 {crc:08x}, its marker says {files[name]['crc32']:08x} (corrupted)"
    return None


# ----------------------------------------------------------------------------- what a run may do

class CkptDir:
    """One run's hold on its checkpoint directory (rank 0's; other ranks only write their files)."""

    def __init__(self, root: Path, say=print):
        self.root, self.say = Path(root), say
        self.lock: int | None = None                     # the flock on run.lock (claim)

    def claim(self) -> str | None:
        """Rank 0, before any work: the directory must be a directory (created if absent), writable,
        and this run's alone. An exclusive flock on <dir>/run.lock for the run's lifetime, with who
        holds it written inside. The kernel drops it when the process dies, so a killed run never
        leaves a stale lock (torchrun restarts take it again). On a shared file system flock must
        reach every node (NFSv4, Lustre mounted with -o flock, as FSx for Lustre is).
        Returns the problem, or None."""
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
        self.lock = fd
        return None

    def release(self):
        if self.lock is not None:
            os.close(self.lock)           # releases the flock
            self.lock = None

    def set_aside(self, dirs: list[Path]):
        """Rename skipped checkpoints step_N.bad<time>: a new save of step N starts in an empty folder."""
        for d in dirs:
            os.replace(d, d.with_name(f"{d.name}.bad{time.time_ns()}"))

    def wait_for_markers(self, step: int, world: int, timeout_s: float):
        """Rank 0's writer: until every rank's marker of `step` is there. Polls the file system: no
        collective in a background thread."""
        d, deadline = step_dir(self.root, step), time.monotonic() + timeout_s
        while missing := [r for r in range(world) if not (d / marker_name(r)).exists()]:
            if time.monotonic() > deadline:
                return missing
            time.sleep(0.02)
        return []

    def publish(self, step: int):
        """Point `latest` at a complete step."""
        d = step_dir(self.root, step)
        try:
            atomic_write(self.root / "latest", d.name.encode())
        except OSError as e:      # the checkpoint is complete: resume finds it by scanning, not by `latest`
            self.say(f"warning: {d.name} is complete but `latest` could not be updated ({e.strerror or e}); "
                     f"resuming finds checkpoints without it")
            (self.root / ".latest.tmp").unlink(missing_ok=True)

    def prune(self, keep: int):
        # After a good save, the half-written checkpoints set aside as step_N.bad<time> have served
        # their purpose (being looked at): they only take space.
        for p in self.root.iterdir():
            if (m := STEP_DIR.match(p.name)) and m.group(2):
                shutil.rmtree(p, ignore_errors=True)
        if keep <= 0:
            return
        complete = [s for s, d in scan(self.root) if check(d)[0] is None]
        if len(complete) <= keep:
            return
        oldest_kept = complete[keep - 1]
        for p in self.root.iterdir():
            m = STEP_DIR.match(p.name)
            if m and int(m.group(1)) < oldest_kept:
                shutil.rmtree(p, ignore_errors=True)
