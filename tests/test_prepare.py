"""prepare.py: every input format, in parallel workers, into one Arrow file or one per shard; bad
records named and skipped (or fatal with --strict); constant memory whatever the shard size;
training reading compressed shards through its Arrow cache."""
import gzip
import json
import os
import re
import socket
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import corpus  # noqa: E402
import data  # noqa: E402
import prepare  # noqa: E402

DOCS = [f"document {i}: " + "word " * (i % 7 + 1) + "é中" * (i % 3) for i in range(60)]


def jsonl(docs) -> bytes:
    return "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)).encode()


@pytest.fixture
def shards(tmp_path):
    """One shard of every format, ten documents each (the .jsonl with three bad records and an empty one)."""
    src = tmp_path / "src"
    src.mkdir()
    bad = b'not json\n{"body": "x"}\n{"text": 5}\n{"text": ""}\n'
    (src / "a.jsonl").write_bytes(jsonl(DOCS[0:5]) + bad + jsonl(DOCS[5:10]))
    (src / "b.jsonl.gz").write_bytes(gzip.compress(jsonl(DOCS[10:20])))
    with pa.CompressedOutputStream(str(src / "c.jsonl.zst"), "zstd") as f:
        f.write(jsonl(DOCS[20:30]))
    (src / "d.json.gz").write_bytes(gzip.compress(jsonl(DOCS[30:40])))
    pq.write_table(pa.table({"text": DOCS[40:50]}), src / "e.parquet", row_group_size=3)
    with pa.OSFile(str(src / "f.arrow"), "wb") as sink, pa.ipc.new_file(sink, pa.schema({"text": pa.string()})) as w:
        w.write_table(pa.table({"text": DOCS[50:60]}))
    (src / "g.txt").write_text("a whole file\nis one document\n")
    return src



def test_the_bad_records_named_are_the_first_five_across_all_shards(tmp_path, capsys):
    """MAX_EXAMPLES bad records are named in the summary over the whole run, in shard order, not up to five per
    shard (three shards of three bad records: 9 counted, 5 named, the third shard's none)."""
    for s in range(3):
        (tmp_path / f"s{s}.jsonl").write_text(f'{{"text": "good {s}"}}\nnot json {s}a\nnot json {s}b\n{{"body": "{s}"}}\n')
    counts = prepare.prepare([str(tmp_path / f"s{s}.jsonl") for s in range(3)], str(tmp_path / "all.arrow"), workers=1)
    err = capsys.readouterr().err
    named = [w for s in range(3) for w in (f"s{s}.jsonl:2: not JSON", f"s{s}.jsonl:3: not JSON",
                                           f"s{s}.jsonl:4: no field 'text'") if w in err]
    assert counts["bad_records"] == 9 and "9 bad records skipped" in err and prepare.MAX_EXAMPLES == 5
    assert named == ["s0.jsonl:2: not JSON", "s0.jsonl:3: not JSON", "s0.jsonl:4: no field 'text'",
                     "s1.jsonl:2: not JSON", "s1.jsonl:3: not JSON"], err

def read(path) -> list[str]:
    return pa.ipc.open_stream(pa.memory_map(str(path))).read_all().column("text").to_pylist()


def test_the_bar_counts_every_workers_last_report_before_the_file_is_written(shards, tmp_path, monkeypatch):
    """A worker's last progress report (its shard's final bytes) is put on the queue just before it returns its
    result. With a multiprocessing.Queue (a feeder thread sends it later) the result could arrive first and the
    report was never read: the bar ended short, and test_bad_input's Ctrl-C (raised from the bar's update) did not
    happen under load. Every byte of every shard is counted, whatever the order."""
    import tqdm
    seen = []
    monkeypatch.setattr(tqdm.tqdm, "update", lambda self, n=1: seen.append(n))
    total = sum(p.stat().st_size for p in shards.iterdir() if p.is_file())
    for k in range(6):
        seen.clear()
        prepare.prepare([str(shards)], str(tmp_path / f"all{k}.arrow"), workers=2)
        assert sum(seen) == total, (k, sum(seen), total)


def test_one_bad_record_is_said_in_the_singular(tmp_path, capsys):
    """`python data.py prepare` over a file with one bad line said '[prepare] 1 bad records skipped' (training's
    data warning says '1 bad record skipped'): the count's noun follows the count."""
    (tmp_path / "a.jsonl").write_text('{"text": "good"}\nnot json\n')
    prepare.prepare([str(tmp_path / "a.jsonl")], str(tmp_path / "a.arrow"), workers=1)
    assert "[prepare] 1 bad record skipped (pass --strict" in capsys.readouterr().err


def test_every_format_in_parallel_into_one_file_and_one_per_shard(shards, tmp_path, capsys):
    out = tmp_path / "all.arrow"
    counts = prepare.prepare([str(shards)], str(out), workers=2)
    want = DOCS + ["a whole file\nis one document\n"]
    assert read(out) == want                            # the shards' order, whatever finished first
    assert counts["documents"] == 61 and counts["bad_records"] == 3 and counts["empty_docs"] == 1
    err = capsys.readouterr().err
    # Each bad record named by file and line, once, in the summary; and tqdm's bar with documents/s.
    for where in ("a.jsonl:6: not JSON", "a.jsonl:7: no field 'text'", "a.jsonl:8: field 'text' holds a number, not a string"):
        assert err.count(where) == 1, err
    assert "docs/s" in err and "3 bad records skipped" in err
    assert not [p for p in os.listdir(tmp_path) if p != "all.arrow" and p != "src"]   # no temporary left

    counts2 = prepare.prepare([str(shards)], str(tmp_path / "shards") + "/", workers=2)
    names = sorted(os.listdir(tmp_path / "shards"))
    assert names == ["00000-a.arrow", "00001-b.arrow", "00002-c.arrow", "00003-d.arrow", "00004-e.arrow",
                     "00005-f.arrow", "00006-g.arrow"] and counts2 == counts
    assert [t for n in names for t in read(tmp_path / "shards" / n)] == want
    # --data reads the folder of shards, and the raw folder itself (compressed shards via the cache).
    prepared = corpus.Corpus(str(tmp_path / "shards"), cache_dir=str(tmp_path / "c"))   # (not .cache of the cwd)
    assert [t for t, _, _ in prepared.read(range(prepared.n_docs))] == want
    raw = corpus.Corpus(str(shards), cache_dir=str(tmp_path / "cache"))
    texts = [t for t, _, bad in raw.read(range(raw.n_docs), quiet=True) if not bad and t]
    assert texts == want
    assert len([p for p in os.listdir(tmp_path / "cache") if p.endswith(".arrow")]) == 4   # b, c, d, e: once each
    with pytest.raises(data.DataError, match="exists; pass --force"):
        prepare.prepare([str(shards)], str(tmp_path / "shards") + "/")


def test_strict_stops_at_the_first_bad_record_and_writes_nothing(shards, tmp_path):
    with pytest.raises(SystemExit, match=r"a.jsonl:6: not JSON .*--strict"):
        data.main(["prepare", str(shards), "--out", str(tmp_path / "x.arrow"), "--strict", "-j", "2"])
    assert sorted(os.listdir(tmp_path)) == ["src"]
    for j in ("1", "2"):                     # one .arrow per shard: no shard, no temporary is left either
        with pytest.raises(SystemExit, match=r"a.jsonl:6: not JSON .*--strict"):
            data.main(["prepare", str(shards), "--out", f"{tmp_path}/dir{j}/", "--strict", "-j", j])
        assert os.listdir(tmp_path / f"dir{j}") == []


def test_out_with_a_tilde_after_the_equals_sign_is_written_in_the_home_folder(shards, tmp_path, monkeypatch):
    """`prepare ... --out=~/x.arrow`: bash leaves ~ after '=', and prepare wrote the corpus into a folder named
    '~' in the working directory (one `rm -rf ~` from the user's home). --out, and the tokenizer command's --data
    and --cache-dir, expand it as the shell would."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    monkeypatch.chdir(tmp_path)
    data.main(["prepare", str(shards / "a.jsonl"), "--out=~/x.arrow"])
    assert os.listdir(tmp_path / "home") == ["x.arrow"] and not (tmp_path / "~").exists()


def test_wrong_text_field_and_broken_gzip_are_one_line_errors_before_any_output(shards, tmp_path):
    with pytest.raises(SystemExit, match=r"a.jsonl:1: no field 'body'.*--text-field"):
        data.main(["prepare", str(shards / "a.jsonl"), "--out", str(tmp_path / "x.arrow"), "--text-field", "body"])
    (tmp_path / "cut.jsonl.gz").write_bytes((shards / "b.jsonl.gz").read_bytes()[:-30])
    with pytest.raises(SystemExit, match=r"cut.jsonl.gz: cannot be decompressed"):
        data.main(["prepare", str(tmp_path / "cut.jsonl.gz"), "--out", str(tmp_path / "x.arrow")])
    assert sorted(os.listdir(tmp_path)) == ["cut.jsonl.gz", "src"]


@pytest.mark.parametrize("name,body", [("z.jsonl", '{"text": "hi there"}\n'.encode("utf-16")),       # a byte order mark
                                       ("z.txt.gz", gzip.compress("no mark at all".encode("utf-16-le")))])
def test_a_utf16_source_is_refused_before_any_shard_is_converted(shards, tmp_path, monkeypatch, name, body):
    """A UTF-16 file among the sources is refused in one line naming it and iconv before anything is converted or
    written (its first bytes sniffed, decompressed, once a file). Before: when its shard was reached, after every
    shard before it was converted (a 37 MB .jsonl first: 18.9 s of work, then the refusal)."""
    (shards / name).write_bytes(body)
    converted, convert = [], prepare.convert
    monkeypatch.setattr(prepare, "convert", lambda p, *a, **k: converted.append(p) or convert(p, *a, **k))
    with pytest.raises(SystemExit, match=f"{name} is UTF-16.*not UTF-8: convert it to UTF-8 \\(e.g. .*iconv -f UTF-16"):
        data.main(["prepare", str(shards), "--out", str(tmp_path / "out" / "x.arrow"), "-j", "1"])
    assert converted == [] and not (tmp_path / "out").exists()


# The peak of this process's resident memory (VmHWM: ru_maxrss would start at the parent's, pytest's).
MEMORY = """
import gzip, json, re, sys
sys.path.insert(0, {root!r})
import prepare
prepare.BLOCK, prepare.BATCH_BYTES = 1 << 16, 1 << 18
doc = json.dumps({{"text": "x " * 500}}) + "\\n"
with gzip.open(sys.argv[1], "wt", compresslevel=1) as f:
    for _ in range(int(sys.argv[2])):
        f.write(doc)
peak = lambda: int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read())[1])
before = peak()
prepare.convert(sys.argv[1], sys.argv[1] + ".arrow")
prepare.copy_records(sys.argv[1], sys.argv[1] + ".copy", "text", False)     # training's copy (cached)
print((peak() - before) // 1024)
"""


@pytest.mark.slow
def test_memory_is_the_same_for_a_small_and_an_8x_larger_shard(tmp_path):
    """A 4 MB and a 32 MB shard (text, decompressed): the peak memory of the converter and of training's
    copy (one row per record) grows by less than 4 MB (holding the shard would add 32 MB or more)."""
    def peak_growth(n):
        r = subprocess.run([sys.executable, "-c", MEMORY.format(root=ROOT), str(tmp_path / f"s{n}.jsonl.gz"), str(n)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return int(r.stdout.split()[-1])
    small, large = peak_growth(4_000), peak_growth(32_000)
    assert large - small < 4, (small, large)
    assert len(read(tmp_path / "s32000.jsonl.gz.arrow")) == len(read(tmp_path / "s32000.jsonl.gz.copy")) == 32_000


@pytest.mark.slow
def test_data_warnings_said_once_by_rank_0_with_the_count_never_mid_line(tmp_path):
    """Two ranks (torchrun, gloo) read a corpus with bad records and invalid UTF-8: each kind is said
    once per run, on stdout between the step lines, by rank 0 only, with the count over both ranks;
    the run's totals at the end; nothing on stderr (where rank 1's copies used to cut into lines)."""
    from gloo_spawn import run_train
    src = tmp_path / "c"
    src.mkdir()
    import sysconfig
    code = "".join(open(os.path.join(sysconfig.get_paths()["stdlib"], f)).read() for f in ("textwrap.py", "string.py", "shlex.py"))
    good = [json.dumps({"text": code[i * 400:(i + 1) * 400]}) for i in range(12)]
    bad = ["not json", json.dumps({"body": "no text"})]
    (src / "a.jsonl").write_text("\n".join(good[:6] + bad + good[6:]) + "\n")
    (src / "0.txt").write_bytes(b"caf\xe9 au lait \xff " * 5)
    (src / "empty.txt").write_bytes(b"")
    (src / "table.csv").write_text("a,b\n")            # a type not read: said at start, once
    r = run_train(["--model.n_layers=1", "--model.dim=32", "--model.n_heads=2", "--model.n_kv_heads=1",
                   "--model.ffn_dim=64", "--seq_len=32", "--model.max_seq_len=32", "--global_batch=4",
                   "--micro_batch=2", "--steps=40", "--log.interval=4", "--model.vocab_size=384",
                   "--log.eval_interval=0", "--log.sample_tokens=0", "--log.peak_tflops=1", "--log.tensorboard=",
                   "--ckpt.interval=0", "--data.shuffle=1", f"--data={src}", f"--out_dir={tmp_path}/o",
                   f"--ckpt.dir={tmp_path}/o/ckpt", f"--data.cache_dir={tmp_path}/cache", "--dp=2", "--device=cpu"], nproc=2)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    for what in (r"bad records? skipped", r"invalid UTF-8 sequences? replaced", r"empty files? skipped", r"left out \(1 \.csv"):
        said = [x for x in lines if re.search(what, x)]                 # one of a kind said in the singular (30e5671)
        assert len(said) == 1 and said[0].startswith("data warning: "), (what, said)
    assert all(x.startswith(("step", "data warning", "data: this run")) or "data warning" not in x for x in lines)
    assert "invalid UTF-8" not in r.stderr and "skipped" not in r.stderr, r.stderr[-2000:]
    total = [x for x in lines if x.startswith("data: this run")]
    assert len(total) == 1 and "bad records" in total[0] and "utf8 replacements" in total[0], total
    assert re.search(r"\bbad records 2\b", total[0]), total        # the 2 bad lines, not once per epoch read


def test_training_cache_of_a_compressed_shard_keeps_its_bytes_for_the_loader_to_count(tmp_path, capsys):
    """A .txt.gz / .jsonl.gz is read through an Arrow copy of its records' bytes: invalid UTF-8 is replaced
    and counted as it is read, named by the compressed file, as in the raw file (the copy held the text
    already replaced, said once by the process that converted it, never by a later run)."""
    with gzip.open(tmp_path / "a.txt.gz", "wb") as f:
        f.write(b"caf\xe9 au lait \xff and more text")
    out = prepare.cached(str(tmp_path / "a.txt.gz"), "text", False, str(tmp_path / "cache"))
    assert read(out) == [b"caf\xe9 au lait \xff and more text"]
    c = corpus.Corpus(str(tmp_path / "a.txt.gz"), cache_dir=str(tmp_path / "cache"))
    assert c.read([0]) == [("caf\ufffd au lait \ufffd and more text", 2, False)]
    assert c.examples["utf8"].startswith(f"{tmp_path / 'a.txt.gz'}: 2 invalid UTF-8 sequences replaced")


@pytest.mark.parametrize("argv,code", [(["--help"], 0), (["-h"], 0), ([], 1), (["x.jsonl", "--out", "x.arrow"], 1)])
def test_prepare_py_run_as_a_script_names_the_command(capsys, monkeypatch, argv, code):
    # `python prepare.py --help` printed its usage as an error (exit 1): asking for help is no error
    import runpy
    monkeypatch.setattr(sys, "argv", ["prepare.py", *argv])
    status, said = 0, ""
    try:
        runpy.run_path(os.path.join(ROOT, "prepare.py"), run_name="__main__")
        said = capsys.readouterr().out
    except SystemExit as e:
        status, said = (1, e.code) if isinstance(e.code, str) else (e.code or 0, capsys.readouterr().out)
    assert status == code and said.startswith("usage: python data.py prepare SOURCES... --out"), (status, said)


@pytest.mark.parametrize("cmd,flags", [("prepare", ["sources", "--out OUT", "--text-field", "--doc-per-line", "--force"]),
                                       ("tokenizer", ["--data DATA", "--vocab VOCAB", "--cache-dir", "--doc-per-line"])])
def test_data_py_help_says_what_every_argument_is(capsys, cmd, flags):
    # `python data.py prepare --help` left the sources, --out, --text-field, --doc-per-line and --force
    # unexplained (tokenizer: every flag); each now says what it is, the tokenizer's which train.py key it mirrors
    with pytest.raises(SystemExit) as e:
        data.main([cmd, "--help"])
    out = capsys.readouterr().out
    lines = out.split("positional arguments:" if cmd == "prepare" else "options:")[1].splitlines()
    for flag in flags:
        i = next(i for i, x in enumerate(lines) if x.strip().startswith(flag))
        said = lines[i].strip()[len(flag):].strip() or lines[i + 1].strip()      # beside it, else below
        assert e.value.code == 0 and said and not said.startswith("-"), f"{flag} has no help:\n{out}"
    assert cmd == "prepare" or "train.py's --model.vocab_size (default: 4096)" in out, out


def test_the_split_refusal_names_prepares_flag_and_leaves_the_folders_name_as_it_is(tmp_path):
    """The flag reaches the refusal as a parameter: rewriting '--data.split' in the message also
    rewrote a folder whose name holds it."""
    folder = tmp_path / "dump--data.split"
    folder.mkdir()
    for name in ("validation.jsonl", "test.jsonl"):
        (folder / name).write_text('{"text": "a document"}\n')
    with pytest.raises(prepare.DataError) as e:
        prepare.prepare([str(folder)], str(tmp_path / "x.arrow"))
    assert str(e.value) == (f"{folder} holds the splits test, validation, not 'train'; choose one with --split")


@pytest.mark.slow      # ~3 s: datasets' import and save_to_disk
def test_prepare_takes_a_split_and_its_refusal_names_its_own_flag(tmp_path, capsys):
    """A DatasetDict without a train split was refused naming --data.split, which prepare did not take."""
    datasets = pytest.importorskip("datasets")
    dd = tmp_path / "dd"
    datasets.DatasetDict({"validation": datasets.Dataset.from_dict({"text": ["a validation doc"]}),
                          "test": datasets.Dataset.from_dict({"text": ["a test doc", "another"]})}).save_to_disk(dd)
    with pytest.raises(SystemExit, match=r"splits validation, test, not 'train'; choose one with --split$"):
        data.main(["prepare", str(dd), "--out", str(tmp_path / "x.arrow")])
    data.main(["prepare", str(dd), "--out", str(tmp_path / "x.arrow"), "--split", "test"])
    assert "documents 2," in capsys.readouterr().err


@pytest.mark.parametrize("j", ["1", "2"])
def test_a_binary_file_named_txt_is_skipped_and_named_not_written_as_text(shards, tmp_path, capsys, j):
    """A shard that is not UTF-8 text (a gzip file named .txt: 45% of its characters invalid) was written as
    text full of U+FFFD, said only as 'utf8_replacements 168,512' in the summary; training on the output then
    met no invalid byte (U+FFFD is valid UTF-8) and failed on the tokenizer's vocabulary, or trained on garbage.
    Now it is skipped as a whole, named with the fix and counted; --strict stops at it; alone, nothing is written."""
    blob = tmp_path / "blob.txt"
    blob.write_bytes(gzip.compress(os.urandom(3000) + b"x" * 3000).replace(b"\0", b"\1"))
    latin1 = tmp_path / "latin1.txt"                    # a few invalid bytes in text: kept, counted as before
    latin1.write_bytes("Le café est bon, le thé aussi, et le pain est frais ce matin. ".encode("latin-1") * 20)
    out = tmp_path / "o.arrow"
    counts = prepare.prepare([str(shards / "g.txt"), str(blob), str(latin1)], str(out), workers=int(j))
    assert counts["documents"] == 2 and counts["not_text_files"] == 1 and read(out)[0] == "a whole file\nis one document\n"
    assert read(out)[1].startswith("Le caf\ufffd est") and counts["utf8_replacements"] == 40
    err = capsys.readouterr().err
    assert re.search(r"\[prepare\] 1 file skipped, not UTF-8 text: \S+blob.txt \(\d[\d,]* of its [\d,]+ characters are "
                     r"invalid UTF-8: binary or another encoding\); convert it to UTF-8 \(iconv\) or leave it out", err), err
    with pytest.raises(SystemExit, match=r"blob.txt \(.* invalid UTF-8: binary or another encoding\).*--strict"):
        data.main(["prepare", str(blob), "--out", str(tmp_path / "s.arrow"), "--strict", "-j", j])
    with pytest.raises(SystemExit, match=r"no document has text .*blob.txt .*invalid UTF-8"):
        data.main(["prepare", str(blob), "--out", str(tmp_path / "d") + "/", "-j", j])
    assert not os.path.exists(tmp_path / "s.arrow") and os.listdir(tmp_path / "d") == []
    prepare.prepare([str(shards / "g.txt"), str(blob)], str(tmp_path / "d") + "/", workers=int(j))
    assert os.listdir(tmp_path / "d") == ["00000-g.arrow"] and "wrote " + str(tmp_path / "d") + "/ (1 shards)" in capsys.readouterr().err


def test_a_rerun_after_a_killed_prepare_removes_what_the_killed_one_left(shards, tmp_path, capsys):
    """A prepare killed (SIGKILL, a node lost) left its temporaries for ever: OUT.arrow.parts-HOST-PID/ and
    OUT.arrow.tmp-HOST-PID beside a one-file output, NNNNN-x.arrow.tmp-HOST-PID in a shard folder (each up to the
    corpus's size, and said as 'left out' by every run on the folder). A rerun removes those of a process of this
    host that is gone, and says so; those of a live process (a prepare still running), the user's files and another
    host's stay: two hosts preparing to one --out on a shared file system removed each other's temporaries (named
    OUT.arrow.tmpPID, a pid of the other host judged gone here), and a name without a host is never judged."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live, host = os.getppid(), socket.gethostname()
    out = tmp_path / "o.arrow"
    for pid in (dead.pid, live):
        (tmp_path / f"o.arrow.parts-{host}-{pid}").mkdir()
        (tmp_path / f"o.arrow.parts-{host}-{pid}" / "00000-a.arrow").write_bytes(b"half")
        (tmp_path / f"o.arrow.tmp-{host}-{pid}").write_bytes(b"half")
    others = [f"o.arrow.tmp-{host}x-{dead.pid}", f"o.arrow.tmp-other-{dead.pid}", f"o.arrow.tmp{dead.pid}", "o.arrow.tmpnotes"]
    for name in others:
        (tmp_path / name).write_text("another host's, or mine")
    prepare.prepare([str(shards / "g.txt")], str(out), workers=1)
    assert read(out) == ["a whole file\nis one document\n"]
    assert sorted(os.listdir(tmp_path)) == sorted(["src", "o.arrow", f"o.arrow.parts-{host}-{live}",
                                                   f"o.arrow.tmp-{host}-{live}", *others])
    assert re.search(rf"\[prepare\] removed 2 temporaries of an interrupted prepare \(process {dead.pid}, gone\): "
                     rf"\S+o.arrow.parts-{host}-{dead.pid}", capsys.readouterr().err)
    d = tmp_path / "d"
    d.mkdir()
    kept = [f"00003-z.arrow.tmp-{host}-{live}", f"00001-b.arrow.tmp-other-{dead.pid}", f"00002-c.arrow.tmp{dead.pid}"]
    for name in (f"00000-a.arrow.tmp-{host}-{dead.pid}", *kept, "notes.txt"):
        (d / name).write_bytes(b"half")
    prepare.prepare([str(shards / "g.txt")], str(d) + "/", workers=1)
    assert sorted(os.listdir(d)) == sorted(["00000-g.arrow", *kept, "notes.txt"])


def test_shards_written_into_a_folder_of_other_files_say_what_data_would_read_beside_them(shards, tmp_path, capsys):
    """Shards written into a folder that holds the user's files keep those files, but --data=that/ then trained on a
    notes.txt beside them, or (a train.jsonl there names a split) left the shards out, silently. Said at the end."""
    out = tmp_path / "o"
    out.mkdir()
    prepare.prepare([str(shards / "g.txt")], str(out) + "/", workers=1)
    assert "note:" not in capsys.readouterr().err
    (out / "notes.txt").write_text("mine")
    prepare.prepare([str(shards / "a.jsonl")], str(out) + "/", workers=1, force=True)
    assert re.search(r"\[prepare\] note: --data=\S+/o/ reads 2 files beside the shards written \(the first: \S+00000-g.arrow\): "
                     r"move the other files out, or give the shards as \S+/o/\*.arrow", capsys.readouterr().err)
    assert (out / "notes.txt").read_text() == "mine"
    (out / "train.jsonl").write_text('{"text": "mine"}\n')
    prepare.prepare([str(shards / "a.jsonl")], str(out) + "/", workers=1, force=True)
    assert re.search(r"reads 2 files beside .*notes.txt\) and leaves out 1 of them \(a file beside them names a split\)",
                     capsys.readouterr().err)


def test_nothing_to_write_names_what_was_skipped_not_zero_counts(tmp_path):
    """A prepare that finds no text said "no document has text (0 empty, 0 bad records, the first: blob.txt (...
    invalid UTF-8 ...))" of a file not UTF-8, and "(0 empty, 0 bad records)" of an empty file: counts that contradict
    what was skipped. It names what it skipped, by kind, and the first example."""
    import data
    blob, empty = tmp_path / "blob.txt", tmp_path / "empty.txt"
    blob.write_bytes(b"hello \xff\xfe world " * 1000)
    empty.write_bytes(b"")
    for src, said in ((blob, r"\(1 file not UTF-8 text; the first: \S*blob.txt \(2,000 of its"), (empty, r"\(1 empty file\)")):
        with pytest.raises(SystemExit, match=r"no document has text " + said) as e:
            data.main(["prepare", str(src), "--out", str(tmp_path / "o.arrow"), "-j", "1"])
        assert "0 empty" not in str(e.value) and "0 bad" not in str(e.value), e.value


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_a_wrong_column_names_prepares_own_flag(tmp_path, fmt):
    """`data.py prepare x.parquet` (or an Arrow file) without a 'text' column said "set --data.text_field", a flag
    prepare does not take (its own is --text-field, as its JSON-lines message says); training still names its own."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import data
    p, t = tmp_path / f"body.{fmt}", pa.table({"body": ["doc one two", "doc three"]})
    if fmt == "parquet":
        pq.write_table(t, p)
    else:
        with pa.ipc.new_file(str(p), t.schema) as w:
            w.write_table(t)
    with pytest.raises(SystemExit, match=r"no column 'text'; its columns are \['body'\]: set --text-field ") as e:
        data.main(["prepare", str(p), "--out", str(tmp_path / "o.arrow"), "-j", "1"])
    assert "--data.text_field" not in str(e.value)
    with pytest.raises(data.DataError, match=r"set --data.text_field to"):
        data.Corpus(str(p), cache_dir=str(tmp_path / "cache"))


def test_the_tokenizer_command_names_its_own_flag_for_a_parquet_column(tmp_path):
    """`data.py tokenizer --data x.parquet` without a 'text' column said "set --data.text_field" (training's flag) where
    its JSON-lines twin says "--text-field", the command's own: the Parquet copy is told which flag to name."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import data
    pq.write_table(pa.table({"body": ["doc one two", "doc three"]}), tmp_path / "body.parquet")
    with pytest.raises(SystemExit, match=r"no column 'text'; its columns are \['body'\]: set --text-field ") as e:
        data.main(["tokenizer", "--data", str(tmp_path / "body.parquet"), "--vocab", "300", "--cache-dir", str(tmp_path / "c")])
    assert "--data.text_field" not in str(e.value)


def test_null_and_whitespace_texts_are_empty_documents_as_training_reads_them(tmp_path):
    """A record whose text is null or only whitespace is an empty document, as training's reader counts it
    (corpus.py: a null text is ""; whitespace makes no token): not written, counted as empty, not as bad. A
    number is a bad record. Written, a whitespace text was a document of the prepared corpus and of its count."""
    src = tmp_path / "a.jsonl"
    src.write_text("\n".join(json.dumps({"text": t}) for t in ("one doc", None, " \n\t ", "two docs", 5)) + "\n")
    counts = prepare.prepare([str(src)], str(tmp_path / "o.arrow"), workers=1)
    assert read(tmp_path / "o.arrow") == ["one doc", "two docs"]
    assert (counts["documents"], counts["empty_docs"], counts["bad_records"]) == (2, 2, 1), counts


def test_a_failed_forced_prepare_leaves_the_shards_that_were_there(shards, tmp_path):
    """--force replaces the shards in --out as each is written; a run that fails first (here --strict at a bad
    record of the first source) removes only what it began, never the earlier run's shards."""
    sources, out = [str(shards / "a.jsonl"), str(shards / "b.jsonl.gz")], f"{tmp_path}/dir/"
    prepare.prepare(sources, out, workers=1)
    before = {n: (tmp_path / "dir" / n).read_bytes() for n in os.listdir(tmp_path / "dir")}
    assert sorted(before) == ["00000-a.arrow", "00001-b.arrow"]
    with pytest.raises(data.DataError, match="a.jsonl:6: not JSON .*--strict"):
        prepare.prepare(sources, out, force=True, strict=True, workers=1)
    assert {n: (tmp_path / "dir" / n).read_bytes() for n in os.listdir(tmp_path / "dir")} == before


def test_shards_into_the_folder_holding_a_source_are_refused(shards, tmp_path):
    """--out DIR/ (one shard per source) where DIR holds a source file: --data=DIR would read that source beside its
    own shards, every document twice. Refused before anything is written."""
    before = sorted(os.listdir(shards))
    with pytest.raises(data.DataError, match=f"--out {shards}/ holds some of the sources"):
        prepare.prepare([str(shards / "a.jsonl")], f"{shards}/", workers=1)
    assert sorted(os.listdir(shards)) == before
