"""Sources: the documents of one file (or of a run of whole files), read by index (corpus.Corpus
composes them into a corpus).

A rank reads only the documents of its own spans, so what it reads does not grow with the number
of ranks, and nothing it holds grows with the number of documents: where a file's documents lie
(a .jsonl file's line ends, an Arrow file's record batches) is in an offsets index written once
per file and node next to the cache (offsets_file: streamed, bounded memory, under a lock, renamed
into place) and memory-mapped by every rank of the node, so the page cache holds it once and a rank
touches only the pages of the documents it reads. At 1e9 documents a rank holds, per source file,
two memory maps, the file's and its index's (no open file; a few KB, with the last BATCHES Arrow
batches opened): nothing per document or per batch (measured: rank 0 of 32's data share after one step is
the same at 1M and 16M documents, `python bench.py data --data_part memory --data_shapes
arrow,arrow_1000,jsonl`). The node's page cache holds the indexes: 8 bytes a line of a .jsonl
corpus (8 GB at 1e9 lines), 40 bytes a record batch of an Arrow corpus (40 MB in 1,000-row
batches), besides the span index (spans.py, 24 bytes a span).
"""
from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import json
import os
import pathlib
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from configs import ConfigError

# The format of each kind of offsets index: a change rebuilds that kind's indexes only.
INDEX_VERSION = {"lines": 1, "batches": 2}
# Arrow record batches a reader keeps open (views into the map, ~1 KB of objects each). Reads come
# grouped by batch (read), in order (lengths, a long document's spans): a few suffice, and a
# folder of 4,000 shards then holds ~16 MB of them per rank.
BATCHES = 4


class DataError(ConfigError):
    """Data that cannot be used as given. Raised before training starts, naming the fix."""


def offsets_file(path: str, kind: str, cache_dir: str, write) -> np.ndarray:
    """The int64 offsets index of `path`, memory-mapped: built once per node by write(path, f), which
    streams it into f, a temporary file renamed into place (one process of a node builds under a
    lock, the others wait and map it). Keyed by the file's real path, size and mtime: a changed file
    gets a new index."""
    st = os.stat(path)
    key = hashlib.sha256(json.dumps([os.path.realpath(path), st.st_size, st.st_mtime_ns, kind,
                                     INDEX_VERSION[kind]]).encode()).hexdigest()[:16]
    out = os.path.join(cache_dir, f"{kind}-{key}.idx")
    os.makedirs(cache_dir, exist_ok=True)
    with open(out + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(out):
            tmp = f"{out}.tmp{os.getpid()}"
            try:
                with open(tmp, "wb") as f:
                    write(path, f)
                os.replace(tmp, out)
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
            give_back_heap()
    return mapped(out, np.int64)


def mapped(path: str, dtype=np.uint8) -> np.ndarray:
    """A file as a read-only array over Arrow's memory map. No file descriptor stays open (an
    np.memmap keeps one: a folder of thousands of shards would pass the usual limit of 1,024)."""
    if not os.path.getsize(path):
        return np.zeros(0, dtype)
    return np.frombuffer(pa.memory_map(path, "r").read_buffer(), dtype)


def give_back_heap() -> None:
    """Hand the heap pages an index build freed back to the OS. glibc keeps freed memory for reuse,
    and a build's transient blocks (a few MB each) land in its heap: the process that built an index
    kept ~30 MB more than one that found it built (measured at 1M documents in 1,000-row batches:
    333 -> 299 MB RssAnon after the span index), by chance of fragmentation. Not glibc: nothing to do."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


class Source:
    """n documents; read(local ids) -> raw bytes (or None) per document; lengths(lo, hi) -> their
    byte lengths without reading them; read_range(i, start, stop) -> a slice of one; where(i) names one."""
    jsonl, n = False, 0

    def where(self, i):
        return f"{self.path}[{i}]"


class FileDocs(Source):
    """One document per file (.txt, .md, .py): the stdlib corpus is 1,800 of these."""

    def __init__(self, paths: list[str]):
        self.paths, self.n = paths, len(paths)

    def read(self, ids):
        return [pathlib.Path(self.paths[i]).read_bytes() for i in ids]

    def lengths(self, lo, hi):
        return np.array([os.path.getsize(p) for p in self.paths[lo:hi]], np.int64)

    def read_range(self, i, start, stop):
        with open(self.paths[i], "rb") as f:
            f.seek(start)
            return f.read(stop - start if stop >= 0 else -1)

    def where(self, i):
        return self.paths[i]


class LineDocs(Source):
    """One document per line: .txt with doc_per_line, and .jsonl (parsed by the Corpus). The line
    index holds -1 and then where each line ends (its newline, or the file's size for a last line
    without one): line i is bytes bounds[i] + 1 .. bounds[i + 1] of the memory-mapped file."""

    def __init__(self, path: str, jsonl: bool, field: str, cache_dir: str = ".cache"):
        self.path, self.jsonl, self.field = path, jsonl, field
        self.bounds = offsets_file(path, "lines", cache_dir, self.scan)
        self.n = len(self.bounds) - 1
        self.text = mapped(path)                           # the file's bytes, memory-mapped
        if jsonl:
            self._check_first_record()

    @staticmethod
    def scan(path, f, block: int = 1 << 22):
        """Every newline, found with numpy 4 MiB at a time (held: the block, 8 bytes a newline of it)."""
        size, last = os.path.getsize(path), -1
        f.write(np.int64(-1).tobytes())
        with open(path, "rb") as src:
            for s in range(0, size, block):
                ends = np.flatnonzero(np.frombuffer(src.read(block), np.uint8) == 10).astype(np.int64) + s
                f.write(ends.tobytes())
                last = int(ends[-1]) if len(ends) else last
        if size and last != size - 1:
            f.write(np.int64(size).tobytes())             # a last line without a newline

    def _check_first_record(self):
        """A wrong file or field shows on the first record: refuse it now, not mid-training."""
        i = next((i for i in range(self.n) if self.read([i])[0].strip()), None)
        if i is None:
            return
        try:
            rec = json.loads(self.read([i])[0].decode("utf-8", "replace"))
        except json.JSONDecodeError as e:
            raise DataError(f"{self.path}:{i + 1}: not JSON ({e.msg}); each line of a .jsonl file "
                            f"must be one JSON object") from None
        if not isinstance(rec, dict) or self.field not in rec:
            raise DataError(f"{self.path}:{i + 1}: no text field {self.field!r}; the record has "
                            f"{sorted(rec) if isinstance(rec, dict) else type(rec).__name__}: set "
                            f"--data.text_field to the one holding the text")

    def read(self, ids):
        b = self.bounds
        return [self.text[int(b[i]) + 1:int(b[i + 1])].tobytes().rstrip(b"\r") for i in ids]

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
    """A text column of an Arrow IPC file (the stream format `datasets.save_to_disk` writes, or the
    file format), memory-mapped: opening a terabyte file costs nothing and only the rows read are
    paged in. The batch index (built once per file and node from the messages' headers) holds the
    first row of every batch, then per batch where its message and its text column's offsets, bytes
    and validity bitmap lie in the file: a document is read with two lookups into the map, no Arrow
    call, and a rank holds nothing per batch. (Opening a record batch costs ~18 us: with shuffled
    reads at 1e9 documents nearly every short document would need one; a table read whole held
    ~0.7 KB of private memory per batch, 0.7 GB per rank at 1e9 documents in 1,000-row batches, as
    prepare and datasets write.) A compressed body's buffers are not in the file as read: such a
    batch is opened by Arrow (the last BATCHES kept), as is a lengths() range. A schema with
    dictionary-encoded columns needs the dictionaries to open a batch: such a file (rare; never
    written by prepare or datasets) is read whole."""

    def __init__(self, path: str, field: str, cache_dir: str = ".cache"):
        self.path, self.field, self.table = path, field, None
        try:
            self.map = pa.memory_map(path, "r").read_buffer()     # the whole file, zero-copy
            self.first = 8 if self.map.size >= 8 and self.map[:6].to_pybytes() == b"ARROW1" else 0
            self.schema = pa.ipc.read_schema(pa.ipc.read_message(self.map.slice(self.first)))
            text_column(self.schema.empty_table(), field, path)             # checks name and type
            self.column, self.bytes = self.schema.get_field_index(field), np.frombuffer(self.map, np.uint8)
            self.wide = pa.types.is_large_string(self.schema.field(field).type) or pa.types.is_large_binary(self.schema.field(field).type)
            if any(pa.types.is_dictionary(f.type) for f in self.schema):
                reader = pa.ipc.open_file if self.first else pa.ipc.open_stream
                self.table = text_column(reader(pa.memory_map(path, "r")).read_all(), field, path)
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
        """The batch index: the first row of every batch and the total (n + 1 numbers), then per batch
        its layout (4 numbers). Only headers are read (the buffers are views into the map); 65,536
        batches at a time, the layouts through a temporary file (bounded memory)."""
        reader, rows, firsts, offs = pa.BufferReader(self.map), 0, [0], []
        reader.seek(self.first)
        with tempfile.TemporaryFile(dir=os.path.dirname(f.name)) as tail:
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
                    f.write(np.asarray(firsts, np.int64).tobytes())
                    tail.write(np.asarray(offs, np.int64).tobytes())
                    firsts, offs = [], []
            f.write(np.asarray(firsts, np.int64).tobytes())
            tail.write(np.asarray(offs, np.int64).tobytes())
            tail.seek(0)
            while chunk := tail.read(1 << 24):
                f.write(chunk)

    def where_column(self, col: pa.Array) -> tuple[int, int, int]:
        """Where a batch's text column lies in the file: its offsets, its bytes (0 for an empty
        buffer: nothing is read there) and its validity bitmap (-1: no nulls). (-1, 0, 0) where
        it is not a view of the file (a compressed body, decompressed elsewhere) or starts mid-buffer."""
        base, size = self.map.address, self.map.size
        def at(buf):
            if buf is None or buf.size == 0:
                return 0
            return buf.address - base if base <= buf.address and buf.address + buf.size <= base + size else None
        valid, offsets, data = col.buffers()
        spots = (at(offsets), at(data), at(valid) if col.null_count else -1)
        return (-1, 0, 0) if None in spots or col.offset or (len(col) and offsets is None) else spots

    def _batch(self, c: int) -> pa.Array:
        """The text of record batch c as bytes (a view into the map: Arrow copies nothing)."""
        if self.table is not None:
            return self.table.chunk(c)
        msg = pa.ipc.read_message(self.map.slice(int(self.layout[c, 0])))
        col = pa.ipc.read_record_batch(msg, self.schema).column(self.column)
        return col.view(pa.large_binary() if self.wide else pa.binary())

    def _find(self, i) -> tuple[int, int]:
        c = int(np.searchsorted(self.starts, np.int64(i), "right") - 1)
        return c, int(i - self.starts[c])

    def spots(self, ids, c):
        """Documents ids (in batches c) in the map: first byte, end byte, not null. Two lookups each."""
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


def text_column(table: pa.Table, field: str, path: str) -> pa.ChunkedArray:
    """The text column viewed as bytes, so the Corpus decodes (and counts bad UTF-8) in one place."""
    if field not in table.column_names:
        raise DataError(f"{path}: no column {field!r}; its columns are {table.column_names}: set "
                        f"--data.text_field to the one holding the text")
    col = table.column(field)
    if pa.types.is_string(col.type) or pa.types.is_binary(col.type):
        return col.cast(pa.binary())                    # same offsets layout: a view, no copy
    if pa.types.is_large_string(col.type) or pa.types.is_large_binary(col.type):
        return col.cast(pa.large_binary())
    raise DataError(f"{path}: column {field!r} has type {col.type}, expected string or large_string")
