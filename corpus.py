"""The corpus: a --data spec's documents, read by index, and the tokenizer trained on them.

A rank reads only the documents of its own spans (random access by index): what it reads does not
grow with the number of ranks. The tokenizer is a sentencepiece .model (Llama 2's as is), a
tokenizer.json (Llama 3), or a byte-fallback BPE of exactly the model's vocab size trained on the
corpus once and cached.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import signal
import sys
import threading
import time

import numpy as np
import sentencepiece as spm

import prepare
from configs import DataConfig
from sources import (COMPRESSED, CachedDocs, ColumnDocs, DataError, FileDocs, LineDocs, build_once, decode,
                     give_back_heap, no_surrogates, resolve_paths)
from spans import by_hash, held_out, permute

COPIED = COMPRESSED + (".parquet",)     # read through an Arrow copy (prepare.cached): no cheap random access
# The flags a corpus or tokenizer refusal names: train.py's. `data.py tokenizer` passes its own (and has no
# --data.tokenizer to offer): passed down, not rewritten into the message, which would rewrite a path too.
MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"   # the kernel's limit of memory maps a process (65,530 by default)
MAP_ROOM = 8192     # maps left to the run itself (libraries, threads, torch's large tensors: a tiny CPU run holds ~770)


def check_maps(n_files: int) -> None:
    """A JSON lines, Arrow or cached file is memory-mapped with its offsets index for the whole run: 2 maps a
    file on every rank, against the kernel's per-process limit (~28,000 files at the default). Past it a map fails
    with ENOMEM partway through the start (said as a damaged Arrow file): refused here, before any work."""
    try:
        with open(MAX_MAP_COUNT) as f, open("/proc/self/maps") as held:
            limit, held = int(f.read()), sum(1 for _ in held)
    except (OSError, ValueError):       # not Linux: no such limit
        return
    if held + 2 * n_files + MAP_ROOM > limit:
        raise DataError(f"--data has {n_files:,} files read through memory maps, 2 each for the whole run: with the "
                        f"{held:,} this process holds and {MAP_ROOM:,} for the run, past the kernel's vm.max_map_count "
                        f"{limit:,}. Join them into fewer files (python data.py prepare SRC... --out corpus.arrow: one), "
                        f"or raise the limit (sysctl -w vm.max_map_count={held + 2 * n_files + 2 * MAP_ROOM})")


FLAGS = {"data.data": "--data", "data.text_field": "--data.text_field", "data.split": "--data.split",
         "model.vocab_size": "--model.vocab_size", "data.tokenizer": "--data.tokenizer"}


def or_given(flags: dict) -> str:
    return f", or pass {flags['data.tokenizer']}" if "data.tokenizer" in flags else ""


def parse_mixture(spec: str) -> list[tuple[str, float | None]]:
    """'code.arrow:0.7,prose.jsonl:0.3' -> [('code.arrow', 0.7), ('prose.jsonl', 0.3)]; all weights or none.
    The weight is what follows an entry's last ':'; an entry that names a path whole is that path (a ':'
    in a file's name), and a name with ':' takes a weight after it (a:b.jsonl:0.5)."""
    out = []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        head, sep, tail = entry.rpartition(":")
        if not sep or os.path.lexists(entry):
            out.append((entry, None))
            continue
        try:
            out.append((head.strip(), float(tail)) if head.strip() else (entry, None))
        except ValueError:      # a glob may hold a ':' (run:*/x.jsonl); anything else meant a weight or a path
            if any(c in entry for c in "*?["):
                out.append((entry, None))
                continue
            raise DataError(f"--data: no file {entry!r} exists, and {tail.strip()!r} after its last ':' is not a "
                            f"mixture weight; give a path, or a path and a positive number (a.arrow:0.7,b.jsonl:0.3)")
    weights = [w for _, w in out]
    if None in weights and any(w is not None for w in weights):
        raise DataError(f"--data {spec!r}: {out[weights.index(None)][0]!r} has no weight; give every source a "
                        f"weight (a.arrow:0.7,b.jsonl:0.3) or none")
    if bad := [f"{e}:{w:g}" for e, w in out if w is not None and not (0 < w < float("inf"))]:
        raise DataError(f"--data: mixture weights must be positive numbers, got {', '.join(bad)} (leave a source "
                        f"out rather than weigh it 0)")
    if not np.isfinite(sum(w or 0 for w in weights)):   # 1e308 twice: normalized, each 0 (the first source's windows)
        raise DataError(f"--data: the mixture weights {', '.join(f'{w:g}' for w in weights)} sum past the largest "
                        f"float; weights are relative: give smaller ones (a.arrow:0.7,b.jsonl:0.3)")
    if weights[0] is not None:      # data.py draws a source with a 53-bit uniform against these cumulative shares
        cum = np.cumsum(np.array(weights) / sum(weights))
        if never := [f"{e}:{w:g}" for (e, w), step in zip(out, np.diff(cum, prepend=0.0)) if not step > 0]:
            raise DataError(f"--data: {never[0]} is so small beside the other weights that its source is never drawn "
                            f"(each draw is a 53-bit number); raise it, or leave the source out")
    return out


def mixture_files(spec: str, split: str = "train", left_out: list | None = None, split_flag: str = "--data.split"
                  ) -> tuple[list[tuple[str, float | None]], list[list[str]]]:
    """parse_mixture's entries and each one's files; a file named by two entries counts in the first. A
    weighted source left no file of its own is refused: train.py calls this before any work."""
    entries, seen, per_entry = parse_mixture(spec), set(), []
    for entry, _ in entries:        # (one source: resolve_paths has left each file once)
        found = resolve_paths(entry, split, left_out, split_flag)
        real = map(os.path.realpath, found) if len(entries) > 1 else found
        per_entry.append([p for p, r in zip(found, real) if not (r in seen or seen.add(r))])
    empty = [e for (e, w), ps in zip(entries, per_entry) if w is not None and not ps]
    if empty:
        raise DataError(f"mixture source {empty[0]!r} holds no files of its own: they are an earlier source's too; "
                        f"name each file in one source only")
    return entries, per_entry


class Corpus:
    """All documents of a data spec, indexed 0..n_docs-1 in a fixed order (the sources in the order
    given, files sorted). `groups`: (name, weight, first doc, end) per source of a weighted spec
    (`a.arrow:0.7,b/:0.3`, weights summing to 1); unweighted, one group of every document."""

    def __init__(self, spec: str = "stdlib", text_field: str = "text", doc_per_line: bool = False,
                 split: str = "train", cache_dir: str = ".cache", flags: dict = FLAGS, listing: tuple | None = None):
        self.spec, self.sources, self.examples = spec, [], {}
        self._record = (-1, b"")                # read_spans: (document, its text) of the last long .jsonl record
        # listing: mixture_files' (entries, per_entry) and its left_out, where the caller has listed the corpus
        # already (train.py, before any work): one listing a rank, a metadata request a file on a shared file system
        if listing is None:
            listing = (*mixture_files(spec, split, left := [], flags["data.split"]), left)
        entries, per_entry, self.left_out = listing
        # One text field for every source, or one per source in --data's order (a mixture of "text" and "content")
        fields = [f.strip() for f in text_field.split(",")]
        if len(fields) not in (1, len(entries)) or not all(fields):
            what = (f"{len(fields)} fields for the {len(entries)} sources of {flags['data.data']}" if all(fields)
                    else "an empty field")
            raise DataError(f"{flags['data.text_field']}={text_field} names {what}: give one field for all, or one per "
                            f"source in its order")
        field_of = {p: fields[i % len(fields)] for i, ps in enumerate(per_entry) for p in ps}
        field_flag = flags["data.text_field"]     # a mixture's sources may each hold their text under another name
        if len(entries) > 1:
            field_flag += f" (for one source of a mixture: one field a source, in its order, {field_flag}=A,B)"
        paths = [p for ps in per_entry for p in ps]
        stat = {p: os.stat(p) for p in paths}  # once a file: a metadata op per file and rank on a shared file system
        empty = [p for p in paths if stat[p].st_size == 0]
        lined, other = (".jsonl", ".json") + ((".txt",) if doc_per_line else ()), COPIED + (".arrow",)
        check_maps(mapped := sum(stat[p].st_size > 0 and p.endswith(lined + other) for p in paths))     # indexed or copied
        # A UTF-16 file refused before any file is indexed or copied (hours for a big corpus): the heads of those still to
        # copy sniffed first (a first start only: a 4 KiB read of each a rank; later a stat of each copy a rank), those whose
        # lines are indexed (LineDocs reads that page anyway), and whole files beside indexed or copied ones (a 4 KiB read
        # of each a rank, each start; whole files alone: the span index build, their first work, sniffs them once a node).
        prepare.check_heads([p for p in paths if stat[p].st_size and (p.endswith(lined) or mapped and not p.endswith(other) or
                             p.endswith(COMPRESSED) and not os.path.exists(prepare.copy_path(p, field_of[p], doc_per_line,
                                                                                             cache_dir, stat[p])))])
        docs_of = {}                            # path -> documents it holds (the mixture's groups)
        for p in paths:
            field = field_of[p]
            if stat[p].st_size == 0:
                continue
            elif p.endswith(COPIED):     # through an Arrow copy, made once (sources.COMPRESSED)
                copy = prepare.cached(p, field, doc_per_line, cache_dir, field_flag)
                self.sources.append(CachedDocs(p, copy, field, doc_per_line, cache_dir, field_flag))
                if not self.sources[-1].n and p.endswith(COMPRESSED):     # nothing decompressed: an empty file,
                    empty.append(p)                                         # said as its raw twin is
            elif p.endswith((".jsonl", ".json")):
                self.sources.append(LineDocs(p, True, field, cache_dir, field_flag))
            elif p.endswith(".arrow"):
                self.sources.append(ColumnDocs(p, field, cache_dir, field_flag))
            elif doc_per_line and p.endswith(".txt"):
                self.sources.append(LineDocs(p, False, field, cache_dir))
            elif self.sources and isinstance(self.sources[-1], FileDocs):
                self.sources[-1].paths.append(p)        # consecutive whole files share one source
                self.sources[-1].n += 1
            else:
                self.sources.append(FileDocs([p]))
            docs_of[p] = 1 if isinstance(self.sources[-1], FileDocs) else self.sources[-1].n
        self.empty_files = len(empty)
        if empty:
            self.examples["empty_files"] = empty[0]
        self.offsets = np.cumsum([0] + [s.n for s in self.sources])
        self.n_docs = int(self.offsets[-1])
        if self.n_docs == 0:
            raise DataError(f"no documents in {spec!r} ({len(paths)} files, {self.empty_files} empty)")
        # Identity for caches and resume checks: file names and sizes (hashing a terabyte of content at
        # every start costs more than it protects; names, so the same files mounted elsewhere match).
        ident = [",".join(fields), doc_per_line, [(os.path.basename(p), stat[p].st_size) for p in paths]]
        if any(p.endswith(COPIED) for p in paths):      # and how their copies read (a resume over an older
            ident.append(prepare.RECIPE)                # copy's documents is refused); raw corpora: as before
        self.fingerprint = hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:16]
        # and, for the span index's file (not its resume key), where the files are and when they last changed:
        # a file rewritten at its size (its lines shuffled) reused the old cuts
        stamp = [(os.path.realpath(p), stat[p].st_size, stat[p].st_mtime_ns) for p in paths]
        self.stamp = hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:8]
        self.groups = [(spec, 1.0, 0, self.n_docs)]
        if entries[0][1] is not None:
            ends = np.cumsum([sum(docs_of.get(p, 0) for p in ps) for ps in per_entry])
            total = sum(w for _, w in entries)
            self.groups = [(e, w / total, int(lo), int(hi)) for (e, w), lo, hi in zip(entries, [0, *ends[:-1]], ends)]
            empty = [g[0] for g in self.groups if g[2] == g[3]]
            if empty:       # (only empty files: mixture_files refused a source of no files)
                raise DataError(f"mixture source {empty[0]!r} holds no documents")

    def warn(self, kind: str, msg: str):
        """Keep the first data problem of each kind as its example (the loader's stats count them). Not
        printed: the packing thread's line would cut into the step lines (train.py says each kind once)."""
        self.examples.setdefault(kind, msg)

    def mixture_line(self, counts) -> str:
        """A weighted mixture's realized shares (windows per source) beside its weights, to 3 digits: a
        weight of 0.5% is not '0%' nor 99.5% '100%'."""
        n = int(sum(counts))
        shares = [f"{name} {100 * c / max(n, 1):.3g}% (weight {100 * w:.3g}%)"
                  for (name, w, _, _), c in zip(self.groups, counts)]
        return f"data mixture over {n:,} windows: " + ", ".join(shares)

    def warning(self, kind: str, count: int) -> str:
        """The line that says a kind of data problem: the run's count and this rank's first example."""
        one, many, rest = {"bad_records": ("bad record", "bad records", " skipped (not JSON, or no text field)"),
                           "utf8_replacements": ("invalid UTF-8 sequence", "invalid UTF-8 sequences", " replaced by U+FFFD"),
                           "empty_files": ("empty file", "empty files", " skipped")}[kind]
        what = (one if count == 1 else many) + rest         # "1 bad record skipped", not "1 bad records"
        first = self.examples.get({"bad_records": "bad_record", "utf8_replacements": "utf8"}.get(kind, kind))
        return (f"data warning: {count:,} {what}" + (" so far (each counted once, however many epochs read it)"
                                                      if kind != "empty_files" else "")
                + (f" (the first here: {first})" if first else ""))

    def start_warnings(self) -> list[str]:
        """What a run says once at start: empty files skipped, files of a folder left out (prepare.left_out_line)."""
        return ([self.warning("empty_files", self.empty_files)] if self.empty_files else []) + \
            ([prepare.left_out_line(self.left_out)] if self.left_out else [])

    def read(self, ids: np.ndarray, quiet: bool = False) -> list[tuple[str | None, int, bool]]:
        """(text, utf8 replacements, bad record) per document."""
        out = [None] * len(ids)
        for src, local, pick in self._where(ids):
            raws, got = src.read(local), None
            try:        # valid UTF-8 without a call a document (a strict decode makes no surrogate)
                got = None if src.jsonl else [(r.decode(), 0, False) for r in raws]
            except (AttributeError, UnicodeDecodeError):    # a null, a bad byte: _decode (warns, counts)
                pass
            if got is None:
                got = [self._decode(raw, src, i, quiet) for i, raw in zip(local.tolist(), raws)]
            if len(pick) == len(ids):
                return got
            for j, r in zip(pick.tolist(), got):            # lists: no numpy scalar per document
                out[j] = r
        return out

    def _where(self, docs):
        """(source, local ids, positions) per source of the documents `docs`."""
        docs = np.asarray(docs, np.int64)
        which = np.searchsorted(self.offsets, docs, side="right") - 1
        for s in np.unique(which):
            pick = np.flatnonzero(which == s)
            yield self.sources[s], docs[pick] - self.offsets[s], pick

    def _ranges(self, lo: int, hi: int):
        """(source, first, end) of documents lo..hi-1, per source, in the source's own ids."""
        for s in range(np.searchsorted(self.offsets, lo, "right") - 1, len(self.sources)):
            if self.offsets[s] >= hi:
                break
            a, b = max(lo, self.offsets[s]), min(hi, self.offsets[s + 1])
            if a < b:                           # a source of no documents (an Arrow file of no rows) in between
                yield self.sources[s], int(a - self.offsets[s]), int(b - self.offsets[s])

    def doc_lengths(self, lo: int, hi: int) -> np.ndarray:
        """Bytes of documents lo..hi-1 without reading them (a .jsonl record's: an upper bound of its text's)."""
        return np.concatenate([src.lengths(a, b) for src, a, b in self._ranges(lo, hi)]).astype(np.int64)

    def check_heads(self, lo: int, hi: int) -> None:
        """Refuse now what reading documents lo..hi-1 would refuse (a UTF-16 file: sources.not_utf16)."""
        for src, a, b in self._ranges(lo, hi):
            src.check_heads(a, b)

    def raw(self, docs) -> list[bytes]:
        """The bytes spans index into: the file's bytes of a document, a .jsonl record's text in UTF-8."""
        out = [b""] * len(docs)
        for src, local, pick in self._where(docs):
            for j, i, r in zip(pick, local, src.read(local)):
                out[j] = (self._decode(r, src, int(i), True)[0] or "").encode() if src.jsonl else (r or b"")
        return out

    def raw_blocks(self, doc: int, size: int):
        """raw() of one document as (bytes, last) blocks of `size` bytes: a long file is never held whole
        (a .jsonl record is: its text is parsed whole)."""
        (src, local, _), = self._where([doc])
        i, n = int(local[0]), int(self.doc_lengths(doc, doc + 1)[0])
        if src.jsonl:
            yield self.raw([doc])[0], True
            return
        for start in range(0, max(n, 1), size):
            last = start + size >= n            # read to the end: a line's \r is dropped as read() drops it
            yield src.read_range(i, start, -1 if last else start + size) or b"", last

    def read_spans(self, rows: np.ndarray, quiet: bool = False) -> list[tuple[str | None, int, bool]]:
        """read() of spans (rows of the span index); a part of a long document is a slice of its bytes."""
        rows = np.asarray(rows, np.int64).reshape(-1, 3)
        whole = (rows[:, 1] == 0) & (rows[:, 2] < 0)
        if whole.all():
            return self.read(rows[:, 0], quiet)
        out = [None] * len(rows)
        for j, r in zip(np.flatnonzero(whole).tolist(), self.read(rows[whole, 0], quiet)):
            out[j] = r
        for j in np.flatnonzero(~whole):
            d, start, stop = (int(x) for x in rows[j])
            (src, local, _), = self._where([d])
            if src.jsonl:       # the record's text, parsed once for all its spans (the last record kept;
                rec = self._record                  # read once: the packing and evaluation threads share it)
                if rec[0] != d:
                    rec = self._record = (d, self.raw([d])[0])
                b = rec[1]
                raw = b[start:stop if stop >= 0 else len(b)]
            else:
                raw = src.read_range(int(local[0]), start, stop)
            out[j] = self._decode(raw, src, int(local[0]), quiet, parse=False)    # a slice of a record's text
        return out

    def _decode(self, raw, src, i: int, quiet: bool, parse: bool = True):
        if raw is None:
            return "", 0, False                         # a null in a text column: an empty document
        text, repl = decode(raw)
        if repl and not quiet:
            self.warn("utf8", f"{src.where(i)}: {repl} invalid UTF-8 sequences replaced by U+FFFD")
        if parse and src.jsonl and text.strip():
            try:
                text = json.loads(text)[src.field] or ""
                if not isinstance(text, str):
                    raise TypeError(f"field {src.field!r} holds {prepare.json_kind(text)}, not a string")
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                if not quiet:
                    what = {KeyError: f"no field {src.field!r}", TypeError: str(e)}.get(type(e), f"not JSON ({e})")
                    self.warn("bad_record", f"{src.where(i)}: {what}: line skipped")
                return None, repl, True
            text, bad = no_surrogates(text)
            repl += bad
        return text, repl, False


# ----------------------------------------------------------------------------- 2. tokenizer

class Tokenizer:
    """A sentencepiece model: ours, or a Llama 2 tokenizer.model unchanged."""

    def __init__(self, path: str, fix: str = "give a sentencepiece .model file with --data.tokenizer"):
        try:
            self.path, self.sp = path, spm.SentencePieceProcessor(model_file=path)
        except (OSError, RuntimeError) as e:
            if is_tiktoken(path):
                raise DataError(f"{path} is a tiktoken file (Llama 3's original tokenizer.model), which nanotrn does not "
                                f"read: give the model's Hugging Face tokenizer.json instead (--data.tokenizer, or beside "
                                f"config.json for --init_from)") from None
            raise DataError(f"{path}: not a sentencepiece model ({_spm_message(e)}); {fix}") from None
        self.vocab_size = self.sp.vocab_size()
        self.bos_id, self.eos_id = self.sp.bos_id(), self.sp.eos_id()
        # Identity = what encoding depends on: the pieces, their scores and the normalizer's effect
        # (not the whole proto, which also records where the model was trained).
        probe = " Hello,\n\t wörld 12 中 "
        ident = [[self.sp.id_to_piece(i), self.sp.get_score(i)] for i in range(self.vocab_size)]
        self.fingerprint = hashlib.sha256(json.dumps([ident, self.sp.encode(probe)]).encode()).hexdigest()[:16]
        try:                                # sentencepiece >= 0.2.1 returns numpy arrays directly
            self._numpy = self.sp.encode(["a"], out_type="numpy") is not None
        except (ValueError, TypeError):
            self._numpy = False

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])

    def encode_batch(self, texts: list[str], bos: bool, eos: bool, threads: int = 1) -> list[np.ndarray]:
        """Many documents at once: sentencepiece's batch API, in C++ threads without the GIL.
        A document longer than PIECE_CHARS is encoded in pieces (iter_pieces)."""
        if not texts:
            return []
        if max(map(len, texts)) > PIECE_CHARS:
            out = []
            for t in texts:
                if len(t) <= PIECE_CHARS:
                    out += self.encode_batch([t], bos, eos, threads)
                    continue
                parts = self.encode_batch(list(iter_pieces(t)), False, False, threads)
                out.append(np.concatenate([np.asarray([self.bos_id] if bos else [], np.int32), *parts,
                                           np.asarray([self.eos_id] if eos else [], np.int32)]).astype(np.int32))
            return out
        if self._numpy:
            return self.sp.encode(texts, out_type="numpy", add_bos=bos, add_eos=eos, num_threads=threads)
        ids = self.sp.encode(texts, add_bos=bos, add_eos=eos, num_threads=threads)
        return [np.asarray(x, np.int32) for x in ids]


# sentencepiece holds ~60 bytes per character of one input while it encodes it: a 50 MB document
# in one line took 3.1 GB. Longer documents are cut into pieces of at most this many characters.
PIECE_CHARS = 1 << 20


def iter_pieces(text: str, limit: int = PIECE_CHARS):
    """text in pieces of at most `limit` (PIECE_CHARS) characters whose tokens, joined, are the whole's.
    A cut replaces one space between two non-space characters: sentencepiece merges only inside words,
    and the dummy prefix it adds to the next piece is that space. Over limit/2 characters without
    one: a hard cut (the next piece gains one leading space, the only difference)."""
    start = 0
    while len(text) - start > limit:
        cut, lo = start + limit, start + limit // 2
        while (cut := text.rfind(" ", lo, cut)) > 0 and (text[cut - 1].isspace() or text[cut + 1].isspace()):
            pass
        if cut <= start:                       # no clean space in the second half: a hard cut
            yield text[start:start + limit]
            start += limit
        else:
            yield text[start:cut]
            start = cut + 1
    yield text[start:]


TOKENIZER_CHARS = 8_000_000   # training text sampled from the corpus: enough for 4k-32k pieces, fast
# The most pieces a tokenizer trained on that sample may have: its last pieces are seen a handful of times (the
# embedded corpus's sample holds at most 92,777), and sentencepiece learns "too many" only after the whole training.
MAX_TRAINED_VOCAB = 65536
SAMPLE_BYTES = 4 * TOKENIZER_CHARS  # read of one document at most, and about that much a read
TOKENIZER_RECIPE = "bpe-v2"   # bump when the training settings below change (invalidates caches)


def line_chunks(line: str, n: int = 2000):
    """A line in pieces of at most n characters, cut at a space where there is one: sentencepiece
    skips longer sentences, and cutting them short instead trained a one-line corpus (a book without
    newlines, minified text) on its first 2,000 characters alone."""
    i = 0                                   # an index, not slices: a 1 GB line is not copied per piece
    while len(line) - i > n:
        cut = line.rfind(" ", i + n // 2, i + n)
        end = cut if cut >= 0 else i + n
        yield line[i:end]
        i = end + 1 if cut >= 0 else end    # the space dropped: the next word opens a sentence
    yield line[i:]


def find_tokenizer(folder: str) -> str | None:
    """The tokenizer a model folder holds: tokenizer.model first (Llama 2's original), else tokenizer.json; also
    where a tokenizer.model is Llama 3's original (tiktoken's, which nanotrn does not read)."""
    found = [p for p in (os.path.join(folder, n) for n in ("tokenizer.model", "tokenizer.json")) if os.path.isfile(p)]
    if len(found) == 2 and is_tiktoken(found[0]):
        return found[1]
    return found[0] if found else None


def is_tiktoken(path: str) -> bool:
    """tiktoken's format: text, one 'base64-bytes rank' a line (a sentencepiece model is a binary protobuf)."""
    try:
        with open(path, "rb") as f:
            return re.fullmatch(rb"[A-Za-z0-9+/]+=* \d+", f.readline(256).rstrip(b"\r\n")) is not None
    except OSError:
        return False


def load_tokenizer(path: str):
    """A sentencepiece .model (Llama 2), a Hugging Face tokenizer.json (Llama 3; hf.HFTokenizer),
    or a model folder holding one of them."""
    if os.path.isdir(path):
        if (found := find_tokenizer(path)) is None:
            raise DataError(f"tokenizer folder {path!r} holds neither tokenizer.model nor tokenizer.json: put the "
                            f"model's tokenizer file there, or name one with --data.tokenizer")
        path = found
    if not os.path.isfile(path):
        raise DataError(f"tokenizer {path!r} does not exist; give a sentencepiece .model, a tokenizer.json "
                        f"or a folder with one, or leave --data.tokenizer empty to train one on the corpus")
    if path.endswith(".json"):
        import hf
        return hf.HFTokenizer(path)
    return Tokenizer(path)


def build_tokenizer(cfg: DataConfig, vocab_size: int, corpus: Corpus | None = None, flags: dict = FLAGS,
                    pretrained: bool = False) -> Tokenizer:
    """Load cfg.tokenizer, or train (first use) / load (cached) a BPE of exactly vocab_size pieces (a refusal
    names `flags`, FLAGS or a command's own). pretrained: vocab_size is an --init_from model's (train.check_tokenizer
    checked the pair): its rows past the pieces are that model's own padding, not refused."""
    if cfg.tokenizer:
        tok = load_tokenizer(cfg.tokenizer)
        if tok.vocab_size > vocab_size:
            raise DataError(f"tokenizer {cfg.tokenizer} has {tok.vocab_size} pieces but the model's "
                            f"vocab_size is {vocab_size}: token ids would index past the embedding; "
                            f"set --model.vocab_size={tok.vocab_size} (or more)")
        if vocab_size > (padded := -(-tok.vocab_size // 128) * 128) and not pretrained:
            # Padding to a multiple of 128 is common; more means rows no token ever trains.
            raise DataError(f"tokenizer {cfg.tokenizer} has {tok.vocab_size} pieces but --model.vocab_size is "
                            f"{vocab_size}: {vocab_size - tok.vocab_size} embedding rows would never be trained "
                            f"and the sample would draw from them; set --model.vocab_size={tok.vocab_size} "
                            f"(or padded, at most {padded})")
    else:
        check_vocab(vocab_size, flags, cfg.cache_dir)       # before the corpus is read
        corpus = corpus or Corpus(cfg.data, cfg.text_field, cfg.doc_per_line, cfg.split, cfg.cache_dir, flags)
        key = hashlib.sha256(json.dumps([corpus.fingerprint, vocab_size, cfg.val_fraction,
                                         TOKENIZER_RECIPE]).encode()).hexdigest()[:12]
        if not os.path.exists(path := os.path.join(cfg.cache_dir, f"tokenizer-{vocab_size}-{key}.model")):
            check_vocab(vocab_size, flags)      # to be trained now (check_vocab let a cached one through: not this one)
        # Every process of a launch calls this at once: one trains into FILE.tmp-HOST-PID (its .model and .vocab;
        # this host's killed trainings' removed first), the others wait for its file.
        build_once(path, lambda tmp: train_tokenizer(corpus, cfg.val_fraction, vocab_size, tmp, flags, shown=path))
        tok = Tokenizer(path, fix=f"a damaged cache file: delete it (rm {path}) and it is trained again")
    for name, wanted, tid in (("bos", cfg.bos, tok.bos_id), ("eos", cfg.eos, tok.eos_id)):
        if wanted and tid < 0 and (said := getattr(tok, "named", {}).get(name)):    # two files that disagree
            raise DataError(f"{os.path.join(os.path.dirname(tok.path), 'tokenizer_config.json')} names {name}_token "
                            f"{said!r}, which {tok.path} does not have: make the two agree (one model's pair), "
                            f"or set --data.{name}=false")
        if wanted and tid < 0:
            raise DataError(f"tokenizer {tok.path} has no {name.upper()} piece; set --data.{name}=false")
    if isinstance(tok, Tokenizer):      # the run ends with a Hugging Face export: refused now, not then
        import hf
        hf.check_sentencepiece_export(tok)
    return tok


def check_vocab(vocab_size: int, flags: dict = FLAGS, cache_dir: str = "") -> None:
    """Whether a tokenizer of vocab_size pieces can be trained (train.py asks before any work); above the bound (Llama 3's
    128,256: Meta's, not what a sample makes) one an earlier nanotrn trained into cache_dir is let through for
    build_tokenizer (tokenizer-VOCAB-KEY.model: a listing; a folder this user cannot list, mode 0300, holds none)."""
    if vocab_size < 260:            # sentencepiece's own error for these is an empty message
        raise DataError(f"a {vocab_size}-piece tokenizer cannot hold the 256 byte pieces and unk/bos/eos; set "
                        f"{flags['model.vocab_size']}=260 or more (the corpus's characters add to that){or_given(flags)}")
    if vocab_size > MAX_TRAINED_VOCAB and not (os.path.isdir(cache_dir) and os.access(cache_dir, os.R_OK) and any(
            re.fullmatch(rf"tokenizer-{vocab_size}-[0-9a-f]{{12}}\.model", n) for n in os.listdir(cache_dir))):
        raise DataError(f"a {vocab_size:,}-piece tokenizer is more than nanotrn trains on its {TOKENIZER_CHARS:,}-character "
                        f"sample (at most {MAX_TRAINED_VOCAB:,}): set {flags['model.vocab_size']}={MAX_TRAINED_VOCAB} "
                        f"or less" + (f"{or_given(flags)} (a pretrained model's, e.g. Llama 3's tokenizer.json)" if or_given(flags) else ""))


def sample_texts(corpus: Corpus, val_fraction: float):
    """(text, utf8 replacements) of the train documents in a fixed permutation (the same on every node),
    read as consumed: a document longer than SAMPLE_BYTES gives the whole lines of its first SAMPLE_BYTES
    (a single line: its start), and a read takes about SAMPLE_BYTES. A one-document 10 GB .txt file was
    read whole, and 256 long documents at once, for the 8M characters kept."""
    n = corpus.n_docs
    for start in range(0, n, 256):
        order = permute(np.arange(start, min(n, start + 256)), n, (0,))
        if by_hash(n, val_fraction):
            order = order[~held_out(order, val_fraction)]
        lengths = np.asarray([corpus.doc_lengths(d, d + 1)[0] for d in order.tolist()], np.int64)
        long, ends = lengths > SAMPLE_BYTES, np.cumsum(np.minimum(lengths, SAMPLE_BYTES)) // SAMPLE_BYTES
        for group in np.split(np.arange(len(order)), np.flatnonzero(np.diff(ends)) + 1) if len(order) else []:
            rows = np.stack([order[group], 0 * group, np.where(long[group], SAMPLE_BYTES, -1)], 1)
            for (text, repl, _), cut in zip(corpus.read_spans(rows, quiet=True), long[group]):
                text = text or ""
                yield (text[:text.rfind("\n") + 1 or None] if cut else text), repl


def train_tokenizer(corpus: Corpus, val_fraction: float, vocab_size: int, path: str, flags: dict = FLAGS,
                    shown: str = "", probe: bool = False) -> int | None:
    """Byte-fallback BPE with Llama 2's settings (identity normalization, digits split, unk/bos/eos =
    0/1/2) on lines of the train documents in a fixed permutation: deterministic, the same on every node.
    Written to `path` (build_tokenizer: build_once's temporary, renamed into place as `shown` once complete).
    probe: nothing written; returns the pieces it reaches, at most vocab_size (what sentencepiece's "too high" says)."""
    t0, lines, n, chars, bad = time.time(), [], corpus.n_docs, 0, 0
    for text, repl in sample_texts(corpus, val_fraction):
        bad += repl
        for c in (c for line in text.split("\n") if line.strip() for c in line_chunks(line)):
            lines.append(c)
            chars += len(c)
            if chars >= TOKENIZER_CHARS:    # bounded: a 1 GB one-line document gives 8M chars, not 1 GB
                break
        if chars >= TOKENIZER_CHARS:
            break
    if not lines:
        raise DataError(f"{corpus.spec!r} holds no text to train a tokenizer on ({n} documents, "
                        f"all empty or unreadable records); check {flags['data.data']} and {flags['data.text_field']}")
    if bad > chars / 10:
        raise DataError(f"{corpus.spec!r} does not look like text: {bad:,} of the {chars:,} characters sampled "
                        f"are invalid UTF-8 (binary or another encoding); convert it to UTF-8 or leave it out")
    if not probe:
        print(f"[data] training a {vocab_size}-piece BPE tokenizer on {len(lines):,} lines "
              f"({chars / 1e6:.1f}M chars) of {corpus.spec!r}...", file=sys.stderr, flush=True)
    # Ctrl-C inside sentencepiece's C++ would wait for the training: the default action ends the
    # process at once (the model file is only ever renamed into place).
    main_thread = threading.current_thread() is threading.main_thread()
    old_handler = signal.signal(signal.SIGINT, signal.SIG_DFL) if main_thread else None
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), vocab_size=vocab_size, model_type="bpe",
            **({"model_writer": (out := io.BytesIO()), "hard_vocab_limit": False} if probe else {"model_prefix": path}),
            byte_fallback=True, split_digits=True, normalization_rule_name="identity",
            add_dummy_prefix=True, remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
            character_coverage=0.9995, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            input_sentence_size=0, shuffle_input_sentence=False, max_sentence_length=8192,
            num_threads=min(16, os.cpu_count() or 1), minloglevel=2)
    except (RuntimeError, ValueError) as e:             # ValueError: a vocab_size beyond int32
        if m := re.search(r"smaller than required_chars. (\d+) vs (\d+)", str(e)):
            need = int(m[2])        # a piece per distinct character, + 256 byte pieces + unk/bos/eos (above)
            raise DataError(f"{corpus.spec!r} needs at least {need} pieces ({need - 259} distinct characters, 256 bytes, "
                            f"unk/bos/eos), more than a {vocab_size}-piece tokenizer holds; set "
                            f"{flags['model.vocab_size']}={need} or more{or_given(flags)}") from None
        raise DataError(f"could not train a {vocab_size}-piece tokenizer on {corpus.spec!r}: {_spm_message(e)}; "
                        f"lower {flags['model.vocab_size']}, add data{or_given(flags)}") from None
    finally:
        if main_thread:
            signal.signal(signal.SIGINT, old_handler)
    if probe:
        return spm.SentencePieceProcessor(model_proto=out.getvalue()).get_piece_size()
    os.replace(path + ".model", path)                   # sentencepiece writes PREFIX.model and PREFIX.vocab
    os.remove(path + ".vocab")
    del lines
    give_back_heap()        # training's freed working memory: glibc kept it, 30-90 MB RssAnon for the whole run
    print(f"[data] tokenizer trained in {time.time() - t0:.1f} s -> {shown or path}", file=sys.stderr, flush=True)


def _spm_message(e: Exception) -> str:
    """sentencepiece's own words without its source location: "INTERNAL: x.cc(744) [cond] text"."""
    return re.sub(r"^(INTERNAL|Internal|NOT_FOUND|INVALID_ARGUMENT): (\S+\(\d+\) )?(\[.*?\] )?", "", str(e)).strip().rstrip(".")
