"""Data: raw text in, packed windows of token ids out, tokenized online while training runs.

The blog kept the raw corpus as one Arrow file and tokenized and packed it online on every DP rank
(re-tokenizing offline costs days each time the data or tokenizer changes). The steps: sources.py
(files -> documents), corpus.py (the corpus, the tokenizer), spans.py (documents -> spans, the unit
that is shuffled and dealt, and their order), then here: global_batch streams, each reading
`shuffle` lanes of spans; a lane tokenizes its spans in order into one sequence cut into windows of
seq_len + 1 tokens (no padding, nothing dropped, targets never across a segment). Global batch b is
window b of every stream at any DP degree and micro-batch; DP rank r packs only its streams. A
lane's position is (reads done, token offset): a restored loader, at any DP degree, re-reads at
most one span a lane. docs/data.md tells the whole design and what one rank holds at 1e9 documents.

    python data.py prepare SRC... --out corpus.arrow             # many shards -> one Arrow file (prepare.py)
    python data.py tokenizer --data corpus.arrow --vocab 32000   # train + cache before a launch
"""
from __future__ import annotations

import argparse
import atexit
import collections
import dataclasses
import queue
import signal
import sys
import threading
import weakref

if __name__ == "__main__":      # Ctrl-C while the imports below load (seconds): end quietly, not
    signal.signal(signal.SIGINT, signal.SIG_DFL)   # with a traceback from inside torch; main() restores it

import numpy as np
import torch

from configs import Config, ConfigError, DataConfig, check_dir, check_values, expand_home

# data.py is what train.py and benchmarks/ read: the names they need from the other modules come from here.
from corpus import Corpus, DataError, Tokenizer, build_tokenizer, find_tokenizer, load_tokenizer, train_tokenizer  # noqa: F401
from prepare import prepare
from spans import Deal, SpanIndex, held_out, lanes_per_stream, positions, uniform

# ----------------------------------------------------------------------------- packing

STAT_KEYS = ("spans", "documents", "empty_docs", "bad_records", "utf8_replacements", "tokens")
COUNTERS = STAT_KEYS + ("windows",)
# Counted in a span's first-epoch read only: a data problem is said as the number of distinct bad
# records / replaced sequences met, not once more per epoch (every span has one read per epoch).
ONCE = [STAT_KEYS.index(k) for k in ("bad_records", "utf8_replacements")]
AHEAD = 256     # reads / windows whose order a lane / stream computes at once (pure functions: any batching)
FORMAT = 2      # of the data state: 2 = lanes of spans (reads, offset); none = documents (before spans)


class StaleDataState(DataError):
    """A data state written before the current format: the run resumes its model, not its stream."""


def check_size(cfg: DataConfig, index: SpanIndex, dp: int = 1, eval_windows: int = 0, vocab: int = 0) -> None:
    """Refuse a corpus smaller than one global batch before a tokenizer is trained on it: tokens <=
    bytes (byte fallback) + one a span (a dummy prefix) + BOS/EOS, so only when certainly too small,
    naming the settings that pass. Likewise more evaluation windows than the whole corpus holds
    (EvalWindows would cycle the held-out stream for them, in memory: --log.eval_windows=1000000 ran out of it).
    vocab: the pieces of the tokenizer to be trained next (0: one given), whose own bound the refusal names too.
    The bound holds where normalizing does not lengthen the text: ours and Llama 2's (identity), byte-level BPEs.
    A given sentencepiece with NFKC (its default nmt_nfkc) makes U+FDFA (3 bytes) 18 characters (20 tokens at 300
    pieces): a corpus of such text just under a batch of bytes may be refused though its tokens fill one (the
    advice still runs). Left so: only corpora under one global batch, and the tokenizer is not loaded here."""
    L1, gb, step, ends = cfg.seq_len + 1, cfg.global_batch, cfg.micro_batch * dp, int(cfg.bos) + int(cfg.eos)
    # A sentencepiece dummy prefix is a token of its own before a piece that has none ('{'): one more a span.
    bound = index.bytes + index.n_spans + ends * index.corpus.n_docs
    # Under one global batch the refusal below comes first: it names settings that pass (this one could not).
    if gb * L1 <= bound < eval_windows * L1:
        raise DataError(f"--log.eval_windows={eval_windows} windows of seq_len {cfg.seq_len} + 1 tokens are more than "
                        f"all of {cfg.data!r} holds (at most {bound:,} tokens), "
                        f"let alone its held-out share: lower --log.eval_windows (or --log.eval_interval=0)")
    if bound >= gb * L1:
        return check_val(cfg, index) if eval_windows else None
    # Small enough to read (under one global batch of bytes): a document of only whitespace (one span) makes no
    # token; a span of whitespace inside a document does.
    rows = np.asarray(index.rows)
    first, last = rows[:, 1] == 0, rows[:, 2] <= 0
    text = [t or "" for t, _, _ in index.corpus.read_spans(rows, quiet=True)]
    kept = ~(first & last & np.array([not t.strip() for t in text], bool))
    size = int(sum(len(t.encode()) for t, k in zip(text, kept.tolist()) if k))
    most = size + int(kept.sum()) + int(cfg.bos) * int((kept & first).sum()) + int(cfg.eos) * int((kept & last).sum())
    fits = most // L1 // step * step
    fix = " or ".join(([f"--global_batch={fits}"] if fits else []) + ([f"--seq_len={most // gb - 1}"] if most // gb > 1 else []))
    if fix and eval_windows and not index.has_val():      # else the next refusal: 'no held-out split'
        fix += ", with --log.eval_interval=0 (under one span of text, nothing is held out to evaluate on)"
    # A tokenizer trained on this little text is bounded too (sentencepiece's "too high", after the advice was taken):
    # the pieces a training on the same sample reaches, said now. Work of one global batch of text at most.
    if fix and vocab and (most_pieces := train_tokenizer(index.corpus, cfg.val_fraction, vocab, "", probe=True)) < vocab:
        fix += f", and --model.vocab_size={most_pieces} or less (what a tokenizer trained on this text holds)"
    raise DataError(f"{cfg.data!r} holds {size:,} bytes of text, at most {most:,} tokens, but one global batch "
                    f"is global_batch {gb} x (seq_len {cfg.seq_len} + 1) = {gb * L1:,} tokens: add data"
                    + (f", or set {fix}" if fix else ""))


def check_val(cfg: DataConfig, idx: SpanIndex) -> None:
    """A held-out split to evaluate on: refused by check_size before a tokenizer is trained, and by a val loader."""
    if not idx.has_val():
        fix = ("set --data.val_fraction above 0" if cfg.val_fraction <= 0 else "raise --data.val_fraction"
               if idx.n_spans > 1 else "add data (one span is never split)")
        raise DataError(f"{cfg.data!r} has no held-out split (val_fraction {cfg.val_fraction}, {idx.n_spans} "
                        f"span): {fix}, or turn evaluation off with --log.eval_interval=0")


def pack(blocks, L1: int, position: dict):
    """Cut one lane's tokens into windows of L1 tokens, forever, from `position` ({"i", "offset",
    "stats"}). `blocks` yields (tokens of reads i, i + 1, ... from token `skip` of read i, i, tokens
    per read, counts per read (STAT_KEYS), skip). Yields (window, starts: True at each span's first
    token, position after it). Holds < a window + a block; a block's windows are cut at once."""
    stats = np.array([position["stats"][k] for k in COUNTERS], np.int64)
    tok, after = np.zeros(0, np.int32), (position["i"], position["offset"])
    # The non-empty reads in tok: read index, where its token 0 is (or would be) in tok, where it
    # ends; and the reads not yet counted (a read is counted once the position is past it).
    ks = origin = ends = pending = np.zeros(0, np.int64)
    counts = np.zeros((0, len(STAT_KEYS)), np.int64)
    while True:
        while len(tok) < L1:
            new, i0, lens, cs, skip = next(blocks)
            e, read_ids = len(tok) + np.cumsum(lens) - skip, i0 + np.arange(len(lens))
            some = e > np.maximum(e - lens, len(tok))                   # has tokens in tok
            ks, origin, ends = (np.concatenate((a, b[some])) for a, b in ((ks, read_ids), (origin, e - lens), (ends, e)))
            pending, counts = np.concatenate((pending, read_ids)), np.concatenate((counts, cs))
            tok, after = np.concatenate((tok, new)), (i0 + len(lens), 0)
        m = len(tok) // L1                                  # windows complete in tok
        cut = L1 * np.arange(1, m + 1)                      # the position after each
        starts = np.zeros(m * L1, bool)
        starts[origin[(origin >= 0) & (origin < m * L1)]] = True
        starts = starts.reshape(m, L1)
        r = np.minimum(np.searchsorted(ends, cut, "right"), len(ks) - 1)    # the read holding the next token
        i, off = ks[r], cut - origin[r]
        if cut[-1] == len(tok):
            i[-1], off[-1] = after
        done = np.searchsorted(pending, i)                  # reads fully behind each position
        total = np.concatenate((np.zeros((1, len(STAT_KEYS)), np.int64), np.cumsum(counts, 0)))[done]
        rows = np.concatenate((stats[:-1] + total, stats[-1:] + np.arange(1, m + 1)[:, None]), 1)   # + windows
        for k, (ik, ok, row) in enumerate(zip(i.tolist(), off.tolist(), rows.tolist())):
            yield tok[k * L1:(k + 1) * L1], starts[k], {"i": ik, "offset": ok, "stats": dict(zip(COUNTERS, row))}
        stats, live = rows[-1], ends > cut[-1]
        tok, ks, origin, ends = tok[cut[-1]:], ks[live], origin[live] - cut[-1], ends[live] - cut[-1]
        pending, counts = pending[done[-1]:], counts[done[-1]:]


def make_batch(wins, document_mask: bool = True) -> dict[str, torch.Tensor]:
    """Windows (tokens, starts) -> tokens, targets (-100 where the next token opens a segment),
    positions and doc_ids per segment; document_mask=False: positions 0..seq_len-1, no doc_ids."""
    w, start = np.stack([t for t, _ in wins]), np.stack([s for _, s in wins])     # [B, seq_len + 1]
    targets = w[:, 1:].astype(np.int64)
    targets[start[:, 1:]] = -100
    (B, T), as_t = targets.shape, torch.from_numpy
    batch = {"tokens": as_t(w[:, :-1].astype(np.int64)), "targets": as_t(targets)}
    if not document_mask:
        return {**batch, "positions": as_t(np.tile(np.arange(T), (B, 1)))}
    start[:, 0] = True                                  # segments, row-major: every row opens one
    seg = np.flatnonzero(start[:, :-1])                 # where each starts in the flat [B * T]
    size, row = np.diff(np.append(seg, B * T)), np.searchsorted(seg, np.arange(B) * T)
    doc = np.arange(len(seg)) - np.repeat(row, np.diff(np.append(row, len(seg))))   # 0 for a row's first
    return {**batch, "positions": as_t((np.arange(B * T) - np.repeat(seg, size)).reshape(B, T)),
            "doc_ids": as_t(np.repeat(doc, size).reshape(B, T))}


_RUNNING = weakref.WeakSet()        # Prefetch objects whose thread runs: stopped at interpreter exit


@atexit.register
def _stop_all() -> None:
    """A script that takes a batch and exits without close(): the interpreter ends a daemon thread
    that comes back from the tokenizer's C++ (GIL released) mid-finalization by unwinding it through
    noexcept frames: 'terminate called without an active exception', exit 134 (2 in 12 runs)."""
    for p in list(_RUNNING):
        p.close()


class Prefetch:
    """A generator's items computed up to `depth` ahead in a daemon thread (0: in the caller); its
    exception is raised in the caller at the item where it happened. Stopped at exit (_stop_all)."""

    def __init__(self, gen, depth: int, name: str = "prefetch"):
        self.gen, self.depth, self.error, self.thread = gen, depth, None, None
        if depth:
            self.stop, self.queue = threading.Event(), queue.Queue(depth)
            self.thread = threading.Thread(target=self._run, name=name, daemon=True)
            self.thread.start()
            _RUNNING.add(self)

    def _run(self):
        try:
            for item in self.gen:
                if self.stop.is_set():
                    return
                self.queue.put(item)            # blocks while the queue is full: prefetch depth
        except BaseException as e:              # handed to the consumer, raised there
            self.queue.put(e)

    def __next__(self):
        if self.error is not None:
            raise self.error
        try:
            item = self.queue.get() if self.depth else next(self.gen)
        except Exception as e:                  # without a thread: fail the same way as with one
            item = e
        if isinstance(item, BaseException):
            self.error = item
            raise item
        return item

    def close(self) -> None:
        if self.thread is not None:
            self.stop.set()
            while self.thread.is_alive():       # empty the queue so a blocked put() returns
                try:
                    self.queue.get(timeout=0.05)
                except queue.Empty:
                    pass
            self.thread.join()
            self.thread = None
            _RUNNING.discard(self)


class SpanReader:
    """Spans -> tokens: their text (corpus + span index), one tokenizer call a read, BOS/EOS at a document's ends."""

    def __init__(self, corpus: Corpus, index: SpanIndex, tok: Tokenizer, bos: bool, eos: bool, threads: int = 1):
        self.corpus, self.index, self.tok, self.bos, self.eos, self.threads = corpus, index, tok, bos, eos, threads
        if hasattr(tok, "use_threads"):         # a tokenizer.json: the tokenizers library's own pool (hf.py)
            tok.use_threads(threads)
        # A tokenizer that adds a dummy prefix (sentencepiece) reads a span's opening space as its own
        # prefix; a byte-level one (tokenizer.json) keeps it (spans.cut_points).
        self.drop_space = tok.encode("ab cd") == tok.encode("ab") + tok.encode("cd")

    def __call__(self, spans: np.ndarray, keep: str = "", quiet: bool = False):
        """Tokens of some reads' spans joined (int32), tokens per read, counts per read (STAT_KEYS); a
        span of the other split reads as nothing. One tokenizer call; BOS/EOS and counts in numpy."""
        mine = np.ones(len(spans), bool) if not keep else self.index.is_val(spans) == (keep == "val")
        rows = np.asarray(self.index.rows)[spans[mine]]     # asarray: no np.memmap per read (its __getitem__)
        text, reps, bad = zip(*self.corpus.read_spans(rows, quiet)) if len(rows) else ((), (), ())
        text = [t or "" for t in text] if None in text else list(text)     # None: a bad record
        first, last = rows[:, 1] == 0, rows[:, 2] <= 0        # end 0: a long blank document's one span (spans.blank)
        # A span's opening space: the tokenizer's own dummy prefix stands for it (drop_space). A
        # document of only whitespace makes no token, not even BOS/EOS. Per span only C-level maps.
        if self.drop_space and not first.all():
            text = [t[1:] if t and s > 0 and t[0] == " " else t for t, s in zip(text, rows[:, 1].tolist())]
        ok = (np.fromiter(map(len, text), np.int64, len(text)) > 0) & ~(first & last & np.fromiter(map(str.isspace, text), bool, len(text)))
        enc = self.tok.encode_batch(text if ok.all() else [t for t, k in zip(text, ok.tolist()) if k], False, False, self.threads)
        # A document's last span can be empty (a final ' ' its dummy prefix stood for): its EOS, and its count, still.
        bos, eos = ok & first & self.bos, (ok | ~first) & last & self.eos
        n = np.zeros(len(rows), np.int64)
        n[ok] = np.fromiter(map(len, enc), np.int64, len(enc))
        n += bos.astype(np.int64) + eos
        end = np.cumsum(n)
        heads, tails = (end - n)[bos], (end - 1)[eos]
        tokens, body = np.empty(int(n.sum()), np.int32), np.ones(int(n.sum()), bool)
        body[heads] = body[tails] = False
        tokens[heads], tokens[tails] = self.tok.bos_id, self.tok.eos_id
        tokens[body] = np.concatenate(enc or [np.zeros(0, np.int32)])
        reps, bad = np.array(reps, np.int64), np.array(bad, np.int64)
        counts = np.zeros((len(spans), len(STAT_KEYS)), np.int64)
        counts[mine] = np.stack([np.ones(len(rows), np.int64), last & ((n > 0) | ~first),
                                 last & first & (n == 0) & (bad == 0), bad, reps, n], 1)
        return tokens, counts[:, -1], counts        # counts[:, -1]: tokens per read (0: the other split)


def read_lane(read: SpanReader, deal: Deal, j: int, i: int, skip: int, want: int, what: str):
    """Lane j's reads i, i+1, ... of `deal` (one span each; read i from its token `skip`) in blocks
    of ~`want` tokens, as pack() takes them. The first block is one read, then growing."""
    chunk, idle = 1, 0
    ahead, at = np.zeros(0, np.int64), i            # span ids (epochs) of reads at, at + 1, ...: computed
    while True:                                     # AHEAD reads at a time (a permutation call each)
        if i + chunk > at + len(ahead):
            at, (ahead, epochs) = i, positions(deal, j, i, max(AHEAD, min(4 * chunk, 4096)))
        new, lens, counts = read(ahead[i - at:i - at + chunk], deal.keep)
        counts[np.ix_(epochs[i - at:i - at + chunk] > 0, ONCE)] = 0
        d, skip = min(skip, int(lens[0])), 0            # resuming inside read i
        yield new[d:], i, lens, counts, d
        idle = 0 if len(new) else idle + chunk
        if idle > 100 * deal.n + chunk:                 # 100 epochs' share without a token: a corpus of
            # (almost) only empty documents, which _check_tokens lets through when one span has tokens
            raise DataError(f"the {what}: its spans {deal.lo}..{deal.lo + deal.n - 1} hold no tokens (empty "
                            f"documents or unreadable records); check --data")
        i += chunk                          # next: ~want tokens, growing at most 4x a block (an empty
        chunk = max(1, min(4096, 4 * chunk, chunk * want // max(len(new), 1)))    # span must not ask for 4096)


class PackedLoader:
    """Infinite iterator of one DP rank's packed batches: int64 tensors [micro_batch, seq_len] of
    tokens, targets, positions, doc_ids. train: S = global_batch streams, each `shuffle` lanes per
    source; window b of stream s comes from the lane drawn by a hash of (seed, s, b); DP rank r
    hands out streams [r*S/dp, (r+1)*S/dp) round-robin. At the blog's scale (dp 512, global batch
    1024, shuffle 8) a rank packs 2 streams x 8 lanes, however many ranks or documents.
    val: S = dp streams, one lane each, over the held-out spans in corpus order, cycled."""

    def __init__(self, cfg: DataConfig, tok: Tokenizer, dp_rank: int = 0, dp_size: int = 1,
                 split: str = "train", *, corpus: Corpus | None = None, index: SpanIndex | None = None,
                 threads: int = 1, prefetch: int = 4):
        if split not in ("train", "val") or not 0 <= dp_rank < dp_size:
            raise ValueError(f"need split 'train' or 'val' and 0 <= dp_rank < dp_size, got {split!r}, {dp_rank}, {dp_size}")
        if cfg.seq_len < 1 or cfg.micro_batch < 1:
            raise DataError(f"seq_len {cfg.seq_len} and micro_batch {cfg.micro_batch} must be >= 1")
        self.n_streams = cfg.global_batch if split == "train" else dp_size
        if split == "train" and cfg.global_batch % (dp_size * cfg.micro_batch):
            raise DataError(f"global_batch {cfg.global_batch} is not divisible by micro_batch {cfg.micro_batch} "
                            f"x dp {dp_size}; pick a multiple of {cfg.micro_batch * dp_size}")
        self.cfg, self.rank, self.split, self.prefetch = cfg, dp_rank, split, prefetch
        k = self.n_streams // dp_size
        self.streams = list(range(dp_rank * k, (dp_rank + 1) * k))     # the streams this rank packs
        self.corpus = corpus or Corpus(cfg.data, cfg.text_field, cfg.doc_per_line, cfg.split, cfg.cache_dir)
        self.index = idx = index or SpanIndex(self.corpus, cfg.seq_len, cfg.cache_dir, cfg.val_fraction)
        if split == "train":
            ranges, keep = [idx.train_range(g) for g in range(len(idx.groups))], "train" if idx.hashed else ""
            self.weights, self.lanes_max = np.array([w for _, w, _, _ in self.corpus.groups]), max(1, cfg.shuffle)
            for (name, _, dlo, dhi), (lo, hi) in zip(self.corpus.groups, ranges):
                if hi <= lo or (idx.hashed and dhi - dlo <= 65536 and held_out(np.arange(dlo, dhi), cfg.val_fraction).all()):
                    raise DataError(f"{name!r}: every span is held out for validation (val_fraction "
                                    f"{cfg.val_fraction}); lower --data.val_fraction or add data")
        else:
            check_val(cfg, idx)
            ranges, keep = [idx.val_range()], "val" if idx.hashed else ""
            self.weights, self.lanes_max = np.ones(1), 1
        self.lanes = [lanes_per_stream(hi - lo, self.n_streams, self.lanes_max) for lo, hi in ranges]
        self.deals = [Deal(lo, hi - lo, self.n_streams * n, split == "train", cfg.seed, g, keep)
                      for g, ((lo, hi), n) in enumerate(zip(ranges, self.lanes))]
        self.cum_weights = np.cumsum(self.weights / self.weights.sum())
        self.global_lanes = [self.global_lane(s, g, c) for s in self.streams
                         for g in range(len(self.lanes)) for c in range(self.lanes[g])]
        self.read = SpanReader(self.corpus, idx, tok, cfg.bos, cfg.eos, threads)
        # Read blocks of ~8 windows: a block's work is paid over many tokens (~70-token documents: 2
        # windows a block packed at 0.74x the raw tokenizer, 8 at 0.85x); the blog's rank holds ~2 MB.
        self.want = max(8 * (cfg.seq_len + 1), 262144 // len(self.global_lanes))
        # What a saved position means depends on these; a resume must match them.
        self.fingerprint = {"corpus": self.corpus.fingerprint, "spans": idx.key, "tokenizer": tok.fingerprint,
                            "content": idx.content, "seed": cfg.seed, "val_fraction": cfg.val_fraction, "bos": cfg.bos, "eos": cfg.eos,
                            "shuffle": self.lanes_max, "mixture": [round(float(w), 12) for w in self.weights]}
        start = {"i": 0, "offset": 0, "stats": dict.fromkeys(COUNTERS, 0)}
        self._start_state = {"format": FORMAT, "split": split, "n_streams": self.n_streams, "dp_size": dp_size,
                             "index": idx.meta["version"], **self.fingerprint, "streams": {str(s): start for s in self.global_lanes}}
        self._state, self._it = self._start_state, None
        for g, (name, *_) in enumerate(self.corpus.groups if split == "train" else [(cfg.data,)]):
            self._check_tokens(self.deals[g], name)

    def _check_tokens(self, deal: Deal, name: str) -> None:
        """Refuse a split without a single token (all documents empty or unreadable) now, not at the first batch."""
        lo, n = deal.lo, 16
        while lo < deal.lo + deal.n:
            spans = np.arange(lo, min(lo + n, deal.lo + deal.n))
            if len(self.read(spans, deal.keep, quiet=True)[0]):
                return
            lo, n = lo + n, n * 4
        raise DataError(f"the {self.split} split of {name!r} has 0 tokens ({deal.n:,} spans of empty documents "
                        f"or unreadable records); check --data and --data.text_field")

    def global_lane(self, stream: int, group: int, lane: int) -> int:
        """A stream's lanes are contiguous ids, so DP ranks own whole blocks."""
        return (stream * len(self.lanes) + group) * self.lanes_max + lane

    def _deal_of(self, lane: int) -> tuple[Deal, int]:
        """The deal of lane `lane` (a global_lane) and its index among that deal's lanes."""
        stream, rest = divmod(lane, len(self.lanes) * self.lanes_max)
        g, c = divmod(rest, self.lanes_max)
        return self.deals[g], stream * self.lanes[g] + c

    def draw_source_and_lane(self, streams, b) -> tuple[np.ndarray, np.ndarray]:
        """(source, lane) of window b of each stream: by a hash of (seed, stream, b), the source by
        weight, then one of its lanes uniformly. Arrays broadcast."""
        g = np.minimum(np.searchsorted(self.cum_weights, uniform(self.cfg.seed, 1, streams, b), side="right"),
                       len(self.lanes) - 1)
        return g, (uniform(self.cfg.seed, 2, streams, b) * np.asarray(self.lanes)[g]).astype(np.int64)

    # ---------------------------------------------------------------- producer
    def _produce(self, state: dict):
        """Yield (batch, state after it) forever from `state`: this rank's streams round-robin."""
        positions_ = {lane: state["streams"][str(lane)] for lane in self.global_lanes}
        what, L1 = f"{self.split} split of {self.cfg.data!r}", self.cfg.seq_len + 1
        packers = {lane: pack(read_lane(self.read, *self._deal_of(lane), p["i"], p["offset"], self.want, what), L1, p)
                   for lane, p in positions_.items()}
        per = len(self.global_lanes) // len(self.streams)       # lanes per stream, contiguous
        done = [sum(positions_[lane]["stats"]["windows"] for lane in self.global_lanes[k * per:(k + 1) * per])
                for k in range(len(self.streams))]          # windows each stream has handed out
        i, wins = sum(n > min(done) for n in done), []      # mid-round: the streams ahead come first
        ahead = [(0, [], [])] * len(self.streams)          # (first window, sources, lanes) per stream
        while True:
            b0, gs, cs = ahead[i]
            if not b0 <= done[i] < b0 + len(gs):          # the next AHEAD choices of stream i, in one call
                b0, gs, cs = ahead[i] = (done[i], *(a.tolist() for a in self.draw_source_and_lane(
                    self.streams[i], np.arange(done[i], done[i] + AHEAD))))
            lane = self.global_lane(self.streams[i], gs[done[i] - b0], cs[done[i] - b0])
            tokens, starts, positions_[lane] = next(packers[lane])
            wins.append((tokens, starts))
            done[i] += 1
            i = (i + 1) % len(self.streams)
            if len(wins) == self.cfg.micro_batch:
                yield make_batch(wins, self.cfg.document_mask), {**state, "streams": {str(k): v for k, v in positions_.items()}}
                wins = []

    # ---------------------------------------------------------------- consumer
    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._it is None:
            self._it = Prefetch(self._produce(self._state), self.prefetch, f"data-{self.split}-dp{self.rank}")
        batch, self._state = next(self._it)
        return batch

    def state_dict(self) -> dict:
        """The position after the last batch handed out (not prefetched): this rank's streams, JSON-able."""
        return {**self._state, "streams": dict(self._state["streams"])}

    def load_state_dict(self, sd) -> None:
        """Continue from this rank's saved state, or from every saved DP rank's (a new DP degree)."""
        parts = [sd]
        if not isinstance(sd, dict):                    # a sequence, one state per saved DP rank
            self._check(sd[0])
            per = self.n_streams // len(sd)             # streams per saved rank (contiguous)
            parts = [sd[i] for i in sorted({s // per for s in self.streams})]
        streams = {}
        for p in parts:
            self._check(p)
            streams.update(p["streams"])
        missing = [s for s in self.global_lanes if str(s) not in streams]
        if missing:
            raise DataError(f"the data state holds no position for streams {missing[:8]} of this rank: it "
                            f"was saved by another DP rank; give every saved DP rank's state")
        self.close()
        self._state = {**self._start_state, "streams": {str(s): streams[str(s)] for s in self.global_lanes}}

    def _check(self, sd: dict):
        if sd.get("format") != FORMAT:
            raise StaleDataState(f"the data state was written by an older nanotrn (format {sd.get('format', 1)}, "
                                 f"whole documents; now {FORMAT}, spans): its position means nothing to this loader")
        if sd.get("n_streams") != self.n_streams:
            raise DataError(f"the data state was saved with {sd.get('n_streams')} streams (global batch) but this "
                            f"run has {self.n_streams}: the stream is defined by the global batch, so it cannot "
                            f"continue exactly. Resume with --global_batch={sd.get('n_streams')}, or start the data "
                            f"stream afresh with --ckpt.reset_data")
        for key in ("split",) + tuple(self.fingerprint):
            want = self._start_state[key]
            if sd.get(key) != want and None not in (sd.get(key), want):    # None: a content digest not known
                if key == "tokenizer":      # the model learned the saved one's ids: a fresh data stream mends nothing
                    raise DataError(f"the checkpoint was trained with another tokenizer than the one this run loads "
                                    f"(fingerprint {sd.get(key)}, now {want}): its token ids mean other things; resume "
                                    f"with the run's own (kept in <ckpt.dir>/tokenizer: is another run's there, or "
                                    f"a damaged copy?)")
                why = {"corpus": " (another corpus: its files' names or sizes, or how this nanotrn reads a .gz/.zst/.parquet file, changed)",
                       "content": " (a file of the corpus was rewritten at its name and size)" if sd.get("index") else
                                  " (the state's span index, of an older nanotrn, cut a whitespace-only document longer "
                                  "than a span into spans, now one that reads nothing; or a file of the corpus was "
                                  "rewritten at its name and size)",
                       "spans": " (another --data.seq_len, or a corpus with a file of no documents between others, "
                                "which nanotrn now cuts into spans right)"}.get(key, "")
                restore = "" if key in ("corpus", "content") else "restore the original setting, or "
                raise DataError(f"the data state was saved with {key}={sd.get(key)!r} but this loader has {key}={want!r}"
                                f"{why}: the saved position means nothing here; {restore}keep the model and optimizer "
                                f"and start the data stream afresh with --ckpt.reset_data")

    def stats(self) -> dict:
        """Counts over this rank's streams up to the last batch handed out (a span once fully behind)."""
        st = self._state["streams"]
        s = {k: sum(p["stats"][k] for p in st.values()) for k in COUNTERS}
        s["windows_by_source"] = [sum(p["stats"]["windows"] for k, p in st.items()
                                      if int(k) // self.lanes_max % len(self.lanes) == g) for g in range(len(self.lanes))]
        return s

    def close(self) -> None:
        """Stop the prefetch thread (the next batch starts a new one from the current position)."""
        if self._it is not None:
            self._it.close()
        self._it = None


# ----------------------------------------------------------------------------- evaluation

class EvalWindows:
    """The first `n_windows` windows of the val split (one stream, corpus order), whatever the layout:
    DP rank r takes the r-th block of ceil(n / dp), in micro-batches padded with rows of targets -100
    (static shapes for XLA), so the summed loss over the summed count is the same at every layout.
    A rank packs at most n_windows x (seq_len + 1) tokens, however many ranks."""

    def __init__(self, cfg: DataConfig, tok: Tokenizer, n_windows: int, dp_rank: int = 0, dp_size: int = 1,
                 *, corpus: Corpus | None = None, index: SpanIndex | None = None):
        per = -(-n_windows // dp_size)          # windows per rank; the last ranks may hold fewer
        mine = range(min(n_windows, dp_rank * per), min(n_windows, (dp_rank + 1) * per))
        val = PackedLoader(dataclasses.replace(cfg, micro_batch=1), tok, 0, 1, split="val", corpus=corpus,
                           index=index, prefetch=0)
        rows = [next(val) for _ in range(mine.stop)][mine.start:]
        val.close()
        mb, T = cfg.micro_batch, cfg.seq_len
        blank = {"tokens": torch.zeros(1, T, dtype=torch.long), "targets": torch.full((1, T), -100),
                 "positions": torch.arange(T)[None], "doc_ids": torch.zeros(1, T, dtype=torch.long)}
        if not cfg.document_mask:
            del blank["doc_ids"]
        rows += [blank] * (-(-per // mb) * mb - len(rows))      # the same number of batches on every rank
        self.batches = [{k: torch.cat([r[k] for r in rows[i:i + mb]]) for k in blank}
                        for i in range(0, len(rows), mb)]
        self.i = 0

    def __len__(self) -> int:
        return len(self.batches)

    def reset(self) -> None:
        self.i = 0

    def __next__(self) -> dict[str, torch.Tensor]:
        self.i += 1
        return self.batches[self.i - 1]

    def close(self) -> None:
        pass


# ----------------------------------------------------------------------------- to the device

class DeviceLoader:
    """A PackedLoader's batches on `device` (XLA: torch-xla's MpDeviceLoader uploads ahead), with the
    loader's state and stats of the batch last handed out. Restore the loader's state before wrapping it."""

    def __init__(self, loader: PackedLoader, device: torch.device):
        self.loader, self.device = loader, torch.device(device)
        self._last, self._states = (loader.state_dict(), loader.stats()), collections.deque()
        if self.device.type == "xla":
            from torch_xla.distributed.parallel_loader import MpDeviceLoader
            self._it = iter(MpDeviceLoader(self._record(), self.device, loader_prefetch_size=4,
                                           device_prefetch_size=2))
        else:
            self._it = ({k: v.to(self.device, non_blocking=True) for k, v in b.items()} for b in self._record())

    def _record(self):
        for batch in self.loader:
            self._states.append((self.loader.state_dict(), self.loader.stats()))
            yield batch

    __iter__ = PackedLoader.__iter__

    def __next__(self) -> dict[str, torch.Tensor]:
        batch = next(self._it)
        self._last = self._states.popleft()
        return batch

    def state_dict(self) -> dict:
        return self._last[0]

    def stats(self) -> dict:
        return self._last[1]


# ----------------------------------------------------------------------------- command line

def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prepare", help="text/jsonl(.gz/.zst)/arrow/parquet shards -> Arrow, in parallel (prepare.py)")
    a.add_argument("sources", nargs="+", help="files, directories or globs of text/jsonl/arrow/parquet, or 'stdlib'")
    a.add_argument("--out", required=True, type=expand_home, help="x.arrow: one Arrow file; dir/: one Arrow file per shard")
    a.add_argument("--text-field", default="text", help="the JSON key or column holding the text (default: text)")
    a.add_argument("--split", default="train", help="a DatasetDict's or dataset repository's split (default: train)")
    a.add_argument("-j", "--workers", type=int, default=0, help="worker processes (default: one per core)")
    for flag, what in (("--doc-per-line", ".txt: a document per line"), ("--force", "replace --out"), ("--strict", "stop at the first bad record")):
        a.add_argument(flag, action="store_true", help=what)
    t = sub.add_parser("tokenizer", help="train and cache the default tokenizer (once, before a launch)")
    # train.py's keys the trained tokenizer depends on, so that it finds this one in the cache. Its refusals name
    # these flags, passed down (a message rewritten afterwards also rewrote a path holding '--data.split').
    flags = {"data.data": "--data", "model.vocab_size": "--vocab", "data.cache_dir": "--cache-dir",
             "data.text_field": "--text-field", "data.split": "--split", "data.val_fraction": "--val-fraction"}
    for key, flag in flags.items():
        default = getattr(getattr(Config(), key.split(".")[0]), key.split(".")[1])
        t.add_argument(flag, default=default, type=expand_home if flag in ("--data", "--cache-dir") else type(default),
                       help=f"train.py's --{key} (default: {default})")
    t.add_argument("--doc-per-line", action="store_true", help="train.py's --data.doc_per_line")
    args = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if args.cmd == "prepare":
            if not args.text_field.strip():
                raise DataError("--text-field is empty: name the column or JSON key holding the text")
            prepare(args.sources, args.out, args.text_field, args.doc_per_line, args.force, args.workers, args.strict, args.split)
        else:
            cfg = Config(data=DataConfig(data=args.data, cache_dir=args.cache_dir, text_field=args.text_field,
                                         doc_per_line=args.doc_per_line, split=args.split, val_fraction=args.val_fraction))
            cfg.model.vocab_size, cfg.log.eval_interval = args.vocab, 0     # nothing evaluated: any --val-fraction
            check_values(cfg, lambda k: flags.get(k, f"--{k}"))     # train.py's checks of its keys
            check_dir("cache-dir", args.cache_dir)
            print(build_tokenizer(cfg.data, args.vocab, flags=flags).path)
    except ConfigError as e:
        sys.exit(f"data error: {e}")
    except KeyboardInterrupt:       # Ctrl-C: one word and the shell's status for it, 128 + SIGINT (as train.py)
        print("interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
