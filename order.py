"""The order of the data: pure functions of integer keys, no state, no I/O (data.py and spans.py use them).

- hash64 / uniform: a counter-based hash (splitmix64 chained over the keys). Every random choice of
  the data stream (the held-out split, which lane a window comes from, a mixture's source) is one
  of these, never a stateful RNG: any rank computes any choice alone, from the global indices.
- permute: a bijection of [0, n) from a key, computed per index (a Feistel network with cycle
  walking), never materialized: epoch e of a split reads span permute(k, n, (seed, e)) at its k-th
  position. Memory O(1) whatever n; cost a few hash rounds per index (vectorized).
- Deal / positions: which span a lane reads at its i-th read. A source's spans form one infinite
  sequence, epoch after epoch, each epoch a fresh permutation; its n lanes deal it round-robin
  (lane j reads positions j, j + n, j + 2n, ...). A lane that runs out of an epoch goes on into
  the next one, so a stream never runs short, whatever the corpus shape: with fewer spans than
  lanes, the lanes simply read different epochs at once.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

_M1, _M2, _GOLD = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def _mix(z):
    """splitmix64's step: a bijective scramble of uint64 values (wrapping arithmetic)."""
    if isinstance(z, np.ndarray) and z.ndim:    # arrays wrap silently: no errstate (~3 us a call), in place
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
    """The image of indices i under a bijection of [0, n) chosen by `key` (a tuple of ints).
    A balanced Feistel network permutes [0, 4^h) for the smallest 4^h >= n; an image >= n is fed
    through again (cycle walking) until it lands in [0, n): the walk from each i ends, and two i
    never meet, because the network is a permutation of the larger domain. 4^h < 4n, so fewer
    than 4 rounds of the network per index on average."""
    i = np.asarray(i, np.int64)
    if n <= 1:
        if n < 1 or (i != 0).any():
            raise ValueError(f"permute: index outside [0, {n})")
        return np.zeros_like(i)
    h = max(1, ((n - 1).bit_length() + 1) // 2)         # half width: 2h bits cover n - 1
    mask, hh = np.uint64((1 << h) - 1), np.uint64(h)
    round_keys = _round_keys(tuple(int(k) for k in key))

    def network(x):
        left, right = x >> hh, x & mask
        for rk in round_keys:               # round function: splitmix of the right half and the round key
            left, right = right, left ^ (_mix(right ^ rk) & mask)
        return (left << hh) | right
    x = network(i.astype(np.uint64))
    out = np.where(x < np.uint64(n), x, np.uint64(0))
    todo = np.flatnonzero(x >= np.uint64(n))
    while len(todo):
        x = network(x[x >= np.uint64(n)])
        done = x < np.uint64(n)
        out[todo[done]] = x[done]
        todo = todo[~done]
    return out.astype(np.int64)


@lru_cache(maxsize=64)
def _round_keys(key: tuple) -> tuple:
    """The Feistel round keys of a permutation key (hashed once per key: an epoch's reads share them)."""
    return tuple(hash64(*key, r) for r in range(ROUNDS))


@dataclass(frozen=True)
class Deal:
    """How one source's spans are dealt to its lanes. Spans lo .. lo + n - 1 (ids of the span index);
    `lanes` lanes in all (streams x lanes per stream); `shuffled`: each epoch a fresh permutation
    keyed (seed, epoch[, group]), else corpus order (the held-out split). `keep`: which spans of the
    range belong to this split when membership is by hash ("train": not held out, "val": held
    out; positions of the others are read as nothing), or "" (all of them)."""
    lo: int
    n: int
    lanes: int
    shuffled: bool
    seed: int = 0
    group: int = 0
    keep: str = ""


def positions(deal: Deal, lane: int, i0: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """(span ids, epochs) of reads i0 .. i0 + count - 1 of lane `lane`: the lane's positions
    k = lane + i * lanes in the source's endless sequence; epoch k // n, index k % n of that epoch."""
    k = lane + (i0 + np.arange(count, dtype=np.int64)) * deal.lanes
    epoch, idx = np.divmod(k, deal.n)
    if not deal.shuffled:
        return deal.lo + idx, epoch
    out = np.empty_like(idx)
    for e in np.unique(epoch):                          # a read batch spans one or two epochs
        at = epoch == e
        key = (deal.seed, int(e)) + ((deal.group,) if deal.group else ())   # one source: as without a mixture
        out[at] = permute(idx[at], deal.n, key)
    return deal.lo + out, epoch


def lanes_per_stream(n_spans: int, n_streams: int, shuffle: int) -> int:
    """A stream's lanes of one source: `shuffle` spans in flight, fewer for a source of few spans
    (every lane should read its own spans in an epoch rather than share them with other lanes)."""
    return max(1, min(shuffle, n_spans // n_streams))


def lane_key(stream: int, group: int, lane: int, n_groups: int, lanes_max: int) -> int:
    """The key of one lane: a stream's lanes are contiguous, so DP ranks own whole blocks."""
    return (stream * n_groups + group) * lanes_max + lane


def choose(seed: int, cum_weights: np.ndarray, lanes: np.ndarray, streams, b) -> tuple[np.ndarray, np.ndarray]:
    """(source, lane) that window b of each stream comes from: a hash of (seed, stream, b), the
    source by weight, then one of its lanes uniformly. Arrays broadcast."""
    g = np.minimum(np.searchsorted(cum_weights, uniform(seed, 1, streams, b), side="right"), len(lanes) - 1)
    c = (uniform(seed, 2, streams, b) * np.asarray(lanes)[g]).astype(np.int64)
    return g, c


# Held-out membership: by a hash of the document when the corpus holds enough documents that the
# fraction is met closely (>= HASH_DOCS expected held-out documents; whole documents are held out,
# so no document is in both splits); otherwise the last val_fraction of the spans, at least one,
# as nanoGPT holds out the last 10% of one text. Deterministic, whatever seed, layout or tokenizer.
HASH_DOCS = 64


def by_hash(n_docs: int, val_fraction: float) -> bool:
    return val_fraction > 0 and n_docs * val_fraction >= HASH_DOCS


def held_out(docs, val_fraction: float) -> np.ndarray:
    """Hash membership of documents (arrays): True = held out."""
    return uniform(0x5EED, docs) < val_fraction


def tail_spans(n_docs: int, n_spans: int, val_fraction: float) -> int:
    """How many spans at the end of the corpus are held out (0 when membership is by hash)."""
    if val_fraction <= 0 or by_hash(n_docs, val_fraction):
        return 0
    return min(n_spans - 1, max(1, int(np.ceil(val_fraction * n_spans))))
