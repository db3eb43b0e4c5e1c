"""The span index: every document of a corpus cut into spans, the unit the data stream shuffles and deals.

A span is a bounded piece of one document: at most span_bytes(seq_len) = 16 x seq_len bytes (~4
windows of text), cut only where tokenization does not cross the cut (cut_points), so a
document's spans, tokenized and joined, are the document tokenized. A
document shorter than that is one span. So a single 1 MB text file is ~250 spans at seq_len 256,
spread over every stream and lane like a folder of 250 files, and no stream ever holds a whole
long document.

The index is one file per corpus (and span size) in the cache directory, next to the tokenizer:
rows of (document, first byte, end byte or -1 = to the document's end), int64, in corpus order.
It is built once, streamed (a block of documents at a time: bounded memory, whatever the corpus),
under a lock (one process of a node builds, the others wait), and memory-mapped by every rank:
the page cache holds it once per node, and a rank touches only the pages of the spans it reads.
At 1e9 documents: ~24 GB on disk per corpus, ~0 private bytes per rank.

The held-out split is by spans too (order.by_hash / tail_spans): whole documents by hash for a
corpus of many documents, the last spans for a corpus of few (one book: its last 1%).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
import time

import numpy as np

from corpus import Corpus, DataError
from order import by_hash, held_out, tail_spans
from sources import give_back_heap

INDEX_VERSION = 1
BLOCK = 1 << 18             # documents per block while building: ~6 MB of rows in memory at once
READ_BYTES = 1 << 26        # bytes of long documents read at once while building (a longer one alone)


_SPACES = np.frombuffer(b" \t\n\r\x0b\x0c", np.uint8)


def cut_points(raw: bytes, limit: int) -> list[int]:
    """Where to cut a document's bytes into spans of at most `limit` bytes that, tokenized and
    joined, are the document tokenized (iter_pieces' rule, in bytes): at a space between two
    non-space bytes, the space opening the next span (a tokenizer with a dummy prefix, as
    sentencepiece's, drops it and adds it back; a byte-level one keeps it: its pre-tokenizer starts
    a piece there). A stretch of over limit/2 bytes without such a space is cut where it is, at a
    UTF-8 character boundary: there the next span's first word is split, the only difference.
    Returns the start of every span after the first."""
    if len(raw) <= limit:
        return []
    b = np.frombuffer(raw, np.uint8)
    ws = np.isin(b, _SPACES)
    clean = np.flatnonzero((b[1:-1] == 32) & ~ws[:-2] & ~ws[2:]) + 1
    cuts, start = [], 0
    while len(b) - start > limit:
        k = np.searchsorted(clean, start + limit, side="right") - 1
        if k >= 0 and clean[k] > start + limit // 2:
            cut = int(clean[k])
        else:
            cut = start + limit
            while cut > start + 1 and b[cut] & 0xC0 == 0x80:     # not inside a character
                cut -= 1
        cuts.append(cut)
        start = cut
    return cuts


def span_bytes(seq_len: int) -> int:
    """Bytes of text per span: ~4 windows at ~4 bytes per token, at least 4 KiB."""
    return max(4096, 16 * seq_len)


class SpanIndex:
    """rows[s] = (document, first byte, end byte or -1) of span s, memory-mapped. Also the split:
    is_val(spans), the span ranges of a mixture's sources, and the corpus's size in bytes."""

    def __init__(self, corpus: Corpus, seq_len: int, cache_dir: str, val_fraction: float = 0.0):
        self.corpus, self.span_bytes, self.val_fraction = corpus, span_bytes(seq_len), val_fraction
        self.path = self.path_for(corpus, seq_len, cache_dir)
        self.key = os.path.basename(self.path)[6:-4]
        os.makedirs(cache_dir, exist_ok=True)
        with open(self.path + ".lock", "w") as lock:        # every rank of a node at once: one builds
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not os.path.exists(self.path):
                self._build()
                give_back_heap()
        with open(self.path + ".json") as f:
            self.meta = json.load(f)
        self.n_spans, self.bytes = self.meta["spans"], self.meta["bytes"]
        if self.meta.get("documents") != corpus.n_docs or os.path.getsize(self.path) != 24 * self.n_spans:
            raise DataError(f"the span index {self.path} does not match the corpus {corpus.spec!r}; delete it "
                            f"(rm {self.path}*) and it is built again")
        self.rows = np.memmap(self.path, np.int64, "r", shape=(self.n_spans, 3))
        self.hashed = by_hash(corpus.n_docs, val_fraction)
        self.tail = tail_spans(corpus.n_docs, self.n_spans, val_fraction)
        # A mixture's sources are ranges of documents, so ranges of spans: a binary search in the map
        # (np.searchsorted would copy the strided column: 8 bytes a span).
        self.groups = [(self.first_span(lo), self.first_span(hi)) for _, _, lo, hi in corpus.groups]

    @staticmethod
    def path_for(corpus: Corpus, seq_len: int, cache_dir: str) -> str:
        key = hashlib.sha256(json.dumps([corpus.fingerprint, span_bytes(seq_len), INDEX_VERSION]).encode()).hexdigest()[:12]
        return os.path.join(cache_dir, f"spans-{key}.bin")

    def _build(self):
        c, t0, n, total, long_docs = self.corpus, time.time(), 0, 0, 0
        tmp = f"{self.path}.tmp{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                for lo in range(0, c.n_docs, BLOCK):
                    hi = min(c.n_docs, lo + BLOCK)
                    lengths = c.doc_lengths(lo, hi)
                    total += int(lengths.sum())
                    rows = np.stack([np.arange(lo, hi), np.zeros(hi - lo, np.int64), np.full(hi - lo, -1)], 1)
                    big = np.flatnonzero(lengths > self.span_bytes)
                    parts, prev = [], 0
                    # long documents: read and cut a group at a time, at most 64 of them and ~READ_BYTES
                    group = np.cumsum(lengths[big]) // READ_BYTES
                    firsts = np.flatnonzero((np.arange(len(big)) % 64 == 0) | (np.diff(group, prepend=group[:1]) > 0))
                    for a, b in zip(firsts, [*firsts[1:], len(big)]):
                        for j, raw in zip(big[a:b], c.raw(lo + big[a:b])):
                            starts = np.asarray([0] + cut_points(raw, self.span_bytes), np.int64)
                            ends = np.append(starts[1:], -1)
                            parts += [rows[prev:j], np.stack([np.full(len(starts), lo + j), starts, ends], 1)]
                            prev, long_docs = j + 1, long_docs + (len(starts) > 1)
                    block = np.concatenate(parts + [rows[prev:]]).astype(np.int64)
                    f.write(block.tobytes())
                    n += len(block)
            with open(self.path + ".json", "w") as f:
                json.dump({"version": INDEX_VERSION, "spans": n, "documents": c.n_docs, "bytes": total,
                           "long_documents": long_docs, "span_bytes": self.span_bytes, "corpus": c.spec}, f)
            os.replace(tmp, self.path)                  # the rows appear whole or not at all
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        print(f"[data] span index: {n:,} spans of {c.n_docs:,} documents ({long_docs:,} cut, {total / 1e6:,.1f} MB "
              f"of text) in {time.time() - t0:.1f} s -> {self.path}", file=sys.stderr, flush=True)

    def first_span(self, doc: int) -> int:
        """The first span of document `doc` (n_spans for doc = n_docs)."""
        lo, hi = 0, self.n_spans
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if self.rows[mid, 0] < doc else (lo, mid)
        return lo

    def is_val(self, spans: np.ndarray) -> np.ndarray:
        """Held out? (arrays of span ids)"""
        spans = np.asarray(spans, np.int64)
        if self.hashed:
            return held_out(self.rows[spans, 0], self.val_fraction)
        return spans >= self.n_spans - self.tail

    def train_range(self, g: int) -> tuple[int, int]:
        """Spans source g deals to training: its range, less the held-out tail (by hash: skipped as read)."""
        lo, hi = self.groups[g]
        return lo, min(hi, self.n_spans - self.tail)

    def val_range(self) -> tuple[int, int]:
        return (0, self.n_spans) if self.hashed else (self.n_spans - self.tail, self.n_spans)

    def has_val(self) -> bool:
        return self.val_fraction > 0 and (self.hashed or self.tail > 0)
