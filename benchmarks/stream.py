"""The data stream (`bench.py data`): packing speed per rank against the raw tokenizer, and a
rank's memory and start-up at 1M-16M documents (one fresh process per corpus)."""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

from benchmarks.common import ROOT, median_ratio, run_child, table, write_json

MEM_CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
sys.path.insert(0, sys.argv[1])
import numpy as np, torch  # noqa: F401  (a training process imports torch: count it in the baseline)
import data
from configs import DataConfig

def status():
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) for k, v in (l.split(":", 1) for l in f)
                if k in ("RssAnon", "RssFile", "RssShmem", "VmHWM")}

def shm_used():
    s = os.statvfs("/dev/shm")
    return (s.f_blocks - s.f_bfree) * s.f_frsize // 1024

base, shm0, t_import = status(), shm_used(), time.perf_counter() - t0
path, tok_path, cache, dp = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
cfg = DataConfig(data=path, tokenizer=tok_path, cache_dir=cache, seq_len=2048, global_batch=512, micro_batch=4)
t1 = time.perf_counter()
corpus = data.Corpus(cfg.data, cache_dir=cfg.cache_dir)
built = not os.path.exists(data.SpanIndex.path_for(corpus, cfg.seq_len, cache))
index = data.SpanIndex(corpus, cfg.seq_len, cfg.cache_dir, cfg.val_fraction)
t_index = time.perf_counter() - t1
data.check_size(cfg, index, dp)
tok = data.load_tokenizer(tok_path)
loader = data.PackedLoader(cfg, tok, 0, dp, corpus=corpus, index=index)
ev = data.EvalWindows(cfg, tok, 8, 0, dp, corpus=corpus, index=index)
accum = cfg.global_batch // (dp * cfg.micro_batch)
for _ in range(accum):                          # one optimizer step's micro-batches of this rank
    next(loader)
t_start = time.perf_counter() - t1
after = status()
def children_of(task):                          # a thread (a tokenizer's) may end between listdir and open
    try:
        return len(open(f"/proc/self/task/{task}/children").read().split())
    except FileNotFoundError:
        return 0
children = sum(children_of(t) for t in os.listdir("/proc/self/task"))
threads = len(os.listdir("/proc/self/task"))
loader.close()
print(json.dumps({"docs": corpus.n_docs, "spans": index.n_spans, "built": built, "index_s": t_index,
                  "startup_s": t_start, "import_s": t_import, "base": base, "after": after,
                  "shm_kb": shm_used() - shm0, "children": children, "threads": threads,
                  "index_mb": (os.path.getsize(index.path) + sum(a.nbytes for s in corpus.sources for a in  # + offsets
                               (getattr(s, k, None) for k in ("bounds", "starts", "offsets"))
                               if a is not None)) / 2**20}))
"""


def _docs_arrow(path: str, n: int, rows: int = 1 << 17) -> float:
    """A corpus of n short documents (~60 bytes: a few words and the document's number), written in
    record batches of `rows` rows (bounded memory), or as JSON lines (path ending in .jsonl).
    Returns the seconds it took."""
    import numpy as np
    import pyarrow as pa
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    words = ["the", "data", "model", "of", "a", "token", "stream", "rank", "shard", "train", "index",
             "value", "return", "for", "in", "span", "epoch", "batch", "loss", "step"]
    pool = [" ".join(rng.choice(words, k)) for k in rng.integers(4, 12, 1024)]
    schema = pa.schema({"text": pa.string()})
    tmp = f"{path}.tmp"
    if path.endswith(".jsonl"):
        with open(tmp, "w") as f:
            for lo in range(0, n, 1 << 16):
                f.write("".join(json.dumps({"text": f"{pool[i % 1024]} {i}."}) + "\n"
                                for i in range(lo, min(n, lo + (1 << 16)))))
    else:
        with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_stream(sink, schema) as w:
            for lo in range(0, n, rows):
                texts = [f"{pool[i % 1024]} {i}." for i in range(lo, min(n, lo + rows))]
                w.write_batch(pa.record_batch([pa.array(texts, pa.string())], schema=schema))
    os.replace(tmp, path)
    return time.perf_counter() - t0


def bench_data(args):
    """The data stream, in one run: (1) packing speed per rank: tokens/s of data.PackedLoader (read
    Arrow + tokenize + pack + batch; the tokens it tokenized) against the raw tokenizer encoding the
    same documents in 64-document calls, alternating rounds, median of the per-round ratios. Per
    rank = one thread (the loader's default), tokens per CPU-second of the whole process
    (time.process_time: every thread counted, so a tokenizer running threads of its own could not
    inflate it); wall clock beside it. Tokenizer: a 32000-piece BPE (Llama 2's vocab size) trained
    on the stdlib; corpora of the same text (1/8 of the stdlib, ~1.1M tokens): its files as
    documents (long ones, cut into spans), and the same files cut at blank lines (~15k short
    documents, ~70 tokens each: per-document work shows there), those also in 1,000-row and 8-row
    record batches (8: a read's documents each in a batch of its own, as at 1e9 documents in
    1,000-row batches). (2) Per-rank memory and start-up at 1M, 4M and 16M documents: one process
    per corpus (Arrow, short documents) builds the span index if needed, then starts rank 0 of 32
    (global batch 512 x seq 2048, shuffle 8: 16 streams x 8 lanes) with its evaluation windows and
    takes one step's micro-batches; RssAnon (private memory) and /dev/shm before and after, child
    processes, start-up seconds. Projected to 1e9 documents x 32 ranks against a 512 GiB host.
    Everything it makes (corpora, tokenizer, indexes) goes under --out: a first run from an empty
    --out builds them, a later run reuses them."""
    import numpy as np
    import pyarrow as pa
    import data
    from configs import DataConfig
    t_all = time.perf_counter()
    cache = os.path.join(args.out, "cache")
    os.makedirs(cache, exist_ok=True)
    arrow = os.path.join(args.out, "stdlib.arrow")
    if not os.path.exists(arrow):
        data.prepare(["stdlib"], arrow)
    tok = data.build_tokenizer(DataConfig(data=arrow, cache_dir=cache), vocab_size=32000)
    corpus = data.Corpus(arrow)
    ids = np.random.default_rng(0).permutation(corpus.n_docs)[: corpus.n_docs // 8]
    files = [t for t, _, _ in corpus.read(ids, quiet=True)]
    paragraphs = [p for t in files for p in t.split("\n\n") if p.strip()]
    if args.data_part == "memory":
        write_json(os.path.join(args.out, "data_memory.json"), _data_memory(args, tok.path))
        return

    def write(name, texts, rows):           # in record batches of `rows` rows
        path = os.path.join(args.out, name)
        if not os.path.exists(path):
            schema = pa.schema({"text": pa.large_string()})
            with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, schema) as w:
                for lo in range(0, len(texts), rows):
                    w.write_batch(pa.record_batch([pa.array(texts[lo:lo + rows], pa.large_string())], schema=schema))
        return path

    class Counting:                         # the tokenizer, counting the tokens it makes
        def __init__(self, tok):
            self.tok, self.n = tok, 0

        def __getattr__(self, name):
            return getattr(self.tok, name)

        def encode_batch(self, texts, bos, eos, threads=1):
            out = self.tok.encode_batch(texts, bos, eos, threads)
            self.n += sum(map(len, out))
            return out
    counting = Counting(tok)

    def raw(texts, passes):                 # the tokenizer alone: 64-document calls, numpy out
        t0, c0, n = time.perf_counter(), time.process_time(), 0
        for i in [i for _ in range(passes) for i in range(0, len(texts), 64)]:
            n += sum(map(len, tok.encode_batch(texts[i:i + 64], False, False, 1)))
        return n, (n / (time.perf_counter() - t0), n / (time.process_time() - c0))

    # Packed tokens/s: the tokens the loader tokenized in the timed stretch (what the tokenizer made,
    # BOS/EOS aside, as in raw()) over its time, all its work counted (read, tokenize, pack, batch,
    # and the thread's). Not the tokens handed out: the lanes hold up to ~1M tokens read ahead (64
    # lanes x a block of ~8 windows), so a stretch of 1M handed-out tokens could be half buffered.
    def packed(cfg, n_tokens, prefetch):    # as many tokens, in the loader's steady state: after a
        loader = data.PackedLoader(cfg, counting, prefetch=prefetch)   # warm-up of half as many
        for _ in range(n_tokens // 2 // (cfg.micro_batch * (cfg.seq_len + 1))):
            next(loader)                    # (the lanes' first blocks; the thread starts)
        t0, c0, n0 = time.perf_counter(), time.process_time(), counting.n
        while counting.n - n0 < n_tokens:
            next(loader)
        n = counting.n - n0
        r = (n / (time.perf_counter() - t0), n / (time.process_time() - c0))
        loader.close()
        return r

    speed, load0 = {}, os.getloadavg()[0]
    # The text once a round, after a warm-up of half as much: the lanes' first blocks are small (one
    # span, then growing to ~8 windows), so that they reach their steady state in the warm-up.
    # The paragraphs also in 1,000-row record batches (as prepare and datasets write), and in 8-row
    # ones: there nearly every document of a read lies in a record batch of its own, as at 1e9
    # documents in 1,000-row batches (a read's ~230 documents among a million batches).
    corpora = dict(zip(CORPORA, ((files, 1 << 30), (paragraphs, 1 << 30), (paragraphs, 1000), (paragraphs, 8))))
    for name in args.data_corpora.split(","):
        texts, rows = corpora[name]
        file = f"stdlib_eighth_{name.split('_')[0]}{'' if rows > len(texts) else f'_b{rows}'}.arrow"
        cfg = DataConfig(data=write(file, texts, rows), seq_len=2048, micro_batch=4,
                         global_batch=8, val_fraction=0.0, cache_dir=cache)
        packed(cfg, 1, 0)                   # builds the span index once, outside the timing
        # The loader reads the documents shuffled, and the tokenizer alone is slower on shuffled
        # text than on a file's consecutive paragraphs (its caches): raw() reads them in a fixed
        # shuffled order; the corpus order's raw speed is measured beside it.
        shuffled = [texts[i] for i in np.random.default_rng(1).permutation(len(texts))]
        rounds = []
        for _ in range(5):                  # alternate; the machine is shared and noisy
            n, r_raw = raw(shuffled, 1)
            rounds.append((r_raw, packed(cfg, n, 0), packed(cfg, n, 4), raw(texts, 1)[1]))
        speed[name] = {"documents": len(texts), "tokens_per_round": n, "rounds": rounds}
        for i, clock in enumerate(("wall", "cpu")):
            raw_s, packed_s, thread_s, order_s = ([r[k][i] for r in rounds] for k in range(4))
            speed[name][clock] = {"raw": statistics.median(raw_s), "packed": statistics.median(packed_s),
                                  "ratio": median_ratio(packed_s, raw_s), "ratio_thread": median_ratio(thread_s, raw_s),
                                  "raw_corpus_order": median_ratio(order_s, raw_s)}
    print(f"\npacking, 32000-piece BPE, seq 2048, one thread per rank, median of 5 alternating rounds "
          f"(load average {load0:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores):")
    print()
    table(["corpus", "clock", "raw tokenizer", "packed", "ratio", "with the prefetch thread", "raw in corpus order"],
          [[f"{name}: {sp['documents']:,} documents, {sp['tokens_per_round'] / 1e6:.2f}M tokens a round",
            "CPU time" if clock == "cpu" else "wall", f"{s['raw'] / 1e6:.2f}M tok/s", f"{s['packed'] / 1e6:.2f}M tok/s",
            f"{s['ratio']:.2f}x", f"{s['ratio_thread']:.2f}x", f"{s['raw_corpus_order']:.2f}x"]
           for name, sp in speed.items() for clock in ("cpu", "wall") for s in [sp[clock]]])
    print(f"\na 1B model on one H100 eats ~50,000 tokens/s: one packing thread here is "
          f"{min(sp['cpu']['packed'] for sp in speed.values()) / 5e4:,.0f}x that per CPU-second (slowest corpus)")
    t_speed = time.perf_counter() - t_all
    if args.data_part == "packing":
        write_json(os.path.join(args.out, "data_packing.json"), {"speed": speed})
        return

    memory = _data_memory(args, tok.path)
    print(f"\nbench data: {time.perf_counter() - t_all:.0f} s in all (packing {t_speed:.0f} s); load average "
          f"{os.getloadavg()[0]:.1f} at the end")
    write_json(os.path.join(args.out, "data.json"), {"speed": speed, **memory, "wall_s": time.perf_counter() - t_all})


CORPORA = ("files", "paragraphs", "paragraphs_b1000", "paragraphs_b8")   # the packing part's (--data_corpora)
DOCUMENTS = (1 << 20, 1 << 22, 1 << 24)        # the memory part's corpus sizes: 1M, 4M, 16M
# Corpus shapes of the memory part (--data_shapes): the file, by its number of documents, and how it is written.
DATA_SHAPES = {"arrow": ("docs_{}M.arrow", 1 << 17, "Arrow, 131k-row record batches"),
               "arrow_1000": ("docs_{}M_b1000.arrow", 1000,
                              "Arrow, 1,000-row record batches (as prepare and datasets write)"),
               "jsonl": ("docs_{}M.jsonl", 0, "JSON lines")}


def mb(kb: float) -> float:
    return kb / 1024


def _data_memory(args, tok_path: str) -> dict:
    """(2) of bench_data: memory and start-up against the number of documents, per corpus shape."""
    t_mem = time.perf_counter()
    cache, made_any = os.path.join(args.out, "cache"), False
    out = {"memory": {}, "growth_mb": {}, "rank_at_1e9_bytes": {}}
    for shape in args.data_shapes.split(","):
        name, batch_rows, what = DATA_SHAPES[shape]
        rows = []
        for n in DOCUMENTS:
            path = os.path.join(args.out, name.format(n >> 20))
            made, build_s = _docs_arrow(path, n, batch_rows) if not os.path.exists(path) else None, None
            made_any = made_any or made is not None
            for _ in range(2):              # a first run builds the indexes (once per corpus); then a plain start
                r = run_child([sys.executable, "-c", MEM_CHILD, ROOT, path, tok_path, cache, "32"],
                              f"the {n:,}-document {shape} child", timeout=900)
                got = json.loads(r.stdout.strip().splitlines()[-1])
                if not got["built"]:
                    break
                build_s, first = got["index_s"], got
            got.update(generate_s=made, build_s=build_s, first_run=first if build_s else None)
            rows.append(got)
        print(f"\n{what}, short documents ({shape}):")
        table(["documents", "RssAnon after imports", "RssAnon at step 1", "the data's share",
               "same, indexes built in that run", "/dev/shm", "processes started", "start-up",
               "index build (once per corpus)"],
              [[f"{g['docs'] / 2**20:.0f}M", f"{mb(g['base']['RssAnon']):.0f} MB",
                f"{mb(g['after']['RssAnon']):.0f} MB",
                f"{mb(g['after']['RssAnon'] - g['base']['RssAnon']):.0f} MB",
                f"{mb(f['after']['RssAnon'] - f['base']['RssAnon']):.0f} MB" if f else "-",
                f"{g['shm_kb'] / 1024:.0f} MB", g["children"], f"{g['startup_s']:.1f} s",
                f"{g['build_s']:.1f} s" if g["build_s"] else "cached"] for g in rows for f in [g["first_run"]]])
        lo, hi = rows[0], rows[-1]
        growth = mb(hi["after"]["RssAnon"] - lo["after"]["RssAnon"])
        per_doc = max(0.0, (hi["after"]["RssAnon"] - lo["after"]["RssAnon"]) * 1024 / (hi["docs"] - lo["docs"]))
        at_1e9 = hi["after"]["RssAnon"] * 1024 + per_doc * (1e9 - hi["docs"])
        index_1e9 = hi["index_mb"] / hi["docs"] * 1e9 * 2**20
        if lo["first_run"] and hi["first_run"]:
            print(f"growth 1M -> 16M documents, the indexes built in the same run: "
                  f"{mb(hi['first_run']['after']['RssAnon'] - lo['first_run']['after']['RssAnon']):+.1f} MB per rank")
        print(f"growth 1M -> 16M documents: {growth:+.1f} MB per rank ({per_doc:.2f} bytes per document); "
              f"at 1e9 documents: {at_1e9 / 2**30:.2f} GiB per rank, x 32 ranks = {32 * at_1e9 / 2**30:.0f} GiB "
              f"of a 512 GiB host, plus the indexes in the page cache once per node ({index_1e9 / 2**30:.0f} GiB, "
              f"file-backed: reclaimable)")
        out["memory"][shape], out["growth_mb"][shape], out["rank_at_1e9_bytes"][shape] = rows, growth, at_1e9
    print(f"(the memory part took {time.perf_counter() - t_mem:.0f} s, corpora "
          + ("generated" if made_any else "reused") + ")")
    return out
