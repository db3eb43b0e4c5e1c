"""Sources: which files a --data spec names, and the documents of one file read by index.

A rank reads only its own spans' documents and holds nothing per document: where a file's documents lie (a .jsonl
file's line ends, an Arrow file's record batches) is an offsets index built once per file and node in the cache and
memory-mapped by every rank, so the page cache holds it once (docs/data.md: memory at 1e9 documents).
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import glob
import hashlib
import json
import os
import pathlib
import re
import shlex
import socket
import sys
import sysconfig
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from configs import ConfigError, path_kind

# JSON lines, also compressed as public corpora ship them (C4, Dolma: .json.gz; the Pile: .jsonl.zst), and .json: a
# decompressed .json.gz. A directory's .json files are its metadata (dataset_infos.json, a model's config.json), so a
# .json is read only when named, alone or by a glob (dataset_files). gzip, zstd and Parquet allow no cheap random
# access: training reads them through an Arrow copy made once per node (prepare.cached).
COMPRESSED = (".gz", ".zst")
JSON_LINES = (".jsonl", ".json", ".jsonl.gz", ".jsonl.zst", ".json.gz", ".json.zst")
SUFFIXES = (".txt", ".md", ".rst", ".py", ".arrow", ".parquet", ".txt.gz", ".txt.zst") + JSON_LINES
STRUCTURED = (".arrow", ".parquet") + JSON_LINES
# datasets' SPLIT_KEYWORDS: a word of a data file's or folder's name -> the split it names
SPLITS = {"train": "train", "training": "train", "validation": "validation", "valid": "validation", "val": "validation",
          "dev": "validation", "test": "test", "testing": "test", "eval": "test", "evaluation": "test"}
INDEX_VERSION = {"lines": 2, "batches": 2}      # per kind of offsets index: a change rebuilds that kind
BATCHES = 4     # Arrow record batches a reader keeps open (reads come grouped by batch): ~1 KB each
PROGRESS_DELAY = 2.0        # seconds a build runs before its progress bar shows
BOM = b"\xef\xbb\xbf"         # UTF-8 byte order mark: Windows tools open files with it; RFC 8259 lets it be ignored
UTF16 = (b"\xff\xfe", b"\xfe\xff")     # UTF-16's byte order marks (Notepad's "Unicode"): LE, BE
NUL_PROBE = 4096            # first bytes of a file looked at for the NULs of UTF-16/32 without a mark


class DataError(ConfigError):
    """Data that cannot be used as given. Raised before training starts, naming the fix."""


# ----------------------------------------------------------------------------- which files

def stdlib_files() -> list[str]:
    """The embedded corpus: every .py file of the running interpreter's standard library."""
    out = []
    for d, dirs, files in os.walk(sysconfig.get_paths()["stdlib"]):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "dist-packages", "__pycache__"))
        out += [os.path.join(d, f) for f in sorted(files) if f.endswith(".py")]
    return out


def dataset_files(folder: str, split: str = "train", left_out: list | None = None,
                  split_flag: str = "--data.split") -> list[str]:
    """A directory's documents' files: a Hugging Face dataset as `datasets` reads it (`split`'s files only, never its
    card or scripts), else every text file, recursively; hidden entries never (docs/data.md). `left_out` gets skipped
    files a user may have meant as data (.json, a type not read), said at start. Refusals name `split_flag`."""
    marker = os.path.join(folder, "dataset_dict.json")
    if os.path.isfile(marker):
        splits = json.loads(pathlib.Path(marker).read_text()).get("splits", [])
        named = [s for s in splits if s == split] or [s for s in splits if SPLITS.get(s, s) == SPLITS.get(split, split)]
        if len(named) != 1:     # 'val' names a 'validation' split, as a data file's name (docs/data.md)
            raise DataError(f"{folder} is a DatasetDict with splits {', '.join(splits)}, not {split!r}; "
                            f"choose one with {split_flag}")
        return dataset_files(os.path.join(folder, named[0]), split, left_out, split_flag)
    state = os.path.join(folder, "state.json")
    if os.path.isfile(state):       # one saved Dataset: the split it records (or its DatasetDict's), else all 'train'
        state = json.loads(pathlib.Path(state).read_text())
        dict_split = os.path.isfile(os.path.join(folder, os.pardir, "dataset_dict.json")) and os.path.basename(folder)
        only_split(folder, split, split_flag, dict_split or state.get("_split"))     # the dict's key names it
        named = [os.path.join(folder, d["filename"]) for d in state.get("_data_files", [])]
        return named or sorted(glob.glob(os.path.join(folder, "*.arrow")))
    if len(configs := repo_configs(folder)) > 1:      # read one at a time, as datasets does (its default alone)
        name, pats, split = next(((n, f) for n, f, default in configs if default), (None, None)) + (SPLITS.get(split, split),)
        if name is None:
            names, pats = ", ".join(n for n, _, _ in configs), next((f[split] for _, f, _ in configs if split in f), [])
            raise DataError(f"{folder} is a dataset repository of {len(configs)} configs ({names}: its README.md), read "
                            f"one at a time as `datasets` does: give its files, e.g. '{','.join(os.path.join(folder, x) for x in pats)}'")
        if split not in pats:
            raise DataError(f"{folder}'s default config {name} has the splits {', '.join(pats)}, not {split!r}; choose one with {split_flag}")
        return sorted({p for x in pats[split] for p in glob.glob(os.path.join(folder, x), recursive=True) if os.path.isfile(p)})
    def unlisted(e):    # os.walk passes over a folder (the top, a subfolder) it cannot list without a word
        raise DataError(f"{e.filename} cannot be listed by this user: fix its permissions or leave it out")
    files, walked = [], set()
    for d, dirs, fs in os.walk(folder, onerror=unlisted, followlinks=True):     # a folder linked in is data too (the
        walked.add(os.path.realpath(d))             # glob ** reads it); a link loop or a second link to a folder: once
        dirs[:] = sorted(x for x in dirs if not x.startswith(".") and os.path.realpath(os.path.join(d, x)) not in walked)
        files += [os.path.join(d, f) for f in sorted(fs) if not f.startswith(".")]
    if left_out is not None:
        left_out += [p for p in files if not p.endswith(SUFFIXES) or p.endswith(".json")]
    files = [p for p in files if not p.endswith(".json")]
    def split_of(p):    # a split's word in a name, between datasets' NON_WORDS_CHARS (C4's c4-validation.0.json.gz)
        for part in os.path.relpath(p, folder).lower().split(os.sep):
            for word, name in SPLITS.items():
                if re.fullmatch(rf"(.*[-._ 0-9])?{word}([-._ 0-9].*)?", part):
                    return name
        return None
    found, want = {p: split_of(p) for p in files if p.endswith(STRUCTURED)}, SPLITS.get(split, split)
    only_split(folder, split, split_flag, want if any(found.values()) else None)
    if not found:
        return [p for p in files if p.endswith(SUFFIXES)]
    read, card = STRUCTURED + (".txt", ".txt.gz", ".txt.zst"), ("README", "LICENSE", "CHANGELOG")    # text, compressed too
    texts = [p for p in files if not os.path.basename(p).upper().startswith(card)]     # a dataset's card aside
    data_files = [p for p in texts if p.endswith(read)]
    if left_out is not None:    # its .md/.rst/.py: left out, and said so at start (they were dropped in silence)
        left_out += [p for p in texts if p.endswith(SUFFIXES) and not p.endswith(read)]
    if any(found.values()):
        if want not in found.values():
            raise DataError(f"{folder} holds the splits {', '.join(sorted(set(filter(None, found.values()))))}, "
                            f"not {split!r}; choose one with {split_flag}")
        data_files = [p for p in data_files if found.get(p, want) == want]
    return data_files


def only_split(folder: str, split: str, split_flag: str, had: str | None = None) -> None:
    """A folder that names no split (had None) is 'train' whole: another split asked of it would read the same data."""
    if SPLITS.get(split, split) not in ("train", SPLITS.get(had or "train", had)):
        raise DataError(f"{folder} names no {split!r} split (all of it is {had or 'train'!r}): {split_flag}={split} "
                        f"would read the same data; leave {split_flag} at its default or give the {split} data's own files")


def repo_configs(folder: str) -> list[tuple[str, dict[str, list[str]], bool]]:
    """A dataset repository's configs in its README.md's YAML header: (name, split -> patterns, default) each."""
    import yaml
    try:
        with open(os.path.join(folder, "README.md"), encoding="utf-8", errors="replace") as f:
            m = re.match(r"---[ \t]*\r?\n(.*?)\r?\n---", f.read(1 << 20), re.S)
        meta = yaml.safe_load(m[1]) if m else None
    except (OSError, yaml.YAMLError):
        return []
    out = []
    for c in [c for c in (meta.get("configs") or [] if isinstance(meta, dict) else []) if isinstance(c, dict)]:
        files = c.get("data_files") or []       # a pattern, patterns (train), {split: ...} or [{split, path}]
        if isinstance(files, str) or (isinstance(files, list) and files and isinstance(files[0], str)):
            files = {"train": files}
        files = [{"split": k, "path": v} for k, v in files.items()] if isinstance(files, dict) else files
        splits = {}
        for f in (f for f in files if isinstance(f, dict) and f.get("path")):
            splits.setdefault(SPLITS.get(f.get("split", "train"), f.get("split", "train")), []).extend(
                [f["path"]] if isinstance(f["path"], str) else f["path"])
        out.append((str(c.get("config_name", "default")), splits, bool(c.get("default"))))
    return out


def resolve_paths(spec: str, split: str = "train", left_out: list | None = None,
                  split_flag: str = "--data.split") -> list[str]:
    """'stdlib', files, directories and globs, comma-separated -> readable files, each once (and the
    directories' files left out, into `left_out`: dataset_files, whose refusals name `split_flag`)."""
    paths = []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        if entry == "stdlib":
            found = stdlib_files()
        elif os.path.isdir(entry):
            found = dataset_files(entry, split, left_out, split_flag)
        elif any(c in entry for c in "*?["):
            found = sorted(p for p in glob.glob(entry, recursive=True) if os.path.isfile(p))
        elif (kind := path_kind(entry)) == "a file":
            found = [entry]
        elif kind == "nothing":
            raise DataError(f"data source {entry!r} does not exist (give files, directories, globs or 'stdlib')")
        else:
            raise DataError(f"data source {entry!r} is {kind}, not a file or a directory: give files, "
                            f"directories, globs or 'stdlib'")
        if not found:
            json_in = os.path.isdir(entry) and any(f.endswith(".json") for _, _, fs in os.walk(entry) for f in fs)
            raise DataError(f"{entry!r} holds no {'/'.join(SUFFIXES)} files" + (f" (a folder's .json files are "
                            f"read only when named: give {entry.rstrip('/')}/*.json)" if json_in else ""))
        paths += found
    for p in paths:
        if not p.endswith(SUFFIXES):
            raise DataError(f"{p}: unsupported file type; use one of {', '.join(SUFFIXES)} "
                            f"(convert it to JSON lines or text first)")
        if not os.access(p, os.R_OK):
            if os.path.islink(p) and not os.path.exists(p):     # a folder's (a named one: path_kind above)
                raise DataError(f"{p} is {path_kind(p)}: fix the link or remove it")
            raise DataError(f"{p} is not readable by this user: fix its permissions or leave it out")
    seen = set()        # one realpath a file: on a shared file system a metadata request per path component and rank
    return [p for p, real in zip(paths, map(os.path.realpath, paths)) if not (real in seen or seen.add(real))]


def not_utf16(head: bytes, path: str) -> bytes:
    """`head` (a file's first bytes, in its reader's hand anyway), or a DataError if it opens a UTF-16/32 file (its
    ASCII is valid UTF-8 with NULs between, trained on as garbage; without a byte order mark: over 1/4 NULs in its
    first NUL_PROBE bytes, UTF-8 text holds none, a .jsonl may not) or a binary one (NULs at every position of four).
    Cost: ~1-2 us a file (a 4 KiB copy, a memchr) when first read: at 1e9 one-document files ~30 min of CPU a run."""
    probe = bytes(head[:NUL_PROBE])
    bom = probe[:2] in UTF16
    if bom or (probe.find(0) >= 0 and probe.count(0) * 4 > len(probe)):     # find: memchr, ~1 us
        if not bom and min(per := [probe[r::4].count(0) for r in range(4)]) * 20 > sum(per):   # UTF-16/32: a NUL-free position
            raise DataError(f"{path} is not text: {sum(per):,} of its first {len(probe):,} bytes are NUL, at every "
                            f"position of four (binary: an executable, an image, an archive); leave it out")
        name, ext = os.path.splitext(path)
        if tool := {".gz": "gzip", ".zst": "zstd"}.get(ext):      # iconv must read the text, not the compressed bytes
            name, inner = os.path.splitext(name)
            ext = inner + ext
        fix = (f"{tool} -dc {path} | iconv -f UTF-16 -t UTF-8 | {tool} > {name}.utf8{ext}" if tool else
               f"iconv -f UTF-16 -t UTF-8 {path} > {name}.utf8{ext}")
        what = ("UTF-16 text (it opens with a UTF-16 byte order mark)" if bom else f"UTF-16 or UTF-32 text without a "
                f"byte order mark ({probe.count(0):,} of its first {len(probe):,} bytes are NUL)")
        raise DataError(f"{path} is {what}, not UTF-8: convert it to UTF-8 (e.g. {fix}; -f UTF-32 for UTF-32) or leave it out")
    return head


def decode(raw: bytes) -> tuple[str, int]:
    """(text, invalid UTF-8 sequences replaced by U+FFFD)."""
    try:
        return raw.decode("utf-8"), 0
    except UnicodeDecodeError:
        text = raw.decode("utf-8", "replace")
        return text, text.count("\ufffd") - raw.count(b"\xef\xbf\xbd")


def no_surrogates(text: str) -> tuple[str, int]:
    """A JSON string's lone surrogates ("\\udc80" escapes: not encodable) replaced by U+FFFD, and how many."""
    try:
        text.encode("utf-8")
        return text, 0
    except UnicodeEncodeError:
        fixed = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        return fixed, fixed.count("\ufffd") - text.count("\ufffd")


# ----------------------------------------------------------------------------- offsets indexes

def temporary(path: str, kind: str = "tmp", pid: int | str | None = None) -> str:
    """PATH.tmp-HOST-PID: where a process writes `path` until complete, then renamed. A rerun removes a killed one's
    by its name, this host's only: on a file system several hosts write (FSx, NFS), another's pid means nothing here."""
    return f"{path}.{kind}-{socket.gethostname()}-{os.getpid() if pid is None else pid}"


def build_once(path: str, build, stale=None) -> None:
    """Make the cache file `path` once per node: every rank calls this at once, the first to get the lock runs
    build(tmp), renamed into place (never half-written), the others wait and find it. stale(path): True = built again."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(path) or (stale and stale(path)):
            mine = temporary(path, pid="")      # with the lock held, none is live here: killed ones (PID, PID.model/.vocab)
            for old in [p for p in glob.glob(glob.escape(mine) + "*") if re.fullmatch(r"\d+(\.[a-z]+)?", p[len(mine):])]:
                os.remove(old)
            tmp = temporary(path)
            try:
                build(tmp)
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
            give_back_heap()


def offsets_file(path: str, kind: str, cache_dir: str, write) -> np.ndarray:
    """The int64 offsets index of `path`, memory-mapped: write(path, f) streams it, once per node.
    Keyed by the file's real path, size and mtime: a changed file gets a new index."""
    st = os.stat(path)
    key = hashlib.sha256(json.dumps([os.path.realpath(path), st.st_size, st.st_mtime_ns, kind,
                                     INDEX_VERSION[kind]]).encode()).hexdigest()[:16]
    out = os.path.join(cache_dir, f"{kind}-{key}.idx")

    def build(tmp):
        with open(tmp, "wb") as f:
            write(path, f)
    build_once(out, build)
    return mapped(out, np.int64)


def progress(total: int, desc: str, unit: str = "B"):
    """A tqdm bar with ETA for a long index build, on a terminal only (never in logs or tests): one a node."""
    from tqdm import tqdm

    class Bar(tqdm):
        monitor_interval = 0      # tqdm starts its monitor thread even for a disabled bar: none in a loader
    return Bar(total=total, desc=desc, unit=unit, unit_scale=True, file=sys.stderr, disable=None,
               leave=False, delay=PROGRESS_DELAY, mininterval=1.0, dynamic_ncols=True)


def mapped(path: str, dtype=np.uint8) -> np.ndarray:
    """A file as a read-only array over Arrow's memory map, which keeps no descriptor open (np.memmap keeps one:
    a folder of thousands of shards would pass the usual limit of 1,024)."""
    return np.frombuffer(map_file(path), dtype) if os.path.getsize(path) else np.zeros(0, dtype)


def map_file(path: str) -> pa.Buffer:
    """The whole file, memory-mapped by Arrow, which opens only UTF-8 names: another through its descriptor's /proc."""
    try:
        return pa.memory_map(path, "r").read_buffer()
    except UnicodeEncodeError:
        fd = os.open(path, os.O_RDONLY)
        try:
            return pa.memory_map(f"/proc/self/fd/{fd}", "r").read_buffer()
        except FileNotFoundError:               # no /proc (not Linux)
            raise DataError(f"{path!r}: its name is not UTF-8, which Arrow cannot open; rename it") from None
        finally:
            os.close(fd)


def give_back_heap() -> None:
    """Hand the heap pages an index build freed back to the OS: glibc keeps them, and the rank that
    built an index kept ~30 MB more than one that found it built (1M documents: 333 -> 299 MB RssAnon)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def array_to_lines(path: str) -> str:
    """The shell line that writes a file of one JSON array as JSON lines, into a file not there yet: never the
    input (`jq ... a.jsonl > a.jsonl` empties a.jsonl before jq reads it) nor a file of the user's; jq reads
    no .gz or .zst, so those are decompressed first."""
    base = path[:-len(next((s for s in JSON_LINES if path.endswith(s)), ""))] or path
    out, i = base + ".jsonl", 0
    while os.path.exists(out):
        i += 1
        out = f"{base}.{i}.jsonl"
    q = shlex.quote
    unpack = {".gz": "gzip -dc", ".zst": "zstd -dc"}.get(os.path.splitext(path)[1])
    return (f"{unpack} {q(path)} | jq -c '.[]'" if unpack else f"jq -c '.[]' {q(path)}") + f" > {q(out)}"


class Source:
    """n documents; read(ids) -> bytes (None: a null) each; lengths(lo, hi) -> their sizes unread;
    read_range(i, start, stop) -> a slice of one (stop -1: to its end); where(i) names one."""
    jsonl, n = False, 0

    def where(self, i):
        return f"{self.path}[{i}]"

    def check_heads(self, lo, hi):              # what a read would refuse, said before the first step
        pass

    def _check_first_record(self, lines=None):
        """JSON lines: a wrong file or field shows on the first record (of lines, (number, bytes), if given): now."""
        lines = ((j, t) for j, t in lines or ((j, self.read([j])[0]) for j in range(self.n)) if t.strip())
        if (first := next(lines, None)) is None:
            return
        i, line = first[0], first[1].decode("utf-8", "replace")
        try:
            rec, bad = json.loads(line), ""
        except json.JSONDecodeError as e:
            rec, bad = None, f"not JSON ({e.msg})"
        if line.lstrip().startswith("[") and (bad or next(lines, None) is None):    # pretty-printed, or one line
            raise DataError(f"{self.path} holds one JSON array, not JSON lines (one object a line): convert it, "
                            f"e.g. {array_to_lines(self.path)}")
        if bad or not isinstance(rec, dict):
            raise DataError(f"{self.path}:{i + 1}: {bad or 'a JSON ' + type(rec).__name__}: each line must be one "
                            f"JSON object")
        if self.field not in rec:
            raise DataError(f"{self.path}:{i + 1}: no text field {self.field!r}; the record has {sorted(rec)}: set "
                            f"{self.field_flag} to the one holding the text")


class FileDocs(Source):
    """One document per file (.txt, .md, .py): the stdlib corpus is 1,800 of these."""

    def __init__(self, paths: list[str]):
        self.paths, self.n = paths, len(paths)

    def read(self, ids):        # a file is opened only when read (checked again then: it may have changed)
        return [not_utf16(pathlib.Path(self.paths[i]).read_bytes(), self.paths[i]) for i in ids]

    def check_heads(self, lo, hi):
        """Files lo..hi-1 opened and their first bytes checked (not_utf16) by the span index build, once
        per corpus and node: a lane reads a file only when its span comes, possibly hours into a run.
        Cost: an open and a 4 KiB read, ~30 us a file (1e6 files: ~30 s, beside the build's stats)."""
        for p in self.paths[lo:hi]:
            with open(p, "rb") as f:
                not_utf16(f.read(NUL_PROBE), p)

    def lengths(self, lo, hi):
        return np.array([os.path.getsize(p) for p in self.paths[lo:hi]], np.int64)

    def read_range(self, i, start, stop):
        with open(self.paths[i], "rb") as f:
            f.seek(start)
            raw = f.read(stop - start if stop >= 0 else -1)
        return not_utf16(raw, self.paths[i]) if start == 0 else raw

    def where(self, i):
        return self.paths[i]


class LineDocs(Source):
    """One document per line: .txt with doc_per_line, and .jsonl (parsed by the Corpus). The index holds -1 (2 after
    a UTF-8 byte order mark), then where each line ends: line i is bytes bounds[i] + 1 .. bounds[i + 1] of the file."""

    def __init__(self, path: str, jsonl: bool, field: str, cache_dir: str = ".cache", field_flag: str = "--data.text_field"):
        self.path, self.jsonl, self.field, self.field_flag = path, jsonl, field, field_flag
        self.text = mapped(path)                           # the file's bytes, memory-mapped
        not_utf16(self.text[:NUL_PROBE], path)             # before its newlines are indexed
        if jsonl:       # from its first lines: a wrong --data.text_field on 10 GB refused before they are indexed
            self._check_first_record(self.heads())
        self.bounds = offsets_file(path, "lines", cache_dir, self.scan)
        self.n = len(self.bounds) - 1

    def heads(self):        # the file's lines from its start, (number, bytes) as read() gives them: no index
        with open(self.path, "rb") as f:
            f.seek(3 if f.read(3) == BOM else 0)
            yield from ((i, line.rstrip(b"\n").rstrip(b"\r")) for i, line in enumerate(f))

    @staticmethod
    def scan(path, f, block: int = 1 << 22):
        """Every newline, found with numpy 4 MiB at a time (held: the block, 8 bytes a newline of it)."""
        size, last = os.path.getsize(path), -1
        with open(path, "rb") as src, progress(size, f"[data] indexing {os.path.basename(path)}") as bar:
            f.write(np.int64(2 if src.read(3) == BOM else -1).tobytes())    # a BOM is not line 1's text
            src.seek(0)
            for s in range(0, size, block):
                ends = np.flatnonzero(np.frombuffer(src.read(block), np.uint8) == 10).astype(np.int64) + s
                f.write(ends.tobytes())
                last = int(ends[-1]) if len(ends) else last
                bar.update(min(block, size - s))
        if size and last != size - 1:
            f.write(np.int64(size).tobytes())             # a last line without a newline

    def read(self, ids):
        return [self.text[int(self.bounds[i]) + 1:int(self.bounds[i + 1])].tobytes().rstrip(b"\r") for i in ids]

    def lengths(self, lo, hi):                          # of the line (.jsonl: the record, not its text)
        return np.asarray(np.diff(self.bounds[lo:hi + 1]) - 1)

    def read_range(self, i, start, stop):               # .txt lines only (a .jsonl record is parsed whole)
        first = int(self.bounds[i]) + 1
        end = int(self.bounds[i + 1]) if stop < 0 else first + stop
        raw = self.text[first + start:end].tobytes()
        return raw.rstrip(b"\r") if stop < 0 else raw

    def where(self, i):
        return f"{self.path}:{i + 1}"


class ColumnDocs(Source):
    """A text column of an Arrow IPC file (stream or file format), memory-mapped. The batch index holds every batch's
    first row, then where its message and its column's offsets, bytes and validity bitmap lie: a document is two
    lookups into the map, no Arrow call (opening a batch costs ~18 us). A compressed batch is opened by Arrow (the last
    BATCHES kept); a schema with dictionary columns (never written by prepare or datasets) is read whole."""

    def __init__(self, path: str, field: str, cache_dir: str = ".cache", field_flag: str = "--data.text_field"):
        self.path, self.field, self.table, self.field_flag = path, field, None, field_flag
        try:
            self.map = map_file(path)                           # the whole file, zero-copy
            self.first = 8 if self.map.size >= 8 and self.map[:6].to_pybytes() == b"ARROW1" else 0
            self.schema = pa.ipc.read_schema(pa.ipc.read_message(self.map.slice(self.first)))
            self.wide = pa.types.is_large_binary(text_column(self.schema.empty_table(), field, path, field_flag).type)
            self.column, self.bytes = self.schema.get_field_index(field), np.frombuffer(self.map, np.uint8)
            if any(pa.types.is_dictionary(f.type) for f in self.schema):
                reader = pa.ipc.open_file if self.first else pa.ipc.open_stream
                self.table = text_column(reader(self.map).read_all(), field, path, field_flag)
                self.starts = np.cumsum([0] + [len(c) for c in self.table.chunks])
            else:
                index = offsets_file(path, "batches", cache_dir, self.scan)
                nb = (len(index) - 1) // 5
                self.starts, self.layout = index[:nb + 1], index[nb + 1:].reshape(nb, 4)
        except (pa.ArrowException, OSError, EOFError) as e:   # random bytes: ArrowInvalid; truncated: OSError
            raise DataError(f"{path}: not a valid {os.path.splitext(path)[1]} file ({str(e).splitlines()[0]}); "
                            f"write it again from its sources (python data.py prepare SRC... --out {os.path.basename(path)}) "
                            f"or leave it out of --data") from None
        self.n = int(self.starts[-1])
        self.batch = functools.lru_cache(BATCHES)(self._batch)

    def scan(self, path, f):
        """The batch index: every batch's first row and the total, then each batch's layout (4 numbers),
        from the headers only; the layouts through a temporary file (bounded memory)."""
        reader, rows, firsts, offs = pa.BufferReader(self.map), 0, [0], []
        reader.seek(self.first)
        bar = progress(self.map.size, f"[data] indexing {os.path.basename(path)}")
        with tempfile.TemporaryFile(dir=os.path.dirname(f.name)) as tail, bar:
            while True:
                pos = reader.tell()
                try:
                    msg = pa.ipc.read_message(reader)
                except EOFError:                                  # the end-of-stream marker, or the end
                    break
                if msg.type == "record batch":
                    batch = pa.ipc.read_record_batch(msg, self.schema)
                    rows += batch.num_rows
                    firsts.append(rows)
                    offs += [pos, *self.where_column(batch.column(self.column))]
                if len(offs) >= 1 << 16:
                    bar.update(reader.tell() - bar.n)
                    f.write(np.asarray(firsts, np.int64).tobytes())
                    tail.write(np.asarray(offs, np.int64).tobytes())
                    firsts, offs = [], []
            f.write(np.asarray(firsts, np.int64).tobytes())
            tail.write(np.asarray(offs, np.int64).tobytes())
            tail.seek(0)
            while chunk := tail.read(1 << 24):
                f.write(chunk)

    def where_column(self, col: pa.Array) -> tuple[int, int, int]:
        """Where a batch's text column lies in the file: offsets, bytes (0: empty), validity bitmap (-1:
        no nulls); (-1, 0, 0) where it is no view of the file (compressed) or starts mid-buffer."""
        base, size = self.map.address, self.map.size
        def at(buf):
            if buf is None or buf.size == 0:
                return 0
            return buf.address - base if base <= buf.address and buf.address + buf.size <= base + size else None
        valid, offsets, data = col.buffers()
        spots = (at(offsets), at(data), at(valid) if col.null_count else -1)
        return (-1, 0, 0) if None in spots or col.offset or (len(col) and offsets is None) else spots

    def _batch(self, c: int) -> pa.Array:
        """The text of record batch c as bytes (a view into the map)."""
        if self.table is not None:
            return self.table.chunk(c)
        msg = pa.ipc.read_message(self.map.slice(int(self.layout[c, 0])))
        col = pa.ipc.read_record_batch(msg, self.schema).column(self.column)
        return col.view(pa.large_binary() if self.wide else pa.binary())

    def _find(self, i) -> tuple[int, int]:
        c = int(np.searchsorted(self.starts, np.int64(i), "right") - 1)
        return c, int(i - self.starts[c])

    def spots(self, ids, c):
        """Documents ids (in batches c) in the map: first byte, end byte, not null."""
        lay, j = self.layout[c], ids - self.starts[c]
        w = 8 if self.wide else 4
        at = (lay[:, 1] + j * w)[:, None] + np.arange(2 * w)                 # offsets j and j + 1
        offs = self.bytes[at.ravel()].view("<i8" if self.wide else "<i4").reshape(-1, 2)
        bits = self.bytes[np.where(lay[:, 3] >= 0, lay[:, 3] + j // 8, 0)] >> (j % 8) & 1
        return lay[:, 2] + offs[:, 0], lay[:, 2] + offs[:, 1], (lay[:, 3] < 0) | (bits == 1)

    def direct(self, c) -> bool:                        # batches c read from the map (not compressed)
        return self.table is None and len(c) > 0 and bool((self.layout[c, 1] >= 0).all())

    def read(self, ids):
        ids = np.asarray(ids, np.int64)
        which = np.searchsorted(self.starts, ids, "right") - 1
        if self.direct(which):
            m = memoryview(self.bytes)                  # a memoryview's slice: ~3x cheaper than an array's
            return [m[a:b].tobytes() if ok else None for a, b, ok in zip(*(x.tolist() for x in self.spots(ids, which)))]
        # Batch by batch, Arrow's take() on each (a take() on a ChunkedArray copies the whole column).
        out = [None] * len(ids)
        for c in np.unique(which):
            pick = np.flatnonzero(which == c)
            got = self.batch(int(c)).take(pa.array(ids[pick] - self.starts[c], pa.int64())).to_pylist()
            for j, v in zip(pick, got):
                out[j] = v
        return out

    def lengths(self, lo, hi):                          # from the offsets, batch by batch: no text is read
        out, i = [np.zeros(0, np.int64)], lo
        while i < hi:
            c, j = self._find(i)
            part = self.batch(c).slice(j, min(hi - i, int(self.starts[c + 1]) - i))
            out.append(pc.binary_length(part).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64))
            i += len(part)
        return np.concatenate(out)

    def read_range(self, i, start, stop):               # a slice of the mapped bytes: the row is not copied
        c, j = self._find(i)
        if self.direct(np.array([c])):
            (a,), (b,), (ok,) = self.spots(np.array([i], np.int64), np.array([c]))
            return self.bytes[a + start:b if stop < 0 else a + stop].tobytes() if ok else None
        chunk = self.batch(c)
        if chunk.null_count and not chunk[j].is_valid:
            return None
        offs = np.frombuffer(chunk.buffers()[1], np.int64 if self.wide else np.int32)[chunk.offset + j:chunk.offset + j + 2]
        end = int(offs[1]) if stop < 0 else int(offs[0]) + stop
        return chunk.buffers()[2][int(offs[0]) + start:end].to_pybytes()


class CachedDocs(ColumnDocs):
    """A compressed or Parquet file read through its Arrow copy (prepare.cached: a row per record of
    the file, its bytes): its documents named, parsed and counted as its raw reader does (LineDocs,
    FileDocs, ColumnDocs), so that a .jsonl.gz trains as its .jsonl does."""

    def __init__(self, path: str, copy: str, field: str, doc_per_line: bool, cache_dir: str = ".cache",
                 field_flag: str = "--data.text_field"):
        super().__init__(copy, "text", cache_dir)
        self.path, self.field, self.jsonl, self.field_flag = path, field, path.endswith(JSON_LINES), field_flag
        self.lines = self.jsonl or doc_per_line
        if self.jsonl:
            self._check_first_record()

    def where(self, i):                 # a Parquet file's rows as a column's; the raw reader's names else
        return (super().where(i) if self.path.endswith(".parquet") else
                f"{self.path}:{i + 1}" if self.lines else self.path)


def text_column(table: pa.Table, field: str, path: str, field_flag: str = "--data.text_field") -> pa.ChunkedArray:
    """The text column viewed as bytes (the Corpus decodes and counts bad UTF-8)."""
    if field not in table.column_names:
        raise DataError(f"{path}: no column {field!r}; its columns are {table.column_names}: set "
                        f"{field_flag} to the one holding the text")
    col = table.column(field)
    large = pa.types.is_large_string(col.type) or pa.types.is_large_binary(col.type)
    if large or pa.types.is_string(col.type) or pa.types.is_binary(col.type):     # the same offsets: a view, no copy
        return col.cast(pa.large_binary() if large else pa.binary())
    strings = ", ".join(f.name for f in table.schema if str(f.type) in ("string", "large_string")) or "none"
    raise DataError(f"{path}: column {field!r} has type {col.type}, not text: set {field_flag} to a string column "
                    f"(this file's: {strings})")
