"""data.py: every source format, packing against a plain-Python reference, coverage over DP ranks,
exact resume (mid-document, epoch boundary, with the prefetch thread), bad input, prepare, XLA."""
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402
from configs import DataConfig, ModelConfig  # noqa: E402

SEQ = 32
VOCAB = 400
WORDS = ["def", "return", "self", "value", "x", "print", "import", "lambda", "café", "naïve",
         "中文", "for", "in", "range", "(", ")", ":", "=", "+", "1", "42", "\t", "  "]


def make_docs(n=120, seed=0):
    """Single-line documents (so .txt one-per-line can hold them too), a few much longer than a window."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 120, n)
    lengths[[5, 17, 60]] = [900, 400, 1500]        # documents spanning many windows
    return [" ".join(rng.choice(WORDS, k)) for k in lengths]


DOCS = make_docs()


def write_formats(root, docs):
    """The same documents in every supported format; returns {format: data spec}."""
    os.makedirs(root / "txt", exist_ok=True)
    for i, d in enumerate(docs):
        (root / "txt" / f"doc_{i:04d}.txt").write_text(d)
    (root / "lines.txt").write_text("\n".join(docs) + "\n")
    (root / "docs.jsonl").write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)))
    # datasets' own save_to_disk: IPC *stream* files of record batches plus json metadata; two shards.
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(root / "hf"), num_shards=2)
    # IPC *file* format, large_string
    lschema = pa.schema({"text": pa.large_string()})
    with pa.OSFile(str(root / "file.arrow"), "wb") as sink, pa.ipc.new_file(sink, lschema) as w:
        w.write_batch(pa.record_batch([pa.array(docs, pa.large_string())], schema=lschema))
    pq.write_table(pa.table({"text": docs}), str(root / "docs.parquet"), row_group_size=30)
    return {"txt": str(root / "txt"), "txt_lines": str(root / "lines.txt"), "jsonl": str(root / "docs.jsonl"),
            "arrow_stream_hf_dir": str(root / "hf"), "arrow_file_large": str(root / "file.arrow"),
            "parquet": str(root / "docs.parquet")}


@pytest.fixture(scope="session")
def files(tmp_path_factory):
    return write_formats(tmp_path_factory.mktemp("corpus"), DOCS)


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def tok(files, cache):
    return data.build_tokenizer(DataConfig(data=files["txt"], cache_dir=cache, val_fraction=0.1), VOCAB)


def cfg(spec, **kw):
    base = dict(data=spec, seq_len=SEQ, micro_batch=1, global_batch=4, val_fraction=0.1, seed=7,
                doc_per_line=spec.endswith("lines.txt"), shuffle=1)     # stream order: packing checked exactly
    return DataConfig(**{**base, **kw})


def reference_stream(tok, docs, ids):
    """Plain Python: each document encoded alone, with BOS and EOS, concatenated in reading order."""
    ids_out, starts = [], []
    for i in ids:
        if docs[i].strip():
            t = [tok.bos_id] + tok.encode(docs[i]) + [tok.eos_id]
            starts += [True] + [False] * (len(t) - 1)
            ids_out += t
    return np.array(ids_out, np.int64), np.array(starts, bool)


def reference_window(w, s):
    """tokens, targets, positions, doc_ids of one window, by loops (no numpy tricks)."""
    targets = [(-100 if s[i + 1] else int(w[i + 1])) for i in range(SEQ)]
    positions, doc_ids, p, d = [], [], 0, 0
    for i in range(SEQ):
        if s[i] and i > 0:
            p, d = 0, d + 1
        positions.append(p)
        doc_ids.append(d)
        p += 1
    return [torch.tensor(x) for x in (w[:-1].tolist(), targets, positions, doc_ids)]


def take(loader, n):
    return [next(loader) for _ in range(n)]


def equal(a, b):
    return all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in ("tokens", "targets", "positions", "doc_ids"))


# ----------------------------------------------------------------------------- coverage, formats

@pytest.mark.parametrize("fmt", ["txt", "txt_lines", "jsonl", "arrow_stream_hf_dir", "arrow_file_large", "parquet"])
def test_epoch_coverage_every_format(files, tok, fmt):
    """Each stream's windows equal the reference packing of its documents, then its next epoch's;
    the streams' documents partition the train split; seen + dropped tails = the tokenized split."""
    c = cfg(files[fmt])                             # global_batch 4 = 4 streams, handed out round-robin
    S, L1 = c.global_batch, SEQ + 1
    train_ids, val_ids = data.split_documents(len(DOCS), c.val_fraction)
    loader = data.PackedLoader(c, tok)
    refs = [reference_stream(tok, DOCS, loader.documents(s, 0)) for s in range(S)]
    ns = [len(stream) // L1 for stream, _ in refs]
    batches = take(loader, S * (max(ns) + 1))       # every stream's epoch and into its next one
    seen, dropped = [], 0
    for s, (stream, starts) in enumerate(refs):
        mine = batches[s::S]
        for k in range(ns[s]):
            for got, want in zip((mine[k][key][0] for key in ("tokens", "targets", "positions", "doc_ids")),
                                 reference_window(stream[k * L1:(k + 1) * L1], starts[k * L1:(k + 1) * L1])):
                assert torch.equal(got, want), (fmt, s, k)
        nxt, nxt_starts = reference_stream(tok, DOCS, loader.documents(s, 1))
        assert torch.equal(mine[ns[s]]["tokens"][0], torch.from_numpy(nxt[:SEQ]))
        # Documents count once fully behind the position: all of epoch 0 and, of epoch 1, those
        # ending inside the windows read (k = the last document start at or before their end).
        p = loader.state_dict()["streams"][str(s)]
        into = (len(mine) - ns[s]) * L1
        k = np.flatnonzero(nxt_starts[:into + 1])[-1]
        tail = len(stream) - ns[s] * L1
        assert p["epoch"] == 1 and p["stats"]["dropped_tail"] == tail < L1
        assert p["stats"]["documents"] == len(loader.documents(s, 0)) + nxt_starts[1:k + 1].sum()
        assert p["stats"]["tokens"] == len(stream) + k
        seen.append(stream[:ns[s] * L1])
        dropped += tail
    loader.close()
    docs_seen = np.concatenate([loader.documents(s, 0) for s in range(S)])
    assert sorted(docs_seen.tolist()) == sorted(train_ids.tolist())    # disjoint and complete
    everything = reference_stream(tok, DOCS, train_ids)[0]
    counts_seen = np.bincount(np.concatenate(seen), minlength=VOCAB)
    counts_all = np.bincount(everything, minlength=VOCAB)
    assert (counts_seen <= counts_all).all() and (counts_all - counts_seen).sum() == dropped < S * L1


def global_batches(c, tok, dp, n, resume=None):
    """n global batches of a run at DP degree dp: each rank's microbatches, ranks in order."""
    loaders = [data.PackedLoader(c, tok, dp_rank=r, dp_size=dp) for r in range(dp)]
    for loader in loaders if resume is not None else ():
        loader.load_state_dict(resume)              # every saved rank's state: a DP change
    accum = c.global_batch // (dp * c.micro_batch)
    out = [torch.cat([next(x)["tokens"] for x in loaders for _ in range(accum)]) for _ in range(n)]
    states = [json.loads(json.dumps(x.state_dict())) for x in loaders]      # plain data
    stats = [x.stats() for x in loaders]
    for x in loaders:
        x.close()
    return out, states, {k: sum(s[k] for s in stats) for k in data.COUNTERS}


def test_same_global_batches_at_any_dp_and_micro_batch_and_resume_across_dp(files, tok):
    """The stream is defined by global window index: DP 1, 2, 4 and micro-batches 1, 2, 4 give the
    very same global batches, and a run saved at one DP degree continues exactly at another."""
    c = lambda mb: cfg(files["jsonl"], micro_batch=mb)
    ref, _, ref_stats = global_batches(c(1), tok, 1, 30)
    for dp, mb in ((1, 4), (2, 1), (2, 2), (4, 1)):
        got, _, stats = global_batches(c(mb), tok, dp, 30)
        assert all(torch.equal(a, b) for a, b in zip(ref, got)) and stats == ref_stats, (dp, mb)
    _, saved, _ = global_batches(c(2), tok, 2, 12)
    for dp, mb in ((4, 1), (1, 2)):
        got, _, stats = global_batches(c(mb), tok, dp, 18, resume=saved)
        assert all(torch.equal(a, b) for a, b in zip(ref[12:], got)) and stats == ref_stats, (dp, mb)


def test_shuffle_and_mixture_same_at_any_layout_and_resume_across_dp(files, tok):
    """Window-level shuffling (4 documents in flight per stream) and a 0.7/0.3 mixture of two
    sources keep the stream a function of the global window index: the same global batches at
    DP 1, 2, 4 and any micro-batch, and exact resume across DP degrees."""
    mix = f"{files['jsonl']}:0.7,{files['arrow_file_large']}:0.3"
    for spec, shuffle in ((files["jsonl"], 4), (mix, 2)):
        c = lambda mb: cfg(spec, micro_batch=mb, shuffle=shuffle)
        ref, _, ref_stats = global_batches(c(1), tok, 1, 24)
        plain, _, _ = global_batches(cfg(files["jsonl"]), tok, 1, 24)
        assert not all(torch.equal(a, b) for a, b in zip(ref, plain))         # the order did change
        for dp, mb in ((2, 2), (4, 1)):
            got, _, stats = global_batches(c(mb), tok, dp, 24)
            assert all(torch.equal(a, b) for a, b in zip(ref, got)) and stats == ref_stats, (spec, dp, mb)
        _, saved, _ = global_batches(c(2), tok, 2, 10)
        got, _, stats = global_batches(c(1), tok, 4, 14, resume=saved)
        assert all(torch.equal(a, b) for a, b in zip(ref[10:], got)) and stats == ref_stats, spec
    # The mixture: lanes of source 1 read only its documents; the windows each source gave (summed
    # over the DP ranks' states) are what mixture_counts() recomputes from the hash for the log.
    loaders = [data.PackedLoader(cfg(mix, micro_batch=2, shuffle=2), tok, r, 2, prefetch=0) for r in range(2)]
    assert all(d >= len(DOCS) for lane in loaders[0].lane_ids if lane % 4 >= 2 for d in loaders[0].documents(lane, 0))
    take(loaders[0], 30)
    take(loaders[1], 30)
    by_source = np.sum([x.stats()["windows_by_source"] for x in loaders], axis=0)
    assert by_source.tolist() == loaders[0].mixture_counts(30).tolist() and by_source.sum() == 120
    # Realized proportions over 20,000 windows: within 4 binomial standard deviations of 0.7.
    n = loaders[0].mixture_counts(5000)
    assert abs(n[0] / n.sum() - 0.7) < 4 * (0.7 * 0.3 / n.sum()) ** 0.5, n
    with pytest.raises(data.DataError, match="every source a weight"):
        data.Corpus(f"{files['jsonl']}:0.7,{files['arrow_file_large']}")


def test_eval_windows_are_the_same_at_every_layout(files, tok):
    """Evaluation is a property of the model: the held-out windows split over DP ranks and padded
    to micro-batches give the same windows and the same loss at every DP degree and micro-batch."""
    from model import Llama
    import parallel
    import train
    c = lambda mb: cfg(files["txt"], val_fraction=0.3, micro_batch=mb)
    m = Llama(ModelConfig(vocab_size=VOCAB, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64,
                          max_seq_len=SEQ)).init_weights(0)
    one = data.EvalWindows(c(7), tok, 7)                # one process, one micro-batch of all 7
    ref = train.evaluate(m, one, len(one), parallel.Grid(), torch.device("cpu"))
    windows = one.batches[0]["tokens"]
    for dp, mb in ((1, 2), (2, 3), (3, 2), (4, 1), (8, 1)):
        ranks = [data.EvalWindows(c(mb), tok, 7, r, dp) for r in range(dp)]
        assert len({len(x) for x in ranks}) == 1                             # every rank: as many batches
        real = torch.cat([b["tokens"][(b["targets"] != -100).any(1)] for x in ranks for b in x.batches])
        assert torch.equal(real, windows), (dp, mb)
        total = count = 0.0                     # train.evaluate's sums, all-reduced over the ranks
        with torch.no_grad():
            for x in ranks:
                for b in x.batches:
                    total += float(m(b["tokens"], b["positions"], b["doc_ids"], b["targets"]))
                    count += int((b["targets"] != -100).sum())
        assert total / count == pytest.approx(float(ref), rel=1e-6), (dp, mb)


def test_formats_yield_identical_batches(files, tok):
    ref = take(data.PackedLoader(cfg(files["txt"], micro_batch=2), tok, dp_rank=1, dp_size=2), 40)
    for fmt, spec in files.items():
        got = take(data.PackedLoader(cfg(spec, micro_batch=2), tok, dp_rank=1, dp_size=2), 40)
        assert equal(ref, got), fmt


def test_mixed_sources_dir_glob_and_list(files):
    spec = f"{files['jsonl']},{os.path.dirname(files['txt_lines'])}/*.parquet"
    corpus = data.Corpus(spec)
    assert corpus.n_docs == 2 * len(DOCS)
    assert [t for t, _, _ in corpus.read(np.array([3, len(DOCS) + 3]))] == [DOCS[3], DOCS[3]]
    assert data.Corpus(files["txt"]).n_docs == len(DOCS)          # a directory, recursively


# ----------------------------------------------------------------------------- resume

def test_resume_mid_document_with_prefetch_thread(files, tok):
    c = cfg(files["arrow_stream_hf_dir"], micro_batch=2)
    straight = take(data.PackedLoader(c, tok, dp_rank=1, dp_size=2), 60)
    a = data.PackedLoader(c, tok, dp_rank=1, dp_size=2, prefetch=8)
    for n in range(1, 50):
        next(a)
        sd = a.state_dict()
        if max(p["offset"] for p in sd["streams"].values()) > 3 * SEQ:     # inside a long document
            break
    assert max(p["offset"] for p in sd["streams"].values()) > 3 * SEQ
    stats_then = a.stats()
    a.close()
    sd = json.loads(json.dumps(sd))                 # plain data: goes in any checkpoint
    b = data.PackedLoader(c, tok, dp_rank=1, dp_size=2)
    b.load_state_dict(sd)
    assert b.stats() == stats_then
    assert equal(take(b, 60 - n), straight[n:])
    ref = data.PackedLoader(c, tok, dp_rank=1, dp_size=2, prefetch=0)
    take(ref, 60)
    assert b.stats() == ref.stats()


def test_resume_at_epoch_boundary(files, tok):
    c = cfg(files["jsonl"], micro_batch=1)          # 4 streams, round-robin: stream 0 is every 4th window
    a = data.PackedLoader(c, tok)
    n = len(reference_stream(tok, DOCS, a.documents(0, 0))[0]) // (SEQ + 1)
    straight = take(a, 4 * n + 10)
    assert not np.array_equal(a.documents(0, 0), a.documents(0, 1))      # reshuffled per epoch
    b = data.PackedLoader(c, tok)
    take(b, 4 * (n - 1) + 1)                        # exactly the end of stream 0's epoch 0
    sd = b.state_dict()
    b.close()
    r = data.PackedLoader(c, tok)
    r.load_state_dict(sd)
    assert equal(take(r, 10), straight[4 * (n - 1) + 1:][:10])
    assert r.state_dict()["streams"]["0"]["epoch"] == 1


def test_resume_refuses_other_global_batch_seed_or_rank(files, tok):
    a = data.PackedLoader(cfg(files["txt"]), tok, dp_rank=0, dp_size=2)
    take(a, 3)
    b = data.PackedLoader(cfg(files["txt"], global_batch=8), tok, dp_rank=0, dp_size=2)
    with pytest.raises(data.DataError, match="saved with 4 streams.*has 8.*--ckpt.reset_data"):
        b.load_state_dict(a.state_dict())
    c = data.PackedLoader(cfg(files["txt"], seed=8), tok, dp_rank=0, dp_size=2)
    with pytest.raises(data.DataError, match="seed=7"):
        c.load_state_dict(a.state_dict())
    d = data.PackedLoader(cfg(files["txt"]), tok, dp_rank=1, dp_size=2)
    with pytest.raises(data.DataError, match=r"no position for streams \[2, 3\]"):
        d.load_state_dict(a.state_dict())


# ----------------------------------------------------------------------------- split, batches, model

def test_val_split_held_out_fixed_and_cycled(files, tok):
    train, val = data.split_documents(1000, 0.05)
    assert not set(train) & set(val) and len(train) + len(val) == 1000 and 30 < len(val) < 70
    assert np.array_equal(val, data.split_documents(1000, 0.05)[1])
    assert len(data.split_documents(5, 0.01)[1]) == 1                 # never empty for a tiny corpus
    v = data.PackedLoader(cfg(files["txt"], micro_batch=2), tok, split="val", dp_rank=0, dp_size=2)
    assert set(v.documents(0, 0)) <= set(data.split_documents(len(DOCS), 0.1)[1].tolist())
    assert np.array_equal(v.documents(0, 0), v.documents(0, 5))         # val order never changes
    first = take(v, 3)
    v.reset()
    assert equal(take(v, 3), first)


def test_packed_batch_matches_separate_documents_in_the_model(files, tok):
    """Positions and doc_ids make a packed window compute what each document computes alone."""
    from model import Llama
    b = next(data.PackedLoader(cfg(files["txt"], micro_batch=4), tok))
    assert all(b[k].dtype == torch.int64 and b[k].shape == (4, SEQ) for k in b)
    row = int(torch.argmax((b["doc_ids"].max(1).values >= 1).int()))  # a window holding a document start
    torch.manual_seed(0)
    m = Llama(ModelConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                          max_seq_len=SEQ)).init_weights(0).eval()
    with torch.no_grad():
        packed = m(b["tokens"][row:row + 1], b["positions"][row:row + 1], b["doc_ids"][row:row + 1])[0]
        for d in b["doc_ids"][row].unique():
            sel = b["doc_ids"][row] == d
            alone = m(b["tokens"][row:row + 1, sel])[0]
            torch.testing.assert_close(packed[sel], alone, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- bad input

def behind(loader):
    """How often each document is fully behind the loader's position, over its streams and epochs."""
    n = np.zeros(loader.corpus.n_docs, np.int64)
    for s, p in loader.state_dict()["streams"].items():
        for e in range(p["epoch"] + 1):
            np.add.at(n, loader.documents(int(s), e)[:None if e < p["epoch"] else p["doc"]], 1)
    return n


def test_empty_files_empty_docs_and_bad_utf8_are_counted(tok, tmp_path, capsys):
    d = tmp_path / "bad"
    d.mkdir()
    (d / "a_empty.txt").write_bytes(b"")
    (d / "b_blank.txt").write_bytes(b"  \n\t\n")
    (d / "c.txt").write_bytes(("x = 1 " * 40).encode() + b"caf\xe9 \xff\xfe end")
    (d / "d.jsonl").write_bytes(b'{"text": "' + b"print(1) " * 30 + b'\xc3"}\n\n{"text": ""}\n')
    c = cfg(str(d), seq_len=8, global_batch=2, val_fraction=0.0)
    loader = data.PackedLoader(c, tok, prefetch=0)
    # documents: 0 b_blank, 1 c, 2-4 the jsonl lines (text, blank line, empty text)
    assert [t for t, _, _ in loader.corpus.read(range(5))][2:] == ["print(1) " * 30 + "\ufffd", "", ""]
    while loader.stats()["epoch"] == 0:
        next(loader)
    st, n = loader.stats(), behind(loader)
    assert st["empty_files"] == 1
    assert st["empty_docs"] == n[0] + n[3] + n[4] and st["documents"] == n[1] + n[2]
    assert st["utf8_replacements"] == 3 * n[1] + n[2]               # \xe9 \xff \xfe, \xc3
    err = capsys.readouterr().err
    assert "c.txt" in err and "invalid UTF-8" in err and "1 empty files skipped" in err


def test_bad_jsonl_line_is_skipped_counted_and_named(tok, tmp_path, capsys):
    p = tmp_path / "x.jsonl"
    p.write_text('{"text": "a b c d e f g h i j k l m n o p"}\n{"text": "q r s t u v"}\n'
                 '{not json\n{"body": "no text"}\n{"text": "w x \\udc80 y z"}\n')     # a lone surrogate
    loader = data.PackedLoader(cfg(str(p), seq_len=4, global_batch=2, val_fraction=0.0), tok, prefetch=0)
    while loader.stats()["epoch"] == 0:
        next(loader)
    st, n = loader.stats(), behind(loader)
    assert st["bad_records"] == n[2] + n[3] and st["documents"] == n[0] + n[1] + n[4]
    assert st["utf8_replacements"] == n[4]
    err = capsys.readouterr().err
    assert "x.jsonl:3: not JSON" in err and "x.jsonl:4: no field 'text'" in err
    p.write_text('{not json\n')
    with pytest.raises(data.DataError, match=r"x.jsonl:1: not JSON"):
        data.Corpus(str(p))


def test_rank_share_below_one_window_fails_through_the_thread(tok, tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": " ".join(WORDS * 4)}) + "\n" + '{"text": "a"}\n')
    c = cfg(str(tmp_path / "d.jsonl"), seq_len=16, global_batch=2, val_fraction=0.0)
    failed, tiny, threads = [], None, []
    for r in (0, 1):
        loader = data.PackedLoader(c, tok, dp_rank=r, dp_size=2, prefetch=2)
        if loader.documents(r, 0).tolist() == [1]:   # stream r is rank r's (global batch 2, dp 2)
            tiny = r                                    # this rank holds only the 3-token document
        try:
            take(loader, 3)
        except data.DataError as e:
            assert f"stream {r} of the train split" in str(e) and "fewer than seq_len + 1 = 17 tokens" in str(e)
            failed.append(r)
            with pytest.raises(data.DataError):        # stays failed
                next(loader)
        threads.append(loader._thread)
        loader.close()
    assert failed == [tiny]
    assert all(t is not None and not t.is_alive() for t in threads)                # close() stopped them


def test_missing_text_column_names_the_columns(tmp_path):
    pq.write_table(pa.table({"content": ["a"], "id": [1]}), str(tmp_path / "t.parquet"))
    with pytest.raises(data.DataError, match=r"no column 'text'.*\['content', 'id'\].*text_field"):
        data.Corpus(str(tmp_path / "t.parquet"))
    schema = pa.schema({"body": pa.large_string()})
    with pa.OSFile(str(tmp_path / "t.arrow"), "wb") as s, pa.ipc.new_stream(s, schema) as w:
        w.write_batch(pa.record_batch([pa.array(["a"], pa.large_string())], schema=schema))
    with pytest.raises(data.DataError, match=r"\['body'\]"):
        data.Corpus(str(tmp_path / "t.arrow"))
    (tmp_path / "t.jsonl").write_text('{"body": "a"}\n')
    with pytest.raises(data.DataError, match=r"t.jsonl:1: no text field 'text'.*\['body'\]"):
        data.Corpus(str(tmp_path / "t.jsonl"))


def test_refusals_before_training(files, tok, cache, tmp_path):
    with pytest.raises(data.DataError, match=f"{VOCAB} pieces but the model's vocab_size is 300"):
        data.build_tokenizer(DataConfig(tokenizer=tok.path), vocab_size=300)
    with pytest.raises(data.DataError, match=r"has [\d,]+ tokens .* needs global_batch 5000 x \(seq_len 32 \+ 1\) = 165,000"):
        data.PackedLoader(cfg(files["txt"], global_batch=5000), tok)
    with pytest.raises(data.DataError, match="does not exist"):
        data.Corpus(files["txt"] + "/nope.txt")
    (tmp_path / "t.csv").write_text("a,b\n")
    with pytest.raises(data.DataError, match="t.csv: unsupported file type"):
        data.Corpus(f"{files['jsonl']},{tmp_path / 't.csv'}")
    with pytest.raises(data.DataError, match="for 200 streams"):
        data.PackedLoader(cfg(files["txt"], global_batch=200), tok, dp_rank=0, dp_size=200)
    with pytest.raises(data.DataError, match="could not train a 100000-piece tokenizer"):
        data.build_tokenizer(DataConfig(data=files["jsonl"], cache_dir=cache), 100000)


# ----------------------------------------------------------------------------- tokenizer, prepare, device

def test_tokenizer_trained_exactly_cached_and_deterministic(files, tok, cache, tmp_path, capsys):
    assert tok.vocab_size == VOCAB and (tok.bos_id, tok.eos_id) == (1, 2)
    text = "def f(x):\n\treturn  café 中文 ✓ 42\n"        # indentation, accents, unseen char (bytes)
    assert tok.decode(tok.encode(text)) == text
    again = data.build_tokenizer(DataConfig(data=files["txt"], cache_dir=cache, val_fraction=0.1), VOCAB)
    assert again.path == tok.path and "training" not in capsys.readouterr().err     # from the cache
    corpus = data.Corpus(files["txt"])
    data.train_tokenizer(corpus, data.split_documents(corpus.n_docs, 0.1)[0], VOCAB, str(tmp_path / "b.model"))
    assert data.Tokenizer(str(tmp_path / "b.model")).fingerprint == tok.fingerprint
    # A given .model (here ours: the same settings as Llama 2's tokenizer.model) loads as is.
    assert data.build_tokenizer(DataConfig(tokenizer=tok.path), VOCAB).fingerprint == tok.fingerprint


def test_prepare_writes_one_large_string_arrow(files, tmp_path, capsys):
    out = str(tmp_path / "all.arrow")
    data.main(["prepare", files["jsonl"], files["parquet"], "--out", out])
    assert "[prepare]" in capsys.readouterr().err
    table = pa.ipc.open_stream(pa.memory_map(out)).read_all()
    assert table.schema.field("text").type == pa.large_string()
    assert table.column("text").to_pylist() == DOCS + DOCS
    with pytest.raises(SystemExit, match="exists; pass --force"):
        data.main(["prepare", files["jsonl"], "--out", out])


def test_stdlib_corpus_smoke():
    corpus = data.Corpus("stdlib")
    assert corpus.n_docs > 500
    assert not any("site-packages" in p for p in data.stdlib_files())
    assert "import" in corpus.read([corpus.n_docs // 2])[0][0]


def test_device_loader_cpu_keeps_state_of_handed_batch(files, tok):
    loader = data.PackedLoader(cfg(files["txt"], micro_batch=2), tok, prefetch=4)
    dl = data.to_device_loader(loader, torch.device("cpu"))
    b = take(dl, 3)
    ref = data.PackedLoader(cfg(files["txt"], micro_batch=2), tok, prefetch=0)
    assert equal(b, take(ref, 3)) and dl.state_dict() == ref.state_dict()


XLA_SCRIPT = r"""
import sys, time, torch, torch_xla
sys.path.insert(0, sys.argv[1])
import data
from configs import DataConfig
c = DataConfig(data=sys.argv[2], seq_len=32, micro_batch=2, global_batch=4, val_fraction=0.1, seed=7)
tok = data.Tokenizer(sys.argv[3])
dl = data.to_device_loader(data.PackedLoader(c, tok), torch_xla.device())
got = [next(dl) for _ in range(5)]
ref = data.PackedLoader(c, tok, prefetch=0)
want = [next(ref) for _ in range(5)]
assert all(g[k].device.type == "xla" and torch.equal(g[k].cpu(), w[k]) for g, w in zip(got, want) for k in w)
assert dl.state_dict() == ref.state_dict(), "state must be that of the batch handed to training"
for _ in range(100):                 # MpDeviceLoader's thread reads ahead of training (give it time)
    if dl.loader.stats()["windows"] > ref.stats()["windows"]:
        break
    time.sleep(0.05)
assert dl.loader.stats()["windows"] > ref.stats()["windows"], "MpDeviceLoader should have read ahead"
print("XLA_OK")
"""


def test_device_loader_xla_uses_mpdeviceloader(files, tok):
    pytest.importorskip("torch_xla")
    env = {**os.environ, "PJRT_DEVICE": "CPU", "OMP_NUM_THREADS": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", XLA_SCRIPT, root, files["txt"], tok.path], env=env,
                       capture_output=True, text=True, timeout=300)
    assert "XLA_OK" in r.stdout, r.stdout + r.stderr


def test_datasets_folders_read_as_datasets_would(tmp_path):
    """A DatasetDict trains on its train split unless --data.split says otherwise; a cloned dataset
    repository yields its data files' documents only (not README.md or the loading script), of the
    split asked for."""
    datasets = pytest.importorskip("datasets")
    train, test = DOCS[:80], DOCS[80:]
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": train}),
                               "test": datasets.Dataset.from_dict({"text": test})})
    dd.save_to_disk(str(tmp_path / "dd"))

    def texts(spec, **kw):
        c = data.Corpus(spec, **kw)
        return [t for t, _, _ in c.read(np.arange(c.n_docs))]
    assert texts(str(tmp_path / "dd")) == train
    assert texts(str(tmp_path / "dd"), split="test") == test
    with pytest.raises(data.DataError, match="splits train, test, not 'validation'; choose one with --data.split"):
        data.Corpus(str(tmp_path / "dd"), split="validation")
    repo = tmp_path / "repo"                     # the layout of a dataset repository on the Hub
    os.makedirs(repo / "data")
    (repo / "README.md").write_text("---\nlicense: mit\n---\n# A dataset card, not a document\n")
    (repo / "repo.py").write_text("import datasets  # a loading script\n")
    (repo / ".gitattributes").write_text("*.parquet filter=lfs\n")
    dd["train"].to_parquet(str(repo / "data" / "train-00000-of-00001.parquet"))
    dd["test"].to_parquet(str(repo / "data" / "test-00000-of-00001.parquet"))
    assert texts(str(repo)) == train
    assert texts(str(repo), split="test") == test
    cfg = DataConfig(data=str(tmp_path / "dd"), split="test", seq_len=SEQ)
    assert data.Corpus(cfg.data, cfg.text_field, cfg.doc_per_line, cfg.split).n_docs == len(test)


def test_long_document_packed_piece_by_piece_bounded_and_resumed(tok, tmp_path, monkeypatch):
    """A 1 MB document in one line, cut into 20,000-character pieces: the windows are those of the
    document encoded whole, a resume inside it is exact, and the lane never holds more than one
    window plus one piece of its tokens."""
    monkeypatch.setattr(data, "PIECE_CHARS", 20_000)
    rng = np.random.default_rng(3)
    long = " ".join(w for w in rng.choice(WORDS, 300_000) if w.strip())     # clean spaces: exact cuts
    assert len(long) > 40 * data.PIECE_CHARS
    docs = DOCS[:6] + [long] + DOCS[6:12]
    (tmp_path / "lines.txt").write_text("\n".join(docs) + "\n")
    c = DataConfig(data=str(tmp_path / "lines.txt"), doc_per_line=True, seq_len=1024, micro_batch=1,
                   global_batch=1, val_fraction=0.0, shuffle=1, seed=7)
    a = data.PackedLoader(c, tok, prefetch=0)
    ref, starts = reference_stream(tok, docs, a.documents(0, 0))     # every document encoded whole
    L1, n = c.seq_len + 1, len(ref) // (c.seq_len + 1)
    got, states = [], []
    for _ in range(n):
        got.append(next(a))
        states.append(a.state_dict())
    want = [data.PackedLoader._batch([(ref[i * L1:(i + 1) * L1], starts[i * L1:(i + 1) * L1])]) for i in range(n)]
    assert equal(got, want)
    assert a.most_held <= L1 + data.PIECE_CHARS + 2 and a.most_held < len(ref) / 20
    # resume inside the long document, between piece boundaries, and read on into the next epoch
    k = next(i for i, s in enumerate(states) if s["streams"]["0"]["offset"] > 3 * data.PIECE_CHARS // 2)
    b = data.PackedLoader(c, tok, prefetch=0)
    b.load_state_dict(json.loads(json.dumps(states[k])))
    assert equal(take(b, n - k - 1), got[k + 1:])
    assert b.stats() == a.stats() and b.most_held <= L1 + data.PIECE_CHARS + 2
    assert equal(take(b, 5), take(a, 5))
