"""The training step against transformers' and the trainer against the bare step (`bench.py step`),
and our Llama against transformers' in fp32 and bf16 (`bench.py train`): speed as the median of
per-round ratios, peak memory each in a fresh process."""
from __future__ import annotations

import dataclasses
import multiprocessing
import os
import statistics

import torch

from benchmarks.common import alternate, median_ratio, no_page_fault_churn, table

# The shapes of issue 27's GPU table, scaled to the 2-core CPU: the same vocabularies with a small
# body (dim 256, 2 layers, 512 tokens a step: the 128k head then weighs on the step as it does on
# Llama 3.2 1B), and Llama 2 7B's layer (MHA, ffn = 2.69 dim) at dim 512 and 512 tokens.
STEP_SHAPES = {
    "1B body, vocab 128256": dict(vocab_size=128256, dim=256, n_layers=2, n_heads=4, n_kv_heads=1, ffn_dim=1024,
                                  batch=4, seq=128),
    "1B body, vocab 32000": dict(vocab_size=32000, dim=256, n_layers=2, n_heads=4, n_kv_heads=1, ffn_dim=1024,
                                 batch=4, seq=128),
    "1B body, vocab 512": dict(vocab_size=512, dim=256, n_layers=2, n_heads=4, n_kv_heads=1, ffn_dim=1024,
                               batch=4, seq=128),
    "7B layers, vocab 32000": dict(vocab_size=32000, dim=512, n_layers=2, n_heads=8, n_kv_heads=8, ffn_dim=1376,
                                   batch=1, seq=512),
}
# On a GPU, issue 27's shapes at full size: Llama 3.2 1B (tied head, GQA 32/8) at three vocabularies,
# 8 x 2048 tokens a step, and six of Llama 2 7B's layers at 2 x 4096 tokens.
BODY_1B = dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, tie_embeddings=True,
               rope_theta=500000.0, batch=8, seq=2048)
GPU_SHAPES = {
    "Llama 3.2 1B, vocab 128256": dict(BODY_1B, vocab_size=128256),
    "1B body, vocab 32000": dict(BODY_1B, vocab_size=32000),
    "1B body, vocab 512": dict(BODY_1B, vocab_size=512),
    "6 Llama 2 7B layers, vocab 32000": dict(vocab_size=32000, dim=4096, n_layers=6, n_heads=32, n_kv_heads=32,
                                             ffn_dim=11008, batch=2, seq=4096),
}


def step_fns(cfg, batch: int, seq: int, dtype, which: tuple, fused: bool | None = True,
             device=torch.device("cpu")) -> dict:
    """The training steps compared, each with its own model and optimizer (the same weights, seed 0)
    on the same batch: "ours" and "transformers" (LlamaForCausalLM, as it loads by default: SDPA),
    each with torch's AdamW (fused, or None: torch's default); "trainer" (train.train_step: our
    AdamW in bf16_sr, or fp32, with clipping) and "bare step" (ours with torch's AdamW) on a packed
    batch (three documents a row). On a GPU the weights are drawn there (N(0, 0.02), norms 1):
    our seeded init draws a 1B model on the host for minutes, and a step's speed does not depend on them."""
    import transformers
    import hf as hf_io
    import model as llama
    import optim
    import parallel
    import train
    from configs import Config
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    doc_ids = (torch.arange(seq) * 3 // seq).expand(batch, seq)
    positions = torch.cat([torch.arange(n) for n in torch.bincount(doc_ids[0])]).expand(batch, seq)
    x, y, doc_ids, positions = (t.to(device) for t in (x, y, doc_ids, positions))
    scale = 1 / y.numel()       # told to the model's fused loss, as train.py does: in bf16 it scales in fp32
    fns = {}
    for name in which:
        if device.type == "cpu":
            ours = llama.Llama(cfg).init_weights(0).to(dtype)
        else:
            with torch.device(device), torch.no_grad():
                ours = llama.Llama(cfg).to(dtype)
                for p in ours.parameters():
                    p.fill_(1.0) if p.dim() == 1 else p.normal_(0, 0.02)
        if name == "ours":
            opt = torch.optim.AdamW(ours.parameters(), lr=1e-4, fused=fused)

            def step(m=ours, opt=opt):
                (m(x, targets=y, grad_scale=scale) * scale).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        elif name == "transformers":
            hf_cfg = transformers.LlamaConfig(**{k: v for k, v in hf_io.hf_config(cfg).items()
                                                 if k not in ("architectures", "model_type", "torch_dtype")})
            with torch.device(device):
                m = transformers.LlamaForCausalLM(hf_cfg).to(dtype)
            # a tied head is the embedding in transformers too (the export writes only the embedding)
            missing = m.load_state_dict(hf_io.to_hf_state_dict(ours.state_dict(), cfg), strict=False).missing_keys
            assert missing == (["lm_head.weight"] if cfg.tie_embeddings else []), missing
            assert (m.lm_head.weight is m.model.embed_tokens.weight) == cfg.tie_embeddings
            del ours
            opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=fused)

            def step(m=m, opt=opt):
                logits = m(input_ids=x).logits
                loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
                loss.div(y.numel()).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        elif name == "bare step":
            opt = torch.optim.AdamW(ours.parameters(), lr=1e-4, fused=fused)

            def step(m=ours, opt=opt):
                (m(x, positions, doc_ids, y, scale) * scale).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        else:                                                  # the trainer
            run = Config()
            run.model = cfg
            run.optim.precision = "fp32" if dtype == torch.float32 else "bf16_sr"
            opt = optim.build_optimizer(ours, run)
            b = {"tokens": x, "positions": positions, "doc_ids": doc_ids, "targets": y}

            def step(m=ours, opt=opt, run=run, b=b):
                train.train_step(m, opt, [b], parallel.Grid(), run)
        fns[name] = step
    return fns


def _shape(shape: dict):
    """(ModelConfig, batch, seq) of a STEP_SHAPES entry."""
    from configs import ModelConfig
    shape = dict(shape)
    batch, seq = shape.pop("batch"), shape.pop("seq")
    return ModelConfig(max_seq_len=seq, **shape), batch, seq


def peak_memory(shape: dict, name: str, dtype_name: str, threads: int) -> float:
    """Run in a fresh process: the peak resident bytes of two training steps of one model (its
    weights, gradients, optimizer state and the step's buffers) above the process's memory before
    the model was built; the building's own temporaries (the weights loaded into transformers)
    are left out by resetting the peak (Linux's clear_refs) once the step is ready. glibc's
    allocator maps every buffer above 64 KiB fresh and returns it on free, so that the resident
    peak is the peak of live buffers. Every one-time cost of the step's code is paid before the
    baseline, by one step of a tiny model of the same kind: its lazy imports (torch.optim's AdamW
    imports torch._dynamo when built, ~100 MiB resident that our AdamW never loads) and kernels' set-up."""
    import ctypes
    libc = ctypes.CDLL(None)
    libc.mallopt(-3, 65536)              # M_MMAP_THRESHOLD, fixed (no adaptive threshold)
    libc.mallopt(-1, 0)                  # M_TRIM_THRESHOLD
    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    tiny = dict(shape, vocab_size=64, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32, batch=2, seq=8)
    step_fns(*_shape(tiny), dtype, (name,))[name]()

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
    before = status("VmRSS:")
    fns = step_fns(*_shape(shape), dtype, (name,))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                     # VmHWM := VmRSS
    fns[name]()
    fns[name]()
    return status("VmHWM:") - before


def cuda_peak_memory(shape: dict, name: str, dtype_name: str, device) -> int:
    """peak_memory on a GPU, in this process: the caching allocator counts live tensors exactly, so
    the peak of two steps above what was allocated before the model was built (the building's own
    peak left out, as on the CPU) needs no fresh process."""
    import gc
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    fn = step_fns(*_shape(shape), getattr(torch, dtype_name), (name,), device=device)[name]
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del fn
    gc.collect()
    torch.cuda.empty_cache()
    return peak


def bench_step(args):
    """Issue 27's comparison on this machine: our training step against transformers'
    LlamaForCausalLM at each shape (same config, weights and batch; torch's AdamW on both; SDPA on
    both; the causal batch transformers gets), and the trainer (train.train_step) against the bare
    step. Rounds alternate over the steps compared, so that machine noise hits all alike; the speed
    is the median over rounds of the per-round ratio. Peak memory: each step alone (on the CPU in a
    fresh process, peak_memory; on a GPU cuda_peak_memory), the ratio of the two. On the CPU,
    STEP_SHAPES and --threads 1 (with two, per-round ratios scatter from 0.8x to 2.3x on this 2-core
    machine); the trainer pair runs at the body's 512 tokens and at --step_tokens (batch 4 x
    step_tokens / 4, default 4096): our AdamW costs the same per step whatever the batch, so its
    share of the step -- where the trainer and the bare step differ -- falls as the batch grows. On
    a GPU (--device auto finds one), GPU_SHAPES at full size and the trainer pair at the 1B body."""
    from hardware import measure_matmul_flops
    from model import flops_per_token
    rounds = args.steps or 5
    device = args.device
    gpu = device.type == "cuda"
    shapes = GPU_SHAPES if gpu else STEP_SHAPES
    small = shapes["1B body, vocab 512"]
    # The timed pair holds both steps at once, ~100 KiB a token each (peak_memory at 4096 and 16384 tokens, fp32):
    # at most this machine's memory over 256 KiB a token, else every other row runs first and then this one fails.
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    most = ram // (256 << 10) // small["batch"] * small["batch"]
    if not gpu and not (0 <= args.step_tokens <= most and args.step_tokens % small["batch"] == 0):   # (GPU: none)
        raise SystemExit(f"--step_tokens={args.step_tokens}: give a multiple of {small['batch']} up to {most} (the "
                         f"trainer and the bare step hold ~100 KiB a token each; this machine has {ram / 2**30:.0f} "
                         f"GiB), or 0 for the 512-token trainer rows only")
    bodies = [small] if gpu or not args.step_tokens else [small, dict(small, seq=args.step_tokens // small["batch"])]
    where = torch.cuda.get_device_name(device) if gpu else f"CPU, {torch.get_num_threads()} thread(s)"
    print(f"bench.py step: {args.dtype}, {where}, {rounds} rounds, torch {torch.__version__}")
    sync = (lambda: torch.cuda.synchronize(device)) if gpu else None
    # MFU on a GPU: against the matmul rate measured here (8192^3 in bf16), not a datasheet's
    peak = measure_matmul_flops(device, torch.bfloat16, ((8192, 8192, 8192),)) if gpu else None
    # The trainer in both precisions whatever --dtype: fp32 (our AdamW in fp32) and bf16 weights
    # (bf16_sr: software stochastic rounding; the bare step's fused AdamW rounds to nearest).
    pairs = ([(s, shapes[s], ("ours", "transformers"), args.dtype) for s in shapes]
             + [(f"1B body, vocab 512, {sh['batch']} x {sh['seq']} tokens", sh, ("trainer", "bare step"), d)
                for d in ("float32", "bfloat16") for sh in bodies])
    rows = []
    ctx = multiprocessing.get_context("spawn")
    for shape_name, shape, which, dtype_name in pairs:
        cfg, batch, seq = _shape(shape)
        mem = {}
        for n in which:                                  # each alone: before the timed pair is built
            if gpu:
                mem[n] = cuda_peak_memory(shape, n, dtype_name, device)
            else:
                with ctx.Pool(1) as pool:
                    mem[n] = pool.apply(peak_memory, (shape, n, dtype_name, args.threads))
        times = alternate(step_fns(cfg, batch, seq, getattr(torch, dtype_name), which, device=device), rounds,
                          sync=sync)
        a, b = which
        if which[0] == "trainer":
            name = f"{shape_name}, packed documents, {dtype_name}"
            a = "trainer (bf16_sr)" if dtype_name == "bfloat16" else a
            times[a], mem[a] = times.pop("trainer"), mem.pop("trainer")
        else:
            name = f"{shape_name}, {dtype_name}"
        speed, tokens = median_ratio(times[b], times[a]), batch * seq
        tok_a, tok_b = tokens / statistics.median(times[a]), tokens / statistics.median(times[b])
        mfu = (f"; MFU {tok_a * flops_per_token(cfg, seq) / peak:.0%} vs {tok_b * flops_per_token(cfg, seq) / peak:.0%}"
               if peak else "")
        rows.append((name, a, b, tok_a, tok_b, speed, min(times[b]) / min(times[a]), mem[a] / mem[b], mem[a], mem[b],
                     mfu))
        print(f"{name}: {a} {tok_a:,.0f} tok/s, {b} {tok_b:,.0f} tok/s: {speed:.2f}x (median of rounds; "
              f"best rounds {rows[-1][6]:.2f}x){mfu}; peak memory {mem[a] / 2**20:,.0f} vs {mem[b] / 2**20:,.0f} MiB: "
              f"{mem[a] / mem[b]:.2f}x", flush=True)
    print()
    if peak:
        print(f"MFU: the model's FLOPs (model.flops_per_token) over the measured 8192^3 bf16 matmul rate, "
              f"{peak / 1e12:.0f} TFLOP/s")
    table([f"shape ({where})", "compared", "tok/s", "speed (median; best rounds)", "peak memory"],
          [[name, f"{a} vs {b}", f"{ta:,.0f} vs {tb:,.0f}", f"{speed:.2f}x ({best:.2f}x)",
            f"{m:.2f}x ({ma / 2**30:,.1f} vs {mb / 2**30:,.1f} GiB)" if gpu else f"{m:.2f}x ({ma / 2**20:,.0f} vs {mb / 2**20:,.0f} MiB)"]
           for name, a, b, ta, tb, speed, best, m, ma, mb, _ in rows])
    return rows


def bench_train(args):
    """Our Llama against transformers' LlamaForCausalLM on the identical config, in this run:
    same weights, same batches, same torch.optim.AdamW; fp32 and bf16. Ours runs twice, with each
    attention (sdpa: torch's kernel; explicit: model.ExplicitAttention), with the fused head + loss
    that training uses; transformers as it loads by default (SDPA attention). Rounds rotate over
    the three so that machine noise hits all alike; each round gives a ratio to transformers, and
    the median over rounds is reported beside the ratio of the totals."""
    import model as llama
    from configs import ModelConfig
    from hardware import measure_matmul_flops
    no_page_fault_churn()
    cfg = ModelConfig(vocab_size=8000, dim=384, n_layers=6, n_heads=6, n_kv_heads=6, ffn_dim=1024, max_seq_len=256)
    batch, seq, rounds, steps_per_round = 8, 256, args.steps or 8, 2
    flops_step = llama.flops_per_token(cfg, seq) * batch * seq
    print(f"config: dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads} heads, ffn {cfg.ffn_dim}, vocab "
          f"{cfg.vocab_size}, seq {seq}, batch {batch}, {torch.get_num_threads()} threads; "
          f"{flops_step / 1e9:.1f} GFLOP per step; {rounds} rounds of {steps_per_round} steps")
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        fns = {f"ours ({a})": step_fns(dataclasses.replace(cfg, attention=a), batch, seq, dtype, ("ours",),
                                       fused=None)["ours"] for a in ("sdpa", "explicit")}
        fns.update(step_fns(cfg, batch, seq, dtype, ("transformers",), fused=None))
        times = alternate(fns, rounds, steps_per_round)
        peak = measure_matmul_flops(torch.device("cpu"), torch.bfloat16) / 1e9
        tok_s = {k: rounds * steps_per_round * batch * seq / sum(v) for k, v in times.items()}
        results[dtype] = tok_s
        name = str(dtype).removeprefix("torch.")
        print(f"{name}: transformers {tok_s['transformers']:,.0f} tok/s; measured bf16 matmul peak {peak:.0f} GFLOP/s")
        for k in ("ours (sdpa)", "ours (explicit)"):
            per_round = [h / o for h, o in zip(times["transformers"], times[k])]
            gflops = tok_s[k] * flops_step / (batch * seq) / 1e9
            print(f"  {k:<16} {tok_s[k]:7,.0f} tok/s | vs transformers {tok_s[k] / tok_s['transformers']:.2f}x "
                  f"(median of rounds {statistics.median(per_round):.2f}x, range {min(per_round):.2f}-"
                  f"{max(per_round):.2f}) | {gflops:.0f} GFLOP/s = {gflops / peak:.0%} of the bf16 matmul peak")
    return results
