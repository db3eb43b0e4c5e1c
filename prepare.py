"""Raw shards -> Arrow, the blog's offline step (and training's cache of compressed shards).

    python data.py prepare shards/*.jsonl.zst --out corpus.arrow        # everything into one file
    python data.py prepare shards/ --out prepared/ -j 16                 # one .arrow per shard

Streamed (a worker's memory is the same for a 1 MB and a 1 TB shard), shards in parallel worker
processes. The output is a `text` column of large_string in the Arrow IPC stream format, as
`datasets.save_to_disk` writes it. Bad records are named, skipped and counted (--strict: the first
is fatal); each output is written under a temporary name and renamed: nothing is half-written.
"""
from __future__ import annotations

import collections
import hashlib
import json
import multiprocessing
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from configs import check_dir, path_kind
from sources import (BOM, COMPRESSED, JSON_LINES, NUL_PROBE, SUFFIXES, DataError, build_once, decode, map_file,
                     no_surrogates, not_utf16, progress, resolve_paths, temporary, text_column)

BLOCK = 8 << 20                 # input read at a time (decompressed bytes)
BATCH_BYTES = 16 << 20          # text per output record batch
MAX_EXAMPLES = 5                # bad records named in the summary; the rest are counted
SCHEMA = pa.schema({"text": pa.large_string()})
RECIPE = "copy-v2"              # training's copies (cached): bump when what they hold changes (a new copy,
                                # and a new Corpus.fingerprint: a resume over the older copy is refused)


# ----------------------------------------------------------------------------- reading one shard

def _open(path: str):
    """(raw file, decompressed stream): progress is the raw file's position."""
    raw = pa.PythonFile(open(path, "rb"), mode="r")      # not pa.OSFile: it opens only names that are UTF-8
    codec = {".gz": "gzip", ".zst": "zstd"}.get(os.path.splitext(path)[1])
    if codec and not pa.Codec.is_available(codec):
        raise DataError(f"{path}: this pyarrow was built without {codec}; install pyarrow from PyPI")
    return raw, (pa.CompressedInputStream(raw, codec) if codec else raw)


def _lines(path: str):
    """Yield (line number, bytes, raw bytes read so far) of a possibly compressed file, BLOCK at a time."""
    raw, stream = _open(path)
    with raw, stream:
        tail, n = b"", 0
        while True:
            try:
                block = stream.read(BLOCK)
            except OSError as e:               # a truncated or corrupt gzip/zstd stream
                raise DataError(f"{path}: cannot be decompressed after line {n} ({e}); re-download it "
                                f"or leave it out") from None
            if not block:
                break
            if n == 0 and not tail:
                block = not_utf16(block, path).removeprefix(BOM)
            parts = (tail + block).split(b"\n")
            tail = parts.pop()
            pos = raw.tell()
            for line in parts:
                n += 1
                yield n, line.rstrip(b"\r"), pos
        if tail:
            yield n + 1, tail.rstrip(b"\r"), raw.tell()


def _parquet_column(path: str, field: str, flag: str = "--data.text_field"):
    """(value as bytes or None, rows read / rows) of a Parquet file's text column, 1,024 rows at a time; a
    wrong column is refused naming `flag` (training's, or prepare's --text-field)."""
    with open(path, "rb") as f:         # a file object: pq opens only names that are UTF-8
        pf = pq.ParquetFile(f)
        text_column(pf.schema_arrow.empty_table(), field, path, flag)            # checks only
        total, row = max(pf.metadata.num_rows, 1), 0
        for batch in pf.iter_batches(batch_size=1024, columns=[field]):
            for value in text_column(pa.Table.from_batches([batch]), field, path, flag).to_pylist():
                row += 1
                yield value, min(row / total, 1)


def _arrow_column(path: str, field: str, flag: str = "--data.text_field"):
    """(value as bytes or None, bytes read so far) of an Arrow IPC file's (or stream's) text column."""
    source = pa.BufferReader(map_file(path))            # map_file: names not in UTF-8 too
    if source.read(6) == b"ARROW1":
        reader = pa.ipc.open_file(source)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    else:
        source.seek(0)
        batches = pa.ipc.open_stream(source)
    for batch in batches:
        for value in text_column(pa.Table.from_batches([batch]), field, path, flag).to_pylist():
            yield value, source.tell()


def records(path: str, field: str, doc_per_line: bool):
    """Yield (where, text or None, problem or None, utf8 replacements, input bytes read so far) for
    every record of one shard, in order, streaming. `where` names the record (file:line or file[row])."""
    if path.endswith(JSON_LINES):
        for n, line, pos in _lines(path):
            if not line.strip():
                continue
            text, repl = decode(line)
            try:
                rec = json.loads(text)
                if not isinstance(rec, dict):
                    raise TypeError(f"{json_kind(rec)}, not an object")
                if field not in rec:
                    raise KeyError(f"no field {field!r} (it has {sorted(rec)[:8]}; set --text-field)")
                value = rec[field]
                if value is not None and not isinstance(value, str):
                    raise TypeError(f"field {field!r} holds {json_kind(value)}, not a string")
            except json.JSONDecodeError as e:
                yield f"{path}:{n}", None, f"not JSON ({e.msg})", repl, pos
                continue
            except (KeyError, TypeError) as e:
                yield f"{path}:{n}", None, str(e).strip('"'), repl, pos
                continue
            value, bad = no_surrogates(value or "")
            yield f"{path}:{n}", value, None, repl + bad, pos
    elif path.endswith((".arrow", ".parquet")):
        size = os.path.getsize(path)
        try:
            if path.endswith(".parquet"):
                values = ((raw, size * done) for raw, done in _parquet_column(path, field, "--text-field"))
            else:
                values = _arrow_column(path, field, "--text-field")
            for row, (raw, pos) in enumerate(values):
                text, repl = decode(raw) if raw is not None else ("", 0)
                yield f"{path}[{row}]", text, None, repl, pos
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{path}: not a valid {os.path.splitext(path)[1]} file ({str(e).splitlines()[0]}); "
                            f"leave it out") from None
    elif doc_per_line:
        for n, line, pos in _lines(path):
            text, repl = decode(line)
            yield f"{path}:{n}", text, None, repl, pos
    else:                                           # the whole file is one document
        raw, stream = _open(path)
        with raw, stream:
            try:
                text, repl = decode(not_utf16(stream.read(), path))
            except OSError as e:                    # a truncated or corrupt gzip/zstd stream
                raise DataError(f"{path}: cannot be decompressed ({e}); re-download it or leave it out") from None
        yield path, text, None, repl, os.path.getsize(path)


def check_heads(paths: list[str]) -> None:
    """Refuse a UTF-16/32 text source now (sources.not_utf16 of its first bytes, decompressed), not when its
    shard is reached after hours of converting others. Cost: an open and a 4 KiB read a file."""
    for p in (p for p in paths if not p.endswith((".arrow", ".parquet"))):     # (their text is UTF-8 by format)
        raw, stream = _open(p)
        with raw, stream:
            try:
                head = stream.read(NUL_PROBE)
            except OSError:         # a corrupt .gz/.zst: named where it is read, with the line it stops at
                continue
        not_utf16(head, p)


# ----------------------------------------------------------------------------- one shard -> one .arrow

def convert(path: str, dst: str, field: str = "text", doc_per_line: bool = False, strict: bool = False,
            report=lambda nbytes, ndocs: None) -> dict:
    """Write the documents of shard `path` to the Arrow file `dst`, streaming; report(input bytes,
    documents) about twice a second. Returns the counts and the first MAX_EXAMPLES bad records.
    dst is a temporary name, renamed by the caller once complete (prepare; build_once for the cache):
    a killed conversion leaves no half file under a final name."""
    counts, examples = collections.Counter(), []
    texts, size, done, docs, last = [], 0, 0, 0, time.monotonic()
    with pa.OSFile(dst, "wb") as sink, pa.ipc.new_stream(sink, SCHEMA) as writer:
        def flush():
            writer.write_batch(pa.record_batch([pa.array(texts, pa.large_string())], schema=SCHEMA))
            texts.clear()
        for where, text, problem, repl, pos in records(path, field, doc_per_line):
            counts["utf8_replacements"] += repl
            if problem is not None:
                if strict:
                    raise DataError(f"{where}: {problem} (--strict stops at the first bad record; without "
                                    f"it bad records are skipped and counted)")
                counts["bad_records"] += 1
                if len(examples) < MAX_EXAMPLES:
                    examples.append(f"{where}: {problem}")
            elif not text or text.isspace():
                counts["empty_docs"] += 1
            else:
                texts.append(text)
                size += len(text)
                counts["documents"] += 1
                counts["chars"] += len(text)
                docs += 1
                if size >= BATCH_BYTES:
                    flush()
                    size = 0
            if time.monotonic() - last > 0.5:
                report(int(pos) - done, docs)
                done, docs, last = int(pos), 0, time.monotonic()
        if texts:
            flush()
    report(os.path.getsize(path) - done, docs)
    return {"counts": dict(counts), "examples": examples}


# ----------------------------------------------------------------------------- many shards, in parallel

_QUEUE = None


def _init_worker(q):
    global _QUEUE
    _QUEUE = q
    signal.signal(signal.SIGINT, signal.SIG_IGN)        # Ctrl-C is the parent's to handle
    signal.signal(signal.SIGTERM, signal.SIG_DFL)       # pool.terminate() must end a worker, whatever
    # handler the parent had (a forked worker would inherit train.py's stop-at-step-boundary one)


def _work(args):
    i, path, dst, field, doc_per_line, strict = args
    return convert(path, dst, field, doc_per_line, strict, report=lambda b, d: _QUEUE.put((b, d)))


def shard_name(i: int, path: str) -> str:
    """00003-name.arrow for shard 3: sorted names keep the shards' order (dataset_files sorts)."""
    base = os.path.basename(path).encode("utf-8", "surrogateescape").decode("utf-8", "replace")    # Arrow: UTF-8 names
    for suffix in COMPRESSED + (".jsonl", ".json", ".txt", ".md", ".rst", ".py", ".arrow", ".parquet"):
        base = base.removesuffix(suffix)
    return f"{i:05d}-{base}.arrow"


def prepare(sources: list[str], out: str, text_field: str = "text", doc_per_line: bool = False,
            force: bool = False, workers: int = 0, strict: bool = False, split: str = "train") -> dict:
    """Convert every shard of `sources` (as --data names them, a dataset folder's `split`) into the one file
    `out` (*.arrow) or one file per shard in the directory `out`, in `workers` processes (0: one per core).
    Returns the counts."""
    if workers < 0:
        raise DataError(f"--workers {workers}: give a number of processes >= 1 (0: one per core)")
    from tqdm import tqdm
    if not out.strip():                 # else the working directory: one shard file per source dropped into it
        raise DataError(f"--out {out!r} is empty; give an .arrow file to write, or a directory (ending in /)")
    one = out.endswith(".arrow")
    if (kind := path_kind(out.rstrip("/") or "/")) not in ("nothing", "a file", "a directory") or \
            (one and kind == "a directory") or (not one and kind == "a file"):
        raise DataError(f"--out {out} is {kind}; give an .arrow file to write, or a directory (ending in /)")
    if not one and not (out.endswith("/") or kind == "a directory"):
        raise DataError(f"--out {out}: name the output file *.arrow (one file), or a directory ending in / "
                        f"(one .arrow per shard), so that --data finds it")
    if one and kind == "a file" and not force:
        raise DataError(f"{out} exists; pass --force to replace it")
    folder = os.path.dirname(os.path.abspath(out)) if one else os.path.abspath(out)
    check_dir("out", folder)
    paths = resolve_paths(",".join(sources), split, left_out=(left_out := []), split_flag="--split")
    if left_out:
        print("[prepare] " + left_out_line(left_out).removeprefix("data warning: "), file=sys.stderr, flush=True)
    if one and os.path.realpath(out) in {os.path.realpath(p) for p in paths}:
        raise DataError(f"--out {out} is also one of the sources")
    if not one and any(Path(p).resolve().is_relative_to(Path(folder).resolve()) for p in paths):
        raise DataError(f"--out {out} holds some of the sources; write the shards to another directory")
    inside = [d for d in ",".join(sources).split(",") if os.path.isdir(d.strip()) and
              Path(folder).resolve().is_relative_to(Path(d.strip()).resolve())]
    if inside:          # --data=that directory would then read every document twice
        raise DataError(f"--out {out} is inside the source directory {inside[0]}: write it outside, so that "
                        f"--data={inside[0]} does not read its documents twice")
    empty = [p for p in paths if os.path.getsize(p) == 0]
    paths = [p for p in paths if os.path.getsize(p) > 0]
    check_heads(paths)
    os.makedirs(folder, exist_ok=True)
    _remove_leftovers(out, one, folder)
    parts = temporary(out, "parts") if one else folder
    targets = [os.path.join(parts, shard_name(i, p)) for i, p in enumerate(paths)]
    # each shard converted under a temporary name, renamed when complete (one file: the parts folder is temporary)
    written = targets if one else [temporary(t) for t in targets]
    existed = {t for t in targets if os.path.exists(t)}
    if existed and not force:
        raise DataError(f"{sorted(existed)[0]} exists; pass --force to replace the shards already in {out}")
    first = next((p for p in paths if p.endswith(JSON_LINES)), None)
    for where, _, problem, _, _ in ([] if first is None else records(first, text_field, doc_per_line)):
        if problem is not None and problem.startswith("no field"):      # a wrong --text-field: say so now
            raise DataError(f"{where}: {problem}")
        break
    workers = max(1, min(workers or os.cpu_count() or 1, len(paths)))
    counts = collections.Counter(empty_files=len(empty))
    examples: list[str] = []
    not_text: list[str] = []            # shards skipped as a whole, said with the fix
    tmp = temporary(out)
    bar = tqdm(total=sum(map(os.path.getsize, paths)), desc="[prepare]", unit="B", unit_scale=True,
               file=sys.stderr, dynamic_ncols=True, mininterval=0.5)
    t0, ndocs, pool = time.monotonic(), 0, None

    def progress(nbytes, docs):
        nonlocal ndocs
        ndocs += docs
        bar.set_postfix_str(f"{ndocs:,} docs, {ndocs / max(time.monotonic() - t0, 1e-9):,.0f} docs/s", refresh=False)
        bar.update(nbytes)
    try:
        os.makedirs(parts, exist_ok=True)
        tasks = [(i, p, w, text_field, doc_per_line, strict) for i, (p, w) in enumerate(zip(paths, written))]
        if workers == 1:
            results = (convert(p, t, text_field, doc_per_line, strict, progress) for _, p, t, *_ in tasks)
        else:       # forkserver, not fork: a trainer or a test process has threads (torch's, Arrow's) whose
            # locks a forked child would copy held; the server forks workers from a fresh process that ran no work.
            ctx = multiprocessing.get_context("forkserver" if "forkserver" in multiprocessing.get_all_start_methods()
                                              else "spawn")
            q = ctx.SimpleQueue()   # put writes at once: a worker's last report is read before its result (a
            # Queue's feeder thread sent it later, the result could come first and the bar ended short)
            pool = ctx.Pool(workers, _init_worker, (q,))
            pending = pool.imap(_work, tasks)       # in shard order, whatever order they finish in
            results = _drain(pending, q, progress)
        writer = sink = None
        if one:
            sink = pa.OSFile(tmp, "wb")
            writer = pa.ipc.new_stream(sink, SCHEMA)
        for (i, p, w, *_), t, r in zip(tasks, targets, results):
            c = collections.Counter(r["counts"])
            if c["utf8_replacements"] > c["chars"] / 10:     # as training's sample refuses it: written, it would be
                why = (f"{p} ({c['utf8_replacements']:,} of its {c['chars']:,} characters are invalid UTF-8: binary "   # U+FFFDs:
                       f"or another encoding); convert it to UTF-8 (iconv) or leave it out")      # valid, trained on
                if strict:
                    raise DataError(f"{why} (--strict stops at the first file that is not text; without it such a "
                                    f"file is skipped and counted)")
                counts["not_text_files"] += 1
                not_text.append(why)
                os.remove(w)
                continue
            counts.update(c)
            examples += r["examples"][:MAX_EXAMPLES - len(examples)]
            if one:                                 # append the shard, then free its disk space
                with pa.memory_map(w) as src:
                    for batch in pa.ipc.open_stream(src):
                        writer.write_batch(batch)
                os.remove(w)
            else:
                os.replace(w, t)
        if one:
            writer.close()
            sink.close()
        bar.close()
        if not counts["documents"]:
            kinds = {"empty_files": "empty file{}", "empty_docs": "empty document{}", "bad_records": "bad record{}",
                     "not_text_files": "file{} not UTF-8 text"}     # what was skipped, said as counted
            said = ", ".join(f"{counts[k]:,} " + v.format("s" * (counts[k] > 1)) for k, v in kinds.items() if counts[k])
            said = "; the first: ".join([said or "no documents"] + (not_text + examples)[:1])
            raise DataError(f"{', '.join(sources)}: no document has text ({said}): nothing written to {out}; check the "
                            f"sources and --text-field")
        if one:
            os.replace(tmp, out)
    except BaseException:
        bar.close()
        if pool is not None:
            pool.terminate()                        # ends and joins the workers
            pool = None
        for t in ([] if one else set(targets) - existed | set(written)):    # the shards this run began, no others
            if os.path.exists(t):
                os.remove(t)
        raise
    finally:
        if pool is not None:
            pool.close()
            pool.join()
        if one:
            shutil.rmtree(parts, ignore_errors=True)
            if os.path.exists(tmp):
                os.remove(tmp)
    if not_text:
        print(f"[prepare] {len(not_text):,} file{'s' * (len(not_text) > 1)} skipped, not UTF-8 text: "
              + ("the first: " if len(not_text) > 1 else "") + not_text[0], file=sys.stderr)
    if counts["bad_records"]:
        n = counts["bad_records"]
        print(f"[prepare] {n:,} bad record{'s' * (n > 1)} skipped (pass --strict to stop at the first): "
              + "; ".join(examples), file=sys.stderr)
    print(f"[prepare] wrote {out}" + (f" ({len(paths) - counts['not_text_files']} shards)" if not one else "") + ": "
          + ", ".join(f"{k} {v:,}" for k, v in sorted(counts.items())), file=sys.stderr, flush=True)
    if not one and (note := _beside(out, folder, [t for t in targets if os.path.exists(t)])):
        print(f"[prepare] note: {note}", file=sys.stderr, flush=True)
    return dict(counts)


def _beside(out: str, folder: str, shards: list[str]) -> str | None:
    """What --data=out/ reads other than the shards written: a folder that held the user's files (notes.txt, a
    train.jsonl whose split name leaves the shards out) reads them too, silently."""
    try:
        read = set(map(os.path.realpath, resolve_paths(folder)))
    except DataError as e:
        return f"--data={out} is refused ({e}): give the shards as {os.path.join(folder, '*.arrow')}"
    extra, missing = sorted(read - set(map(os.path.realpath, shards))), set(map(os.path.realpath, shards)) - read
    if not extra and not missing:
        return None
    what = [f"reads {len(extra):,} file{'s' * (len(extra) > 1)} beside the shards written (the first: {extra[0]})"] * bool(extra)
    what += [f"leaves out {len(missing):,} of them (a file beside them names a split)"] * bool(missing)
    return f"--data={out} {' and '.join(what)}: move the other files out, or give the shards as {os.path.join(folder, '*.arrow')}"


def json_kind(value) -> str:
    """A JSON value's kind as JSON names it, with its article ('a int' read badly): 'a number', 'an array'."""
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(value), "null")


def left_out_line(paths: list[str]) -> str:
    """One line saying the files of a folder left out, by type: a .json is read only when named."""
    kinds = collections.Counter(os.path.splitext(p)[1] or "no extension" for p in paths)
    json_dir = next((os.path.dirname(p) for p in paths if p.endswith(".json")), None)
    return (f"data warning: {len(paths):,} files of the data folders left out ("
            + ", ".join(f"{n:,} {k}" for k, n in sorted(kinds.items())) + f"; the first: {paths[0]}): "
            + (f"a folder's .json files are read only when named (give {json_dir}/*.json to read them as JSON "
               f"lines); " if json_dir else "") + f"nanotrn reads {', '.join(SUFFIXES)}"
            + (" (a folder with .jsonl, .arrow or .parquet files: those and its .txt; give the others by name or glob)"
               if any(p.endswith(SUFFIXES) and not p.endswith(".json") for p in paths) else ""))


def _remove_leftovers(out: str, one: bool, folder: str) -> None:
    """Remove the temporaries an earlier prepare to `out` left when it was killed (SIGKILL, a lost node: no
    cleanup runs), each up to the corpus's size: OUT.parts-HOST-PID/ and OUT.tmp-HOST-PID, or a folder's
    NNNNN-x.arrow.tmp-HOST-PID (sources.temporary), of a process of this host that is gone. A live one's (a
    prepare still running) and another host's (its pid means nothing here) stay; names of ours only."""
    host = "(?:" + "|".join(re.escape(temporary("", kind, pid="")) for kind in ("parts", "tmp")) + r")(\d+)"
    pattern = re.escape(os.path.basename(out)) + host if one else r"\d{5}-.*\.arrow" + host
    gone, pids = [], set()
    for name in sorted(os.listdir(folder)):
        if (m := re.fullmatch(pattern, name)) and not _alive(int(m[1])):
            gone.append(os.path.join(folder, name))
            pids.add(int(m[1]))
    for p in gone:
        if os.path.isdir(p):
            shutil.rmtree(p)
        else:
            os.remove(p)
    if gone:
        print(f"[prepare] removed {len(gone)} temporaries of an interrupted prepare (process"
              f"{'es' * (len(pids) > 1)} {', '.join(map(str, sorted(pids)))}, gone): {gone[0]}", file=sys.stderr, flush=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)             # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:         # another user's: alive
        pass
    return True


def _drain(pending, q, progress):
    """The pool's results in order, forwarding the workers' progress reports while waiting."""
    while True:
        try:
            r = pending.next(timeout=0.2)
        except multiprocessing.TimeoutError:
            r = None
        except StopIteration:
            break
        while not q.empty():                # every report a worker put before its result
            progress(*q.get())
        if r is not None:
            yield r


# ----------------------------------------------------------------------------- training's cache

COPY = pa.schema({"text": pa.large_binary()})
COPY_ROWS = 1 << 16             # rows per record batch of a copy at most (a file of blank lines: bounded too)


def _raw_records(path: str, field: str, doc_per_line: bool, flag: str = "--data.text_field"):
    """(bytes or None, input bytes read so far) per record of a compressed or Parquet shard, as the
    reader of the raw file sees its records: every line (blank, not JSON: the Corpus parses and counts
    them), the whole file (none if it is empty, like an empty .txt), a Parquet column's values (nulls too)."""
    if path.endswith(".parquet"):
        size = os.path.getsize(path)
        try:
            for value, done in _parquet_column(path, field, flag):
                yield value, size * done
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{path}: not a valid .parquet file ({str(e).splitlines()[0]}); leave it out") from None
    elif path.endswith(JSON_LINES) or doc_per_line:
        for _, line, pos in _lines(path):
            yield line, pos
    else:
        raw, stream = _open(path)
        with raw, stream:
            try:
                body = not_utf16(stream.read(), path)
            except OSError as e:                    # a truncated or corrupt gzip/zstd stream
                raise DataError(f"{path}: cannot be decompressed ({e}); re-download it or leave it out") from None
        if body:
            yield body, os.path.getsize(path)


def copy_records(path: str, dst: str, field: str, doc_per_line: bool, report=lambda nbytes: None,
                 flag: str = "--data.text_field") -> None:
    """Training's Arrow copy of a compressed or Parquet shard: a row per record of the file, its bytes
    as they are, read by sources.CachedDocs as the raw file is read. The same documents in the same
    order (a .jsonl.gz trains as its .jsonl does: same spans, same batches), bad records and invalid
    UTF-8 counted as they are read. (convert, prepare's, drops empty documents and bad records.)"""
    rows, size, done, last = [], 0, 0, time.monotonic()
    with pa.OSFile(dst, "wb") as sink, pa.ipc.new_stream(sink, COPY) as writer:
        for value, pos in _raw_records(path, field, doc_per_line, flag):
            rows.append(value)
            size += len(value or b"")
            if size >= BATCH_BYTES or len(rows) >= COPY_ROWS:
                writer.write_batch(pa.record_batch([pa.array(rows, pa.large_binary())], schema=COPY))
                rows, size = [], 0
            if time.monotonic() - last > 0.5:
                report(int(pos) - done)
                done, last = int(pos), time.monotonic()
        if rows:
            writer.write_batch(pa.record_batch([pa.array(rows, pa.large_binary())], schema=COPY))
    report(os.path.getsize(path) - done)


def copy_path(path: str, text_field: str, doc_per_line: bool, cache_dir: str, st: os.stat_result) -> str:
    """Where cached() keeps a shard's copy: keyed by name, size, mtime (st: its os.stat) and the settings."""
    key = hashlib.sha256(json.dumps([os.path.basename(path), st.st_size, st.st_mtime_ns, text_field,
                                     doc_per_line, RECIPE]).encode()).hexdigest()[:12]
    return os.path.join(cache_dir, f"{shard_name(0, path)[6:-6]}-{key}.arrow")


def cached(path: str, text_field: str, doc_per_line: bool, cache_dir: str, flag: str = "--data.text_field") -> str:
    """The Arrow file training reads for a compressed or Parquet shard (no cheap random access): copied
    once into cache_dir (copy_path) by the process that gets the lock."""
    st = os.stat(path)
    dst = copy_path(path, text_field, doc_per_line, cache_dir, st)
    if os.path.exists(dst):
        return dst

    def build(tmp):
        print(f"[data] {path} has no cheap random access (compressed or Parquet): copying it once to {dst} "
              f"(python data.py prepare converts many shards in parallel)", file=sys.stderr, flush=True)
        with progress(st.st_size, "[data] converting") as bar:
            copy_records(path, tmp, text_field, doc_per_line, report=bar.update, flag=flag)
    build_once(dst, build)
    return dst


if __name__ == "__main__":      # a library: `python prepare.py` did nothing, silently, with exit 0
    usage = "usage: python data.py prepare SOURCES... --out OUT.arrow|DIR/ [-j N] [--force] (prepare.py is its library)"
    if sys.argv[1:] in (["-h"], ["--help"]):
        print(usage)
    else:
        sys.exit(usage)
