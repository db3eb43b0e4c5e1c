"""sources.py: the readers of one file and their offsets indexes. Arrow files of many record batches
(both IPC formats, nulls, empty batches, large_string, a dictionary column) read row for row as
Arrow reads them whole; a .jsonl / per-line .txt line index round trip (no final newline, CRLF,
blank lines, the scan blocks' edges, a changed file); and per-reader private memory that does
not grow with the number of record batches or lines (a child process, RssAnon)."""
import gc
import json
import os
import re
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from sources import ColumnDocs, LineDocs  # noqa: E402


@pytest.fixture(autouse=True)
def _cache_not_in_the_repository(tmp_path, monkeypatch):
    """data.Corpus(path) without cache_dir caches into ./.cache, as a user's run does: here a test's folder."""
    monkeypatch.chdir(tmp_path)


def write_arrow(path, texts, rows_per_batch, fmt="stream", typ=pa.string(), extra=None):
    """texts in record batches of rows_per_batch rows (and one empty batch in the middle)."""
    fields = {"id": pa.int64(), "text": typ, **({"tag": extra.type} if extra is not None else {})}
    schema = pa.schema(fields)
    new = pa.ipc.new_file if fmt == "file" else pa.ipc.new_stream
    with pa.OSFile(str(path), "wb") as sink, new(sink, schema) as w:
        for lo in range(0, len(texts), rows_per_batch):
            hi = min(len(texts), lo + rows_per_batch)
            cols = [pa.array(range(lo, hi), pa.int64()), pa.array(texts[lo:hi], typ)]
            if extra is not None:
                cols.append(extra.slice(0, hi - lo))
            w.write_batch(pa.record_batch(cols, schema=schema))
            if lo == 0:
                w.write_batch(pa.record_batch([pa.array([], f.type) for f in schema], schema=schema))
    return str(path)


def test_arrow_of_many_record_batches_reads_every_row_as_arrow_does(tmp_path):
    texts = [None if i % 89 == 7 else "é" * (i % 11) + f" document {i}" for i in range(3001)]
    tags = pa.array(["a", "b"] * 600).dictionary_encode()
    cases = [("stream", pa.string(), None), ("file", pa.large_string(), None), ("stream", pa.string(), tags)]
    for k, (fmt, typ, extra) in enumerate(cases):
        path = write_arrow(tmp_path / f"{k}.arrow", texts, 37, fmt, typ, extra)
        docs = ColumnDocs(path, "text", str(tmp_path / "cache"))
        want = [None if t is None else t.encode() for t in texts]
        assert docs.n == len(texts)
        ids = np.random.default_rng(k).permutation(len(texts))
        assert docs.read(ids) == [want[i] for i in ids]
        assert list(docs.lengths(30, 2990)) == [len(w or b"") for w in want[30:2990]]
        assert docs.read_range(1000, 3, 9) == want[1000][3:9] and docs.read_range(1000, 4, -1) == want[1000][4:]
        assert docs.read_range(7, 0, -1) is None
        if extra is None:              # from the batch index: every batch's first row, then its layout
            assert len(docs.starts) == 3001 // 37 + 3 and not docs.starts.flags.owndata
            assert docs.layout.shape == (len(docs.starts) - 1, 4) and (docs.layout[:, 1] >= 0).all()
        assert ColumnDocs(path, "text", str(tmp_path / "cache")).read([3000]) == [want[3000]]   # index reused
    assert len([f for f in os.listdir(tmp_path / "cache") if f.endswith(".idx")]) == 2


def test_arrow_rows_read_from_the_map_as_arrow_reads_them(tmp_path):
    """A document is two lookups into the memory-mapped file (the batch index holds where each batch's
    offsets, bytes and validity bitmap lie): the same bytes as Arrow's own reading, no batch opened.
    A compressed body's buffers are not in the file as read: opened by Arrow, same bytes."""
    rng = np.random.default_rng(0)
    parts = [["x" * int(k) + "é" for k in rng.integers(0, 30, 50)],              # no nulls
             [None if i % 3 else f"d{i}" for i in range(40)],                     # nulls
             [None] * 9, [""] * 7, [], ["", None, "last"]]                       # all null, all empty, empty batch
    for typ in (pa.string(), pa.large_string()):
        for fmt, compression in (("stream", None), ("file", None), ("stream", "zstd"), ("file", "lz4")):
            schema = pa.schema({"id": pa.int64(), "text": typ})
            path = str(tmp_path / f"{typ}-{fmt}-{compression}.arrow")
            new = pa.ipc.new_file if fmt == "file" else pa.ipc.new_stream
            with pa.OSFile(path, "wb") as sink, new(sink, schema, options=pa.ipc.IpcWriteOptions(compression=compression)) as w:
                for part in parts:
                    w.write_batch(pa.record_batch([pa.array(range(len(part)), pa.int64()), pa.array(part, typ)], schema=schema))
            reader = pa.ipc.open_file if fmt == "file" else pa.ipc.open_stream
            want = [None if t is None else t.encode() for t in reader(path).read_all().column("text").to_pylist()]
            docs = ColumnDocs(path, "text", str(tmp_path / "cache"))
            assert docs.n == len(want) == sum(map(len, parts))
            assert (docs.layout[:, 1] >= 0).all() == (compression is None)
            ids = rng.permutation(docs.n)
            assert docs.read(ids) == [want[i] for i in ids] and docs.read([]) == []
            half = [len(w or b"") // 2 for w in want]                          # a cut inside the document
            got = [docs.read_range(i, 1, -1) for i in range(docs.n)] + [docs.read_range(i, h // 2, h) for i, h in enumerate(half)]
            assert got == [w if w is None else w[1:] for w in want] + [w if w is None else w[h // 2:h] for w, h in zip(want, half)]
            assert (docs.batch.cache_info().misses == 0) == (compression is None)      # batches opened
            assert list(docs.lengths(0, docs.n)) == [len(w or b"") for w in want]


def test_line_index_round_trip(tmp_path):
    cache = str(tmp_path / "cache")
    for name, content in [("a.txt", b"ab\r\n\ncd"), ("b.txt", b"one\ntwo\n"), ("c.txt", b"\n\n"), ("d.txt", b"x")]:
        p = tmp_path / name
        p.write_bytes(content)
        lines = LineDocs(str(p), False, "text", cache)
        want = [x.rstrip(b"\r") for x in content.split(b"\n")]
        want = want[:-1] if content.endswith(b"\n") else want
        assert lines.n == len(want) and lines.read(range(lines.n)) == want
        assert list(lines.lengths(0, lines.n)) == [len(x) for x in content.split(b"\n")[:lines.n]]
        assert not lines.bounds.flags.owndata             # a view of the mapped index
    lines = LineDocs(str(tmp_path / "a.txt"), False, "text", cache)
    assert lines.read_range(2, 1, -1) == b"d" and lines.read_range(0, 1, 3) == b"b\r"
    assert lines.read_range(0, 1, -1) == b"b"         # to its end: a CRLF line's last span, as read() gives it
    # The scan's blocks: a newline at every edge of a 7-byte block gives the same index as one block.
    p = tmp_path / "e.jsonl"
    recs = [json.dumps({"text": "x" * (i % 9)}) for i in range(500)]
    p.write_text("\n".join(recs))
    whole, small = tmp_path / "whole.idx", tmp_path / "small.idx"
    with open(whole, "wb") as f:
        LineDocs.scan(str(p), f)
    with open(small, "wb") as f:
        LineDocs.scan(str(p), f, block=7)
    assert whole.read_bytes() == small.read_bytes()
    jl = LineDocs(str(p), True, "text", cache)
    assert jl.read(range(500)) == [r.encode() for r in recs]
    # A changed file gets a new index, never the old one's offsets.
    p.write_text("\n".join(recs[:3]) + "\n")
    assert LineDocs(str(p), True, "text", cache).read(range(3)) == [r.encode() for r in recs[:3]]
    assert LineDocs(str(p), True, "text", cache).n == 3
    # Rewritten at its size later (a record edited in place): its lines lie elsewhere, a new index too.
    p.write_text("\n".join(recs[2::-1]) + "\n")
    os.utime(p, ns=(os.stat(p).st_atime_ns, os.stat(p).st_mtime_ns + 10**9))
    assert LineDocs(str(p), True, "text", cache).read(range(3)) == [r.encode() for r in recs[2::-1]]


def test_readers_hold_no_open_file(tmp_path):
    """A folder of thousands of shards must not run into the limit of open files (often 1,024): a
    reader holds memory maps, no file descriptor."""
    def fds():
        return len(os.listdir("/proc/self/fd"))
    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n' * 10)
    arrow = write_arrow(tmp_path / "a.arrow", ["x"] * 10, 3)
    readers = [LineDocs(str(tmp_path / "a.jsonl"), True, "text", str(tmp_path / "c")),
               ColumnDocs(arrow, "text", str(tmp_path / "c"))]          # the indexes built
    gc.collect()    # earlier tests' garbage: its files closing during the count made it fail after test_data.py
    before = fds()
    readers += [LineDocs(str(tmp_path / "a.jsonl"), True, "text", str(tmp_path / "c")) for _ in range(20)]
    readers += [ColumnDocs(arrow, "text", str(tmp_path / "c")) for _ in range(20)]
    assert [r.read([9]) for r in readers[-40:]] == [[b'{"text": "a"}']] * 20 + [[b"x"]] * 20
    assert fds() == before


MEASURE = textwrap.dedent(r"""
    import sys, numpy as np, pyarrow as pa, pyarrow.compute as pc
    sys.path.insert(0, sys.argv[1])
    from sources import ColumnDocs, LineDocs
    def rss():
        return [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon")][0]
    kind, small, big, cache = sys.argv[2:6]
    open_ = (lambda p: ColumnDocs(p, "text", cache)) if kind == "arrow" else (lambda p: LineDocs(p, True, "text", cache))
    def use(docs):                          # what the span index build and the loader do with a reader
        for lo in range(0, docs.n, 1 << 16):
            docs.lengths(lo, min(docs.n, lo + (1 << 16)))
        for ids in np.random.default_rng(0).integers(0, docs.n, (300, 16)):
            docs.read(ids)
        return docs
    keep = [use(open_(small))]              # warms up Arrow's kernels and the code paths
    base = rss()
    keep.append(use(open_(big)))            # builds its index in this process, as a first run does
    print(rss() - base)
""")


def _growth_kb(tmp_path, kind, small, big):
    r = subprocess.run([sys.executable, "-c", MEASURE, ROOT, kind, small, big, str(tmp_path / "cache")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return int(r.stdout.split()[-1])


def test_reader_memory_does_not_grow_with_record_batches_or_lines(tmp_path):
    """Arrow: 24,000 record batches of 5 rows. The table read whole grew by ~1.4 KB a batch here (84 MB
    at 60,000 batches; 3 MB now); the reader now holds a memory map and the last BATCHES batches.
    .jsonl: 1M lines; line offsets in private arrays grew by 31 MB (1 MB now)."""
    texts = [f"doc {i}" for i in range(120_000)]
    small = write_arrow(tmp_path / "small.arrow", texts[:1000], 5)
    big = write_arrow(tmp_path / "big.arrow", texts, 5)
    arrow_kb = _growth_kb(tmp_path, "arrow", small, big)
    (tmp_path / "small.jsonl").write_text('{"text": "a"}\n' * 1000)
    (tmp_path / "big.jsonl").write_text('{"text": "a"}\n' * 1_000_000)
    lines_kb = _growth_kb(tmp_path, "lines", str(tmp_path / "small.jsonl"), str(tmp_path / "big.jsonl"))
    assert arrow_kb < 8192 and lines_kb < 8192, (arrow_kb, lines_kb)


def test_span_index_reads_long_documents_in_bounded_groups(tmp_path, monkeypatch):
    """The span index build reads its long documents at most ~READ_BYTES at a time (a longer one
    alone), and the rows do not depend on the grouping."""
    import corpus
    import spans
    rng = np.random.default_rng(0)
    docs = [" ".join(["word"] * int(n)) for n in rng.integers(10, 3000, 40)]      # 50 B .. 15 KB
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    c = corpus.Corpus(str(tmp_path / "d.jsonl"), cache_dir=str(tmp_path / "c0"))
    whole = spans.SpanIndex(c, 256, str(tmp_path / "c0")).rows.copy()
    reads, raw = [], c.raw
    monkeypatch.setattr(c, "raw", lambda ids: reads.append([len(docs[i]) for i in ids]) or raw(ids))
    monkeypatch.setattr(spans, "READ_BYTES", 20_000)
    grouped = spans.SpanIndex(c, 256, str(tmp_path / "c1")).rows
    assert np.array_equal(whole, grouped) and len(reads) > 3
    assert all(sum(r) <= 20_000 + 16_000 and len(r) <= 64 for r in reads)


def test_span_index_cuts_a_document_longer_than_a_read_block_without_holding_it(tmp_path, monkeypatch):
    """A document longer than READ_BYTES (one big .txt file, a long line, a long Arrow row) is cut a
    block at a time, never read whole (a 315 MB .txt took 1.4 GB to index), into the same spans."""
    import corpus
    import sources
    import spans
    rng = np.random.default_rng(1)
    words = ["a", "bb", "ccc", "dddd", "\u00e9t\u00e9", "\u4e2d\u6587", "x" * 300, "\u00e9" * 1500, "\n", "\r\n", "  "]
    text = " ".join(rng.choice(words, 1_500).tolist())             # ~430 KB: hard cuts and clean ones
    (tmp_path / "one.txt").write_text(text)
    (tmp_path / "lines.txt").write_bytes(b"short\r\n" + text.replace("\n", " ").encode() + b"\r\nend\n")
    write_arrow(tmp_path / "t.arrow", ["s", text, "t"], 2)
    reads = []
    for cls in (sources.FileDocs, sources.LineDocs, sources.ColumnDocs):
        def read_range(self, i, start, stop, f=cls.read_range):
            got = f(self, i, start, stop)
            reads.append(len(got))
            return got
        monkeypatch.setattr(cls, "read_range", read_range)
    for name, per_line in (("one.txt", False), ("lines.txt", True), ("t.arrow", False)):
        c = corpus.Corpus(str(tmp_path / name), doc_per_line=per_line, cache_dir=str(tmp_path / f"c_{name}"))
        whole = spans.SpanIndex(c, 64, str(tmp_path / f"c_{name}")).rows.copy()
        for block in (1000, 4099):
            monkeypatch.setattr(spans, "READ_BYTES", block)
            reads.clear()
            cache = str(tmp_path / f"c_{name}{block}")
            assert np.array_equal(spans.SpanIndex(c, 64, cache).rows, whole), (name, block)
            # (the content digest reads SAMPLE_SPANS spans: a read of a span, at most span_bytes, whatever READ_BYTES)
            assert reads and max(reads) <= max(block, spans.span_bytes(64)), (name, block)
        monkeypatch.setattr(spans, "READ_BYTES", 1 << 26)


def test_a_killed_index_build_leaves_nothing_this_host_rebuilds(tmp_path):
    """An index build killed (SIGKILL, an OOM kill) left FILE.tmpPID in --data.cache_dir for ever (the span index:
    24 bytes a span). The next build of that file on this host removes what this host's builds left: with the build
    lock held, no live one here writes one. Another host's on a shared cache (FSx, NFS; its build may be running, its
    pid means nothing here) stays, and so do other files' temporaries."""
    import sources
    cache, host = tmp_path / "cache", socket.gethostname()
    cache.mkdir()
    left = [f"spans-x.bin.tmp-{host}-4242", f"spans-x.bin.tmp-{host}-{os.getpid()}"]
    others = ["spans-x.bin.tmp-other-4242", f"spans-x.bin.tmp-{host}-1-4242", f"spans-y.bin.tmp-{host}-4242"]
    for name in left + others:
        (cache / name).write_bytes(b"half")
    sources.build_once(str(cache / "spans-x.bin"), lambda tmp: open(tmp, "wb").write(b"built"))
    assert (cache / "spans-x.bin").read_bytes() == b"built"
    assert sorted(os.listdir(cache)) == sorted(["spans-x.bin", "spans-x.bin.lock", *others])


def test_index_builds_show_a_progress_bar_on_a_terminal_only(tmp_path, monkeypatch):
    """A long build (a line index, a span index) shows tqdm's bar with its ETA on a terminal; logs,
    pipes and captured test output get none."""
    import io
    import corpus
    import sources
    import spans

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    (tmp_path / "a.jsonl").write_text('{"text": "a b"}\n' * 1000)
    monkeypatch.setattr(sources, "PROGRESS_DELAY", 0)          # tiny builds: drawn at once
    for err in (io.StringIO(), Terminal()):
        monkeypatch.setattr(sys, "stderr", err)
        cache = str(tmp_path / type(err).__name__)
        spans.SpanIndex(corpus.Corpus(str(tmp_path / "a.jsonl"), cache_dir=cache), 64, cache)
        bars = [line for line in re.split(r"[\r\n]", err.getvalue()) if "%|" in line]
        if err.isatty():
            assert any("[data] indexing a.jsonl" in b for b in bars) and any("documents/s" in b for b in bars)
        else:
            assert bars == [] and "[data] span index: 1,000 spans" in err.getvalue()


def test_arrow_jsonl_and_parquet_files_with_names_not_in_utf8_read_in_a_folder(tmp_path):
    """A folder copied from a foreign file system holds names that are not UTF-8 (Python's surrogate
    escapes): Arrow opens only UTF-8 names, and its memory map raised UnicodeEncodeError from deep
    inside a reader (a traceback). Each reads as its UTF-8-named twin does, in training and in prepare."""
    import corpus
    import prepare
    import pyarrow.parquet as pq
    docs = [f"document {i} " + "word " * i for i in range(12)]
    folder = tmp_path / "d"
    folder.mkdir()
    with pa.OSFile(str(tmp_path / "a.arrow"), "wb") as sink, pa.ipc.new_file(sink, pa.schema({"text": pa.string()})) as w:
        w.write_table(pa.table({"text": docs[:4]}))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[4:8]))
    pq.write_table(pa.table({"text": docs[8:]}), str(tmp_path / "c.parquet"))
    for name in ("a.arrow", "b.jsonl", "c.parquet"):         # caf\xe9-a.arrow ...: Latin-1 names
        os.rename(str(tmp_path / name), os.path.join(os.fsencode(folder), b"caf\xe9-" + name.encode()))
    c = corpus.Corpus(str(folder), cache_dir=str(tmp_path / "cache"))
    assert [t for t, _, _ in c.read(range(c.n_docs))] == docs
    prepare.prepare([str(folder)], str(tmp_path / "p.arrow"), workers=1)
    assert [t for t, _, _ in corpus.Corpus(str(tmp_path / "p.arrow")).read(range(12))] == docs


@pytest.mark.parametrize("indent", [2, None])
def test_a_json_file_of_one_array_is_refused_naming_the_conversion(tmp_path, indent):
    """A .json of one JSON array of records (Alpaca's format, pretty-printed or on one line) given as --data:
    refused naming what it is and the jq line that makes it JSON lines; it was "not JSON (Expecting value)" or
    "no text field ... the record has list", neither saying why."""
    import data
    p = tmp_path / "alpaca.json"
    p.write_text(json.dumps([{"instruction": "x", "text": "a b c"}] * 3, indent=indent))
    with pytest.raises(data.DataError, match=r"alpaca.json holds one JSON array, not JSON lines.*jq -c '\.\[\]' "
                                             r"\S+alpaca.json > \S+alpaca.jsonl"):
        data.Corpus(str(p))
    # the jq line writes a file not there yet: never a user's alpaca.jsonl, nor its alpaca.1.jsonl
    (tmp_path / "alpaca.jsonl").write_text("mine")
    (tmp_path / "alpaca.1.jsonl").write_text("mine too")
    with pytest.raises(data.DataError, match=r"\S+alpaca.json > \S+alpaca\.2\.jsonl$"):
        data.Corpus(str(p))


def test_json_lines_whose_first_line_is_a_list_are_not_called_one_json_array(tmp_path):
    """A JSON-lines file whose first line is a list ([1]) and whose other lines are records was refused as "holds
    one JSON array, not JSON lines", false, with a jq line that turns it into other data; it is refused naming the
    line and what it holds. A one-line array (the whole file) is still named as one."""
    import data
    p = tmp_path / "first_bad.jsonl"
    p.write_text("[1]\n" + "".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(5)))
    with pytest.raises(data.DataError) as e:
        data.Corpus(str(p))
    assert "JSON array" not in str(e.value) and "jq" not in str(e.value), e.value
    assert "first_bad.jsonl:1: a JSON list: each line must be one JSON object" in str(e.value), e.value
    (tmp_path / "one.jsonl").write_text(json.dumps([{"text": "a"}, {"text": "b"}]) + "\n")
    with pytest.raises(data.DataError, match="one.jsonl holds one JSON array, not JSON lines"):
        data.Corpus(str(tmp_path / "one.jsonl"))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["alpaca.jsonl", "alpaca.json", "alpaca.json.gz", "my data.jsonl.zst"])
def test_the_array_conversion_line_writes_a_new_file_and_works(tmp_path, name):
    """The line suggested for a file of one JSON array is run as given (jq, gzip, zstd are here): it must write a
    new file that reads as the records, never the input (`jq ... a.jsonl > a.jsonl` empties a.jsonl before jq
    reads it: the user's data lost) nor a file already there, and must decompress what it reads."""
    import shlex
    import shutil
    import data
    if not all(map(shutil.which, ("jq", "gzip", "zstd"))):
        pytest.skip("needs jq, gzip and zstd")
    records = [{"instruction": "x", "text": f"doc {i}"} for i in range(3)]
    raw = json.dumps(records, indent=2).encode()
    p = tmp_path / name
    if name.endswith(".gz"):
        import gzip
        raw = gzip.compress(raw)
    elif name.endswith(".zst"):
        raw = subprocess.run(["zstd", "-c"], input=raw, capture_output=True, check=True).stdout
    p.write_bytes(raw)
    if name == "alpaca.json":            # a .jsonl of the same name is the user's: not to be written over
        (tmp_path / "alpaca.jsonl").write_text('{"text": "mine"}\n')
    with pytest.raises(data.DataError, match="holds one JSON array") as e:
        data.Corpus(str(p), cache_dir=str(tmp_path / "cache"))
    line = str(e.value).split("e.g. ", 1)[1]
    subprocess.run(line, shell=True, cwd=tmp_path, check=True)
    assert p.read_bytes() == raw
    if name == "alpaca.json":
        assert (tmp_path / "alpaca.jsonl").read_text() == '{"text": "mine"}\n'
    out = shlex.split(line)[-1]
    assert [json.loads(x) for x in open(out)] == records


def test_a_folder_reads_a_linked_folder_once_and_a_link_loop_ends(tmp_path):
    """A folder of a corpus linked into it (`ln -s /data/more corpus/more`) is read, as the glob corpus/**/*.txt
    reads it: os.walk passed over every linked folder, dropping its documents silently. A link back to an
    ancestor (a loop) and a second link to one folder are walked once."""
    from sources import resolve_paths
    (tmp_path / "corpus" / "real").mkdir(parents=True)
    (tmp_path / "more").mkdir()
    (tmp_path / "corpus" / "real" / "a.txt").write_text("a")
    (tmp_path / "more" / "c.txt").write_text("c")
    (tmp_path / "corpus" / "more").symlink_to(tmp_path / "more")
    (tmp_path / "corpus" / "again").symlink_to(tmp_path / "more")
    (tmp_path / "corpus" / "real" / "loop").symlink_to(tmp_path / "corpus")
    got = resolve_paths(str(tmp_path / "corpus"))
    assert sorted(os.path.realpath(p) for p in got) == [str(tmp_path / "corpus" / "real" / "a.txt"),
                                                        str(tmp_path / "more" / "c.txt")]
    assert sorted(map(os.path.realpath, resolve_paths(str(tmp_path / "corpus" / "**" / "*.txt")))) == \
        sorted(map(os.path.realpath, got))


def test_a_broken_link_in_a_folder_is_named_as_one_not_as_a_permission_problem(tmp_path):
    """A link to nothing in a corpus folder was refused as 'not readable by this user: fix its permissions'."""
    from sources import DataError, resolve_paths
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "b.txt").symlink_to(tmp_path / "gone.txt")
    with pytest.raises(DataError, match=r"b.txt is a broken symbolic link \(to \S+gone.txt\): fix the link or remove it"):
        resolve_paths(str(tmp_path))


def test_a_resume_over_a_file_rewritten_at_its_size_is_refused_and_a_copy_elsewhere_resumes(tmp_path):
    """A corpus is keyed by file names and sizes, so a file rewritten at the same size (its paragraphs shuffled,
    a word replaced by another as long) resumed silently on other windows (found black-box with train.py). The
    span index now carries a digest of what it cut (the cuts, the documents' lengths, the text of up to
    SAMPLE_SPANS spans): a resume over other content is refused in one line; the same bytes under another path and
    modification time (a copy on another node) resume exactly."""
    import data
    from configs import DataConfig
    words = [f"w{i % 97}x{i % 13}" for i in range(9000)]
    text = " ".join(words) + "\n"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    src = tmp_path / "a" / "book.txt"
    src.write_text(text)
    (tmp_path / "b" / "book.txt").write_text(text)
    cfg = lambda p: DataConfig(data=str(p), seq_len=16, global_batch=2, micro_batch=1, val_fraction=0.1,
                               cache_dir=str(tmp_path / "cache"), shuffle=1)
    tok = data.build_tokenizer(cfg(src), 272)
    a = data.PackedLoader(cfg(src), tok, prefetch=0)
    [next(a) for _ in range(3)]
    state, after = a.state_dict(), next(a)
    copy = data.PackedLoader(cfg(tmp_path / "b" / "book.txt"), tok, prefetch=0)
    copy.load_state_dict(state)
    nxt = next(copy)
    assert all(torch_equal(after[k], nxt[k]) for k in after), (after, nxt)
    src.write_text(text.replace("w5x", "w9x"))             # the same size, the same spaces: the same cuts
    assert src.stat().st_size == len(text)
    with pytest.raises(data.DataError, match=r"saved with content=.* \(a file of the corpus was rewritten at its name "
                                             r"and size\): .*--ckpt.reset_data"):
        data.PackedLoader(cfg(src), tok, prefetch=0).load_state_dict(state)
    older = {k: v for k, v in state.items() if k != "content"}      # saved before the digest: not refused
    data.PackedLoader(cfg(src), tok, prefetch=0).load_state_dict(older)


def torch_equal(x, y):
    import torch
    return torch.equal(x, y)


def test_a_dataset_repository_of_several_configs_is_read_one_config_at_a_time(tmp_path):
    """A cloned dataset repository of several configs (wikitext: wikitext-103-raw-v1/, wikitext-2-raw-v1/, ..., listed
    in its README.md's YAML header) was read whole: every config's train files at once, wikitext-2 twice (it is a part
    of wikitext-103), where `datasets` asks for one. Now refused naming the configs and the glob that reads one; a
    config marked default is read alone, as `datasets` does."""
    import pyarrow.parquet as pq
    from sources import DataError, resolve_paths
    repo = tmp_path / "wikitext"
    for conf in ("wikitext-103-raw-v1", "wikitext-2-raw-v1"):
        (repo / conf).mkdir(parents=True)
        for split in ("train-00000-of-00001", "validation-00000-of-00001"):
            pq.write_table(pa.table({"text": [f"{conf} {split}"]}), repo / conf / f"{split}.parquet")
    card = ("---\nlicense: cc-by-sa-3.0\nconfigs:\n- config_name: wikitext-103-raw-v1\n  data_files:\n  - split: train\n"
            "    path: wikitext-103-raw-v1/train-*\n  - split: validation\n    path: wikitext-103-raw-v1/validation-*\n"
            "- config_name: wikitext-2-raw-v1\n  data_files:\n  - split: train\n    path: wikitext-2-raw-v1/train-*\n"
            "  - split: validation\n    path: wikitext-2-raw-v1/validation-*\n---\n# WikiText\n")
    (repo / "README.md").write_text(card)
    with pytest.raises(DataError, match=r"wikitext is a dataset repository of 2 configs \(wikitext-103-raw-v1, "
                                        r"wikitext-2-raw-v1: its README.md\), read one at a time as `datasets` does: "
                                        r"give its files, e.g. '(\S+)'") as e:
        resolve_paths(str(repo))
    glob_ = re.search(r"e.g. '(\S+)'", str(e.value))[1]
    assert resolve_paths(glob_) == [str(repo / "wikitext-103-raw-v1" / "train-00000-of-00001.parquet")]
    (repo / "README.md").write_text(card.replace("- config_name: wikitext-2-raw-v1\n", "- config_name: wikitext-2-raw-v1\n  default: true\n"))
    assert resolve_paths(str(repo)) == [str(repo / "wikitext-2-raw-v1" / "train-00000-of-00001.parquet")]
    assert resolve_paths(str(repo), "validation") == [str(repo / "wikitext-2-raw-v1" / "validation-00000-of-00001.parquet")]


def test_a_binary_file_is_named_binary_not_utf16(tmp_path):
    """A file of NULs everywhere (an executable, a zip named .txt) was refused as 'UTF-16 or UTF-32 text without a
    byte order mark ... convert it with iconv': wrong words and a fix that cannot help. UTF-16/32 text leaves NULs
    out of one position of four (its high or low bytes of ASCII); binary does not."""
    import data
    rng = np.random.default_rng(0)
    body = np.where(rng.random(8192) < 0.6, 0, rng.integers(1, 256, 8192)).astype(np.uint8).tobytes()
    (tmp_path / "blob.txt").write_bytes(b"\x7fELF" + body)
    with pytest.raises(data.DataError, match=r"blob.txt is not text: [\d,]+ of its first 4,096 bytes are NUL, at every "
                                             r"position of four \(binary: an executable, an image, an archive\); leave it out"):
        data.Corpus(str(tmp_path / "blob.txt"), cache_dir=str(tmp_path / "c")).read([0])
    with pytest.raises(data.DataError, match=r"blob.txt is not text"):
        data.prepare([str(tmp_path / "blob.txt")], str(tmp_path / "o.arrow"), workers=1)


def test_a_jsonl_files_wrong_field_is_refused_before_its_lines_are_indexed(tmp_path):
    """The first record's checks (not JSON, one JSON array, no such text field) read only that record: a 10 GB
    JSON-lines file with the wrong --data.text_field was indexed whole (every newline found and written to the
    cache) before its first line was read. Refused now with no index built or begun: the cache folder stays
    empty. A good field still indexes (and a BOM, blank and CRLF lines before the first record are skipped)."""
    import data
    cache = tmp_path / "cache"
    p = tmp_path / "a.jsonl"
    p.write_bytes(b"\xef\xbb\xbf\n  \r\n" + b"".join(json.dumps({"body": f"doc {i}"}).encode() + b"\r\n" for i in range(3000)))
    with pytest.raises(data.DataError, match="a.jsonl:3: no text field 'text'; the record has \\['body'\\]"):
        LineDocs(str(p), True, "text", str(cache))
    assert not cache.exists() or not os.listdir(cache), os.listdir(cache)
    (tmp_path / "arr.jsonl").write_text("[" + ", ".join(['{"text": "a"}'] * 2000) + "]")   # one line, no newline
    with pytest.raises(data.DataError, match="arr.jsonl holds one JSON array"):
        LineDocs(str(tmp_path / "arr.jsonl"), True, "text", str(cache))
    assert not cache.exists() or not os.listdir(cache), os.listdir(cache)
    good = LineDocs(str(p), True, "body", str(cache))
    assert good.n == 3002 and good.read([2]) == [b'{"body": "doc 0"}'] and os.listdir(cache)


def test_a_texts_own_replacement_characters_are_not_counted_as_invalid_utf8():
    """decode counts the sequences it replaced, not the U+FFFD a text already held (valid UTF-8, common in
    scraped pages): counted, they were warned as invalid bytes, and prepare's 10% rule would refuse a file of
    them as 'not UTF-8 text'."""
    import sources
    assert sources.decode("caf\ufffd au lait".encode()) == ("caf\ufffd au lait", 0)
    assert sources.decode("\ufffd\ufffd ok ".encode() + b"\xff") == ("\ufffd\ufffd ok \ufffd", 1)
    # likewise a JSON record's lone surrogate escapes ("\\udc80"), beside a U+FFFD of its own text
    assert sources.no_surrogates("caf\ufffd \udc80\udc81") == ("caf\ufffd \ufffd\ufffd", 2)


def test_a_folder_of_many_files_resolves_each_files_real_path_once_a_listing(tmp_path, monkeypatch):
    """Every rank lists the corpus at start (train.py's check, then Corpus): os.path.realpath, a metadata request
    per path component on a shared file system, was called 5 times a file by Corpus and 4 by the check (a folder
    of 10,000 .txt files five levels deep: 250,083 lstat calls a rank), twice per dedup test. Now once a file and
    listing, and once for the index's stamp: at most 2 per file in Corpus, 1 in mixture_files."""
    import corpus
    n = 40
    for i in range(n):
        (tmp_path / "c" / f"{i % 4}").mkdir(parents=True, exist_ok=True)
        (tmp_path / "c" / f"{i % 4}" / f"{i:03d}.txt").write_text(f"document {i}")
    calls, real = [], os.path.realpath
    monkeypatch.setattr(os.path, "realpath", lambda p, *a, **k: calls.append(p) or real(p, *a, **k))
    corpus.mixture_files(str(tmp_path / "c"))
    assert len(calls) <= n + 16, len(calls)         # (+ 2 a walked folder: 5 here)
    calls.clear()
    c = corpus.Corpus(str(tmp_path / "c"), cache_dir=str(tmp_path / "cache"))
    assert c.n_docs == n and len(calls) <= 2 * n + 16, len(calls)
    two = corpus.mixture_files(f"{tmp_path / 'c' / '0'}:1,{tmp_path / 'c'}:1")[1]   # a file of two sources: in the first
    assert [len(p) for p in two] == [n // 4, n - n // 4]


def test_a_folders_hidden_folders_are_not_read(tmp_path):
    """docs/data.md: a directory's hidden files and folders are never read. `--data=.` in a project reads its
    .py and .txt files, not those of its .venv (thousands of site-packages modules), a .git, or Jupyter's
    .ipynb_checkpoints copy of each text (every document twice); nor are they listed as left out."""
    from sources import resolve_paths
    for d, name in (("", "a.txt"), ("src", "b.py"), (".venv/lib/python3.11", "site.py"),
                    (".ipynb_checkpoints", "a-checkpoint.txt"), (".git/info", "notes.md"), ("src/.cache", "c.txt")):
        (tmp_path / d).mkdir(parents=True, exist_ok=True)
        (tmp_path / d / name).write_text("text")
    left = []
    got = resolve_paths(str(tmp_path), left_out=left)
    assert sorted(os.path.relpath(p, tmp_path) for p in got) == ["a.txt", "src/b.py"] and left == []


def test_a_split_word_inside_a_longer_word_names_no_split_as_in_datasets(tmp_path):
    """A split's word counts only between datasets' NON_WORDS_CHARS ([-._ 0-9], or the name's ends): latest.jsonl
    holds 'test', devices.jsonl 'dev', pretraining.jsonl 'train', yet none names a split, and `datasets` reads the
    four as one 'train' split (get_data_patterns, the reference here). Matched anywhere, the folder was refused
    as holding only test and validation splits."""
    from datasets.data_files import get_data_patterns
    from sources import resolve_paths
    names = ["contest.jsonl", "devices.jsonl", "latest.jsonl", "pretraining.jsonl"]
    for n in names:
        (tmp_path / n).write_text('{"text": "x"}\n')
    assert {str(k): v for k, v in get_data_patterns(str(tmp_path)).items()} == {"train": ["**"]}
    assert sorted(os.path.basename(p) for p in resolve_paths(str(tmp_path))) == names


def test_a_recursive_glob_reads_the_files_it_matches_not_its_folders(tmp_path):
    """`--data='corpus/**'` matches corpus/ and corpus/sub/ as well as the files under them (glob's ** with
    recursive=True): the folders are passed over, the files read, as the folder itself reads them."""
    from sources import resolve_paths
    (tmp_path / "corpus" / "sub.d").mkdir(parents=True)
    (tmp_path / "corpus" / "a.txt").write_text("a")
    (tmp_path / "corpus" / "sub.d" / "b.txt").write_text("b")
    got = resolve_paths(str(tmp_path / "corpus" / "**"))
    assert got == sorted(resolve_paths(str(tmp_path / "corpus"))) == [str(tmp_path / "corpus" / "a.txt"),
                                                                      str(tmp_path / "corpus" / "sub.d" / "b.txt")]


def test_a_compressed_jsonl_names_its_bad_record_by_the_line_the_jsonl_does(tmp_path):
    """A .jsonl.gz is read through its Arrow copy (CachedDocs), a row per line: its first bad record is named
    by its line number in the file, 1-based, as the .jsonl's reader names it (`zcat x.jsonl.gz | sed -n 3p`)."""
    import gzip
    import corpus
    body = b'{"text": "one"}\n{"text": "two"}\n{not json\n{"text": "four"}\n'
    (tmp_path / "x.jsonl").write_bytes(body)
    (tmp_path / "x.jsonl.gz").write_bytes(gzip.compress(body))
    said = []
    for name in ("x.jsonl", "x.jsonl.gz"):
        c = corpus.Corpus(str(tmp_path / name), cache_dir=str(tmp_path / "cache"))
        c.read(range(c.n_docs))
        said.append(c.examples["bad_record"])
    assert [x.split(": ")[0] for x in said] == [f"{tmp_path}/x.jsonl:3", f"{tmp_path}/x.jsonl.gz:3"], said
    assert said[0].split(": ", 1)[1] == said[1].split(": ", 1)[1], said


def test_a_data_folders_md_and_py_beside_its_jsonl_are_said_left_out(tmp_path):
    """A folder with data files (.jsonl) yields those and its .txt (docs/data.md), so a notes.md or a script
    beside them is not read: it was dropped in silence, and the start-up line that lists left-out files (by
    type) did not count it, yet said 'nanotrn reads .md'. Now listed and the line says the folder rule; a
    dataset's card (README.md) is not data and not said; a plain text folder still reads its .md."""
    from prepare import left_out_line
    from sources import resolve_paths
    for name in ("b.jsonl", "notes.md", "tool.py", "README.md", "a.txt"):
        (tmp_path / name).write_text('{"text": "x"}\n')
    left = []
    got = resolve_paths(str(tmp_path), left_out=left)
    assert sorted(os.path.basename(p) for p in got) == ["a.txt", "b.jsonl"]
    assert sorted(os.path.basename(p) for p in left) == ["notes.md", "tool.py"]
    line = left_out_line(left)
    assert "2 files of the data folders left out (1 .md, 1 .py;" in line and "those and its .txt" in line
    (tmp_path / "b.jsonl").unlink()
    left = []
    assert len(resolve_paths(str(tmp_path), left_out=left)) == 4 and left == []
