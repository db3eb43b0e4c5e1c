"""The Llama 2 and 3 decoder: RMSNorm, RoPE (with Llama 3.1 scaling), grouped-query attention,
SwiGLU, and an embedding and head that are separate (Llama 2, Llama 3 8B) or tied (Llama 3.2).
It computes what transformers' LlamaForCausalLM computes (tests/test_model.py), with two choices
of HLAT's: coalesced projections (fewer, larger matmuls and TP collectives: `qkv_proj` rows are [q
heads of KV group 0 | k_0 | v_0 | q heads of group 1 | ...], so a contiguous TP shard holds whole
groups; `gate_up_proj` is [gate | up]) and scaled init (output projections at init_std / sqrt(2 *
n_layers): the blog's 7B diverged without it). Where autograd through plain ops is slow, the
backward is written out as a Function with the same numbers, tested against the plain version.
`doc_ids` [B, T] (packed sequences): a token attends only to earlier tokens of its own document.
docs/model.md has the measurements behind each choice.
"""
from __future__ import annotations

import functools
import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from configs import ModelConfig


class LinearFunction(torch.autograd.Function):
    """y = x @ W^T saving W itself, where F.linear's autograd saves the view W^T. On XLA a saved
    tensor is a graph output: with forward and backward in separate graphs (the pipeline) each
    microbatch kept a transposed copy of every weight (4.4 GB of a 70B first stage). NxD saves the
    weight the same way (parallel_layers/layers_utils.py, _linear_autograd_base_setup_fwd)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return F.linear(x, w)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad_x = grad.matmul(w) if ctx.needs_input_grad[0] else None
        grad_w = (grad.reshape(-1, grad.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))
                  if ctx.needs_input_grad[1] else None)
        return grad_x, grad_w


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T for every projection (parallel.py's too): eager devices keep F.linear (W^T is free)."""
    return LinearFunction.apply(x, w) if w.device.type == "xla" else F.linear(x, w)


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def reset_parameters(self):
        # nn.Linear's kaiming draw, which init_weights or a checkpoint replaces: on the meta device
        # (parallel.build_model) its shape check imported sympy (with to_empty: 0.65 s CPU of every rank's start-up)
        if not self.weight.is_meta:
            nn.Linear.reset_parameters(self)

    def forward(self, x):
        return linear(x, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # CUDA has a fused kernel; on CPU the Function is 1.4x (bf16) to 1.8x faster than autograd through
        # F.rms_norm (composite there); XLA fuses the Function's few ops.
        if x.is_cuda:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return RMSNormFunction.apply(x, self.weight, self.eps)


class RMSNormFunction(torch.autograd.Function):
    """F.rms_norm's numbers (statistics and product in fp32, rounded once), bit-equal, with the
    backward written out: dx = r * (g - xn * mean(g * xn)), g = dy * weight, xn = x * r."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.to(torch.float32, copy=True)
        r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)        # 1 / rms, fp32
        ctx.save_for_backward(x, r, weight)
        return (xf.mul_(r) * weight.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, r, weight = ctx.saved_tensors
        xn = x.to(torch.float32, copy=True).mul_(r)
        g = dy.float()
        dweight = (g * xn).flatten(0, -2).sum(0).to(weight.dtype)
        g = g * weight.float()
        dx = g.sub_(xn.mul_((g * xn).mean(-1, keepdim=True))).mul_(r)
        return dx.to(dy.dtype), dweight, None


def rope_frequencies(cfg: ModelConfig, device=None) -> torch.Tensor:
    """theta^(-2i / head_dim); "llama3" scaling divides the long wavelengths' frequencies by
    `factor` and blends in between (transformers' _compute_llama3_parameters)."""
    hd = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, device=device).float() / hd))
    if cfg.rope_scaling == "llama3":
        ctx, lo, hi = cfg.rope_original_max_len, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = ((ctx / wavelen - lo) / (hi - lo)).clamp(0, 1)     # 0: long waves (scaled), 1: short (kept)
        inv_freq = (1 - smooth) * inv_freq / cfg.rope_factor + smooth * inv_freq
    return inv_freq


def rope_cos_sin(positions: torch.Tensor, cfg: ModelConfig, dtype: torch.dtype):
    """Integer positions [B, T] -> cos and sin, each [B, 1, T, head_dim] (rotate-half layout)."""
    angles = positions.float()[..., None] * rope_frequencies(cfg, positions.device)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]


class RoPE(torch.autograd.Function):
    """x * cos + rotate_half(x) * sin (HF Llama's RoPE) with in-place half-width updates; the
    rotation is orthogonal, so the backward rotates by the opposite angle."""

    @staticmethod
    def rotate(x, cos, sin, direction: float):
        h = x.shape[-1] // 2
        out = torch.mul(x, cos, out=torch.empty(x.shape, dtype=x.dtype, device=x.device))   # contiguous
        out[..., :h].addcmul_(x[..., h:], sin[..., :h], value=-direction)
        out[..., h:].addcmul_(x[..., :h], sin[..., h:], value=direction)
        return out

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return RoPE.rotate(x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return RoPE.rotate(grad, cos, sin, -1.0), None, None


def recompute(fn, *args):
    """fn(*args) with its activations recomputed in backward instead of kept (activation
    checkpointing: `model.checkpointing` full = each block, selective = the attention core)."""
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)


checkpoint = recompute      # its name before issue 29 (it sat next to checkpoint.py), kept for forks


def use_xla_checkpointing(model: nn.Module) -> None:
    """Swap every `recompute_fn` for torch-xla's checkpoint, whose optimization barrier keeps XLA
    from merging the recomputation with the forward (and so keeping the activations after all)."""
    from torch_xla.utils.checkpoint import checkpoint as xla_checkpoint
    for m in model.modules():
        if hasattr(m, "recompute_fn"):
            m.recompute_fn = xla_checkpoint


# A masked score on XLA and in the explicit attention: finite, as NxD's CoreAttention. Its softmax
# weight is still 0, but no inf sits in a tensor (neuronx-cc may lower a transpose as a matmul by
# the identity: inf * 0 = NaN, aws-neuron-sdk #593). SDPA's masks fill -inf, so XLA gets this bias.
MASK_VALUE = -10000.0


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] document ids -> bool [B, 1, T, T]: True where query i may see key j (j <= i, same document)."""
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
    return (same_doc & causal)[:, None]


def attention_mask(doc_ids: torch.Tensor | None, explicit: bool):
    """What every layer's attention_core reads, built once a forward: None for a causal batch (SDPA's
    causal kernel), on CUDA a FlexAttention BlockMask (it skips blocks no query sees), else document_mask."""
    if doc_ids is None:
        return None
    if doc_ids.is_cuda and not explicit:
        return document_block_mask(doc_ids)
    return document_mask(doc_ids)


def document_block_mask(doc_ids: torch.Tensor):
    from torch.nn.attention.flex_attention import create_block_mask
    B, T = doc_ids.shape

    def same_doc_causal(b, h, q, kv):
        return (kv <= q) & (doc_ids[b, q] == doc_ids[b, kv])
    return create_block_mask(same_doc_causal, B, None, T, T, device=doc_ids.device)


@functools.cache
def compiled_flex_attention():
    """torch's FlexAttention, compiled once (uncompiled it runs a dense reference: the tests' CPU path)."""
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


def attention_core(q, k, v, mask, explicit: bool = False):
    """Softmax attention of q [B, H, T, hd] over k, v [B, KV, T, hd] (what selective checkpointing
    recomputes); mask from attention_mask. torch's kernels read each KV head in place for its query
    heads (enable_gqa: 1.23x faster on CPU than repeating it); the explicit path and XLA repeat it."""
    gqa = q.shape[1] != k.shape[1]
    if explicit or q.device.type == "xla":
        if gqa:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if mask is None:
            T = q.shape[-2]
            mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        if explicit:
            return ExplicitAttention.apply(q, k, v, mask)
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, MASK_VALUE)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if not isinstance(mask, torch.Tensor):          # a BlockMask
        from torch.nn.attention.flex_attention import flex_attention
        flex = compiled_flex_attention() if q.is_cuda else flex_attention
        return flex(q, k, v, block_mask=mask, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def softmax_fp32(s: torch.Tensor) -> torch.Tensor:
    """Softmax in fp32, rounded once to s's dtype: torch's CPU kernel does that for bf16 itself
    (bit-equal, tests/test_model.py); XLA reduces bf16 in bf16, so elsewhere it is written out."""
    if s.device.type == "cpu":
        return torch.softmax(s, dim=-1)
    return torch.softmax(s, dim=-1, dtype=torch.float32).to(s.dtype)


def softmax_fp32_backward(dp: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """p * (dp - rowsum(dp * p)) in fp32, rounded once."""
    if p.device.type == "cpu":
        return torch._softmax_backward_data(dp, p, -1, p.dtype)
    pf = p.float()
    return (pf * (dp.float() - (dp.float() * pf).sum(-1, keepdim=True))).to(p.dtype)


class ExplicitAttention(torch.autograd.Function):
    """softmax(q k^T / sqrt(hd), masked) v as NxD's CoreAttention computes it on trn1: matmuls in
    the input dtype, softmax in fp32, the probabilities saved and the backward written out (no fp32
    copies kept). Queries go in blocks that see only the keys up to their own end (causality masks
    the rest): at least QUERY_BLOCK queries, at most MAX_BLOCKS blocks, since each block is unrolled
    into the XLA graph (seq 4096: 8 blocks compile in 43 s, 32 in 225 s, for 9% more matmul work)."""
    QUERY_BLOCK = 128
    MAX_BLOCKS = 8

    @staticmethod
    def block(T: int) -> int:
        return max(ExplicitAttention.QUERY_BLOCK, -(-T // ExplicitAttention.MAX_BLOCKS))

    @staticmethod
    def forward(ctx, q, k, v, mask):
        B, H, T, hd = q.shape
        q, k, v = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)          # [B*H, T, hd]
        masked = ~(mask.expand(B, H, T, T).reshape(B * H, T, T) if mask.dim() == 4 else mask.expand(B * H, T, T))
        out, probs = torch.empty_like(q), []
        qb = ExplicitAttention.block(T)
        for s in range(0, T, qb):
            e = min(T, s + qb)                                     # queries [s, e) see keys [0, e)
            scores = torch.bmm(q[:, s:e], k[:, :e].transpose(1, 2)).mul_(hd ** -0.5)
            p = softmax_fp32(scores.masked_fill_(masked[:, s:e, :e], MASK_VALUE))
            torch.bmm(p, v[:, :e], out=out[:, s:e])
            probs.append(p)
        ctx.save_for_backward(q, k, v, *probs)
        return out.view(B, H, T, hd)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, *probs = ctx.saved_tensors
        shape, scale = dout.shape, q.shape[-1] ** -0.5
        dout = dout.flatten(0, 1)
        dq = torch.empty_like(q)
        # The last block sees every key: it starts dk and dv, the earlier blocks add to their prefix.
        for i in reversed(range(len(probs))):
            p = probs[i]
            s = i * ExplicitAttention.block(q.shape[1])
            e = s + p.shape[1]
            do = dout[:, s:e]
            ds = softmax_fp32_backward(torch.bmm(do, v[:, :e].transpose(1, 2)), p)
            torch.bmm(ds, k[:, :e], out=dq[:, s:e]).mul_(scale)
            if i == len(probs) - 1:
                dv, dk = torch.bmm(p.transpose(1, 2), do), torch.bmm(ds.transpose(1, 2), q[:, s:e]).mul_(scale)
            else:
                dv[:, :e].baddbmm_(p.transpose(1, 2), do)
                dk[:, :e].baddbmm_(ds.transpose(1, 2), q[:, s:e], alpha=scale)
        return dq.view(shape), dk.view(shape), dv.view(shape), None


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # The head counts this module holds: tensor parallelism lowers them to the rank's share.
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.qkv_proj = Linear(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim)
        self.o_proj = Linear(cfg.n_heads * cfg.head_dim, cfg.dim)
        self.selective = cfg.checkpointing == "selective"
        self.explicit = cfg.attention == "explicit"
        self.recompute_fn = recompute

    def forward(self, x, cos, sin, mask):
        qkv = self.qkv_proj(x)
        B, T, _ = qkv.shape          # T is the full sequence even when x is a sequence shard (SP)
        rep = self.n_heads // self.n_kv_heads
        # One split, so backward joins the three gradients with one cat.
        q, k, v = qkv.view(B, T, self.n_kv_heads, rep + 2, self.head_dim).split([rep, 1, 1], dim=3)
        q = q.reshape(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k, v = k.squeeze(3).transpose(1, 2), v.squeeze(3).transpose(1, 2)    # [B, n_kv, T, hd]
        q, k = RoPE.apply(q, cos, sin), RoPE.apply(k, cos, sin)
        if self.selective and torch.is_grad_enabled():
            y = self.recompute_fn(attention_core, q, k, v, mask, self.explicit)
        else:
            y = attention_core(q, k, v, mask, self.explicit)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.dim, 2 * cfg.ffn_dim)
        self.down_proj = Linear(cfg.ffn_dim, cfg.dim)

    def forward(self, x):
        return self.down_proj(SwiGLU.apply(self.gate_up_proj(x)))


class SwiGLU(torch.autograd.Function):
    """silu(gate) * up of [gate | up], bit-equal to autograd through chunk, silu and mul, with both
    halves' gradients written into one buffer, not joined by a cat (a copy of the block's largest activation)."""

    @staticmethod
    def forward(ctx, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        s = F.silu(gate)
        ctx.save_for_backward(gate_up, s)
        return s * up

    @staticmethod
    def backward(ctx, dy):
        gate_up, s = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        d = torch.empty(gate_up.shape, dtype=dy.dtype, device=dy.device)
        dgate, dup = d.chunk(2, dim=-1)
        torch.mul(dy, s, out=dup)                                   # d/d(up) = dy * silu(gate)
        torch.ops.aten.silu_backward.grad_input(torch.mul(dy, up, out=dgate), gate, grad_input=dgate)
        return d


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))


def run_layers(model: nn.Module, layers, x, positions, doc_ids=None):
    """x through the decoder layers (all of Llama's, or a pipeline stage's): RoPE and the mask once;
    under full checkpointing each layer recomputed in the backward, by model.recompute_fn."""
    cos, sin = rope_cos_sin(positions, model.cfg, x.dtype)
    mask = attention_mask(doc_ids, model.cfg.attention == "explicit")
    full = model.cfg.checkpointing == "full" and torch.is_grad_enabled()
    for layer in layers:
        x = model.recompute_fn(layer, x, cos, sin, mask) if full else layer(x, cos, sin, mask)
    return x


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # nn.Embedding draws N(0, 1) rows that init_weights or a checkpoint replaces; on the meta device
        # (parallel.build_model) that draw alone imported torch._dynamo, ~1.5 s CPU of every rank's start-up
        meta = torch.get_default_device().type == "meta"
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim, _weight=torch.empty(cfg.vocab_size, cfg.dim) if meta else None)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = LMHead(cfg.dim, cfg.vocab_size)
        if cfg.tie_embeddings:           # Llama 3.2 1B/3B: the head is the embedding matrix itself
            self.lm_head.weight = self.embed.weight
        self.recompute_fn = recompute

    def forward(self, tokens, positions=None, doc_ids=None, targets=None, grad_scale=None):
        """tokens [B, T] -> logits [B, T, vocab] (the rank's vocab shard under TP), or with targets
        the sum of their cross-entropies (fp32; -100 ignored), without building the logits (TP builds its shard's).
        grad_scale: what the caller will multiply that sum by before backward (LinearCrossEntropy)."""
        B, T = tokens.shape
        if positions is None:
            positions = torch.arange(T, device=tokens.device).expand(B, T)
        x = run_layers(self, self.layers, self.embed(tokens), positions, doc_ids)
        if targets is not None:
            return self.lm_head.loss_sum(self.norm(x), targets, grad_scale)
        return self.lm_head(self.norm(x))

    def init_weights(self, seed: int):
        """Every parameter from (seed, its name) alone: any sharding of the model holds the same weights."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(init_param(name, tuple(p.shape), self.cfg, seed))
        return self

    @torch.no_grad()
    def generate(self, tokens, max_new_tokens: int, temperature: float = 0.8, top_k: int = 50,
                 eos_id: int | None = None):
        """Sample continuations of tokens [B, T], the whole context recomputed per token (no KV cache).
        eos_id: as transformers' generate with it as eos and pad, a row that sampled it goes on with
        it, and sampling ends once every row has."""
        done = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
        for _ in range(max_new_tokens):
            context = tokens[:, -self.cfg.max_seq_len:]
            logits = self(context)[:, -1, :].float() / max(temperature, 1e-5)
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1)
            if eos_id is not None:
                nxt = nxt.masked_fill(done[:, None], eos_id)
                done |= nxt[:, 0] == eos_id
            tokens = torch.cat((tokens, nxt), dim=1)
            if done.all():
                break
        return tokens


def param_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """The full model's state-dict names (embed and lm_head both when tied) and shapes, nothing allocated."""
    with torch.device("meta"):
        return {n: tuple(p.shape) for n, p in Llama(cfg).state_dict().items()}


def _init_stream(name: str, cfg: ModelConfig, seed: int) -> tuple[torch.Generator, float]:
    if cfg.tie_embeddings and name == "lm_head.weight":
        name = "embed.weight"        # tied: a pipeline's last stage holds a copy of the embedding
    std = cfg.init_std
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        std = cfg.init_std / math.sqrt(2.0 * cfg.n_layers)      # scaled init (the blog, HLAT)
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode())), std


def init_param(name: str, shape: tuple, cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The full-shape initial value of one parameter, from its name and the seed only."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    g, std = _init_stream(name, cfg, seed)
    return torch.randn(shape, generator=g) * std


def init_param_part(name: str, shape: tuple, cfg: ModelConfig, seed: int, rows: torch.Tensor | None = None,
                    cols: slice | None = None, chunk: int = 1 << 22) -> torch.Tensor:
    """init_param(...)[rows][:, cols], bit for bit, holding one chunk of the full tensor at a time: a
    TP rank's shard of the 128256 x 4096 embedding costs its rows, not 2 GiB on each of 32 ranks.
    rows: full-tensor rows (-1: a zero padding row; None: all). It walks the generator's stream as
    ATen's normal_fill draws it (blocks of 16 uniforms; an n % 16 tail redrawn at the end): chunks
    of whole rows on 16-element boundaries, drawn with randn where wanted, else skipped by drawing
    as many uniforms (mt19937 cannot jump, so the time stays that of the whole tensor)."""
    if len(shape) == 1 or name.endswith("norm.weight"):     # norm weights: replicated, never cut
        return init_param(name, shape, cfg, seed)
    (R, C), every = shape, slice(None)
    cols = cols or every
    if R * C <= chunk:
        full = init_param(name, shape, cfg, seed)
        return (full if rows is None else torch.where((rows >= 0)[:, None], full[rows.clamp(min=0)], 0.0))[:, cols]
    g, std = _init_stream(name, cfg, seed)
    n, step = R * C, 16 // math.gcd(16, C)               # rows per 16-element boundary
    k = max(step, chunk // C // step * step)              # rows per chunk
    body = n - n % 16                                     # the elements normal_fill makes in whole blocks
    rows = torch.arange(R) if rows is None else rows
    out = torch.zeros(len(rows), len(range(*cols.indices(C))))
    r0 = 0
    while r0 < R:
        r1 = R if R - r0 < 2 * k else r0 + k              # the last chunk takes the rest (>= 16 elements)
        lo, hi = r0 * C, min(r1 * C, body)
        wanted = ((rows >= r0) & (rows < r1)).nonzero().flatten()
        if len(wanted) == 0:
            if r1 < R:
                torch.empty(hi - lo).uniform_(generator=g)  # keep the stream's place
        else:
            vals = torch.empty((r1 - r0) * C)
            vals[:hi - lo] = torch.randn(hi - lo, generator=g)
            if r1 == R and n % 16:                    # normal_fill: the last n % 16 uniforms are drawn,
                torch.empty(n % 16).uniform_(generator=g)  # then the last 16 values redrawn from 16 more
                vals[-16:] = torch.randn(16, generator=g)
            out[wanted] = (vals.view(r1 - r0, C)[rows[wanted] - r0] * std)[:, cols]
        r0 = r1
    return out


class LMHead(nn.Linear):
    """The output projection; loss_sum fuses it with the cross entropy (LinearCrossEntropy)."""

    def __init__(self, dim: int, vocab_size: int):
        super().__init__(dim, vocab_size, bias=False)

    reset_parameters = Linear.reset_parameters

    def loss_sum(self, h: torch.Tensor, targets: torch.Tensor, grad_scale=None) -> torch.Tensor:
        return LinearCrossEntropy.apply(h.flatten(0, -2), self.weight, targets.flatten(), torch.is_grad_enabled(),
                                        grad_scale)


class LinearCrossEntropy(torch.autograd.Function):
    """Sum of cross_entropy(h @ W^T, targets) in chunks of rows, each chunk's gradients computed in
    the forward while its logits are at hand (Liger-Kernel's, torchtune's chunked loss): the
    [tokens, vocab] fp32 logits never exist whole (1.5 GiB per 1024 tokens at 128k, three times over).
    The caller divides by the global batch's valid tokens (torchtitan), so every layout agrees.
    Matmuls in the weights' dtype, log-softmax and softmax - one_hot in fp32. In bf16 the chunks' weight
    gradients add up in fp32 past three (Liger-Kernel's accum_dtype=float32, as its no-out_dtype fallback):
    a bf16 running sum's error grows with the chunks (vs fp64: 1.43x transformers' one matmul at 8, 1.84x at
    16; in fp32 1.13x), but rounds less at two and three (1.06x, 1.09x; in fp32 1.12x, 1.11x).
    grad_scale (train: dp / global valid tokens) is applied to softmax - one_hot in fp32, before
    its one rounding to bf16, as the plain path applies it: scaling the bf16 gradients in the
    backward rounds them a second time (1.6x the plain path's error at a scale like 1/1751). The
    backward multiplies by grad / grad_scale, exactly 1 when the caller scales the loss as it said.
    In fp32 the backward's scaling costs one ulp, less than the forward's extra pass over the chunk's
    logits (about 2% of the fp32 loss at vocab 32000, 4% in bf16): there it stays in the backward."""

    @staticmethod
    def chunk_rows(n_rows: int, vocab: int, dim: int) -> int:
        """max(dim, 2^22 / vocab) rows, balanced: the chunk's logits cost no more than the weight
        gradient, and few chunks (each passes over it, and is unrolled into an XLA graph)."""
        rows = min(n_rows, max(dim, (1 << 22) // vocab, 1))
        chunks = -(-n_rows // rows)
        return -(-n_rows // chunks)

    @staticmethod
    def forward(ctx, h, w, targets, grad_enabled: bool = True, grad_scale=None):
        # grad_enabled: the caller's grad mode (a Function's forward always runs without grad, and its
        # needs_input_grad stays True under no_grad): evaluation skips the gradients and their buffers.
        want_grad = grad_enabled and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
        ctx.grad_scale = grad_scale if h.dtype != torch.float32 else None      # applied here, not in backward
        rows = LinearCrossEntropy.chunk_rows(h.shape[0], w.shape[0], w.shape[1])
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        gh = torch.empty_like(h) if want_grad else None
        gw = torch.empty_like(w) if want_grad else None
        acc = (torch.zeros_like(w, dtype=torch.float32) if want_grad and w.dtype != torch.float32 and 3 * rows < len(h)
               else None)
        for i in range(0, h.shape[0], rows):
            hc, t = h[i:i + rows], targets[i:i + rows]
            valid = t != -100
            t = t.masked_fill(~valid, 0)[:, None]
            logits = hc @ w.t()
            if logits.device.type == "cpu":
                # CPU's log-softmax reads a row whole before writing it: in place, bit-equal (its
                # dtype=float32 converts bf16 first there too, into one more [rows, vocab] buffer)
                logits = logits.float()
                logp = torch.ops.aten._log_softmax.out(logits, -1, False, out=logits)
            else:
                logp = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
            del logits
            total -= (logp.gather(1, t).squeeze(1) * valid).sum()
            if want_grad:        # d(sum of losses)/d(logits) = softmax - one_hot(target)
                g = logp.exp_().scatter_add_(1, t, torch.full(t.shape, -1.0, device=t.device))
                if ctx.grad_scale is not None:  # in fp32 (mul with a bf16 out= is 4x slower on CPU)
                    g.mul_(ctx.grad_scale)
                g = g.to(h.dtype)
                del logp
                keep = valid[:, None].to(h.dtype)      # ignored rows: masked on the [rows, dim] side
                torch.mm(g, w, out=gh[i:i + rows]).mul_(keep)
                if acc is not None:                    # 16-bit, over three chunks: the sum in fp32
                    acc += torch.mm(g.t(), hc * keep, out=gw)
                elif i == 0:                           # the first chunk writes, the others add
                    torch.mm(g.t(), hc * keep, out=gw)
                else:
                    gw.addmm_(g.t(), hc * keep)
        if acc is not None:
            gw.copy_(acc)
        ctx.save_for_backward(gh, gw)
        return total

    @staticmethod
    def backward(ctx, grad):
        gh, gw = ctx.saved_tensors
        if ctx.grad_scale is not None:
            grad = grad / ctx.grad_scale
        return gh.mul_(grad.to(gh.dtype)), gw.mul_(grad.to(gw.dtype)), None, None, None


def num_params(cfg: ModelConfig, embeddings: bool = True) -> int:
    """embeddings=False: without the embedding table, a lookup, not a matmul (the head stays)."""
    d, L, f, v = cfg.dim, cfg.n_layers, cfg.ffn_dim, cfg.vocab_size
    qkv = d * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    per_layer = qkv + cfg.n_heads * cfg.head_dim * d + 3 * d * f + 2 * d
    heads = 1 if cfg.tie_embeddings else 2
    return L * per_layer + d + (heads * v * d if embeddings else v * d)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 per matmul weight, plus causal attention's 6 * n_layers * seq_len *
    n_heads * head_dim (the scores' width: dim unless config.json gives another head_dim)."""
    matmul_weights = num_params(cfg, embeddings=False) - (2 * cfg.n_layers + 1) * cfg.dim   # minus norms
    return 6 * matmul_weights + 6 * cfg.n_layers * seq_len * cfg.n_heads * cfg.head_dim
