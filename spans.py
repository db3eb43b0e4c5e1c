"""Spans and their order: the unit the data stream shuffles and deals, and which span a lane reads when.

A span is a piece of one document of at most span_bytes(seq_len) bytes (~4 windows of text), cut
only where tokenization does not cross the cut: a long document spreads over every stream like many
short ones. The span index (rows of (document, first byte, end byte or -1; 0: a blank one), int64) is built once per
corpus and span size in the cache, streamed, under a lock, and memory-mapped by every rank.
The order is pure functions of integer keys (a counter-based hash, a Feistel permutation computed
per index): any rank computes any choice alone, and nothing per span is ever materialized.
"""
from __future__ import annotations

import codecs
import hashlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from sources import DataError, build_once, progress

_M1, _M2, _GOLD = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def _mix(z):
    """splitmix64's step: a bijective scramble of uint64 values (wrapping arithmetic)."""
    if isinstance(z, np.ndarray) and z.ndim:    # arrays wrap silently: no errstate (~3 us a call)
        z = z + _GOLD
        z ^= z >> np.uint64(30)
        z *= _M1
        z ^= z >> np.uint64(27)
        z *= _M2
        z ^= z >> np.uint64(31)
        return z
    with np.errstate(over="ignore"):            # numpy scalars warn on overflow
        z = z + _GOLD
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def hash64(*keys) -> np.ndarray:
    """splitmix64 chained over integer keys (arrays broadcast): uint64, a pure function of the keys."""
    h = np.uint64(0)
    for k in keys:
        h = _mix(h ^ np.asarray(k).astype(np.uint64))
    return h


def uniform(*keys) -> np.ndarray:
    """A float in [0, 1), a pure function of the integer keys (arrays broadcast)."""
    return (hash64(*keys) >> np.uint64(11)).astype(np.float64) / 2.0 ** 53


ROUNDS = 6          # Feistel rounds: 4 make a pseudo-random permutation (Luby-Rackoff); 6 mix small domains better


def permute(i, n: int, key: tuple) -> np.ndarray:
    """The image of indices i under a bijection of [0, n) chosen by `key` (a tuple of ints, or of
    int arrays shaped as i: each index its own key, as positions' epochs): a Feistel network permutes
    [0, 4^h) for the smallest 4^h >= n, and an image >= n goes through it again (cycle walking)
    until it lands in [0, n): fewer than 4 passes per index on average."""
    i = np.asarray(i, np.int64)
    if n <= 1:
        if n < 1 or (i != 0).any():
            raise ValueError(f"permute: index outside [0, {n})")
        return np.zeros_like(i)
    h = max(1, ((n - 1).bit_length() + 1) // 2)         # half width: 2h bits cover n - 1
    mask, hh = np.uint64((1 << h) - 1), np.uint64(h)
    per_index = any(np.ndim(k) for k in key)
    round_keys = ([hash64(*key, r) for r in range(ROUNDS)] if per_index   # the same keys, an array each
                  else _round_keys(tuple(int(k) for k in key)))

    def network(x, at=slice(None)):
        left, right = x >> hh, x & mask
        for rk in round_keys:               # round function: splitmix of the right half and the round key
            left, right = right, left ^ (_mix(right ^ (rk[at] if per_index else rk)) & mask)
        return (left << hh) | right
    x = network(i.astype(np.uint64))
    out = np.where(x < np.uint64(n), x, np.uint64(0))
    todo = np.flatnonzero(x >= np.uint64(n))
    while len(todo):
        x = network(x[x >= np.uint64(n)], todo)
        done = x < np.uint64(n)
        out[todo[done]] = x[done]
        todo = todo[~done]
    return out.astype(np.int64)


@lru_cache(maxsize=64)
def _round_keys(key: tuple) -> tuple:
    """The Feistel round keys of a permutation key (an epoch's reads share them)."""
    return tuple(hash64(*key, r) for r in range(ROUNDS))


@dataclass(frozen=True)
class Deal:
    """How one source's spans lo .. lo + n - 1 are dealt round-robin to `lanes` lanes, an endless
    sequence of epochs: each a fresh permutation keyed (seed, epoch[, group]) if `shuffled`, else
    corpus order. `keep` ("train" / "val" / "": all): the split's spans where membership is by hash."""
    lo: int
    n: int
    lanes: int
    shuffled: bool
    seed: int = 0
    group: int = 0
    keep: str = ""


def positions(deal: Deal, lane: int, i0: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """(span ids, epochs) of lane `lane`'s reads i0 .. i0 + count - 1: positions k = lane + i * lanes
    of the endless sequence, epoch k // n, index k % n of that epoch."""
    k = lane + (i0 + np.arange(count, dtype=np.int64)) * deal.lanes
    epoch, idx = np.divmod(k, deal.n)
    if not deal.shuffled:
        return deal.lo + idx, epoch
    # Each read its epoch's permutation, in one pass: a source of few spans has many epochs in a read
    # (a permute call each cost ~0.3 s of CPU a batch at 75 spans).
    key = (deal.seed, epoch) + ((deal.group,) if deal.group else ())    # one source: as without a mixture
    return deal.lo + permute(idx, deal.n, key), epoch


def lanes_per_stream(n_spans: int, n_streams: int, shuffle: int) -> int:
    """A stream's lanes of one source: `shuffle`, fewer for a source of few spans (each lane its own)."""
    return max(1, min(shuffle, n_spans // n_streams))


# Held out: whole documents by hash where >= HASH_DOCS are expected held out (no document in both
# splits), else the last val_fraction of the spans, at least one (nanoGPT's last 10% of one text).
HASH_DOCS = 64


def by_hash(n_docs: int, val_fraction: float) -> bool:
    return val_fraction > 0 and n_docs * val_fraction >= HASH_DOCS


def held_out(docs, val_fraction: float) -> np.ndarray:
    """Held out by hash? (document ids)"""
    return uniform(0x5EED, docs) < val_fraction


def tail_spans(n_docs: int, n_spans: int, val_fraction: float) -> int:
    """Spans held out at the corpus's end (0 when membership is by hash)."""
    if val_fraction <= 0 or by_hash(n_docs, val_fraction):
        return 0
    return min(n_spans - 1, max(1, int(np.ceil(val_fraction * n_spans))))


# ----------------------------------------------------------------------------- the span index

# 2: a whitespace-only document longer than a span is one span that reads nothing (95ed806); version 1 cut it
# into spans of whitespace the loader trained on. An index of an older version is built again where it is found.
# The resume key keeps KEY_VERSION: a corpus whose cuts 2 left alone resumes; one whose cuts it changed is told
# by the content digest (data.PackedLoader._check says why).
INDEX_VERSION = 2
KEY_VERSION = 1
BLOCK = 1 << 18             # documents per block while building: ~6 MB of rows in memory at once
READ_BYTES = 1 << 26        # bytes of long documents read at once while building (a longer one in blocks)
SAMPLE_SPANS = 1024         # spans whose text the index's content digest reads (at most 32 MB at seq_len 2048)
_SPACES = np.frombuffer(b" \t\n\r\x0b\x0c", np.uint8)
_LEAD = re.compile(rb"[ \t\n\r\x0b\x0c]*")


def blank(raw: bytes, dec=None, final: bool = True) -> bool:
    """Only whitespace, as str.isspace says of its text: such a document makes no token (data.SpanReader), as
    prepare drops it. Told at the first byte that is not ASCII whitespace; the text is decoded only where that
    opens another space (U+3000). dec: the document's incremental decoder, where it is read in blocks (a
    character may span two)."""
    i = _LEAD.match(raw).end()
    first = raw[i:i + 4].decode("utf-8", "replace")[:1]      # U+FFFD: invalid, or a character a block cuts
    if first not in ("", "\ufffd") and not first.isspace():
        return False                        # the common case: text
    text = (dec or codecs.getincrementaldecoder("utf-8")("replace")).decode(raw, final)
    return text.isspace() or not text


def cut_points(raw: bytes, limit: int, final: bool = True) -> list[int]:
    """The start of every span after the first: spans of at most `limit` bytes that, tokenized and
    joined, are the document tokenized (corpus.iter_pieces' rule, in bytes). A cut is a space between
    two non-space bytes, opening the next span; over limit/2 bytes without one: a hard cut at a
    character boundary, splitting one word (the only difference). Not `final` (more of the document
    follows): only the cuts whose bytes and the one after are all in `raw`, so they are the whole's."""
    keep = limit if final else limit + 1
    if len(raw) <= keep:
        return []
    b = np.frombuffer(raw, np.uint8)
    ws = np.isin(b, _SPACES)
    clean = np.flatnonzero((b[1:-1] == 32) & ~ws[:-2] & ~ws[2:]) + 1
    cuts, start = [], 0
    while len(b) - start > keep:
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


def doc_cuts(corpus, doc: int, limit: int) -> list[int] | None:
    """cut_points of a document longer than READ_BYTES, read a block at a time: held whole, its cutting
    took ~4.5 bytes of memory per byte (1.4 GB for one 315 MB .txt file), so a text file of tens of GB
    could not be indexed. Now ~5 x READ_BYTES (~0.3 GB) whatever its size. None: blank (each block)."""
    cuts, base, buf, empty, dec = [], 0, b"", True, codecs.getincrementaldecoder("utf-8")("replace")
    for block, last in corpus.raw_blocks(doc, READ_BYTES):
        empty = empty and blank(block, dec, last)
        buf += block
        new = cut_points(buf, limit, last)
        cuts += [base + k for k in new]
        if new:
            base, buf = base + new[-1], buf[new[-1]:]
    return None if empty else cuts


def span_bytes(seq_len: int) -> int:
    """Bytes of text per span: ~4 windows at ~4 bytes per token, at least 4 KiB."""
    return max(4096, 16 * seq_len)


class SpanIndex:
    """rows[s] = (document, first byte, end byte or -1) of span s, memory-mapped. Also the split
    (is_val), the span ranges of a mixture's sources, and the corpus's size in bytes."""

    def __init__(self, corpus, seq_len: int, cache_dir: str, val_fraction: float = 0.0):
        self.corpus, self.span_bytes, self.val_fraction = corpus, span_bytes(seq_len), val_fraction
        self.key = self.key_for(corpus, seq_len)       # the resume key: the corpus's names and sizes
        self.path = self.path_for(corpus, seq_len, cache_dir)
        build_once(self.path, self._build, self.stale)
        with open(self.path + ".json") as f:
            self.meta = json.load(f)
        self.n_spans, self.bytes = self.meta["spans"], self.meta["bytes"]
        self.content = self.meta.get("content")        # None: an index built before the digest (not checked)
        if self.meta.get("documents") != corpus.n_docs or os.path.getsize(self.path) != 24 * self.n_spans:
            raise DataError(f"the span index {self.path} does not match the corpus {corpus.spec!r}; delete it "
                            f"(rm {self.path}*) and it is built again")
        self.rows = np.memmap(self.path, np.int64, "r", shape=(self.n_spans, 3))
        self.hashed = by_hash(corpus.n_docs, val_fraction)
        self.tail = tail_spans(corpus.n_docs, self.n_spans, val_fraction)
        # A mixture's sources as ranges of spans: a binary search (np.searchsorted copies the column).
        self.groups = [(self.first_span(lo), self.first_span(hi)) for _, _, lo, hi in corpus.groups]
        # The tail comes off the end of the last source, or, where that would leave it no training span
        # (a mixture's small last source), off the end of the largest: every source still trains.
        sizes = [hi - lo for lo, hi in self.groups]
        self.tail_end = self.groups[-1 if sizes[-1] > self.tail else int(np.argmax(sizes))][1]

    @staticmethod
    def stale(path: str) -> bool:
        """An index an older nanotrn built (its cuts may differ from this one's), or without its .json: built again."""
        if not os.path.exists(path + ".json"):
            return True
        with open(path + ".json") as f:
            version = json.load(f).get("version", 1)
        if version < INDEX_VERSION:
            print(f"[data] span index {path}: built by an older nanotrn (version {version}, now {INDEX_VERSION}); "
                  f"building it again", file=sys.stderr, flush=True)
        return version < INDEX_VERSION

    @staticmethod
    def key_for(corpus, seq_len: int) -> str:
        # A source of no documents between others (an Arrow shard of no rows) hid the documents after it from
        # builds before d6023f0 (Corpus._ranges): such a corpus gets a key of its own, so an index built then is
        # neither reused nor dealt beside a correct one another node builds now. Other corpora keep theirs.
        gap = ["gap"] if 0 in np.trim_zeros([s.n for s in corpus.sources]) else []
        return hashlib.sha256(json.dumps([corpus.fingerprint, span_bytes(seq_len), KEY_VERSION] + gap).encode()).hexdigest()[:12]

    @staticmethod
    def path_for(corpus, seq_len: int, cache_dir: str) -> str:       # (stamp: the files' paths and mtimes)
        return os.path.join(cache_dir, f"spans-{SpanIndex.key_for(corpus, seq_len)}-{corpus.stamp}.bin")

    def _build(self, tmp: str):
        c, t0, n, total, long_docs = self.corpus, time.time(), 0, 0, 0
        digest = hashlib.sha256()
        with open(tmp, "wb") as f, progress(c.n_docs, "[data] span index", " documents") as bar:
            for lo in range(0, c.n_docs, BLOCK):
                hi = min(c.n_docs, lo + BLOCK)
                c.check_heads(lo, hi)           # refused now, not when a lane first reads the file
                lengths = c.doc_lengths(lo, hi)
                total += int(lengths.sum())
                digest.update(lengths.tobytes())
                rows = np.stack([np.arange(lo, hi), np.zeros(hi - lo, np.int64), np.full(hi - lo, -1)], 1)
                big = np.flatnonzero(lengths > self.span_bytes)
                parts, prev = [], 0
                # long documents: read and cut a group at a time, at most 64 of them and ~READ_BYTES
                group = np.cumsum(lengths[big]) // READ_BYTES
                firsts = np.flatnonzero((np.arange(len(big)) % 64 == 0) | (np.diff(group, prepend=group[:1]) > 0))
                for a, b in zip(firsts, [*firsts[1:], len(big)]):
                    fits = lengths[big[a:b]] <= READ_BYTES
                    raws = iter(c.raw(lo + big[a:b][fits]))
                    for j, fit in zip(big[a:b], fits):
                        if fit:
                            raw = next(raws)
                            cut = None if blank(raw) else cut_points(raw, self.span_bytes)
                        else:
                            cut = doc_cuts(c, lo + j, self.span_bytes)
                        # A long blank document: one span that reads nothing (end 0), not spans of whitespace
                        # a lane would tokenize (a short one is read: its text is blank, no token).
                        starts = np.asarray([0] + (cut or []), np.int64)
                        ends = np.append(starts[1:], -1 if cut is not None else 0)
                        parts += [rows[prev:j], np.stack([np.full(len(starts), lo + j), starts, ends], 1)]
                        prev, long_docs = j + 1, long_docs + (len(starts) > 1)
                block = np.concatenate(parts + [rows[prev:]]).astype(np.int64)
                f.write(block.tobytes())
                digest.update(block.tobytes())
                n += len(block)
                bar.update(hi - lo)
        # The resume key is the files' names and sizes; a file rewritten at its size is told by this digest of
        # the cuts, the lengths and the text of SAMPLE_SPANS spans spread over the corpus (sure for a corpus of up to
        # that many spans, a sample beyond). Paths and times are not in it: a copy on another node resumes.
        rows = np.memmap(tmp, np.int64, "r", shape=(n, 3))
        for text, _, _ in c.read_spans(rows[np.unique(np.linspace(0, n - 1, min(n, SAMPLE_SPANS)).astype(np.int64))], True):
            digest.update((text or "").encode("utf-8", "surrogatepass") + b"\0")
        del rows
        c._record = (-1, b"")     # a long .jsonl record the sample parsed: not held by this rank for the whole run
        with open(self.path + ".json", "w") as f:       # before the rows are renamed into place
            json.dump({"version": INDEX_VERSION, "spans": n, "documents": c.n_docs, "bytes": total,
                       "content": digest.hexdigest()[:16],
                       "long_documents": long_docs, "span_bytes": self.span_bytes, "corpus": c.spec}, f)
        print(f"[data] span index: {n:,} spans of {c.n_docs:,} document{'s' * (c.n_docs != 1)} ({long_docs:,} cut, {total / 1e6:,.1f} MB "
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
        return (spans >= self.tail_end - self.tail) & (spans < self.tail_end)

    def train_range(self, g: int) -> tuple[int, int]:
        """Source g's spans for training: its range less the held-out tail (by hash: skipped as read)."""
        lo, hi = self.groups[g]
        return lo, hi - self.tail if hi == self.tail_end else hi

    def val_range(self) -> tuple[int, int]:
        return (0, self.n_spans) if self.hashed else (self.tail_end - self.tail, self.tail_end)

    def has_val(self) -> bool:
        return self.val_fraction > 0 and (self.hashed or self.tail > 0)
