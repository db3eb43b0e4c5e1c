"""The checkpoint directory's rules: what its names mean, when a step folder is complete and valid,
whose it is, and what a run may do to the folders in it (docs/checkpoints.md draws the directory).

- A step folder is complete when its manifest exists (format 1, before manifests: every rank's
  marker), and valid when every file has the size and crc32 its rank's marker records. Markers and
  manifests are written atomically, so a crash leaves at worst a missing one (interrupted); one
  that does not parse, a missing marker beside a manifest, a file of the wrong size or crc: damage.
- Resume takes the newest valid checkpoint; newer folders are renamed aside and kept.
- A run deletes only complete checkpoints of its own lineage beyond the newest --ckpt.keep, and
  refuses a directory holding what is not nanotrn's. Nothing a user has is lost or replaced.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import sys
import time
import uuid
import zlib
from pathlib import Path

from configs import ConfigError


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked (another model, another layout, a failed save)."""


STEP_DIR = re.compile(r"^step_(\d{8})(\.(?:bad|incomplete)\d*)?$")   # step_00000200, or set aside (.bad<time>)
# What nanotrn writes inside a step folder (a folder holding none of these is not ours).
OURS = re.compile(r"^(meta\.json|manifest\.json|rank\d{5}\.(done|pt)|model_tp\d+_pp\d+\.pt|"
                  r"optim_(dp\d+_)?tp\d+_pp\d+\.pt|\.tmp-rank\d{5}|\.(rank\d{5}\.done|manifest\.json)\.tmp)$")
LATEST = re.compile(r"^step_\d{8}$")
PRUNING = ".pruning"          # step_N.pruning: a folder being deleted by prune (only prune deletes it)
MANIFEST = "manifest.json"
# 1: no manifest (before issue 25); 2: manifest, lineage, "format" in meta.json and markers. Bump it
# when an old reader would misread the new one: a reader refuses a newer format by name.
FORMAT = 2
# The verdict on a step folder, ordered so that the ranks' MIN is the worst any rank saw.
NEWER, DAMAGED, INTERRUPTED, OK = 0, 1, 2, 3


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def marker_name(rank: int) -> str:
    return f"rank{rank:05d}.done"


def _read_json(path: Path, fields: dict) -> dict:
    """path's JSON object with `fields` (key: type) checked: a wrong one is a ValueError naming it
    (damage, which resume passes over), never a KeyError that would stop every restart."""
    m = json.loads(path.read_text())            # JSONDecodeError is a ValueError
    if not isinstance(m, dict):
        raise ValueError("not a JSON object")
    for key, want in fields.items():
        if not isinstance(m.get(key), want) or isinstance(m.get(key), bool):
            got = "missing" if key not in m else type(m[key]).__name__
            raise ValueError(f"{key!r} is {got}, expected {want.__name__}")
    return m


def read_marker(path: Path) -> dict:
    m = _read_json(path, {"step": int, "rank": int, "world": int, "files": dict})
    for name, rec in m["files"].items():
        if "/" in name or name.startswith(".") or not isinstance(rec, dict) or not all(
                isinstance(rec.get(k), int) for k in ("bytes", "crc32")):
            raise ValueError(f"its record of {name!r} is damaged")
    if m["world"] < 1:
        raise ValueError(f"world {m['world']}")
    if not isinstance(m.get("format", 1), int):
        raise ValueError(f"'format' is {type(m['format']).__name__}, expected int")
    return m


def read_manifest(path: Path) -> dict:
    return _read_json(path, {"format": int, "step": int, "world": int, "lineage": str})


def newer_format(d: Path, fmt: int) -> str:
    return (f"{d} was written by a newer nanotrn (checkpoint format {fmt}; this one reads formats 1 to "
            f"{FORMAT}): resume it with that nanotrn; it is left as it is")


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


try:        # the same crc32 as zlib's, 4x faster (ISA-L, with the CPU's carry-less multiply): the
    from isal.isal_zlib import crc32   # checksum no longer halves the save and verify bandwidth
except ImportError:                    # (measured on this 2-core host: zlib 770 MB/s, isal 3,300 MB/s)
    crc32 = zlib.crc32


def crc_of(path: Path) -> int:
    # A buffer of the file's size, at most 16 MB: a fresh 16 MB one per file cost 2.7 ms to zero, 11 s to
    # verify the 4096 small rank files of a 4096-rank checkpoint (checkpoint.py ls, export).
    with open(path, "rb", buffering=0) as f:
        crc, buf = 0, bytearray(max(1, min(1 << 24, os.fstat(f.fileno()).st_size)))
        while n := f.readinto(buf):
            crc = crc32(memoryview(buf)[:n], crc)
    return crc


# ----------------------------------------------------------------------------- complete, valid

def scan(root: Path) -> list[tuple[int, Path]]:
    """Step folders (not the set-aside ones), newest first. A directory this user may write into but
    not list (mode 0300, another user's): one line, the first place a run or checkpoint.py lists it."""
    root = Path(root)
    if not root.is_dir():
        return []
    try:
        found = [(int(m.group(1)), p) for p in root.iterdir()
                 if (m := STEP_DIR.match(p.name)) and not m.group(2) and p.is_dir()]
    except PermissionError as e:
        raise ConfigError(f"{root} cannot be listed by this user ({e.strerror}): checkpoints are found by listing "
                          f"it; make it readable (chmod u+rx) or give another checkpoint directory") from None
    return sorted(found, reverse=True)


def check(d: Path, share: tuple[int, int] = (0, 1)) -> tuple[int, str | None, dict]:
    """(verdict, problem or None, {file: {bytes, crc32}} of the markers looked at): the manifest,
    markers and sizes (verify() reads the files). share (i, n): only ranks i, i+n, ...'s markers:
    at 4096 ranks each rank reads rank 0's, its own and the manifest, not 16M reads in all."""
    has_manifest = (d / MANIFEST).exists()
    try:
        m0 = read_marker(d / marker_name(0))
    except FileNotFoundError:
        if has_manifest:
            return DAMAGED, "rank 0's completion marker is missing although its manifest says every rank finished", {}
        return INTERRUPTED, "no completion marker from rank 0: the save was interrupted", {}
    except (ValueError, OSError) as e:
        return DAMAGED, f"rank 0's completion marker is damaged ({e})", {}
    world, fmt = m0["world"], m0.get("format", 1)
    if fmt > FORMAT:
        return NEWER, newer_format(d, fmt), {}
    if fmt >= 2:
        try:
            man = read_manifest(d / MANIFEST)
        except FileNotFoundError:
            return INTERRUPTED, ("no manifest: rank 0 never saw every rank's completion marker (the save was "
                                 "interrupted, or a rank's marker did not arrive in time)"), {}
        except (ValueError, OSError) as e:
            return DAMAGED, f"its manifest is damaged ({e})", {}
        if (man["step"], man["world"]) != (int(d.name[5:13]), world):
            return DAMAGED, "its manifest belongs to another save", {}
    ranks = range(share[0], world, share[1])
    missing = [r for r in ranks if not (d / marker_name(r)).exists()]
    if missing and fmt >= 2:
        return DAMAGED, (f"no completion marker from rank(s) {missing[:8]} of {world}, although its manifest "
                         f"says every rank finished"), {}
    if missing:
        return INTERRUPTED, (f"incomplete: no completion marker from rank(s) {missing[:8]} of {world}: "
                             f"the save was interrupted"), {}
    files = {}
    for r in ranks:
        try:
            m = m0 if r == 0 else read_marker(d / marker_name(r))
        except (ValueError, OSError) as e:
            return DAMAGED, f"rank {r}'s completion marker is damaged ({e})", {}
        if m["step"] != int(d.name[5:13]) or m["world"] != world:
            return DAMAGED, f"rank {r}'s completion marker belongs to another save", {}
        files.update(m["files"])
    for name, rec in files.items():
        if not (d / name).exists():
            return DAMAGED, f"{name} is missing", {}
        if (size := (d / name).stat().st_size) != rec["bytes"]:
            return DAMAGED, f"{name} is {size} bytes, its marker says {rec['bytes']} (truncated or damaged)", {}
    return OK, None, files


def aside(root: Path) -> list[tuple[Path, str]]:
    """The folders a run set aside and keeps, newest step first, each with why: resume never takes them,
    but they are a user's work (`checkpoint.py ls` lists them after the step folders)."""
    found = [(p, "damaged" if m.group(2).startswith(".bad") else "interrupted") for p in Path(root).iterdir()
             if (m := STEP_DIR.match(p.name)) and m.group(2)]
    return sorted(found, reverse=True) + [(p, "moved by --ckpt.start_fresh") for p in sorted(Path(root).glob("previous_*/"))]


def interrupted(d: Path, share: tuple[int, int]) -> bool:
    """Whether resume will pass d over as a save cut short, asked on each rank before they can agree:
    rank 0's marker, the manifest and this rank's share (rank, world) of the markers (check's), a few reads a rank."""
    return check(d, share)[0] == INTERRUPTED


def is_ours(d: Path) -> bool:
    """A step-named folder nanotrn could have made: empty (a save killed between mkdirs) or with its files."""
    try:
        names = os.listdir(d)
    except OSError:                  # unreadable: not a folder a run could write into anyway
        return False
    return not names or any(map(OURS.match, names))


def verify(d: Path, files: dict) -> str | None:
    """The first file of `files` whose crc32 differs from its marker's, or None."""
    for name in sorted(files):
        if (crc := crc_of(d / name)) != files[name]["crc32"]:
            return f"{name}: crc32 {crc:08x}, its marker says {files[name]['crc32']:08x} (corrupted)"
    return None


# ----------------------------------------------------------------------------- what a run may do

class CkptDir:
    """Rank 0's hold on the run's checkpoint directory. lineage: the id in each manifest (a fresh
    start begins one, a resume continues it): the only checkpoints prune() may delete."""

    def __init__(self, root: Path, say=print, warn=None):
        self.root, self.say, self.warn = Path(root), say, warn or say
        self.lock: int | None = None                     # the flock on run.lock (claim)
        self.lineage = uuid.uuid4().hex[:16]             # a fresh start's; a resume adopts its checkpoint's

    def claim(self, resume: bool = True, start_fresh: bool = False) -> str | None:
        """Rank 0, before any work: the directory is a writable directory, and this run's alone: an
        exclusive flock on run.lock (the kernel drops it when the process dies; on a shared file
        system flock must reach every node: NFSv4, FSx for Lustre's -o flock). Returns the problem."""
        root = self.root
        if root.exists() and not root.is_dir():
            return f"--ckpt.dir {root} is a file, not a directory; remove it or give another --ckpt.dir"
        if STEP_DIR.match(root.resolve().name) and root.is_dir() and os.listdir(root) and is_ours(root):
            # (meant as "resume from this one": the run found no step folder in it and started afresh inside it)
            return (f"--ckpt.dir {root} is one checkpoint, not a checkpoint directory: give the directory that "
                    f"holds it, {root.resolve().parent} (a run resumes from its newest valid checkpoint; to resume "
                    f"from this one, copy it and that directory's tokenizer/ into a new directory, and give that)")
        if resume and root.is_dir() and not scan(root) and scan(root / "ckpt"):     # meant to resume that run
            return (f"--ckpt.dir {root} is a run's --out_dir: give its --ckpt.dir, {root / 'ckpt'}, to resume it "
                    f"(or another --ckpt.dir for a new run)")
        # what this claim creates, removed again by release() if the run leaves nothing else (a start refused)
        self.made = ([p for p in (root, *root.parents) if not p.exists()], not (root / "run.lock").exists())
        try:
            root.mkdir(parents=True, exist_ok=True)
            fd = os.open(root / "run.lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            what = {errno.EROFS: "is on a read-only file system", errno.ENOSPC: "is on a full disk",
                    errno.EACCES: "is not writable"}.get(e.errno, f"cannot be written ({e.strerror})")
            return f"--ckpt.dir {root} {what}: checkpoints could not be saved; give a writable --ckpt.dir"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):    # ENOSYS, EOPNOTSUPP, ENOLCK: no flock here,
                os.close(fd)                                         # and run.lock names a run that has ended
                return (f"cannot lock {root / 'run.lock'} ({e.strerror}): its file system does not carry flock, by "
                        f"which a run keeps a second one out of its --ckpt.dir; mount it with flock (FSx for Lustre: "
                        f"-o flock; NFS: v4, or v3 with its lock manager), or give a --ckpt.dir on a disk that has it")
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
        problem = self.foreign()
        if problem is None and not resume and start_fresh and scan(root):
            problem = self.start_fresh()
        if problem is not None:
            self.release()
        return problem

    def release(self):
        if self.lock is None:
            return
        dirs, new_lock = self.made        # a run refused before it kept anything (bad data): no trace of it
        gone = new_lock and os.listdir(self.root) == ["run.lock"]
        if gone:
            (self.root / "run.lock").unlink()       # while locked: a run starting now makes its own
        os.close(self.lock)               # releases the flock
        self.lock = None
        for d in dirs if gone else []:    # the folders claim() made, deepest first, while empty
            with contextlib.suppress(OSError):
                d.rmdir()

    def foreign(self) -> str | None:
        """What is not nanotrn's and would be replaced or written into: a `latest` that is not its
        pointer, a step-named file, a step-named folder holding none of its files, a `tokenizer`
        that is not a folder (the run keeps its tokenizer there: refused here, before it loads)."""
        tok = self.root / "tokenizer"
        if os.path.lexists(tok) and not tok.is_dir():
            return (f"{tok} is {'a link to nothing' if tok.is_symlink() else 'a file'}, not a folder: a run keeps "
                    f"its tokenizer in that folder for `checkpoint.py export`. Move it out of the checkpoint "
                    f"directory, or give another --ckpt.dir")
        latest, why = self.root / "latest", None
        if latest.is_symlink() or (latest.exists() and not latest.is_file()):
            why = f"a {'link' if latest.is_symlink() else 'folder'}"
        elif latest.is_file():
            try:
                text = latest.read_bytes()[:64].decode().strip()
            except PermissionError:         # (mode 0200: it said "not nanotrn's pointer", move it out)
                return (f"{latest} cannot be read by this user, so it cannot be checked, and each save replaces "
                        f"that file: fix its permissions, or give another --ckpt.dir")
            except (OSError, UnicodeDecodeError):
                text = None
            if text is None or not LATEST.match(text) or latest.stat().st_size > 64:
                why = "it should hold a name like step_00000200"
        if why:
            return (f"{latest} is not nanotrn's `latest` pointer ({why}), and each save replaces that file: move "
                    f"it out of the checkpoint directory, or give another --ckpt.dir")
        theirs = [p for p in sorted(self.root.iterdir())
                  if STEP_DIR.match(p.name) and (not p.is_dir() or p.is_symlink() or not is_ours(p))]
        if shut := [p for p in theirs if p.is_dir() and not os.access(p, os.R_OK | os.X_OK)]:   # not "none inside"
            return (f"{shut[0]} cannot be listed by this user, so it cannot be checked, and a save of that step would "
                    f"write into it: fix its permissions, or move it out of the checkpoint directory")
        if theirs and theirs[0].is_symlink():      # a checkpoint moved to another disk and linked back
            return (f"{theirs[0]} is a link (to {os.readlink(theirs[0])}), and a save or prune of that step would act "
                    f"through it: put the folder itself back in its place (remove the link, then move the folder "
                    f"there), or move the link out of the checkpoint directory")
        if theirs:          # why the first is not: a file, or no files of ours
            why = "a file" if not theirs[0].is_dir() else "no checkpoint files inside"
            return (f"{', '.join(map(str, theirs[:5]))}{' ...' if len(theirs) > 5 else ''} "
                    f"{'is' if len(theirs) == 1 else 'are'} named like a checkpoint but not nanotrn's ("
                    f"{'the first: ' * (len(theirs) > 1)}{why}): a save of that step would write into it or prune "
                    f"it. Move {'it' if len(theirs) == 1 else 'them'} out of the checkpoint directory, or give "
                    f"another --ckpt.dir")
        return None

    def start_fresh(self) -> str | None:
        """--ckpt.start_fresh: move the step folders, `latest` and the tokenizer into previous_<time>/."""
        dest = self.root / f"previous_{time.strftime('%Y%m%d-%H%M%S')}_{os.getpid()}"
        moved = [p for p in sorted(self.root.iterdir())
                 if STEP_DIR.match(p.name) or p.name in ("latest", "tokenizer")]
        try:
            dest.mkdir()
            for p in moved:
                os.replace(p, dest / p.name)
            fsync_dir(self.root)
        except OSError as e:
            return f"--ckpt.start_fresh could not move the old checkpoints into {dest}: {e}"
        self.warn(f"--ckpt.start_fresh: moved {len(moved)} entries ({', '.join(p.name for p in moved[:4])}"
                  f"{' ...' if len(moved) > 4 else ''}) into {dest}; nothing was deleted")
        return None

    def set_aside(self, dirs: list[tuple[Path, int]]) -> dict[Path, Path]:
        """Rename skipped folders aside, kept (step_N.bad<time>, step_N.incomplete<time>), so that a
        new save of step N starts in a new folder. Returns where each went."""
        where = {}
        for d, verdict in dirs:
            to = d.with_name(f"{d.name}.{'bad' if verdict == DAMAGED else 'incomplete'}{time.time_ns()}")
            os.replace(d, to)
            where[d] = to
        if dirs:
            fsync_dir(self.root)
        return where

    def write_latest(self, d: Path) -> bool:
        """`latest` names d; where it cannot be written (a full disk) that is said, not raised: resume
        finds checkpoints by scanning, and rank 0 raising here (load_latest) left the others in a barrier."""
        try:
            atomic_write(self.root / "latest", d.name.encode())
            return True
        except OSError as e:
            self.say(f"warning: {d.name} is complete but `latest` could not be updated ({e.strerror or e}); "
                     f"resuming finds checkpoints without it")
            (self.root / ".latest.tmp").unlink(missing_ok=True)
            return False

    def wait_for_markers(self, step: int, world: int, timeout_s: float, give_up=lambda: False) -> list[int]:
        """Rank 0's writer: the ranks whose marker of `step` is still missing after timeout_s, or at
        the first look after give_up() is true. Polls (no collective in a background thread) the
        missing ones, every 20 ms growing to 2 s: at 4096 ranks, 4096 stats and then a few per second."""
        d, deadline, pause = step_dir(self.root, step), time.monotonic() + timeout_s, 0.02
        missing = list(range(world))
        while missing := [r for r in missing if not (d / marker_name(r)).exists()]:
            if time.monotonic() > deadline or give_up():
                return missing
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())) or 0.001)
            pause = min(2.0, pause * 1.5)
        return []

    def complete(self, step: int, world: int):
        """Rank 0, once every marker of `step` is there: its manifest (complete), then `latest`."""
        d = step_dir(self.root, step)
        manifest = {"format": FORMAT, "step": step, "world": world, "lineage": self.lineage,
                    "by": f"pid {os.getpid()} on {socket.gethostname()}", "time": time.time()}
        atomic_write(d / MANIFEST, json.dumps(manifest, indent=1).encode())
        self.write_latest(d)

    def prune(self, keep: int):
        """Delete this lineage's complete checkpoints beyond the newest `keep` (one manifest read
        per folder); never a folder without a manifest of this lineage (but what a prune cut short left)."""
        if keep <= 0:
            return
        ours = []
        for _, d in scan(self.root):
            try:
                if read_manifest(d / MANIFEST)["lineage"] == self.lineage:
                    ours.append(d)
            except (OSError, ValueError):
                continue
        for d in ours[keep:]:
            theirs = [p.name for p in d.iterdir() if not OURS.match(p.name)]
            if theirs:          # a user's file put inside (notes, an eval): the whole folder stays
                self.say(f"not pruning {d.name}: it holds files nanotrn did not write ({', '.join(theirs[:3])}); "
                         f"delete it yourself when you no longer need them")
                continue
            # Renamed first: a crash mid-delete leaves step_N.pruning, never a step folder with files missing
            # (kept forever as interrupted: no manifest), and the next prune finishes it.
            try:
                os.replace(d, d.with_name(d.name + PRUNING))
                fsync_dir(self.root)
            except OSError:
                continue
        for p in self.root.glob("step_*" + PRUNING):
            if LATEST.match(p.name[:-len(PRUNING)]):
                shutil.rmtree(p, ignore_errors=True)
