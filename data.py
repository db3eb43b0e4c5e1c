"""Data: raw text in, packed windows of token ids out, tokenized online while training runs.

The blog kept the raw corpus as one Arrow file and tokenized and packed it online on every DP rank:
re-tokenizing offline costs days each time an experiment changes its data or tokenizer. Four steps:

1. Sources -> documents (corpus.py). `Corpus` indexes .txt/.md/.py (a document per file, or per line for .txt
   with doc_per_line), .jsonl, Arrow IPC (memory-mapped, as `datasets.save_to_disk` and `prepare`
   write it) and Parquet; "stdlib" = the .py files of this interpreter's standard library.
2. Tokenizer (corpus.py). `build_tokenizer` loads a sentencepiece .model (a Llama 2 tokenizer.model as is) or
   trains a byte-fallback BPE of exactly the model's vocab size on the corpus and caches it.
3. Split and streams. A hash of the document index holds out `val_fraction` of the documents.
   Each epoch the train documents are permuted from (seed, epoch) and dealt to `global_batch`
   streams; global batch b is window b of every stream, and DP rank r packs only its share of
   the streams. The batches are thus the same whatever the DP degree and micro-batch. A stream
   mixes `shuffle` documents in flight (and, for `--data a:0.7,b:0.3`, sources by weight), each
   window's pick a hash of (seed, stream, window index). Evaluation reads fixed windows (EvalWindows).
4. Pack. A stream tokenizes its documents in order (BOS/EOS each) into one sequence cut into
   windows of seq_len + 1 tokens, no padding; a long document continues in the next window.
   Windows carry per-document positions and ids; targets never cross a document boundary. The
   partial window at the end of a stream's epoch is dropped and counted: the only loss.

A stream's position is (epoch, document, token offset in it): the partial-window buffer is exactly
the tokens from there on, so the state is a few integers per stream however long documents are,
and a restored loader, at any DP degree, re-tokenizes from there and yields the very same windows.
A thread packs ahead of training.

    python data.py prepare SRC... --out corpus.arrow             # many files -> one Arrow file
    python data.py tokenizer --data corpus.arrow --vocab 32000   # train + cache before a launch
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import queue
import signal
import sys
import threading

if __name__ == "__main__":      # Ctrl-C while the imports below load (seconds): end quietly, not
    signal.signal(signal.SIGINT, signal.SIG_DFL)   # with a traceback from inside torch; main() restores it

import numpy as np
import pyarrow as pa
import torch

import monitor
from configs import Config, ConfigError, DataConfig, check_dir, check_paths, check_values, path_kind

# The documents and the tokenizer live in corpus.py; data.py is what train.py reads, so the names
# a caller needs from both come from here.
from corpus import (MAX_WARNINGS, PIECE_CHARS, Corpus, DataError, Tokenizer, build_tokenizer,  # noqa: F401
                    iter_pieces, load_tokenizer, resolve_paths, split_documents, stdlib_files, train_tokenizer, uniform)

# ----------------------------------------------------------------------------- 4. packing

STAT_KEYS = ("documents", "empty_docs", "bad_records", "utf8_replacements", "tokens")
COUNTERS = STAT_KEYS + ("windows", "dropped_tail", "boundary_targets")


class PackedLoader:
    """Infinite iterator of packed batches for one DP rank: dicts of int64 tensors [micro_batch,
    seq_len] with tokens, targets (-100 across document boundaries), positions, doc_ids.

    The stream is defined by global window index, not by the layout. A split has S streams (train:
    S = global_batch). In epoch e, stream s reads the documents permutation_e[s::S] and packs them
    on its own; global batch b is window b of every stream, in stream order. DP rank r owns the
    streams [r*S/dp, (r+1)*S/dp) and hands out their windows round-robin, micro_batch at a time.
    So every DP degree and micro-batch sees the very same global batches (and the same loss curve),
    a stream's position is a few integers (epoch, document, token offset, counts), and a run resumed
    at another DP degree gives each rank the saved positions of the streams it now owns.
    At the blog's scale (4096 cores = dp 512 x tp 8, global batch 1024) a rank packs 2 streams,
    tokenizes only their documents and saves 2 positions; resumed at another DP degree it reads the
    files of the one or two saved ranks that owned them. Every rank computes each epoch's
    permutation of the document ids (8 bytes per document, independent of the number of ranks).

    train: S = global_batch streams running through epochs of the train documents, reshuffled each
           epoch (a stream starts its next epoch when its own share is used up). Each stream is a
           shuffle buffer of documents: it holds `shuffle` (M) lanes, each packing its own share
           of the documents, and takes window b from a lane drawn by a hash of (seed, stream, b).
           So one long file fills one window in global_batch x M at a time, not every window of
           consecutive steps, and the order is still a pure function of the global window index:
           exactly resumable and the same at every layout. A mixture (`--data a:0.7,b:0.3`) gives
           every stream M lanes per source and draws the source of window b by its weight, from
           the same hash (mixture_counts() recomputes the realized counts from it).
    val:   S = dp streams, one per rank, over the held-out documents in a fixed order, cycled (an
           "epoch" is one pass); `reset()` before each evaluation makes every evaluation read the
           same windows.
    """

    def __init__(self, cfg: DataConfig, tok: Tokenizer, dp_rank: int = 0, dp_size: int = 1,
                 split: str = "train", *, corpus: Corpus | None = None, threads: int = 1, prefetch: int = 4):
        if split not in ("train", "val") or not 0 <= dp_rank < dp_size:
            raise ValueError(f"need split 'train' or 'val' and 0 <= dp_rank < dp_size, got {split!r}, {dp_rank}, {dp_size}")
        if cfg.seq_len < 1 or cfg.micro_batch < 1:
            raise DataError(f"seq_len {cfg.seq_len} and micro_batch {cfg.micro_batch} must be >= 1")
        self.n_streams = cfg.global_batch if split == "train" else dp_size
        if split == "train" and cfg.global_batch % (dp_size * cfg.micro_batch):
            raise DataError(f"global_batch {cfg.global_batch} is not divisible by micro_batch {cfg.micro_batch} "
                            f"x dp {dp_size}; pick a multiple of {cfg.micro_batch * dp_size}")
        self.cfg, self.tok, self.rank, self.dp, self.split = cfg, tok, dp_rank, dp_size, split
        self.threads, self.prefetch = threads, prefetch
        k = self.n_streams // dp_size
        self.streams = list(range(dp_rank * k, (dp_rank + 1) * k))     # the streams this rank packs
        self.corpus = corpus or Corpus(cfg.data, cfg.text_field, cfg.doc_per_line, cfg.split)
        train_ids, val_ids = split_documents(self.corpus.n_docs, cfg.val_fraction)
        self.ids = train_ids if split == "train" else val_ids
        groups = [(lo, hi) for _, _, lo, hi in self.corpus.groups]
        if split == "train":                    # per source: its train documents and its lanes per stream
            self.group_ids = [train_ids[(train_ids >= lo) & (train_ids < hi)] for lo, hi in groups]
            self.weights = np.array([w for _, w, _, _ in self.corpus.groups])
            self.lanes_max = max(1, cfg.shuffle)
        else:                                   # one pool, the sources interleaved document by document
            per = [val_ids[(val_ids >= lo) & (val_ids < hi)] for lo, hi in groups]
            rank = np.concatenate([np.arange(len(p)) for p in per])
            self.ids = np.concatenate(per)[np.lexsort((np.repeat(np.arange(len(per)), [len(p) for p in per]), rank))]
            self.group_ids, self.weights, self.lanes_max = [self.ids], np.ones(1), 1
        # A source with few documents gets fewer lanes: every lane needs at least one document.
        self.lanes = [max(1, min(self.lanes_max, len(ids) // self.n_streams)) for ids in self.group_ids]
        self.cum_weights = np.cumsum(self.weights / self.weights.sum())
        self.lane_ids = [self.lane_id(r, g, c) for r in self.streams
                         for g in range(len(self.lanes)) for c in range(self.lanes[g])]
        self._mix_counts = (0, np.zeros(len(self.lanes), np.int64))     # (batches, windows per source)
        self.most_held = 0                      # the most tokens one lane held at once (see _blocks)
        self._check_size()
        if len(self.ids) < self.n_streams:
            raise DataError(f"the {split} split has {len(self.ids)} documents (of {self.corpus.n_docs}, val_fraction "
                            f"{cfg.val_fraction}) for {self.n_streams} streams (" + ("one per sequence of the global "
                            "batch" if split == "train" else "one per DP rank") + "): each needs at least one; use "
                            "more data" + (" or a larger val_fraction" if split == "val" else " or a smaller --global_batch"))
        self._perms = {}                        # epoch -> permutation of the split, the last few
        # What a saved position means depends on these; a resume must match them.
        self.fingerprint = {"corpus": self.corpus.fingerprint, "tokenizer": tok.fingerprint,
                            "seed": cfg.seed, "val_fraction": cfg.val_fraction, "bos": cfg.bos, "eos": cfg.eos,
                            "shuffle": self.lanes_max, "mixture": [round(float(w), 12) for w in self.weights]}
        start = {"epoch": 0, "doc": 0, "offset": 0, "stats": dict.fromkeys(COUNTERS, 0)}
        self._start_state = {"split": split, "n_streams": self.n_streams, "dp_size": dp_size, **self.fingerprint,
                             "streams": {str(s): start for s in self.lane_ids}}
        self._state = self._start_state
        self._gen = self._thread = self._error = None

    def _check_size(self):
        """Refuse a split smaller than one global batch (val: one micro batch per rank), early."""
        c = self.cfg
        windows = c.global_batch if self.split == "train" else self.dp * c.micro_batch
        need, have = windows * (c.seq_len + 1), 0
        for tokens, *_ in self._blocks(self.ids, 0, 0, quiet=True):    # stop as soon as enough
            have += len(tokens)
            if have >= need:
                return
        what = f"global_batch {c.global_batch}" if self.split == "train" else f"dp {self.dp} x micro_batch {c.micro_batch}"
        raise DataError(f"the {self.split} split of {c.data!r} has {have:,} tokens ({len(self.ids):,} documents) but "
                        f"one batch needs {what} x (seq_len {c.seq_len} + 1) = {need:,} tokens; use more data, "
                        f"or lower --global_batch / --seq_len" + (" or raise --data.val_fraction" if self.split == "val" else ""))

    def lane_id(self, stream: int, group: int, lane: int) -> int:
        """The key of one lane: a stream's lanes are contiguous, so DP ranks own whole blocks."""
        return (stream * len(self.lanes) + group) * self.lanes_max + lane

    def documents(self, lane: int, epoch: int) -> np.ndarray:
        """The document ids lane `lane` (lane_id) reads in `epoch`, in order: its source's
        permutation for the epoch, dealt over the streams x lanes of that source."""
        stream, rest = divmod(lane, len(self.lanes) * self.lanes_max)
        g, c = divmod(rest, self.lanes_max)
        j, n = stream * self.lanes[g] + c, self.n_streams * self.lanes[g]
        if self.split == "val":
            return self.ids[j::n]
        if (epoch, g) not in self._perms:       # lanes cross an epoch at different times: keep a few
            perms = {k: p for k, p in self._perms.items() if k[0] > epoch - 3}
            key = [self.cfg.seed, epoch] + ([g] if g else [])       # one source: as without a mixture
            self._perms = {**perms, (epoch, g): np.random.default_rng(key).permutation(self.group_ids[g])}
        return self._perms[epoch, g][j::n]

    def choose(self, streams, b) -> tuple[np.ndarray, np.ndarray]:
        """(source, lane) that window b of each stream comes from: a hash of (seed, stream, b),
        the source by weight, then one of its lanes uniformly. Arrays broadcast."""
        g = np.minimum(np.searchsorted(self.cum_weights, uniform(self.cfg.seed, 1, streams, b), side="right"),
                       len(self.lanes) - 1)
        c = (uniform(self.cfg.seed, 2, streams, b) * np.asarray(self.lanes)[g]).astype(np.int64)
        return g, c

    def mixture_counts(self, n_batches: int) -> np.ndarray:
        """Windows per source in the first n_batches global batches, over every stream (every DP
        rank): the realized mixture, recomputed from the hash with no communication. Incremental."""
        done, counts = self._mix_counts
        if n_batches < done:
            done, counts = 0, np.zeros_like(counts)
        for b0 in range(done, n_batches, 4096):
            b = np.arange(b0, min(n_batches, b0 + 4096))
            g, _ = self.choose(np.arange(self.n_streams)[:, None], b[None, :])
            counts = counts + np.bincount(g.ravel(), minlength=len(self.lanes))
        self._mix_counts = (n_batches, counts)
        return counts

    # ---------------------------------------------------------------- producer
    def _produce(self, state: dict):
        """Yield (batch, state after it) forever, starting exactly at `state`: this rank's streams
        round-robin, micro_batch windows per batch."""
        positions = {lane: state["streams"][str(lane)] for lane in self.lane_ids}
        packers = {lane: self._pack(lane, positions[lane]) for lane in self.lane_ids}
        per = len(self.lane_ids) // len(self.streams)       # lanes per stream, contiguous
        done = [sum(positions[lane]["stats"]["windows"] for lane in self.lane_ids[k * per:(k + 1) * per])
                for k in range(len(self.streams))]          # windows each stream has handed out
        i, wins = sum(n > min(done) for n in done), []      # mid-round: the streams ahead come first
        while True:
            g, c = self.choose(self.streams[i], done[i])
            lane = self.lane_id(self.streams[i], int(g), int(c))
            tokens, starts, positions[lane] = next(packers[lane])
            wins.append((tokens, starts))
            done[i] += 1
            i = (i + 1) % len(self.streams)
            if len(wins) == self.cfg.micro_batch:
                yield self._batch(wins), {**state, "streams": {str(k): v for k, v in positions.items()}}
                wins = []

    def _blocks(self, order: np.ndarray, nxt: int, skip: int, quiet: bool = False):
        """Yield the tokens of documents order[nxt:], from token `skip` of the first, in blocks:
        (tokens, document (index into order), offset in it, (document, counts) of the documents
        complete in the block, (document, offset) after it). Short documents come many to a block,
        about `want` tokens; a document over PIECE_CHARS characters comes piece by piece with
        split_long's exact cuts (sentencepiece only), so a lane never holds more than about
        PIECE_CHARS of its tokens (a 50 MB document in one line: 0.75 M, not 37 M). Resuming
        inside it re-encodes the pieces before the offset and drops them."""
        c, chunk, want = self.cfg, 16, max(2 * (self.cfg.seq_len + 1), 65536 // len(self.lane_ids))

        def long(t):                            # split_long's cuts are exact for sentencepiece only
            return bool(t) and len(t) > PIECE_CHARS and isinstance(self.tok, Tokenizer)
        while nxt < len(order):
            ids = order[nxt:nxt + chunk]
            docs, j, made = self.corpus.read(ids, quiet), 0, 0
            while j < len(docs):
                t, repl, bad = docs[j]
                if long(t):                     # piece by piece: at most ~PIECE_CHARS tokens at a time
                    n = 0
                    for k, piece in enumerate(iter_pieces(t, PIECE_CHARS)):
                        a = self.tok.encode_batch([piece], c.bos and k == 0, False, self.threads)[0]
                        drop = min(max(skip - n, 0), len(a))
                        yield (a[drop:], np.full(len(a) - drop, nxt + j, np.int32),
                               np.arange(n + drop, n + len(a), dtype=np.int32), [], (nxt + j, n + len(a)))
                        n, made = n + len(a), made + len(a)
                    a = np.asarray([self.tok.eos_id] if c.eos else [], np.int32)[max(skip - n, 0):]
                    n, skip = n + (1 if c.eos else 0), 0
                    yield (a, np.full(len(a), nxt + j, np.int32), np.arange(n - len(a), n, dtype=np.int32),
                           [(nxt + j, (1, 0, int(bad), repl, n))], (nxt + j + 1, 0))
                    j += 1
                    continue
                k, size = j, 0                  # short documents up to the next long one, ~PIECE_CHARS chars
                while k < len(docs) and size <= PIECE_CHARS and not long(docs[k][0]):
                    size, k = size + len(docs[k][0] or ""), k + 1
                keep = [i for i in range(j, k) if docs[i][0] and not docs[i][0].isspace()]
                arrays = self.tok.encode_batch([docs[i][0] for i in keep], c.bos, c.eos, self.threads)
                lens = np.zeros(k - j, np.int64)
                lens[np.asarray(keep, np.int64) - j] = [len(a) for a in arrays]
                entries = [(nxt + i, (int(lens[i - j] > 0), int(not docs[i][2] and lens[i - j] == 0), int(docs[i][2]),
                                      docs[i][1], int(lens[i - j]))) for i in range(j, k)]
                new = np.concatenate(arrays) if arrays else np.zeros(0, np.int32)
                ndoc = np.repeat(np.arange(nxt + j, nxt + k, dtype=np.int32), lens)
                noff = np.arange(len(new), dtype=np.int32) - np.repeat((np.cumsum(lens) - lens).astype(np.int32), lens)
                d, skip = min(skip, len(new)), 0      # resuming in the middle of document order[nxt]
                yield new[d:], ndoc[d:], noff[d:], entries, (nxt + k, 0)
                j, made = k, made + len(new)
            nxt += len(ids)
            chunk = int(np.clip(chunk * want / max(made, 1), 1, 4096))

    def _pack(self, stream: int, state: dict):
        """Yield (window tokens, document starts, position after it) of one stream forever, from `state`."""
        L1 = self.cfg.seq_len + 1
        epoch = state["epoch"]
        stats = dict(state["stats"])            # counts of documents fully behind the position
        pending = collections.deque()           # (doc, per-document counts) of documents in flight
        order = self.documents(stream, epoch)
        blocks = self._blocks(order, state["doc"], state["offset"])
        fresh, emitted = state["doc"] == 0 and state["offset"] == 0, 0
        tok = np.zeros(0, np.int32)
        tdoc = toff = np.zeros(0, np.int32)     # per token: document (index into order), offset in it
        # (int32: 4 bytes a token, not 8; a stream's documents and a document's tokens both stay far
        # below 2**31). The lane holds less than one window plus one block: bounded, however long
        # the document (self.most_held records the most it held).
        pos, after = 0, (state["doc"], state["offset"])

        def commit(until):                      # count the documents now fully behind the position
            while pending and pending[0][0] < until:
                for k, v in zip(STAT_KEYS, pending.popleft()[1]):
                    stats[k] += v
        while True:
            while len(tok) - pos < L1 and (b := next(blocks, None)) is not None:
                new, ndoc, noff, entries, after = b
                pending.extend(entries)
                tok, tdoc, toff = (np.concatenate((a[pos:], n)) for a, n in ((tok, new), (tdoc, ndoc), (toff, noff)))
                pos, self.most_held = 0, max(self.most_held, len(tok))
            if len(tok) - pos >= L1:
                window, starts = tok[pos:pos + L1], toff[pos:pos + L1] == 0
                pos += L1
                emitted += 1
                doc, off = (int(tdoc[pos]), int(toff[pos])) if pos < len(tok) else after
                commit(doc)
                stats["windows"] += 1
                stats["boundary_targets"] += int(starts[1:].sum())     # targets masked in this window
                yield window, starts, {"epoch": epoch, "doc": doc, "offset": off, "stats": dict(stats)}
            else:                               # end of the epoch: drop the partial window, count it
                if fresh and emitted == 0:
                    raise DataError(f"stream {stream} of the {self.split} split ({len(order)} documents in epoch "
                                    f"{epoch}) holds fewer than seq_len + 1 = {L1} tokens: it cannot fill one "
                                    f"window; use more data, a shorter --seq_len or " +
                                    ("a smaller --global_batch or --data.shuffle" if self.split == "train" else "fewer DP ranks"))
                commit(len(order))
                stats["dropped_tail"] += len(tok) - pos
                epoch, pos, fresh, emitted = epoch + 1, 0, True, 0
                tok, tdoc, toff = tok[:0], tdoc[:0], toff[:0]
                order = self.documents(stream, epoch)
                blocks, after = self._blocks(order, 0, 0), (0, 0)

    @staticmethod
    def _batch(wins) -> dict[str, torch.Tensor]:
        w = np.stack([t for t, _ in wins]).astype(np.int64)          # [B, seq_len + 1]
        start = np.stack([s for _, s in wins])                        # True at a document's first token
        ar = np.arange(w.shape[1])
        doc = np.cumsum(start, axis=1) - start[:, :1]                 # 0 for the window's first document
        positions = ar - np.maximum.accumulate(np.where(start, ar, 0), axis=1)
        targets = w[:, 1:].copy()
        targets[start[:, 1:]] = -100            # the next token opens another document: not predictable
        as_t = torch.from_numpy
        return {"tokens": as_t(np.ascontiguousarray(w[:, :-1])), "targets": as_t(targets),
                "positions": as_t(np.ascontiguousarray(positions[:, :-1])),
                "doc_ids": as_t(np.ascontiguousarray(doc[:, :-1]))}

    # ---------------------------------------------------------------- consumer
    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._error is not None:
            raise self._error
        if self._gen is None:
            self._gen = self._produce(self._state)
            if self.prefetch:
                self._stop, self._queue = threading.Event(), queue.Queue(self.prefetch)
                self._thread = threading.Thread(target=self._worker, args=(self._gen, self._queue, self._stop),
                                                name=f"data-{self.split}-dp{self.rank}", daemon=True)
                self._thread.start()
        try:
            item = self._queue.get() if self.prefetch else next(self._gen)
        except Exception as e:                  # without a thread: fail the same way as with one
            item = e
        if isinstance(item, BaseException):
            self._error = item
            raise item
        batch, self._state = item
        return batch

    @staticmethod
    def _worker(gen, q: queue.Queue, stop: threading.Event):
        try:
            for item in gen:
                if stop.is_set():
                    return
                q.put(item)                     # blocks while the queue is full: prefetch depth
        except BaseException as e:              # handed to the training thread, raised there
            q.put(e)

    def state_dict(self) -> dict:
        """The position after the last batch handed out (not after what the thread prefetched):
        this rank's streams only. Plain data (JSON-able), never mutated once handed out."""
        return {**self._state, "streams": dict(self._state["streams"])}

    def load_state_dict(self, sd) -> None:
        """Continue from a saved position: this rank's own state, or, after a change of DP degree,
        the sequence of every saved DP rank's state (only those owning this rank's streams are read)."""
        parts = [sd]
        if not isinstance(sd, dict):                    # a sequence, one state per saved DP rank
            self._check(sd[0])
            per = self.n_streams // len(sd)             # streams per saved rank (contiguous)
            parts = [sd[i] for i in sorted({s // per for s in self.streams})]
        streams = {}
        for p in parts:
            self._check(p)
            streams.update(p["streams"])
        missing = [s for s in self.lane_ids if str(s) not in streams]
        if missing:
            raise DataError(f"the data state holds no position for streams {missing[:8]} of this rank: it "
                            f"was saved by another DP rank; give every saved DP rank's state")
        self.close()
        self._state = {**self._start_state, "streams": {str(s): streams[str(s)] for s in self.lane_ids}}
        self._gen = self._error = None

    def _check(self, sd: dict):
        if sd.get("n_streams") != self.n_streams:
            raise DataError(f"the data state was saved with {sd.get('n_streams')} streams (global batch) but this "
                            f"run has {self.n_streams}: the stream is defined by the global batch, so it cannot "
                            f"continue exactly. Resume with --global_batch={sd.get('n_streams')}, or start the data "
                            f"stream afresh with --ckpt.reset_data")
        for key in ("split",) + tuple(self.fingerprint):
            want = self._start_state[key]
            if sd.get(key) != want:
                raise DataError(f"the data state was saved with {key}={sd.get(key)!r} but this loader has "
                                f"{key}={want!r}: the saved position means nothing here; restore the "
                                f"original setting, or keep the model and optimizer and start the data "
                                f"stream afresh with --ckpt.reset_data" + (" (a new corpus: also pass the "
                                f"run's tokenizer with --data.tokenizer)" if key == "corpus" else ""))

    def reset(self) -> None:
        """Back to the start (use before each evaluation on the val split)."""
        self.load_state_dict(self._start_state)

    def stats(self) -> dict:
        """Counts over this rank's streams up to the last batch handed out (sum them over DP ranks for
        the run's). Documents are counted once fully behind the position; epoch = the lowest stream's."""
        positions = self._state["streams"].values()
        s = {k: sum(p["stats"][k] for p in positions) for k in COUNTERS}
        packed = s["windows"] * (self.cfg.seq_len + 1)
        s["windows_by_source"] = [sum(p["stats"]["windows"] for k, p in self._state["streams"].items()
                                      if int(k) // self.lanes_max % len(self.lanes) == g) for g in range(len(self.lanes))]
        s.update(epoch=min(p["epoch"] for p in positions), empty_files=self.corpus.empty_files,
                 split_documents=len(self.ids), packing_efficiency=packed / max(packed + s["dropped_tail"], 1))
        return s

    def close(self) -> None:
        """Stop the prefetch thread (the next batch starts a new one from the current position)."""
        if self._thread is not None:
            self._stop.set()
            while self._thread.is_alive():      # empty the queue so a blocked put() returns
                try:
                    self._queue.get(timeout=0.05)
                except queue.Empty:
                    pass
            self._thread.join()
        self._gen = self._thread = None


# ----------------------------------------------------------------------------- evaluation

class EvalWindows:
    """The held-out windows evaluation reads: the first `n_windows` windows of the val split (its
    documents in a fixed order, one stream), whatever the layout. DP rank r takes the r-th block
    of ceil(n / dp) of them, in micro-batches padded with rows whose every target is -100 (they add
    nothing to the loss sum or the token count; the shapes stay static for XLA). Every rank runs
    the same number of batches, and the summed loss over the summed count is the same number at
    every DP degree, micro-batch and PP (up to the order of a float sum).
    Every rank packs the windows up to its block: at most n_windows x (seq_len + 1) tokens (32 x
    4097 for 7B), however many ranks. Interface of a loader: reset(), next(); len() batches."""

    def __init__(self, cfg: DataConfig, tok: Tokenizer, n_windows: int, dp_rank: int = 0, dp_size: int = 1,
                 *, corpus: Corpus | None = None):
        per = -(-n_windows // dp_size)          # windows per rank; the last ranks may hold fewer
        mine = range(min(n_windows, dp_rank * per), min(n_windows, (dp_rank + 1) * per))
        val = PackedLoader(dataclasses.replace(cfg, micro_batch=1), tok, 0, 1, split="val", corpus=corpus, prefetch=0)
        rows = [next(val) for _ in range(mine.stop)][mine.start:]
        val.close()
        mb, T = cfg.micro_batch, cfg.seq_len
        blank = {"tokens": torch.zeros(1, T, dtype=torch.long), "targets": torch.full((1, T), -100),
                 "positions": torch.arange(T)[None], "doc_ids": torch.zeros(1, T, dtype=torch.long)}
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
    """Batches of a PackedLoader on `device`, with the loader's state of the batch last handed out.
    On XLA, torch-xla's MpDeviceLoader uploads batches ahead in its own threads; the states are
    queued in the same order so state_dict() still names the batch training received."""

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


def to_device_loader(loader: PackedLoader, device: torch.device) -> DeviceLoader:
    """Iterate `loader` on `device`: MpDeviceLoader on XLA, non-blocking copies elsewhere.
    Restore the loader's state before wrapping it; save the wrapper's state_dict()."""
    return DeviceLoader(loader, device)


# ----------------------------------------------------------------------------- command line

def prepare(sources: list[str], out: str, text_field: str = "text", doc_per_line: bool = False,
            force: bool = False) -> dict:
    """The blog's offline step: many files -> one Arrow IPC stream with a large_string `text`
    column (what datasets writes; `datasets.Dataset.from_file` reads it). Written to a temporary
    file and renamed, so an existing file is never half-overwritten."""
    if not out.endswith(".arrow"):
        raise DataError(f"--out {out}: name the output file *.arrow so that --data finds it")
    if (kind := path_kind(out)) not in ("nothing", "a file"):
        raise DataError(f"--out {out} is {kind}; give the name of an .arrow file to write")
    if kind == "a file" and not force:
        raise DataError(f"{out} exists; pass --force to replace it")
    check_dir("out", os.path.dirname(os.path.abspath(out)))
    if os.path.realpath(out) in {os.path.realpath(p) for p in resolve_paths(",".join(sources))}:
        raise DataError(f"--out {out} is also one of the sources")
    corpus = Corpus(",".join(sources), text_field, doc_per_line)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    schema = pa.schema({"text": pa.large_string()})
    counts = collections.Counter(empty_files=corpus.empty_files)
    bar = monitor.Progress(corpus.n_docs, "[prepare] documents", unit="docs")
    tmp = f"{out}.tmp{os.getpid()}"
    try:
        with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
            for start in range(0, corpus.n_docs, 1024):
                done, texts = min(start + 1024, corpus.n_docs), []
                for text, repl, bad in corpus.read(np.arange(start, done)):
                    empty = not bad and (not text or text.isspace())
                    counts.update(utf8_replacements=repl, bad_records=bad, empty_docs=empty)
                    if not (bad or empty):
                        texts.append(text)
                        counts.update(documents=1, bytes=len(text.encode()))
                writer.write_batch(pa.record_batch([pa.array(texts, pa.large_string())], schema=schema))
                bar.update(done - start)
        bar.close()
        if not counts["documents"]:
            raise DataError(f"{', '.join(sources)}: no document has text ({counts['empty_docs']} empty, "
                            f"{counts['bad_records']} unreadable records): nothing written to {out}; check the "
                            f"sources and --text-field")
        os.replace(tmp, out)
    finally:                                            # an error or Ctrl-C leaves no partial file
        if os.path.exists(tmp):
            os.remove(tmp)
    print(f"[prepare] wrote {out}: " + ", ".join(f"{k} {v:,}" for k, v in sorted(counts.items())),
          file=sys.stderr, flush=True)
    return dict(counts)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prepare", help="many text/jsonl/arrow/parquet files -> one Arrow file")
    a.add_argument("sources", nargs="+")
    a.add_argument("--out", required=True)
    a.add_argument("--text-field", default="text")
    for flag in ("--doc-per-line", "--force"):
        a.add_argument(flag, action="store_true")
    t = sub.add_parser("tokenizer", help="train and cache the default tokenizer (once, before a launch)")
    for flag, default in (("--data", "stdlib"), ("--vocab", 4096), ("--cache-dir", ".cache")):
        t.add_argument(flag, default=default, type=type(default))
    args = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if args.cmd == "prepare":
            if not args.text_field.strip():
                raise DataError("--text-field is empty: name the column or JSON key holding the text")
            prepare(args.sources, args.out, args.text_field, args.doc_per_line, args.force)
        else:
            cfg = Config(data=DataConfig(data=args.data, cache_dir=args.cache_dir))
            cfg.model.vocab_size = args.vocab
            check_values(cfg)                           # the checks train.py runs on the same keys
            check_paths(cfg)
            tok = build_tokenizer(cfg.data, args.vocab)
            print(tok.path)
    except ConfigError as e:
        sys.exit(f"data error: {str(e).replace('--model.vocab_size', '--vocab').replace('--data.cache_dir', '--cache-dir')}")
    except KeyboardInterrupt:
        sys.exit("interrupted")


if __name__ == "__main__":
    main()
