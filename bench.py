"""Benchmarks: every speed or memory figure nanotrn reports, measured as a ratio against a
reference run side by side in the same process, on this machine.

    python bench.py step        # our step vs transformers' at issue 27's shapes, trainer vs bare step
    python bench.py train       # our Llama vs transformers' LlamaForCausalLM, fp32 and bf16
    python bench.py data        # packed tokens/s vs the raw tokenizer; memory and start-up at 1M-16M documents
    python bench.py precision   # fp32 / mixed / bf16 / bf16_sr loss curves and throughput
    python bench.py init        # default vs scaled init: a deep tiny model at a high learning rate
    python bench.py parallel    # TP=2 and DP=2 against one process (gloo, CPU)
    python bench.py pp          # PP=2 1F1B vs GPipe vs one process
    python bench.py ckpt        # async vs synchronous checkpoint save, recovery time
    python bench.py xla         # the trn1 path on XLA:CPU: graphs per step type (and per pipeline task), step time vs eager
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch


def no_page_fault_churn():
    """Take glibc's allocator out of the comparison. By default it maps buffers above an adaptive
    threshold (at most 32 MiB) fresh from the OS and returns them on free, so every step page-faults
    them in again, at a cost that varies with the kernel's state; and the threshold adapts to the
    sizes freed so far, so one model's buffers change the other's costs (transformers' bf16 step
    swung from 3,660 to 4,610 tok/s with which of our attention paths ran in between). With no
    mmap and no trimming, every buffer of either model is reused from the heap after warm-up."""
    import ctypes
    libc = ctypes.CDLL(None)
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    libc.mallopt(M_MMAP_MAX, 0)
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)


def bench_train(args):
    """Our Llama against transformers' LlamaForCausalLM on the identical config, in this run:
    same weights, same batches, same torch.optim.AdamW; fp32 and bf16. Ours runs twice, with each
    attention (sdpa: torch's kernel; explicit: model.ExplicitAttention), with the fused head + loss
    that training uses; transformers as it loads by default (SDPA attention). Rounds rotate over
    the three so that machine noise hits all alike; each round gives a ratio to transformers, and
    the median over rounds is reported beside the ratio of the totals."""
    import statistics
    import transformers
    import hf as hf_io             # `hf` below is the transformers model
    import model as llama
    from configs import ModelConfig
    from monitor import measure_matmul_flops
    no_page_fault_churn()
    cfg = ModelConfig(vocab_size=8000, dim=384, n_layers=6, n_heads=6, n_kv_heads=6, ffn_dim=1024, max_seq_len=256)
    batch, seq, rounds, steps_per_round = 8, 256, args.steps or 8, 2
    flops_step = llama.flops_per_token(cfg, seq) * batch * seq
    print(f"config: dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads} heads, ffn {cfg.ffn_dim}, vocab "
          f"{cfg.vocab_size}, seq {seq}, batch {batch}, {torch.get_num_threads()} threads; "
          f"{flops_step / 1e9:.1f} GFLOP per step; {rounds} rounds of {steps_per_round} steps")
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1))
        x, y = tokens[:, :-1], tokens[:, 1:]
        steps = {}
        for attention in ("sdpa", "explicit"):
            ours = llama.Llama(dataclasses.replace(cfg, attention=attention)).init_weights(0).to(dtype)

            def ours_step(m=ours, opt=torch.optim.AdamW(ours.parameters(), lr=1e-4)):
                (m(x, targets=y) / y.numel()).backward()
                opt.step(); opt.zero_grad(set_to_none=True)
            steps[f"ours ({attention})"] = ours_step
        hf_cfg = transformers.LlamaConfig(**{k: v for k, v in hf_io.hf_config(cfg).items()
                                             if k not in ("architectures", "model_type", "torch_dtype")})
        hf = transformers.LlamaForCausalLM(hf_cfg)
        hf.load_state_dict(hf_io.to_hf_state_dict(ours.state_dict(), cfg))    # the same weights (seed 0)
        hf.to(dtype)

        def hf_step(m=hf, opt=torch.optim.AdamW(hf.parameters(), lr=1e-4)):
            logits = m(input_ids=x).logits
            torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()
            opt.step(); opt.zero_grad(set_to_none=True)
        steps["transformers"] = hf_step

        for fn in steps.values():
            fn()                                          # warm-up: allocator, kernels
        times = {name: [] for name in steps}
        for _ in range(rounds):
            for name, fn in steps.items():
                t = time.perf_counter()
                for _ in range(steps_per_round):
                    fn()
                times[name].append(time.perf_counter() - t)
        peak = measure_matmul_flops(torch.device("cpu"), torch.bfloat16) / 1e9
        tok_s = {k: rounds * steps_per_round * batch * seq / sum(v) for k, v in times.items()}
        results[dtype] = tok_s
        name = str(dtype).removeprefix("torch.")
        print(f"{name}: transformers {tok_s['transformers']:,.0f} tok/s; measured bf16 matmul peak {peak:.0f} GFLOP/s")
        for k in ("ours (sdpa)", "ours (explicit)"):
            per_round = [h / o for h, o in zip(times["transformers"], times[k])]
            gflops = tok_s[k] * flops_step / (batch * seq) / 1e9
            print(f"  {k:<16} {tok_s[k]:7,.0f} tok/s | vs transformers {tok_s[k] / tok_s['transformers']:.2f}x "
                  f"(median of rounds {statistics.median(per_round):.2f}x, range {min(per_round):.2f}-{max(per_round):.2f}) | "
                  f"{gflops:.0f} GFLOP/s = {gflops / peak:.0%} of the bf16 matmul peak")
    return results


MEM_CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
sys.path.insert(0, sys.argv[1])
import numpy as np, torch  # noqa: F401  (a training process imports torch: count it in the baseline)
import data
from configs import DataConfig

def status():
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) for k, v in (l.split(":", 1) for l in f) if k in ("RssAnon", "RssFile", "RssShmem", "VmHWM")}

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
                               (getattr(s, k, None) for k in ("bounds", "starts", "offsets")) if a is not None)) / 2**20}))
"""


def _docs_arrow(path: str, n: int, rows: int = 1 << 17) -> float:
    """A corpus of n short documents (~60 bytes: a few words and the document's number), written in
    record batches of `rows` rows (bounded memory), or as JSON lines (path ending in .jsonl).
    Returns the seconds it took."""
    import json
    import os
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
                f.write("".join(json.dumps({"text": f"{pool[i % 1024]} {i}."}) + "\n" for i in range(lo, min(n, lo + (1 << 16)))))
    else:
        with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_stream(sink, schema) as w:
            for lo in range(0, n, rows):
                texts = [f"{pool[i % 1024]} {i}." for i in range(lo, min(n, lo + rows))]
                w.write_batch(pa.record_batch([pa.array(texts, pa.string())], schema=schema))
    os.replace(tmp, path)
    return time.perf_counter() - t0


# The shapes of issue 27's GPU table, scaled to the 2-core CPU: the same vocabularies with a small
# body (dim 256, 2 layers, 512 tokens a step: the 128k head then weighs on the step as it does on
# Llama 3.2 1B), and Llama 2 7B's layer (MHA, ffn = 2.69 dim) at dim 512 and 512 tokens.
STEP_SHAPES = {
    "1B body, vocab 128256": dict(vocab_size=128256, dim=256, n_layers=2, n_heads=4, n_kv_heads=1, ffn_dim=1024, batch=4, seq=128),
    "1B body, vocab 32000": dict(vocab_size=32000, dim=256, n_layers=2, n_heads=4, n_kv_heads=1, ffn_dim=1024, batch=4, seq=128),
    "1B body, vocab 512": dict(vocab_size=512, dim=256, n_layers=2, n_heads=4, n_kv_heads=1, ffn_dim=1024, batch=4, seq=128),
    "7B layers, vocab 32000": dict(vocab_size=32000, dim=512, n_layers=2, n_heads=8, n_kv_heads=8, ffn_dim=1376, batch=1, seq=512),
}


def _step_fns(shape: dict, dtype, which: tuple):
    """The training steps bench_step compares, on one shape, each with its own model and optimizer
    (the same weights): ours and transformers' with torch's AdamW; the trainer (train.train_step:
    our AdamW in bf16_sr, or fp32, with clipping) and the bare step (ours with torch's AdamW) on the
    same packed batch (three documents a row)."""
    import transformers
    import hf as hf_io
    import model as llama
    import optim
    import parallel
    import train
    from configs import Config, ModelConfig
    shape = dict(shape)
    batch, seq = shape.pop("batch"), shape.pop("seq")
    cfg = ModelConfig(max_seq_len=seq, **shape)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    doc_ids = (torch.arange(seq) * 3 // seq).expand(batch, seq)
    positions = torch.cat([torch.arange(n) for n in torch.bincount(doc_ids[0])]).expand(batch, seq)
    fns = {}
    for name in which:
        ours = llama.Llama(cfg).init_weights(0).to(dtype)
        if name == "ours":
            opt = torch.optim.AdamW(ours.parameters(), lr=1e-4, fused=True)

            def step(m=ours, opt=opt):
                (m(x, targets=y) / y.numel()).backward()
                opt.step(); opt.zero_grad(set_to_none=True)
        elif name == "transformers":
            hf_cfg = transformers.LlamaConfig(**{k: v for k, v in hf_io.hf_config(cfg).items()
                                                 if k not in ("architectures", "model_type", "torch_dtype")})
            m = transformers.LlamaForCausalLM(hf_cfg)
            m.load_state_dict(hf_io.to_hf_state_dict(ours.state_dict(), cfg))
            m.to(dtype)
            del ours
            opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)

            def step(m=m, opt=opt):
                logits = m(input_ids=x).logits
                torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").div(y.numel()).backward()
                opt.step(); opt.zero_grad(set_to_none=True)
        elif name == "bare step":
            opt = torch.optim.AdamW(ours.parameters(), lr=1e-4, fused=True)

            def step(m=ours, opt=opt):
                (m(x, positions, doc_ids, y) / y.numel()).backward()
                opt.step(); opt.zero_grad(set_to_none=True)
        else:                                                  # the trainer
            run = Config()
            run.model = cfg
            run.optim.precision = "fp32" if dtype == torch.float32 else "bf16_sr"
            opt = optim.build_optimizer(ours, run)
            b = {"tokens": x, "positions": positions, "doc_ids": doc_ids, "targets": y}

            def step(m=ours, opt=opt, run=run, b=b):
                train.train_step(m, opt, [b], parallel.Grid(), run)
        fns[name] = step
    return fns, batch * seq


def _peak_memory(shape: dict, name: str, dtype_name: str, threads: int) -> float:
    """Run in a fresh process: the peak resident bytes of two training steps of one model (its
    weights, gradients, optimizer state and the step's buffers) above the process's memory before
    the model was built; the building's own temporaries (the weights loaded into transformers)
    are left out by resetting the peak (Linux's clear_refs) once the step is ready. glibc's
    allocator maps every buffer above 64 KiB fresh and returns it on free, so that the resident
    peak is the peak of live buffers."""
    import ctypes
    libc = ctypes.CDLL(None)
    libc.mallopt(-3, 65536)              # M_MMAP_THRESHOLD, fixed (no adaptive threshold)
    libc.mallopt(-1, 0)                  # M_TRIM_THRESHOLD
    torch.set_num_threads(threads)
    import transformers, train  # noqa: F401,E401   (imported before the baseline)

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
    before = status("VmRSS:")
    fns, _ = _step_fns(shape, getattr(torch, dtype_name), (name,))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                     # VmHWM := VmRSS
    fns[name](); fns[name]()
    return status("VmHWM:") - before


def bench_step(args):
    """Issue 27's comparison on this machine: our training step against transformers'
    LlamaForCausalLM at each of STEP_SHAPES (same config, weights and batch; torch's AdamW on both;
    SDPA on both; the causal batch transformers gets), and the trainer (train.train_step) against
    the bare step. Rounds alternate over the steps compared, so that machine noise hits all alike;
    the speed is the median over rounds of the per-round ratio. Peak memory: each step alone in a
    fresh process (_peak_memory), the ratio of the two. Measure with --threads 1 on this 2-core
    machine (with two, per-round ratios scatter from 0.8x to 2.3x). The trainer pair runs twice:
    at the body's 512 tokens and at --step_tokens (batch 4 x step_tokens / 4, default 4096). Our
    AdamW costs the same per step whatever the batch (it is per parameter: 2.2M), the forward and
    backward grow with the tokens, so the optimizer's share of the step -- where the trainer and
    the bare step differ -- falls as the batch grows (issue 27's GPU run had 16384 tokens a step)."""
    import multiprocessing
    import statistics
    rounds = args.steps or 5
    small = STEP_SHAPES["1B body, vocab 512"]
    if args.step_tokens < 0 or args.step_tokens % small["batch"]:
        raise SystemExit(f"--step_tokens={args.step_tokens}: give a multiple of {small['batch']} "
                         f"(the batch; e.g. 4096 = 4 x 1024), or 0 for the 512-token trainer rows only")
    big = dict(small, seq=args.step_tokens // small["batch"])
    print(f"bench.py step: {args.dtype}, {torch.get_num_threads()} threads, {rounds} rounds, CPU")
    # The trainer in both precisions whatever --dtype: fp32 (our AdamW in fp32) and bf16 weights
    # (bf16_sr: software stochastic rounding; the bare step's fused AdamW rounds to nearest).
    pairs = ([(s, STEP_SHAPES[s], ("ours", "transformers"), args.dtype) for s in STEP_SHAPES]
             + [(f"1B body, vocab 512, {sh['batch']} x {sh['seq']} tokens", sh, ("trainer", "bare step"), d)
                for d in ("float32", "bfloat16") for sh in ([small, big] if args.step_tokens else [small])])
    rows = []
    ctx = multiprocessing.get_context("spawn")
    for shape_name, shape, which, dtype_name in pairs:
        fns, tokens = _step_fns(shape, getattr(torch, dtype_name), which)
        for fn in fns.values():
            fn()                                          # warm-up
        times = {n: [] for n in which}
        for _ in range(rounds):
            for n in which:
                t = time.perf_counter()
                fns[n]()
                times[n].append(time.perf_counter() - t)
        del fns
        mem = {}
        for n in which:                                  # a fresh process each
            with ctx.Pool(1) as pool:
                mem[n] = pool.apply(_peak_memory, (shape, n, dtype_name, args.threads))
        a, b = which
        if which[0] == "trainer":
            name, a = f"{shape_name}, packed documents, {dtype_name}", "trainer (bf16_sr)" if dtype_name == "bfloat16" else a
            times[a], mem[a] = times.pop("trainer"), mem.pop("trainer")
        else:
            name = f"{shape_name}, {dtype_name}"
        speed = statistics.median(tb / ta for ta, tb in zip(times[a], times[b]))
        rows.append((name, a, b, tokens / statistics.median(times[a]), tokens / statistics.median(times[b]),
                     speed, min(times[b]) / min(times[a]), mem[a] / mem[b], mem[a], mem[b]))
        r = rows[-1]
        print(f"{name}: {a} {r[3]:,.0f} tok/s, {b} {r[4]:,.0f} tok/s: {speed:.2f}x (median of rounds; "
              f"best rounds {r[6]:.2f}x); peak memory {mem[a] / 2**20:,.0f} vs {mem[b] / 2**20:,.0f} MiB: {r[7]:.2f}x", flush=True)
    print(f"\n| shape (CPU, {torch.get_num_threads()} thread(s)) | compared | tok/s | speed (median; best rounds) | peak memory |")
    print("| --- | --- | --- | --- | --- |")
    for name, a, b, ta, tb, speed, best, mem, ma, mb in rows:
        print(f"| {name} | {a} vs {b} | {ta:,.0f} vs {tb:,.0f} | {speed:.2f}x ({best:.2f}x) | {mem:.2f}x ({ma / 2**20:,.0f} vs {mb / 2**20:,.0f} MiB) |")
    return rows


def bench_data(args):
    """The data stream, in one run: (1) packing speed per rank: tokens/s of data.PackedLoader (read
    Arrow + tokenize + pack + batch; the tokens it tokenized) against the raw tokenizer encoding the
    same documents in 64-document calls, alternating rounds, median of the per-round ratios. Per rank = one thread
    (the loader's default), tokens per CPU-second of the whole process (time.process_time: every
    thread counted, so a tokenizer running threads of its own could not inflate it); wall clock
    beside it. Tokenizer: a 32000-piece BPE (Llama 2's vocab size) trained on the stdlib; corpora
    of the same text (1/8 of the stdlib, ~1.1M tokens): its files as documents (long ones, cut into
    spans), and the same files cut at blank lines (~15k short documents, ~70 tokens each:
    per-document work shows there), those also in 1,000-row and 8-row record batches (8: a read's
    documents each in a batch of its own, as at 1e9 documents in 1,000-row batches). (2) Per-rank memory and start-up at 1M, 4M and 16M documents:
    one process per corpus (Arrow, short documents) builds the span index if needed, then starts
    rank 0 of 32 (global batch 512 x seq 2048, shuffle 8: 16 streams x 8 lanes) with its evaluation
    windows and takes one step's micro-batches; RssAnon (private memory) and /dev/shm before and
    after, child processes, start-up seconds. Projected to 1e9 documents x 32 ranks against a
    512 GiB host. Everything it makes (corpora, tokenizer, indexes) goes under --out: a first run
    from an empty --out builds them, a later run reuses them."""
    import json
    import os
    import statistics
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
        json.dump(_data_memory(args, tok.path), open(os.path.join(args.out, "data_memory.json"), "w"), indent=1)
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
    corpora = {"files": (files, 1 << 30), "paragraphs": (paragraphs, 1 << 30),
               "paragraphs_b1000": (paragraphs, 1000), "paragraphs_b8": (paragraphs, 8)}
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
            speed[name][clock] = s = {"raw": statistics.median(r[0][i] for r in rounds),
                                      "packed": statistics.median(r[1][i] for r in rounds),
                                      "ratio": statistics.median(r[1][i] / r[0][i] for r in rounds),
                                      "ratio_thread": statistics.median(r[2][i] / r[0][i] for r in rounds),
                                      "raw_corpus_order": statistics.median(r[3][i] / r[0][i] for r in rounds)}
    print(f"\npacking, 32000-piece BPE, seq 2048, one thread per rank, median of 5 alternating rounds "
          f"(load average {load0:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores):")
    print("\n| corpus | clock | raw tokenizer | packed | ratio | with the prefetch thread | raw in corpus order |"
          "\n|---|---|---|---|---|---|---|")
    for name, sp in speed.items():
        for clock in ("cpu", "wall"):
            s = sp[clock]
            print(f"| {name}: {sp['documents']:,} documents, {sp['tokens_per_round'] / 1e6:.2f}M tokens a round | "
                  f"{'CPU time' if clock == 'cpu' else 'wall'} | {s['raw'] / 1e6:.2f}M tok/s | "
                  f"{s['packed'] / 1e6:.2f}M tok/s | {s['ratio']:.2f}x | {s['ratio_thread']:.2f}x | "
                  f"{s['raw_corpus_order']:.2f}x |")
    print(f"\na 1B model on one H100 eats ~50,000 tokens/s: one packing thread here is "
          f"{min(sp['cpu']['packed'] for sp in speed.values()) / 5e4:,.0f}x that per CPU-second (slowest corpus)")
    t_speed = time.perf_counter() - t_all
    if args.data_part == "packing":
        json.dump({"speed": speed}, open(os.path.join(args.out, "data_packing.json"), "w"), indent=1)
        return

    memory = _data_memory(args, tok.path)
    print(f"\nbench data: {time.perf_counter() - t_all:.0f} s in all (packing {t_speed:.0f} s); load average "
          f"{os.getloadavg()[0]:.1f} at the end")
    with open(os.path.join(args.out, "data.json"), "w") as f:
        json.dump({"speed": speed, **memory, "wall_s": time.perf_counter() - t_all}, f, indent=1)


# Corpus shapes of the memory part (--data_shapes): the file, by its number of documents, and how it is written.
DATA_SHAPES = {"arrow": ("docs_{}M.arrow", 1 << 17, "Arrow, 131k-row record batches"),
               "arrow_1000": ("docs_{}M_b1000.arrow", 1000, "Arrow, 1,000-row record batches (as prepare and datasets write)"),
               "jsonl": ("docs_{}M.jsonl", 0, "JSON lines")}


def _data_memory(args, tok_path: str) -> dict:
    """(2) of bench_data: memory and start-up against the number of documents, per corpus shape."""
    import json
    import os
    import subprocess
    t_mem, root = time.perf_counter(), os.path.dirname(os.path.abspath(__file__))
    cache, out, made_any = os.path.join(args.out, "cache"), {"memory": {}, "growth_mb": {}, "rank_at_1e9_bytes": {}}, False
    mb = lambda kb: kb / 1024               # noqa: E731
    for shape in args.data_shapes.split(","):
        name, batch_rows, what = DATA_SHAPES[shape]
        rows = []
        for n in (1 << 20, 1 << 22, 1 << 24):
            path = os.path.join(args.out, name.format(n >> 20))
            made, build_s = _docs_arrow(path, n, batch_rows) if not os.path.exists(path) else None, None
            made_any = made_any or made is not None
            for _ in range(2):              # a first run builds the indexes (once per corpus); then a plain start
                r = subprocess.run([sys.executable, "-c", MEM_CHILD, root, path, tok_path, cache, "32"],
                                   capture_output=True, text=True, timeout=900)
                if r.returncode:
                    raise SystemExit(f"bench data: the {n:,}-document {shape} child failed:\n{r.stderr[-3000:]}")
                got = json.loads(r.stdout.strip().splitlines()[-1])
                if not got["built"]:
                    break
                build_s, first = got["index_s"], got
            got.update(generate_s=made, build_s=build_s, first_run=first if build_s else None)
            rows.append(got)
        print(f"\n{what}, short documents ({shape}):")
        print("| documents | RssAnon after imports | RssAnon at step 1 | the data's share | same, indexes built in "
              "that run | /dev/shm | processes started | start-up | index build (once per corpus) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for g in rows:
            f = g["first_run"]
            print(f"| {g['docs'] / 2**20:.0f}M | {mb(g['base']['RssAnon']):.0f} MB | {mb(g['after']['RssAnon']):.0f} MB | "
                  f"{mb(g['after']['RssAnon'] - g['base']['RssAnon']):.0f} MB | "
                  + (f"{mb(f['after']['RssAnon'] - f['base']['RssAnon']):.0f} MB" if f else "-") +
                  f" | {g['shm_kb'] / 1024:.0f} MB | {g['children']} | {g['startup_s']:.1f} s | "
                  f"{'%.1f s' % g['build_s'] if g['build_s'] else 'cached'} |")
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


def _tiny_study_config(steps: int, *extra: str):
    """The tiny preset shrunk (dim 128, seq 128, one microbatch of 8) so that enough steps of
    several runs fit in minutes on 2 cores; lr, schedule shape, AdamW and clip are the preset's."""
    import configs
    warmup = max(1, round(steps * 20 / 300))              # the preset's 20 of 300 steps, scaled
    return configs.from_args(["--model.dim=128", "--model.n_heads=4", "--model.n_kv_heads=2",
                              "--model.ffn_dim=352", "--model.max_seq_len=128", "--seq_len=128",
                              "--micro_batch=8", "--global_batch=8", f"--steps={steps}",
                              f"--optim.warmup_steps={warmup}", f"--optim.decay_steps={steps - warmup}", *extra])


def _lockstep(runs: dict, cfg, steps: int):
    """Train every run of `runs` (name -> {"cfg", "model", "opt"}) on the same `steps` batches of
    the stdlib stream, one step of each in turn, so a busy machine slows them all alike. Records
    per run the losses, the gradient norms (before clipping) and the time spent in its steps."""
    import data
    import optim
    import parallel
    import train
    grid = parallel.Grid()
    tok = data.build_tokenizer(cfg.data, vocab_size=cfg.model.vocab_size)
    loader = data.PackedLoader(cfg.data, tok, dp_rank=0, dp_size=1, split="train")
    batches = [next(loader) for _ in range(steps)]        # the very same batches for every run
    loader.close()
    for r in runs.values():
        r.update(loss=[], grad_norm=[], time=0.0)
    for step in range(steps):
        for r in runs.values():
            r["opt"].set_lr(optim.lr_at(step, r["cfg"].optim))
            t = time.perf_counter()
            out = train.train_step(r["model"], r["opt"], [batches[step]], grid, r["cfg"])
            r["loss"].append(out["loss"].item())
            r["time"] += time.perf_counter() - t
            r["grad_norm"].append(float(out["grad_norm"]))
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step:4d} | " + " | ".join(f"{m} {r['loss'][-1]:.3f}" for m, r in runs.items()), flush=True)


def _smooth(xs: list[float], window: int) -> list[float]:
    return [sum(xs[max(0, i - window + 1):i + 1]) / len(xs[max(0, i - window + 1):i + 1]) for i in range(len(xs))]


def bench_precision(args):
    """The blog's precision study at tiny scale: fp32, mixed, bf16 and bf16_sr train the same model
    from the same init on the same batches, in lockstep, so the tokens/s ratios stay fair."""
    import json
    import os

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import configs
    import model as llama
    import optim
    import parallel

    steps = args.steps or 400
    cfg = _tiny_study_config(steps)
    tokens_per_step = cfg.data.global_batch * cfg.data.seq_len
    runs = {}
    for mode in optim.PRECISIONS:
        c = configs.from_args([])
        c.model, c.data, c.optim = cfg.model, cfg.data, configs.OptimConfig(**{**vars(cfg.optim), "precision": mode})
        m = llama.Llama(c.model).init_weights(c.seed).to(optim.param_dtype(mode))
        runs[mode] = {"cfg": c, "model": m, "opt": optim.build_optimizer(m, c, parallel.Grid())}
    print(f"bench precision: {steps} steps x {tokens_per_step} tokens, {llama.num_params(cfg.model) / 1e6:.2f}M "
          f"params (tiny preset, dim {cfg.model.dim}, seq {cfg.data.seq_len}), {torch.get_num_threads()} threads")
    _lockstep(runs, cfg, steps)

    tail = max(1, steps // 10)
    table = {}
    for mode, r in runs.items():
        table[mode] = {"final_loss": sum(r["loss"][-tail:]) / tail, "tokens_per_s": steps * tokens_per_step / r["time"],
                       "optimizer_state_bytes": r["opt"].state_bytes(),
                       "param_bytes": sum(p.numel() * p.element_size() for p in r["model"].parameters())}
    ref_loss, ref_speed = table["mixed"]["final_loss"], table["fp32"]["tokens_per_s"]
    print(f"\nfinal loss = mean train loss of the last {tail} steps (same batches for every mode)")
    print(f"{'mode':8s} | {'final loss':>10s} | {'vs mixed':>8s} | {'tokens/s':>8s} | {'vs fp32':>7s} | "
          f"{'opt state':>10s} | {'params':>10s}")
    for mode, row in table.items():
        print(f"{mode:8s} | {row['final_loss']:10.4f} | {100 * (row['final_loss'] / ref_loss - 1):+7.2f}% | "
              f"{row['tokens_per_s']:8.0f} | {row['tokens_per_s'] / ref_speed:6.2f}x | "
              f"{row['optimizer_state_bytes'] / 2**20:7.2f} MiB | {row['param_bytes'] / 2**20:7.2f} MiB")

    os.makedirs(args.out, exist_ok=True)
    window = max(1, steps // 40)
    fig, (ax, dx) = plt.subplots(1, 2, figsize=(12, 4.5))
    mixed = _smooth(runs["mixed"]["loss"], window)
    for mode, r in runs.items():
        ax.plot(_smooth(r["loss"], window), label=f"{mode} ({table[mode]['final_loss']:.3f})")
        dx.plot([a - b for a, b in zip(_smooth(r["loss"], window), mixed)], label=mode)
    ax.set(xlabel="step", ylabel=f"train loss (moving mean of {window})", title="tiny Llama, same data and init",
           ylim=(min(min(r["loss"]) for r in runs.values()) - 0.1, runs["fp32"]["loss"][0] + 0.2))
    dx.set(xlabel="step", ylabel="loss minus mixed-precision loss", title="difference to mixed precision")
    dx.axhline(0, color="gray", lw=0.5)
    for a in (ax, dx):
        a.legend()
        a.grid(alpha=0.3)
    fig.tight_layout()
    png = os.path.join(args.out, "precision.png")
    fig.savefig(png, dpi=110)
    with open(os.path.join(args.out, "precision.json"), "w") as f:
        json.dump({"steps": steps, "tokens_per_step": tokens_per_step, "table": table,
                   "loss": {m: r["loss"] for m, r in runs.items()}}, f)
    print(f"\nbf16_sr vs mixed final loss: {100 * (table['bf16_sr']['final_loss'] / ref_loss - 1):+.2f}%; "
          f"bf16 vs mixed: {100 * (table['bf16']['final_loss'] / ref_loss - 1):+.2f}%; "
          f"bf16_sr tokens/s vs fp32: {table['bf16_sr']['tokens_per_s'] / ref_speed:.2f}x on this CPU")
    print(f"wrote {png} and precision.json")


def bench_init(args):
    """The blog's second stability lesson at tiny scale: a deep, narrow model at a high learning
    rate from Llama's default init (every matmul weight at std 0.02) and from scaled init (the
    attention and MLP output projections at 0.02 / sqrt(2 * n_layers), model.init_param), same
    data, same seed, in lockstep. The default-init model is the scaled one with those two weights
    multiplied back by sqrt(2 * n_layers): the same random draws, only their scale differs."""
    import json
    import math
    import os

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import model as llama
    import monitor
    import optim
    import parallel

    steps = args.steps or 150
    cfg = _tiny_study_config(steps, f"--model.n_layers={args.layers}", "--model.dim=64", "--model.ffn_dim=176",
                             "--model.max_seq_len=64", "--seq_len=64", f"--optim.lr={args.lr}",
                             f"--optim.min_lr={args.lr / 10}", "--precision=fp32")
    runs = {}
    for name in ("default init", "scaled init"):
        m = llama.Llama(cfg.model).init_weights(cfg.seed)
        if name == "default init":
            with torch.no_grad():
                for n, p in m.named_parameters():
                    if n.endswith(("o_proj.weight", "down_proj.weight")):
                        p.mul_(math.sqrt(2.0 * cfg.model.n_layers))
        runs[name] = {"cfg": cfg, "model": m, "opt": optim.build_optimizer(m, cfg, parallel.Grid())}
    print(f"bench init: {steps} steps x {cfg.data.global_batch * cfg.data.seq_len} tokens, {cfg.model.n_layers} "
          f"layers, dim {cfg.model.dim}, {llama.num_params(cfg.model) / 1e6:.2f}M params, lr {cfg.optim.lr:g} "
          f"(warmup {cfg.optim.warmup_steps}, clip {cfg.optim.grad_clip}), {torch.get_num_threads()} threads")
    _lockstep(runs, cfg, steps)

    tail, table = max(1, steps // 10), {}
    for name, r in runs.items():
        det = monitor.SpikeDetector()
        warnings = [w for s, g in enumerate(r["grad_norm"], 1) for w in det.update(s, g)]
        s = det.summary()
        table[name] = {"final_loss": sum(r["loss"][-tail:]) / tail, "min_loss": min(r["loss"]),
                       "loss_at_half": sum(r["loss"][steps // 2 - tail // 2:steps // 2 + tail // 2 + 1]) / (2 * (tail // 2) + 1),
                       "max_grad_norm": max(r["grad_norm"]), "spikes": s["spikes"] + bool(s["open"]),
                       "one_step_share": s["one_step_share"], "longest_spike": max(s["longest"], s["open"]),
                       "warnings": len(warnings)}
    print(f"\nfinal loss = mean train loss of the last {tail} steps; spikes: the blog's detector (monitor.py)")
    print(f"{'init':12s} | {'final loss':>10s} | {'at half':>8s} | {'max grad norm':>13s} | {'spikes':>6s} | "
          f"{'1-step':>6s} | {'longest':>7s} | {'warnings':>8s}")
    for name, row in table.items():
        print(f"{name:12s} | {row['final_loss']:10.4f} | {row['loss_at_half']:8.4f} | {row['max_grad_norm']:13.3f} | "
              f"{row['spikes']:6d} | {row['one_step_share']:6.0%} | {row['longest_spike']:7d} | {row['warnings']:8d}")

    os.makedirs(args.out, exist_ok=True)
    window = max(1, steps // 40)
    fig, (ax, gx) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in runs.items():
        ax.plot(_smooth(r["loss"], window), label=f"{name} ({table[name]['final_loss']:.3f})")
        gx.plot(r["grad_norm"], label=f"{name} (max {table[name]['max_grad_norm']:.2f})", lw=0.8)
    ax.set(xlabel="step", ylabel=f"train loss (moving mean of {window})",
           title=f"{cfg.model.n_layers} layers, lr {cfg.optim.lr:g}, same data and seed")
    gx.set(xlabel="step", ylabel="gradient L2 norm (before clipping)", yscale="log", title="gradient norm")
    for a in (ax, gx):
        a.legend()
        a.grid(alpha=0.3)
    fig.tight_layout()
    png = os.path.join(args.out, "init.png")
    fig.savefig(png, dpi=110)
    with open(os.path.join(args.out, "init.json"), "w") as f:
        json.dump({"steps": steps, "layers": cfg.model.n_layers, "lr": cfg.optim.lr, "table": table,
                   "loss": {n: r["loss"] for n, r in runs.items()},
                   "grad_norm": {n: r["grad_norm"] for n, r in runs.items()}}, f)
    print(f"wrote {png} and init.json")


def _launch_ranks(which: str, name: str, world: int, threads: int, steps: int, **env_extra):
    """Run `bench.py <which>` as `world` gloo ranks (a torchrun-like environment) and wait for them."""
    import os
    import socket
    import subprocess
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = dict(os.environ, **env_extra, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   LOCAL_RANK=str(rank), WORLD_SIZE=str(world), OMP_NUM_THREADS=str(threads))
        cmd = [sys.executable, os.path.abspath(__file__), which, "--threads", str(threads), "--steps", str(steps)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL))
    if any(p.wait() != 0 for p in procs):
        raise SystemExit(f"bench.py {which}: the {name} run failed")


def bench_parallel(args):
    """Training tokens/s of TP=2, TP=2 with SP, and DP=2 (two gloo processes of one thread each)
    against one process (one thread, and two threads: both cores), same global batch and tokens per
    step, the tiny preset, train.train_step. Each layout runs as its own group of processes
    (re-running this file with BENCH_PARALLEL_LAYOUT set, torchrun-style environment)."""
    import json
    import os
    import tempfile

    import configs
    import parallel
    import train

    steps, warmup, rounds = args.steps or 3, 1, 2
    layout = os.environ.get("BENCH_PARALLEL_LAYOUT")
    if layout:                                   # a worker rank: train and time `steps` steps
        tp, dp, sp = (int(v) for v in layout.split(","))
        cfg = configs.tiny()
        cfg.device, cfg.parallel.tp, cfg.parallel.dp, cfg.parallel.sp = "cpu", tp, dp, bool(sp)
        grid = parallel.init_distributed(cfg, torch.device("cpu"))
        model = parallel.init_weights(parallel.build_model(cfg, grid, torch.device("cpu")), cfg, grid)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        accum, d = configs.grad_accum_steps(cfg, grid.dp), cfg.data
        g = torch.Generator().manual_seed(grid.dp_rank)

        def batches():
            out = []
            for _ in range(accum):
                t = torch.randint(0, cfg.model.vocab_size, (d.micro_batch, d.seq_len + 1), generator=g)
                pos = torch.arange(d.seq_len).expand(d.micro_batch, -1)
                out.append({"tokens": t[:, :-1], "targets": t[:, 1:], "positions": pos, "doc_ids": None})
            return out

        for i in range(warmup + steps):
            if i == warmup:
                parallel.barrier(grid)
                t0 = time.perf_counter()
            train.train_step(model, opt, batches(), grid, cfg)
        parallel.barrier(grid)
        if grid.is_main:
            with open(os.environ["BENCH_PARALLEL_OUT"], "w") as f:
                json.dump({"tok_s": steps * d.global_batch * d.seq_len / (time.perf_counter() - t0)}, f)
        parallel.destroy(grid)
        return

    layouts = [("1 process x 1 thread", 1, 1, 1, 0, 1), ("1 process x 2 threads", 1, 1, 1, 0, 2),
               ("TP=2 (2 x 1 thread)", 2, 2, 1, 0, 1), ("TP=2 + SP (2 x 1 thread)", 2, 2, 1, 1, 1),
               ("DP=2 (2 x 1 thread)", 2, 1, 2, 0, 1)]
    cfg = configs.tiny()
    print(f"tiny preset: {cfg.model.dim} dim, {cfg.model.n_layers} layers, global batch "
          f"{cfg.data.global_batch} x {cfg.data.seq_len} tokens per step (micro {cfg.data.micro_batch}), "
          f"{warmup} warm-up + {steps} timed steps, best of {rounds} rounds, gloo on CPU")
    # Rounds alternate over the layouts and each keeps its best round, so that load from other
    # processes on this shared machine does not land on one layout only.
    runs = {name: [] for name, *_ in layouts}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            for name, world, tp, dp, sp, threads in layouts:
                out = os.path.join(tmp, "result.json")
                _launch_ranks("parallel", name, world, threads, steps,
                              BENCH_PARALLEL_LAYOUT=f"{tp},{dp},{sp}", BENCH_PARALLEL_OUT=out)
                with open(out) as f:
                    runs[name].append(json.load(f)["tok_s"])
    results = {name: max(r) for name, r in runs.items()}
    for name, r in runs.items():
        print(f"  {name:28s} {results[name]:8.0f} tok/s  (rounds: {', '.join(f'{x:.0f}' for x in r)})")
    base1, base2 = results["1 process x 1 thread"], results["1 process x 2 threads"]
    print("ratios (tokens/s over the 1-process baselines):")
    for name in results:
        print(f"  {name:28s} {results[name] / base1:5.2f}x vs 1 thread   {results[name] / base2:5.2f}x vs 2 threads")


def bench_pp(args):
    """Step time of PP=2 (two gloo processes of one thread each) with the 1F1B and GPipe schedules
    (and 1F1B over the all-gather point-to-point NxD uses on XLA) against one process (one thread,
    and two threads: both cores) running the same model on the same global batch with
    train.train_step. Tiny preset, 8 microbatches of 2 sequences per step (bubble 1/9). Each layout
    is its own group of processes (this file re-run with BENCH_PP_LAYOUT set); layouts are run in
    2 rounds and the faster of the two is kept (a shared machine)."""
    import json
    import os
    import tempfile

    import configs
    import parallel
    import pipeline
    import train

    steps, warmup, rounds = args.steps or 4, 2, 2

    def config(pp: int, schedule: str = "1f1b", p2p: str = "send") -> configs.Config:
        cfg = configs.tiny()
        cfg.device, cfg.data.micro_batch = "cpu", 2                 # 16 / 2 = 8 microbatches
        cfg.parallel.pp, cfg.parallel.pp_schedule, cfg.parallel.pp_p2p = pp, schedule, p2p
        return cfg

    layout = os.environ.get("BENCH_PP_LAYOUT")
    if layout:                                   # a worker rank: train and time `steps` steps
        pp, schedule, p2p = layout.split(",")
        cfg = config(int(pp), schedule, p2p)
        grid = parallel.init_distributed(cfg, torch.device("cpu"))
        build, step = (pipeline.build_model, pipeline.train_step) if grid.pp > 1 else (parallel.build_model, train.train_step)
        model = parallel.init_weights(build(cfg, grid, torch.device("cpu")), cfg, grid)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        d, g = cfg.data, torch.Generator().manual_seed(0)

        def batches():
            out = []
            for _ in range(configs.grad_accum_steps(cfg, grid.dp)):
                t = torch.randint(0, cfg.model.vocab_size, (d.micro_batch, d.seq_len + 1), generator=g)
                pos = torch.arange(d.seq_len).expand(d.micro_batch, -1)
                out.append({"tokens": t[:, :-1], "targets": t[:, 1:], "positions": pos, "doc_ids": None})
            return out

        idle = max_live = 0.0
        for i in range(warmup + steps):
            if i == warmup:
                parallel.barrier(grid)
                t0 = time.perf_counter()
            r = step(model, opt, batches(), grid, cfg)
            if i >= warmup:
                idle += r.get("idle", 0.0) / steps
                max_live = max(max_live, r.get("max_live", 0))
        parallel.barrier(grid)
        with open(f"{os.environ['BENCH_PP_OUT']}.{grid.rank}", "w") as f:
            json.dump({"step_s": (time.perf_counter() - t0) / steps, "idle": idle, "max_live": max_live,
                       "bubble": r.get("bubble", 0.0)}, f)
        parallel.destroy(grid)
        return

    layouts = [("1 process x 1 thread", 1, "1f1b", "send", 1), ("1 process x 2 threads", 1, "1f1b", "send", 2),
               ("PP=2 1F1B (2 x 1 thread)", 2, "1f1b", "send", 1), ("PP=2 GPipe (2 x 1 thread)", 2, "gpipe", "send", 1),
               ("PP=2 1F1B allgather p2p", 2, "1f1b", "allgather", 1)]
    cfg = config(1)
    print(f"tiny preset: {cfg.model.dim} dim, {cfg.model.n_layers} layers, global batch {cfg.data.global_batch} "
          f"x {cfg.data.seq_len} tokens = 8 microbatches of {cfg.data.micro_batch}; {warmup} warm-up + {steps} "
          f"timed steps, best of {rounds} rounds, gloo on CPU ({os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f})")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            for name, world, schedule, p2p, threads in layouts:
                out = os.path.join(tmp, "result.json")
                _launch_ranks("pp", name, world, threads, steps,
                              BENCH_PP_LAYOUT=f"{world},{schedule},{p2p}", BENCH_PP_OUT=out)
                ranks = []
                for rank in range(world):
                    with open(f"{out}.{rank}") as f:
                        ranks.append(json.load(f))
                step_s = max(r["step_s"] for r in ranks)
                if name not in results or step_s < results[name][0]:
                    results[name] = (step_s, ranks)
    base1, base2 = results["1 process x 1 thread"][0], results["1 process x 2 threads"][0]
    print(f"{'':28s} {'step':>8s}  speed-up vs 1 thread, 2 threads  bubble  measured idle (stage 0, 1)  peak live")
    for name, (step_s, ranks) in results.items():
        extra = ""
        if len(ranks) > 1:
            extra = (f"  {ranks[0]['bubble']:.3f}   " + ", ".join(f"{r['idle']:.3f}" for r in ranks).ljust(26)
                     + "  " + ", ".join(str(int(r["max_live"])) for r in ranks))
        print(f"  {name:26s} {step_s * 1e3:6.0f} ms  {base1 / step_s:13.2f}x {base2 / step_s:9.2f}x      {extra}")
    fo, gp = results["PP=2 1F1B (2 x 1 thread)"][0], results["PP=2 GPipe (2 x 1 thread)"][0]
    print(f"1F1B / GPipe step time: {fo / gp:.2f}; 1F1B / one process (2 threads): {fo / base2:.2f}; "
          f"(1 thread): {fo / base1:.2f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "pp.json"), "w") as f:
        json.dump({k: {"step_s": v[0], "ranks": v[1]} for k, v in results.items()}, f, indent=1)


def bench_ckpt(args):
    """Checkpointing a 134M-parameter Llama with its AdamW state (fp32 params + 2 moments, 1.6 GB):
    a synchronous save vs the disk's own speed, the time a step is blocked by an async save vs a
    synchronous one, the step slowdown while a save is written, restart-to-first-step after a
    SIGKILL, and what these give at the blog's scale (Young/Daly interval, effective utilization)."""
    import json
    import math
    import os
    import shutil
    import statistics
    import subprocess
    import tempfile
    import textwrap

    import configs
    import optim
    import parallel
    from checkpoint import Checkpointer
    from model import num_params

    cfg = configs.Config()
    cfg.model = configs.ModelConfig(vocab_size=32000, dim=768, n_layers=12, n_heads=12, n_kv_heads=12,
                                    ffn_dim=2048, max_seq_len=256)
    os.makedirs(args.out, exist_ok=True)
    root = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.out)
    res = {"params": num_params(cfg.model), "threads": args.threads}
    quiet = lambda *a: None
    try:
        model = parallel.init_weights(parallel.build_model(cfg, parallel.Grid(), "cpu"), cfg, parallel.Grid())
        opt = optim.build_optimizer(model, cfg)
        state = lambda: (model.state_dict(), opt.state_dict())
        res["state_gb"] = (sum(t.numel() * 4 for t in model.state_dict().values()) + opt.state_bytes()) / 1e9
        print(f"state: {res['params'] / 1e6:.0f}M params, fp32 params + 2 AdamW moments = {res['state_gb']:.2f} GB; "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")

        def checkpointer(name, async_save):
            c = configs.Config(model=cfg.model)
            c.ckpt.dir, c.ckpt.async_save, c.ckpt.keep = os.path.join(root, name), async_save, 100
            return Checkpointer(c, log=quiet)

        def clean(name):          # outside the timed parts: deleting 1.6 GB (ext4 discard) is slow too
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            os.sync()
        # A fixed matmul workload stands in for a training step (its forward and backward, then the
        # update); every core of the host is busy with it, the worst case for a background writer.
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)

        def timed_step():
            t = time.perf_counter()
            [a @ b for _ in range(8)]
            return time.perf_counter() - t
        timed_steps = lambda n: [timed_step() for _ in range(n)]             # noqa: E731

        # Alternating rounds (the machine is shared and noisy), each a ratio within the round:
        # 1. the disk's own speed (16 MiB writes, one fsync: `dd bs=16M conv=fsync`) against a
        #    synchronous save of the same bytes (serialization, crc32, write, one fsync per file);
        # 2. an async save as train.py makes it: save(), then the next step's forward and backward
        #    while the writer thread copies the weights and moments into its host buffers, then
        #    before_update() (blocked = both waits); against that round's synchronous save;
        # 3. the step time while that save is written (up to 25 steps) against 10 steps before and
        #    10 after it.
        nbytes = int(res["state_gb"] * 1e9)
        chunk = memoryview(bytearray(os.urandom(1 << 20)) * 16)
        sync_ck, async_ck = checkpointer("sync", False), checkpointer("async", True)
        rounds = []
        timed_steps(3)
        for r in range(1, 5):
            path, t = os.path.join(root, "dd.bin"), time.perf_counter()
            with open(path, "wb", buffering=0) as f:
                for _ in range(0, nbytes, len(chunk)):
                    f.write(chunk)
                os.fsync(f.fileno())
            disk = nbytes / (time.perf_counter() - t)
            os.unlink(path)
            os.sync()
            sync_ck.save(r, *state())
            sync, saved = sync_ck.stats["blocked_s"], sync_ck.stats["bytes"]
            clean("sync")
            before = timed_steps(10)
            async_ck.save(r, *state(), defer_copy=True)
            timed_steps(1)                              # the next step's forward and backward
            async_ck.before_update()
            during = []
            while async_ck.in_flight and len(during) < 25:
                during += timed_steps(1)
            t = time.perf_counter()
            async_ck.wait()                             # the rest of the write, at normal priority
            st, rest = async_ck.stats, time.perf_counter() - t
            base = statistics.median(before + timed_steps(10))
            rounds.append(x := dict(disk_mb_s=disk / 1e6, save_mb_s=saved / sync / 1e6, sync_s=sync,
                                    blocked_s=st["blocked_s"], write_s=st["write_s"], rest_s=rest, step_s=base,
                                    step_in_flight_s=statistics.median(during) if during else base,
                                    steps_in_flight=len(during)))
            clean("async")
            print(f"round {r}: disk {x['disk_mb_s']:.0f} MB/s, sync save {x['save_mb_s']:.0f} MB/s ({x['sync_s']:.2f} s), "
                  f"async blocked {x['blocked_s']:.3f} s{' (allocates its buffers)' if r == 1 else ''}, step "
                  f"{1e3 * base:.0f} -> {1e3 * x['step_in_flight_s']:.0f} ms over {len(during)} steps of the write "
                  f"({x['write_s']:.1f} s, {x['rest_s']:.1f} s of it after them)")
        med = lambda f, rs=rounds: statistics.median(f(x) for x in rs)        # noqa: E731
        steady = rounds[1:]                             # the first async save allocates its buffers
        res.update(rounds=rounds, disk_mb_s=med(lambda x: x["disk_mb_s"]), save_mb_s=med(lambda x: x["save_mb_s"]),
                   save_over_disk=med(lambda x: x["save_mb_s"] / x["disk_mb_s"]), sync_s=med(lambda x: x["sync_s"]),
                   async_blocked_s=med(lambda x: x["blocked_s"], steady), async_first_s=rounds[0]["blocked_s"],
                   blocked_over_sync=med(lambda x: x["blocked_s"] / x["sync_s"], steady),
                   in_flight_overhead=med(lambda x: x["step_in_flight_s"] / x["step_s"] - 1, steady))
        verdict = lambda ok: "PASS" if ok else "FAIL"                         # noqa: E731
        print(f"medians of the rounds' ratios (load average {os.getloadavg()[0]:.1f}):\n"
              f"  synchronous save / disk     {100 * res['save_over_disk']:5.0f}%  (target >= 70%: "
              f"{verdict(res['save_over_disk'] >= 0.7)}; {res['save_mb_s']:.0f} vs {res['disk_mb_s']:.0f} MB/s)\n"
              f"  async blocked / synchronous {100 * res['blocked_over_sync']:5.1f}%  (target < 5%: "
              f"{verdict(res['blocked_over_sync'] < 0.05)}; rounds 2-4; {res['async_blocked_s']:.3f} vs "
              f"{res['sync_s']:.2f} s)\n"
              f"  step slowdown while writing {100 * res['in_flight_overhead']:+5.1f}%  (target < 5%: "
              f"{verdict(res['in_flight_overhead'] < 0.05)}; rounds 2-4)")
        del sync_ck, async_ck, model, opt

        # 4. Restart after a kill: a run saves step 1, then is SIGKILLed halfway through writing step 2
        #    (NANOTRN_FAULT). The restart imports, rebuilds model and optimizer, finds step 2
        #    incomplete, verifies and loads step 1, and takes two steps (seq 256).
        common = textwrap.dedent(f"""
            import json, sys, time
            t_start = time.time()
            import torch
            sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
            import checkpoint, configs, optim, parallel, model as llama
            torch.set_num_threads({args.threads})
            cfg = configs.Config(model=configs.ModelConfig(**{vars(cfg.model)!r}))
            cfg.ckpt.dir = KILL_DIR
            t_import = time.time()
            ck = checkpoint.Checkpointer(cfg)
            loaded = None
            model = parallel.build_model(cfg, parallel.Grid(), "cpu")
            if INIT:                         # before: initialized, then overwritten by the load below
                parallel.init_weights(model, cfg, parallel.Grid())
            else:                            # after: load into the empty model (what train.py does)
                loaded = ck.load_latest()
                model.load_state_dict(loaded.model)
            opt = optim.build_optimizer(model, cfg)
            t_build = time.time()
        """)
        crash = common + "ck.save(1, model.state_dict(), opt.state_dict()); ck.wait(); ck.save(2, model.state_dict(), opt.state_dict()); ck.close()"
        restart = common + textwrap.dedent("""
            if loaded is None:               # before: the model was initialized, now overwritten
                loaded = ck.load_latest()
                model.load_state_dict(loaded.model)
            opt.load_state_dict(loaded.optim)
            t_load = time.time()
            tokens = torch.randint(0, cfg.model.vocab_size, (1, 257))
            def step():
                model(tokens[:, :-1], targets=tokens[:, 1:]).backward(); opt.step(); opt.zero_grad()
            step(); t_step1 = time.time(); step(); t_step2 = time.time()
            print(json.dumps(dict(t_start=t_start, t_import=t_import, t_build=t_build, t_load=t_load,
                                  t_step1=t_step1, t_step2=t_step2, step=loaded.step)))
        """)
        # Before: the model is initialized from the seed, then overwritten by the load (what train.py
        # did). After: built empty (memory only), then loaded (what train.py does now).
        for name, init in (("init_then_load", True), ("empty_then_load", False)):
            head = f"INIT, KILL_DIR = {init}, {os.path.join(root, name)!r}\n"
            r = subprocess.run([sys.executable, "-c", head.replace(str(init), "True", 1) + crash],
                               env={**os.environ, "NANOTRN_FAULT": "0:2:save"}, capture_output=True, text=True)
            assert r.returncode == -9, r.stderr[-2000:]
            t0 = time.time()
            r = subprocess.run([sys.executable, "-c", head + restart], capture_output=True, text=True)
            assert r.returncode == 0, r.stderr[-2000:]
            t = json.loads(r.stdout.strip().splitlines()[-1])
            assert t["step"] == 1 and "skipping step_00000002" in r.stdout
            rs = dict(restart_to_first_step_s=t["t_step1"] - t0, restart_import_s=t["t_import"] - t0,
                      restart_build_s=t["t_build"] - t["t_import"], restart_load_s=t["t_load"] - t["t_build"],
                      restart_first_step_s=t["t_step1"] - t["t_load"], restart_next_step_s=t["t_step2"] - t["t_step1"])
            res[name] = rs
            print(f"restart to first step ({name.replace('_', ' ')}) {rs['restart_to_first_step_s']:.1f} s = "
                  f"start+imports {rs['restart_import_s']:.1f} + build model/opt {rs['restart_build_s']:.1f} + "
                  f"find/verify/load {rs['restart_load_s']:.1f} + first step {rs['restart_first_step_s']:.1f} "
                  f"{'' if init else '(the model is loaded during its build) '}"
                  f"(a later step: {rs['restart_next_step_s']:.1f} s)")
        res.update(res["empty_then_load"], restart_load_s=res["init_then_load"]["restart_load_s"])
        res["restart_saved_s"] = (res["init_then_load"]["restart_to_first_step_s"]
                                  - res["empty_then_load"]["restart_to_first_step_s"])
        print(f"building the model empty saves {res['restart_saved_s']:.1f} s per restart "
              f"(build {res['init_then_load']['restart_build_s']:.1f} -> {res['empty_then_load']['restart_build_s']:.1f} s)")
    finally:
        shutil.rmtree(root, ignore_errors=True)

    # 5. The blog's scale, from these rates. Llama 2 7B, TP=8 PP=1 DP=512 on 128 trn1.32xlarge,
    #    bf16 params and bf16 moments (bf16_sr): 6 bytes per parameter. Without ZeRO-1 the 8 ranks of
    #    DP replica 0 write the model and optimizer (NxD's layout): 42 GB, 5.25 GB per rank.
    #    Assumptions (stated, not measured): host-copy and write rates per rank/node as measured here;
    #    cluster MTBF from Llama 3's 419 unexpected interruptions in 54 days on 2,048 nodes, scaled to
    #    128 nodes (about 50 h; also 12 h as a bad case); relaunch after a failure 5 min (torchrun
    #    restart, health check, Neuron runtime, cached graphs) plus the load; manual recovery 4 h.
    gb = 1e9
    stage_bw, write_bw = res["state_gb"] * gb / res["async_blocked_s"], res["state_gb"] * gb / res["sync_s"]
    load_bw = res["state_gb"] * gb / res["restart_load_s"]
    per_rank, per_node = 7e9 * 6 / 8, 7e9 * 6
    C_async, W = per_rank / stage_bw, per_node / write_bw
    C_sync = per_node / write_bw
    R_auto, R_manual = 300 + per_rank / load_bw, 4 * 3600

    def utilization(C, R, M, floor=0.0):
        tau = max(math.sqrt(2 * M * C), floor)        # Young/Daly: sqrt(2 * MTBF * save cost)
        return tau, (1 - C / tau) * (1 - (tau / 2 + R) / M)
    print(f"\nblog scale (7B, 128 nodes): save blocks {C_async:.2f} s async vs {C_sync:.0f} s synchronous; "
          f"the background write takes {W:.0f} s, so saves cannot come more often than that")
    print(f"{'MTBF':>6} {'recovery':>16} {'save':>6} {'interval':>9} {'utilization':>11}")
    res["scale"] = []
    for M_h in (50, 12):
        M = M_h * 3600
        for name, C, R, floor in (("automatic", C_async, R_auto, W), ("automatic", C_sync, R_auto, 0),
                                  ("manual (4 h)", C_async, R_manual, W)):
            tau, u = utilization(C, R, M, floor)
            kind = "async" if C is C_async else "sync"
            res["scale"].append(dict(mtbf_h=M_h, recovery=name, save=kind, interval_s=tau, utilization=u))
            print(f"{M_h:5d}h {name:>16} {kind:>6} {tau / 60:7.1f} min {100 * u:10.2f}%")
    print("(the blog measured 98.81% with automatic recovery, 77.83% with manual)")
    res["load_average_end"] = os.getloadavg()[0]
    print(f"load average at the end: {res['load_average_end']:.1f} on {os.cpu_count()} cores")
    with open(os.path.join(args.out, "ckpt.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {os.path.join(args.out, 'ckpt.json')}")


def bench_xla(args):
    """The trn1 code path on XLA:CPU against the eager CPU, same config, same process: train.py runs
    twice under scripts/xla_check.py (eager CPU, then torch-xla with PJRT_DEVICE=CPU), the tiny preset
    shrunk to 2 layers. Reports the graphs compiled per step type and the steady step time ratio,
    then the pipeline step's census (scripts/pp_graphs.py: PP=2 at 2, 4 and 8 microbatches).
    XLA:CPU is not Trainium: the ratio says what lazy tracing costs on a CPU, not trn1 speed."""
    import json
    import os
    import shutil
    import subprocess

    steps, log, ev, save = max(args.steps, 30), 10, 25, 25
    os.makedirs(args.out, exist_ok=True)
    report = os.path.join(args.out, "xla.json")
    train_args = ["--model.n_layers=2", "--data.global_batch=8", "--data.micro_batch=8", "--log.eval_windows=8",
                  f"--optim.max_steps={steps}", f"--log.interval={log}", f"--log.eval_interval={ev}",
                  f"--ckpt.interval={save}", f"--out_dir={args.out}/xla-run", f"--ckpt.dir={args.out}/xla-run/ckpt",
                  "--log.tensorboard=", "--log.sample_tokens=0", "--precision=fp32"]
    shutil.rmtree(os.path.join(args.out, "xla-run"), ignore_errors=True)
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "xla_check.py"),
           f"--eager-steps={steps}", f"--threads={args.threads}", f"--json={report}",
           f"--graphs={args.out}/xla-graphs.txt", "--", *train_args]
    r = subprocess.run(cmd, env={**os.environ, "PJRT_DEVICE": "CPU"}, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench.py xla: the run failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    rep = json.load(open(report))

    def pace(run):
        # Steps 11-20: XLA runs a step asynchronously, so time a span that ends with a host read
        # (step 20's log waits for every queued step); no compile, eval or save inside it.
        s = run["steps"]
        return (s[2 * log]["begin_s"] - s[log]["begin_s"]) / log

    xs = rep["xla"]["steps"]
    kinds = {"step 1": xs[0]["in_step"]["UncachedCompile"], "step 2": xs[1]["in_step"]["UncachedCompile"],
             "later steps": sum(s["in_step"]["UncachedCompile"] for s in xs[2:]),
             f"first log step ({log})": xs[log - 1]["after"]["UncachedCompile"],
             f"first eval + save ({ev})": xs[ev - 1]["after"]["UncachedCompile"],
             "after every other step": sum(s["after"]["UncachedCompile"] for s in xs[:-1]
                                           if s["step"] not in (log, ev))}
    print(f"tiny preset, 2 layers, batch 8 x 256 tokens, {steps} steps, log every {log}, eval + save at {ev}")
    print("graphs compiled on XLA: " + ", ".join(f"{k}: {v}" for k, v in kinds.items()))
    # The census by graph (scripts/xla_check.py names them: token count, first microbatch, later
    # microbatch, reduce/clip/update inside a step; log, eval, save, resume, setup outside).
    for label, c in rep["xla"]["census"].items():
        print(f"  {label:20s} compiled {c['compiled']}, run {c['runs']}, HLO instructions "
              + ", ".join(f"{n} (from step {k})" for n, k in c["sizes"].items()))
    t_x, t_e = pace(rep["xla"]), pace(rep["eager"])
    diff = max(abs(a - b) for a, b in zip(rep["xla"]["losses"][:5], rep["eager"]["losses"][:5]))
    print(f"steady step time: XLA:CPU {t_x * 1e3:.0f} ms, eager CPU {t_e * 1e3:.0f} ms: ratio {t_x / t_e:.2f}x; "
          f"first 5 losses differ by at most {diff:.1e}; load average {os.getloadavg()[0]:.1f}")
    # The pipeline step's graphs (scripts/pp_graphs.py: PP=2, both stages in this one process, the
    # point-to-point's pair all-gather stood in for; XLA:CPU has no multi-process collectives).
    pp_report = os.path.join(args.out, "pp_graphs.json")
    r = subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "pp_graphs.py"),
                        f"--json={pp_report}", f"--graphs={args.out}/pp-graphs.txt", "--microbatches=2,4,8"],
                       env={**os.environ, "PJRT_DEVICE": "CPU"}, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench.py xla: the pipeline census failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    print("pipeline step graphs, PP=2 1F1B all-gather point-to-point, tiny model 4 layers (scripts/pp_graphs.py):")
    print("\n".join("  " + line for line in r.stdout.strip().splitlines()))
    with open(report, "w") as f:
        json.dump({**rep, "compiles": kinds, "xla_step_s": t_x, "eager_step_s": t_e}, f, indent=1)


BENCHES = {"step": bench_step, "train": bench_train, "data": bench_data, "precision": bench_precision, "init": bench_init,
           "parallel": bench_parallel, "pp": bench_pp, "ckpt": bench_ckpt, "xla": bench_xla}

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", choices=list(BENCHES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=0, help="0 = the benchmark's default")
    parser.add_argument("--out", default="out/bench")
    parser.add_argument("--step_tokens", type=int, default=4096, help="step: tokens per step of the second "
                        "trainer-vs-bare rows (batch 4 x step_tokens/4; 0 = only the 512-token rows)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="step: the weights' dtype")
    parser.add_argument("--layers", type=int, default=16, help="init: the model's depth")
    parser.add_argument("--lr", type=float, default=1e-2, help="init: the (high) peak learning rate")
    parser.add_argument("--data_shapes", default="arrow", help="data: the memory part's corpus shapes, of "
                        "arrow (131k-row record batches), arrow_1000 (1,000-row batches), jsonl")
    parser.add_argument("--data_part", default="all", choices=["all", "memory", "packing"], help="data: one part only")
    parser.add_argument("--data_corpora", default="files,paragraphs,paragraphs_b1000,paragraphs_b8", help="data: the "
                        "packing part's corpora (paragraphs_bN: the paragraphs in N-row record batches)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    BENCHES[args.which](args)
