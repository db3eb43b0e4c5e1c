"""spans.py, the order: the permutation is a bijection computed per index; the deal of spans to lanes covers every
span once per epoch (more lanes than spans too), reshuffled each epoch; lanes and held-out rules."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import spans  # noqa: E402


@pytest.mark.parametrize("n", [1, 2, 3, 1000, 2 ** 20 + 7])
def test_permutation_is_a_bijection(n):
    p = spans.permute(np.arange(n), n, (1234, 0))
    assert np.array_equal(np.sort(p), np.arange(n))
    # per index, in any order and any pieces: the same images (nothing materialized)
    idx = np.random.default_rng(0).integers(0, n, 100)
    assert np.array_equal(spans.permute(idx, n, (1234, 0)), p[idx])


@pytest.mark.parametrize("n,group", [(2, 0), (5, 3), (75, 0), (75, 2), (4097, 1)])
def test_a_read_over_many_epochs_permutes_each_index_by_its_own_epochs_key(n, group):
    """positions() permutes a read in one pass, each index with its epoch's key (a source of few spans
    has hundreds of epochs in a read): the same spans as one permute call per epoch with a scalar key."""
    deal = spans.Deal(lo=10, n=n, lanes=3, shuffled=True, seed=2 ** 62 + 5, group=group)
    got, epochs = spans.positions(deal, 1, 12_345, 4096)
    k = 1 + (12_345 + np.arange(4096)) * 3
    assert np.array_equal(epochs, k // n) and len(np.unique(epochs)) >= min(4096, 3 * 4096 // n)
    for e in np.unique(epochs):
        at = epochs == e
        key = (deal.seed, int(e)) + ((group,) if group else ())
        assert np.array_equal(got[at], 10 + spans.permute(k[at] % n, n, key))


def test_permutation_depends_on_the_key_and_looks_random():
    n = 10_000
    a, b = spans.permute(np.arange(n), n, (1, 0)), spans.permute(np.arange(n), n, (1, 1))
    assert np.mean(a == b) < 0.01 and np.mean(a == np.arange(n)) < 0.01
    assert abs(np.corrcoef(np.arange(n), a)[0, 1]) < 0.05          # no trace of the identity
    with pytest.raises(ValueError):
        spans.permute(np.array([1]), 1, (0,))


@pytest.mark.parametrize("n,lanes", [(10, 3), (7, 7), (3, 16), (1, 4), (1000, 64)])
def test_deal_covers_every_span_once_per_epoch_and_reshuffles(n, lanes):
    """Lane j reads positions j, j + lanes, ...: over the lanes, the first E epochs' positions hold
    every span exactly E times, each epoch in its own order; more lanes than spans is fine."""
    deal = spans.Deal(lo=5, n=n, lanes=lanes, shuffled=True, seed=3)
    E = 3
    per_lane = -(-E * n // lanes)
    k, read, epochs = [], [], []
    for j in range(lanes):
        s, e = spans.positions(deal, j, 0, per_lane)
        k += (j + np.arange(per_lane) * lanes).tolist()
        read += s.tolist()
        epochs += e.tolist()
    k, read, epochs = map(np.array, (k, read, epochs))
    seq = read[np.argsort(k)][:E * n].reshape(E, n)             # the endless sequence, epoch by epoch
    for e in range(E):
        assert sorted(seq[e]) == list(range(5, 5 + n))
    if n > 2:
        assert not np.array_equal(seq[0], seq[1])                 # reshuffled per epoch
    # reads in pieces give the same spans (a resume re-derives them)
    s1, _ = spans.positions(deal, lanes - 1, 0, per_lane)
    s2 = np.concatenate([spans.positions(deal, lanes - 1, i, 1)[0] for i in range(per_lane)])
    assert np.array_equal(s1, s2)


def test_unshuffled_deal_is_corpus_order_cycled():
    deal = spans.Deal(lo=10, n=4, lanes=1, shuffled=False)
    assert spans.positions(deal, 0, 2, 6)[0].tolist() == [12, 13, 10, 11, 12, 13]


def test_held_out_rules():
    assert spans.tail_spans(1, 100, 0.01) == 1 and spans.tail_spans(3, 100, 0.1) == 10
    assert spans.tail_spans(1, 1, 0.5) == 0 and spans.tail_spans(3, 100, 0.0) == 0
    assert spans.by_hash(100_000, 0.01) and spans.tail_spans(100_000, 100_000, 0.01) == 0
    # docs/data.md: by hash from "at least 64 expected held-out documents" on: 64 exactly is by hash
    assert spans.by_hash(128, 0.5) and spans.tail_spans(128, 1000, 0.5) == 0
    assert not spans.by_hash(127, 0.5) and spans.tail_spans(127, 1000, 0.5) == 500
    v = spans.held_out(np.arange(100_000), 0.05)
    assert abs(v.mean() - 0.05) < 0.005
    # each document by its own hash: neighbours (a book's chapters, a source's consecutive records) agree only by chance
    v = spans.held_out(np.arange(100_000), 0.5)
    assert abs((v[0::2] == v[1::2]).mean() - 0.5) < 0.02 and abs((v[:-3] == v[3:]).mean() - 0.5) < 0.02
    assert spans.lanes_per_stream(100, 16, 8) == 6 and spans.lanes_per_stream(5, 16, 8) == 1


def test_spans_are_cut_only_at_a_space_between_two_non_space_bytes():
    """cut_points' rule (corpus.iter_pieces' in bytes): a cut takes a space with a non-space byte on each side,
    where the tokenizers merge nothing across it. A space beside a newline, a tab or another space is not one:
    cut there, the two spans tokenize the run of whitespace otherwise than the whole document does."""
    rng = np.random.default_rng(3)
    seps = [b" "] * 4 + [b"  ", b" \n", b"\n ", b" \t", b"\t ", b"\n\n", b" \n "]
    raw = b"".join(b"w" * int(rng.integers(1, 12)) + seps[int(rng.integers(len(seps)))] for _ in range(6000))
    cuts = spans.cut_points(raw, 256)       # a clean space in every 128 bytes here: no hard cut
    assert len(cuts) > 150
    bounds = [0, *cuts, len(raw)]
    assert max(b - a for a, b in zip(bounds, bounds[1:])) <= 256
    ws = b" \t\n\r\x0b\x0c"
    bad = [c for c in cuts if raw[c] != 32 or raw[c - 1] in ws or raw[c + 1] in ws]
    assert not bad, [raw[c - 3:c + 4] for c in bad[:5]]


def test_a_span_is_hard_cut_only_where_its_second_half_holds_no_clean_space():
    """Over limit/2 bytes without a clean space the span is cut hard at the limit (one word split), not at
    a clean space early in it: that would leave a span of a few bytes, an index of many more spans."""
    assert spans.cut_points(b"ab " + b"w" * 300, 128) == [128, 256]
    assert spans.cut_points(b"w" * 70 + b" " + b"w" * 100, 128) == [70]


def test_a_hard_cut_falls_between_characters():
    """A word longer than the span is cut at a character boundary: each span decodes as UTF-8 on its own."""
    raw = ("日本語のテキスト" * 60).encode()     # 3-byte characters, no space: every cut is hard
    bounds = [0, *spans.cut_points(raw, 128), len(raw)]
    assert len(bounds) > 10 and max(b - a for a, b in zip(bounds, bounds[1:])) <= 128
    for a, b in zip(bounds, bounds[1:]):
        raw[a:b].decode("utf-8")            # raises inside a character


def test_a_document_cut_a_read_block_at_a_time_is_cut_as_a_whole(monkeypatch):
    """doc_cuts reads a long document a block at a time: its cuts are those of the whole document, wherever the
    blocks end (a block ending right after a span's last byte cannot yet tell whether that byte's space is clean)."""
    rng = np.random.default_rng(5)
    raw = b"".join(b"w" * int(rng.integers(1, 9)) + (b" " if rng.random() < 0.8 else b"\n") for _ in range(700))
    limit, whole = 128, spans.cut_points(raw, 128)

    class Blocks:
        def raw_blocks(self, doc, n):
            for i in range(0, len(raw), n):
                yield raw[i:i + n], i + n >= len(raw)
    for n in range(limit // 2, 3 * limit):
        monkeypatch.setattr(spans, "READ_BYTES", n)
        assert spans.doc_cuts(Blocks(), 0, limit) == whole, n


def test_the_content_digest_sees_two_documents_lengths_moved_past_its_text_sample(tmp_path, monkeypatch):
    """A corpus of more spans than SAMPLE_SPANS: a .txt file rewritten at its size with a word moved from one short
    document to the next (a line break moved), both outside the sampled spans, cuts the same rows (one span each)
    and the sample reads the same text: only the documents' lengths in the digest tell the content apart, so a
    resume over it is refused (data.PackedLoader: 'content=')."""
    from corpus import Corpus
    monkeypatch.setattr(spans, "SAMPLE_SPANS", 4)
    lines = [f"doc{i} alpha beta" for i in range(40)]
    f = tmp_path / "lines.txt"
    f.write_text("\n".join(lines) + "\n")
    before = spans.SpanIndex(Corpus(str(f), doc_per_line=True, cache_dir=str(tmp_path / "a")), 8, str(tmp_path / "a"))
    sampled = set(np.linspace(0, 39, 4).astype(np.int64).tolist())
    k = 20
    assert before.n_spans == 40 and not {k, k + 1} & sampled
    lines[k], lines[k + 1] = f"doc{k} alpha", f"beta doc{k + 1} alpha beta"      # one word moved to the next line
    f.write_text("\n".join(lines) + "\n")
    after = spans.SpanIndex(Corpus(str(f), doc_per_line=True, cache_dir=str(tmp_path / "b")), 8, str(tmp_path / "b"))
    assert np.array_equal(np.asarray(before.rows), np.asarray(after.rows)) and after.bytes == before.bytes
    assert after.content != before.content


def test_the_content_digest_reads_the_text_of_every_span_of_a_corpus_of_up_to_sample_spans(tmp_path):
    """Up to SAMPLE_SPANS spans the digest reads every span's text (sure, not a sample): one word of a middle
    document replaced by another as long (the same lengths, the same cuts) gives another digest."""
    from corpus import Corpus
    lines = [f"doc{i:03d} alpha beta" for i in range(100)]
    f = tmp_path / "lines.txt"
    f.write_text("\n".join(lines) + "\n")
    before = spans.SpanIndex(Corpus(str(f), doc_per_line=True, cache_dir=str(tmp_path / "a")), 8, str(tmp_path / "a"))
    lines[50] = "doc050 gamma beta"
    f.write_text("\n".join(lines) + "\n")
    after = spans.SpanIndex(Corpus(str(f), doc_per_line=True, cache_dir=str(tmp_path / "b")), 8, str(tmp_path / "b"))
    assert before.n_spans == 100 <= spans.SAMPLE_SPANS and np.array_equal(np.asarray(before.rows), np.asarray(after.rows))
    assert after.content != before.content


def test_blank_reads_a_document_in_blocks_as_whole_whatever_a_block_cuts():
    """spans.blank, a block at a time with one decoder (doc_cuts: documents over READ_BYTES), says of a document what
    str.isspace says of its text, wherever a block ends: inside a U+3000 too (its first bytes at a block's end read
    as text before: a blank document of them cut into spans and tokenized)."""
    import codecs
    for doc in (" " * 5 + "\u3000" * 3, " \u3000x", "\u3000\n\u2003 ", "a", " " * 4):
        raw = doc.encode()
        for cut in range(len(raw) + 1):
            dec = codecs.getincrementaldecoder("utf-8")("replace")
            assert (spans.blank(raw[:cut], dec, False) & spans.blank(raw[cut:], dec, True)) == doc.isspace(), (doc, cut)
        assert spans.blank(raw) == doc.isspace(), doc
