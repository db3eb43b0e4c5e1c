"""The Llama 2 and 3 decoder: RMSNorm, RoPE (Llama 3.1 scaling), grouped-query attention, SwiGLU,
an embedding and head that are separate (Llama 2, Llama 3 8B) or tied (Llama 3.2 1B and 3B).

Two choices from the HLAT/blog setup shape this file:
- Coalesced projections. q, k and v share one `qkv_proj`, gate and up share one `gate_up_proj`
  (the blog: fewer, larger matmuls and fewer TP/SP collectives). Rows of `qkv_proj` are laid out
  per KV group: [q heads of group 0 | k_0 | v_0 | q heads of group 1 | k_1 | v_1 | ...], so a
  contiguous column-parallel shard holds whole heads and whole KV groups (torchtitan's GQA lesson).
  `gate_up_proj` is [gate | up]; tensor parallelism re-lays it per rank as [gate shard | up shard].
- Scaled init. The attention and MLP output projections start with std init_std / sqrt(2 * n_layers):
  without it the blog's 7B loss diverged after 22k steps.

Everything else follows Hugging Face's LlamaForCausalLM exactly (rotate-half RoPE, RMSNorm in fp32),
so hf.py converts weights by reshaping only, and the tests compare logits and every training
gradient to 1e-5.

Where autograd through plain torch ops is slow and the device has no fused kernel, the backward is
written out as an autograd Function with the same numbers: RMSNorm (CUDA uses torch's fused
rms_norm), RoPE, SwiGLU (one gradient buffer for gate and up), the explicit attention (`attention="explicit"`, NxD's core attention: bf16
matmuls, fp32 softmax; the default is torch's SDPA: its causal kernel for a causal batch,
FlexAttention for packed documents on CUDA), and the head fused with the loss, which never builds
the [tokens, vocab] fp32 logits. Each is tested against the plain version.

Packed sequences: `doc_ids` [B, T] marks which document each token belongs to. A token attends
only to earlier tokens of its own document, and `positions` restart at 0 at each document.
"""
from __future__ import annotations

import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from configs import ModelConfig


class LinearFunction(torch.autograd.Function):
    """y = x @ W^T saving x and W itself for backward, where F.linear's autograd saves the view W^T.
    On XLA a saved tensor is an output of the graph that made it, so where forward and backward
    are separate graphs (the pipeline: pipeline.py cuts after every forward, as NxD does) each
    forward graph wrote a transposed copy of every weight of the stage, kept until that
    microbatch's backward: up to PP copies of the stage's weights on the first stage under 1F1B
    (70B at TP=32 PP=8 in bf16: 0.55 GB a copy, 4.4 GB of a 16 GB NeuronCore). The copies also
    made the second step's forward and backward graphs differ from the first step's (one more
    compile of each; scripts/pp_graphs.py). W is on the device already: saving it costs nothing.
    NxD's layers save the weight the same way (LinearWithAsyncCommunication in
    neuronx_distributed/parallel_layers/layers.py, through layers_utils.py's
    _linear_autograd_base_setup_fwd: ctx.save_for_backward(input, weight)). The same products as
    F.linear's autograd; eager devices keep F.linear (W^T is a free view there): see `linear`."""

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
    """x @ w^T for every projection of the model (and parallel.py's TP layers): LinearFunction on
    XLA (lazy tensors: see there), F.linear elsewhere."""
    return LinearFunction.apply(x, w) if w.device.type == "xla" else F.linear(x, w)


class Linear(nn.Linear):
    """nn.Linear without bias, through `linear`."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x):
        return linear(x, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # CUDA: torch's fused kernel (one pass forward, one backward; the Function below was 11% of
        # an H100's step at the 7B layer shape). CPU: the Function, 1.77x (fp32) and 1.39x (bf16)
        # faster than autograd through F.rms_norm, which is composite there (1 thread, 512x256).
        # XLA: the Function, whose few ops XLA fuses either way (not measured on trn1).
        if x.is_cuda:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return RMSNormFunction.apply(x, self.weight, self.eps)


class RMSNormFunction(torch.autograd.Function):
    """x / rms(x) * weight with the statistics and the product in fp32, rounded once to x's dtype:
    the numbers of torch's F.rms_norm (bit-equal, tests/test_model.py). Its backward is written out,
    dx = r * (g - xn * mean(g * xn)) with g = dy * weight, xn = x * r: five passes over the
    activations where autograd through F.rms_norm's eight ops takes twelve (1.6x faster here)."""

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
    """The [head_dim / 2] rotary frequencies theta^(-2i / head_dim). rope_scaling "llama3" (Llama 3.1
    and later) divides the low frequencies, whose wavelength exceeds the original context divided
    by low_freq_factor, by `factor`, keeps those shorter than context / high_freq_factor, and blends
    in between: transformers' _compute_llama3_parameters, which the tests match to 1e-5."""
    hd = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, device=device).float() / hd))
    if cfg.rope_scaling == "llama3":
        ctx, lo, hi, factor = cfg.rope_original_max_len, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = ((ctx / wavelen - lo) / (hi - lo)).clamp(0, 1)     # 0: long waves (scaled), 1: short (kept)
        inv_freq = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return inv_freq


def rope_cos_sin(positions: torch.Tensor, cfg: ModelConfig, dtype: torch.dtype):
    """cos and sin of the rotary angles for integer positions [B, T] -> two [B, 1, T, head_dim]."""
    angles = positions.float()[..., None] * rope_frequencies(cfg, positions.device)   # [B, T, head_dim/2]
    angles = torch.cat((angles, angles), dim=-1)              # rotate-half layout, as in HF Llama
    return angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]


def apply_rope(x, cos, sin):
    """Rotate-half RoPE, x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1] (HF Llama)."""
    return RoPE.apply(x, cos, sin)


class RoPE(torch.autograd.Function):
    """apply_rope with half-width in-place updates instead of neg, cat and a second product. The
    rotation is orthogonal, so the backward is the rotation by the opposite angle."""

    @staticmethod
    def rotate(x, cos, sin, direction: float):
        h = x.shape[-1] // 2
        out = torch.mul(x, cos, out=torch.empty(x.shape, dtype=x.dtype, device=x.device))   # contiguous [B, H, T, hd]
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


def checkpoint(fn, *args):
    """fn(*args), its activations recomputed in backward instead of saved: torch's non-reentrant
    checkpoint. The default `checkpoint_fn` of Llama (full: each block) and Attention (selective:
    the attention core); use_xla_checkpointing swaps in torch-xla's on an XLA device."""
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)


def use_xla_checkpointing(model: nn.Module) -> None:
    """Activation checkpointing for a model on an XLA device: torch_xla.utils.checkpoint.checkpoint,
    torch's reentrant version (it has no other) plus an optimization barrier on the inputs of the
    recomputation. Without the barrier XLA merges the recomputed forward with the original one, and
    the activations are kept after all. Device code calls this; the model itself never asks."""
    from torch_xla.utils.checkpoint import checkpoint as xla_checkpoint
    for m in model.modules():
        if hasattr(m, "checkpoint_fn"):
            m.checkpoint_fn = xla_checkpoint


# What a masked attention score becomes on XLA and in the explicit attention: finite, as NxD's Llama
# (CoreAttention in examples/training/llama/modeling_llama_nxd.py masks the scores with -10000.0
# after the matmul). Its softmax weight is still exactly 0 (exp(-10000) underflows in fp32), but no
# infinity ever sits in a tensor: on trn1 neuronx-cc may lower a transpose as a matmul with the
# identity, and inf * 0 is NaN (hence its --enable-saturate-infinity; aws-neuron-sdk #593: NaNs
# from -inf masks). SDPA's is_causal and a boolean mask would fill -inf inside its math path (the
# one XLA runs), so on XLA the mask is always this finite additive bias, causal batches included.
MASK_VALUE = -10000.0


def attention_mask(doc_ids: torch.Tensor | None, explicit: bool):
    """What every layer's attention_core reads, built once per forward. None: a causal-only batch
    (no doc_ids), which SDPA runs with its causal kernel and no mask in memory. With documents: on
    CUDA (SDPA path) a FlexAttention BlockMask, whose kernel skips the blocks no query of a block
    may see (most of them, in a batch of short documents); elsewhere the boolean [B, 1, T, T]
    document_mask, which CPU's SDPA kernel reads directly and XLA and the explicit path turn into
    finite scores."""
    if doc_ids is None:
        return None
    if doc_ids.is_cuda and not explicit:
        return document_block_mask(doc_ids)
    return document_mask(doc_ids)


def document_block_mask(doc_ids: torch.Tensor):
    """document_mask as a FlexAttention BlockMask: which (query block, key block) pairs hold any
    allowed score, and the rule inside them (causal and the same document)."""
    from torch.nn.attention.flex_attention import create_block_mask
    B, T = doc_ids.shape

    def same_doc_causal(b, h, q, kv):
        return (kv <= q) & (doc_ids[b, q] == doc_ids[b, kv])
    return create_block_mask(same_doc_causal, B, None, T, T, device=doc_ids.device)


_compiled_flex = None


def flex_attention(q, k, v, block_mask, gqa: bool = False):
    """torch's FlexAttention, compiled once (uncompiled it runs a dense reference implementation)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention as flex
    if q.device.type != "cuda":
        return flex(q, k, v, block_mask=block_mask, enable_gqa=gqa)   # the tests: same numbers, dense and slow
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex, dynamic=False)
    return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=gqa)


def attention_core(q, k, v, mask, explicit: bool = False):
    """Softmax attention of q [B, H, T, hd] over k, v [B, KV, T, hd]; the part selective
    checkpointing recomputes. GQA: query head h reads KV head h // (H / KV). torch's kernels read
    the KV heads in place (enable_gqa); the explicit path and XLA repeat each one over its group
    first. Not repeating halves the attention's copies: SDPA forward and backward 1.23x faster on
    CPU (fp32, 4 heads over 1 KV head, 128 tokens, 1 thread), outputs and dq bit-equal.
    mask: from attention_mask: None for causal, a boolean [B, 1, T, T] (True where a query may
    attend a key) or a FlexAttention BlockMask (CUDA)."""
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
    if not isinstance(mask, torch.Tensor):
        return flex_attention(q, k, v, mask, gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def softmax_fp32(s: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim, computed in fp32 and rounded once to s's dtype. torch's CPU
    kernel does exactly that for bf16 input (bit-equal, tests/test_model.py) at half the memory
    traffic of an fp32 copy. XLA reduces bf16 in bf16, so elsewhere the upcast is written out."""
    if s.device.type == "cpu":
        return torch.softmax(s, dim=-1)
    return torch.softmax(s, dim=-1, dtype=torch.float32).to(s.dtype)


def softmax_fp32_backward(dp: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The gradient through softmax_fp32, p * (dp - rowsum(dp * p)), in fp32, rounded once."""
    if p.device.type == "cpu":
        return torch._softmax_backward_data(dp, p, -1, p.dtype)
    pf = p.float()
    return (pf * (dp.float() - (dp.float() * pf).sum(-1, keepdim=True))).to(p.dtype)


class ExplicitAttention(torch.autograd.Function):
    """softmax(q k^T / sqrt(hd), masked) v as NxD's CoreAttention computes it for Llama on trn1:
    score and value matmuls in the input dtype (bf16 on the TensorEngine), softmax in fp32. The
    probabilities are saved and the backward is written out (dS = P * (dP - rowsum(dP * P))), so
    autograd stores no fp32 copies. Queries go in blocks of QUERY_BLOCK: a block attends only to
    the keys up to its own end, since causality masks the rest, which skips a quarter of the score
    matmuls and probabilities at two blocks and nearly half at many. Against SDPA: on XLA, SDPA is
    the math path with bf16 upcast to fp32 matmuls; on CPU at 256 tokens the whole training step
    of bench.py train is 1.27x faster with this than with the flash kernel in bf16, and no slower
    in fp32. Its cost: the probabilities, about half of [B, H, T, T] per layer, which selective
    checkpointing recomputes instead of keeping.
    How many blocks (issue 26): each is unrolled into the graph, forward and backward. One head at
    seq 4096 on XLA:CPU (attention forward + backward alone, bf16): 32 blocks of 128 queries are
    4293 HLO instructions and 225 s of compile, 8 blocks of 512 are 1221 and 43 s, 1 block 288
    and 6 s (one run, machine shared). Causality skips (n-1)/2n of the scores at n blocks: 48% at
    32, 44% at 8, so 8 blocks cost 9% more attention matmul work than 32 (about 1% of a 7B step
    at 4096) for a quarter of the graph. So: blocks of at least QUERY_BLOCK, at most MAX_BLOCKS."""
    QUERY_BLOCK = 128
    MAX_BLOCKS = 8

    @staticmethod
    def block(T: int) -> int:
        """Queries per block at sequence length T: 128 up to 1024 tokens, then T / 8."""
        return max(ExplicitAttention.QUERY_BLOCK, -(-T // ExplicitAttention.MAX_BLOCKS))

    @staticmethod
    def forward(ctx, q, k, v, mask):
        B, H, T, hd = q.shape
        q, k, v = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)          # [B*H, T, hd]
        # Masked after the matmul with a finite value, as NxD's CoreAttention (see MASK_VALUE).
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
        # Head counts are those held by this module: tensor parallelism lowers them to the
        # rank's share when it swaps the projections for their parallel versions.
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.qkv_proj = Linear(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim)
        self.o_proj = Linear(cfg.n_heads * cfg.head_dim, cfg.dim)
        self.selective_checkpoint = cfg.checkpointing == "selective"
        self.explicit = cfg.attention == "explicit"
        self.checkpoint_fn = checkpoint

    def forward(self, x, cos, sin, mask):
        qkv = self.qkv_proj(x)
        B, T, _ = qkv.shape          # T is the full sequence even when x is a sequence shard (SP)
        rep = self.n_heads // self.n_kv_heads
        # One split, so backward joins the three gradients with one cat (slicing would give each
        # its own zero-filled qkv-sized gradient, summed).
        q, k, v = qkv.view(B, T, self.n_kv_heads, rep + 2, self.head_dim).split([rep, 1, 1], dim=3)
        q = q.reshape(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k, v = k.squeeze(3).transpose(1, 2), v.squeeze(3).transpose(1, 2)    # [B, n_kv, T, hd]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.selective_checkpoint and torch.is_grad_enabled():
            y = self.checkpoint_fn(attention_core, q, k, v, mask, self.explicit)
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
    """silu(gate) * up of gate_up = [gate | up]. Autograd through chunk, silu and the product
    computes the same numbers (bit-equal, tests/test_model.py), but joins the two halves' gradients
    with a cat: a copy of the [tokens, 2 * ffn_dim] gradient per layer, the largest activation of
    the block. Here both halves are written into one buffer. Saved: gate_up and silu(gate), as
    autograd saves them."""

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


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = LMHead(cfg.dim, cfg.vocab_size)
        if cfg.tie_embeddings:           # Llama 3.2 1B/3B: the head is the embedding matrix itself
            self.lm_head.weight = self.embed.weight
        self.checkpoint_fn = checkpoint      # the attention modules hold it too (use_xla_checkpointing)

    def forward(self, tokens, positions=None, doc_ids=None, targets=None):
        """tokens [B, T] -> logits [B, T, vocab] (the rank's vocab shard under tensor parallelism),
        or, given targets [B, T], the sum of their cross-entropies (fp32; -100 ignored) computed
        by the head without materializing the logits."""
        B, T = tokens.shape
        if positions is None:
            positions = torch.arange(T, device=tokens.device).expand(B, T)
        x = self.embed(tokens)
        cos, sin = rope_cos_sin(positions, self.cfg, x.dtype)
        mask = attention_mask(doc_ids, self.cfg.attention == "explicit")
        for layer in self.layers:
            if self.cfg.checkpointing == "full" and torch.is_grad_enabled():
                x = self.checkpoint_fn(layer, x, cos, sin, mask)
            else:
                x = layer(x, cos, sin, mask)
        if targets is not None:
            return self.lm_head.loss_sum(self.norm(x), targets)
        return self.lm_head(self.norm(x))

    # ------------------------------------------------------------------ initialization
    def init_weights(self, seed: int):
        """Initialize every parameter from (seed, its name) alone, so any sharding of the same
        model, initialized with the same seed, holds the same full weights."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(init_param(name, tuple(p.shape), self.cfg, seed))
        return self

    @torch.no_grad()
    def generate(self, tokens, max_new_tokens: int, temperature: float = 0.8, top_k: int = 50):
        """Sample continuations of tokens [B, T]. Recomputes the whole context per token (no KV
        cache): plain and short, fine for the samples a training run prints."""
        for _ in range(max_new_tokens):
            context = tokens[:, -self.cfg.max_seq_len:]
            logits = self(context)[:, -1, :].float() / max(temperature, 1e-5)
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1)
            tokens = torch.cat((tokens, nxt), dim=1)
        return tokens


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] document ids -> boolean [B, 1, T, T]: True where query i may attend key j, i.e. j <= i
    and both tokens are in the same document. Built from comparisons only, so shapes stay static."""
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
    return (same_doc & causal)[:, None]


def _init_stream(name: str, cfg: ModelConfig, seed: int) -> tuple[torch.Generator, float]:
    """The generator and scale of one parameter's initial value: from its name and the seed only."""
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
    """init_param(name, shape, cfg, seed)[rows][:, cols], bit for bit, without building the full
    tensor: a TP rank's shard of the 128256 x 4096 embedding (2 GiB in fp32) costs its own rows
    plus one chunk of `chunk` elements (16 MiB), not the whole matrix on each of a node's 32 ranks.
    rows: full-tensor row of each output row (-1: a zero row, the vocabulary padding); None: all.
    How: the CPU generator's randn(n) for n >= 16 (ATen's normal_fill) draws n uniforms in order,
    turns each block of 16 into normals (Box-Muller pairs i, i+8), and, when n % 16 != 0, draws 16
    more for the last 16 elements (after the n % 16 left over). So the stream is walked in chunks of whole rows starting at
    multiples of 16 elements: a chunk holding wanted rows is drawn with randn (the same blocks,
    the same values), any other is drawn and dropped with uniform_ (one 32-bit draw per element,
    as normal_fill's), and the tail is redrawn as normal_fill does. mt19937 cannot skip ahead, so
    the time stays that of the whole tensor (about 1 s for the embedding); the memory does not."""
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


def loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies; targets of -100 are ignored. The caller divides by the number of
    valid tokens in the whole global batch (torchtitan's rule), which makes every layout agree.
    The reference definition: training computes the same number through LMHead.loss_sum."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")


class LMHead(nn.Linear):
    """The output projection (untied). loss_sum(h, targets) fuses it with the cross entropy so
    the [tokens, vocab] fp32 logits never exist whole: see LinearCrossEntropy."""

    def __init__(self, dim: int, vocab_size: int):
        super().__init__(dim, vocab_size, bias=False)

    def loss_sum(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return LinearCrossEntropy.apply(h.flatten(0, -2), self.weight, targets.flatten())


class LinearCrossEntropy(torch.autograd.Function):
    """loss_sum(h @ W^T, targets) in chunks of rows, each chunk's gradients computed in the forward
    while its logits are at hand and kept for backward (the chunked fused loss of Liger-Kernel and
    torchtune). The [tokens, vocab] fp32 logits, their log-softmax and its gradient never exist
    whole: at Llama 3's 128k vocab they are 1.5 GiB per 1024 tokens, three times over.

    Chunks of `chunk_rows` rows: about `dim` (the chunk's logits then take no more memory than the
    weight gradient held anyway, and the matmuls are square enough to run at full rate: 2048 rows
    at Llama 3.2 1B), more where the vocabulary is small. Few chunks matter twice: each one passes
    over the whole [vocab, dim] weight gradient, and on XLA each is unrolled into the step's graph.
    At TP=1 and 8192 tokens a microbatch, llama3_2_1b unrolls 4 chunks and llama3_8b 2 (the
    former CHUNK_LOGITS = 2^22 cut them into 32-row chunks: 256 each). Their presets run TP=8,
    where the vocab-parallel cross entropy (parallel.py) replaces this Function.

    The fp32/bf16 split, that of loss_sum through autograd: the logits and both gradient matmuls
    in the weights' dtype (bf16 on a tensor engine, which accumulates in fp32 inside the matmul);
    the log-softmax, the loss and softmax - one_hot in fp32, rounded once to the weights' dtype.
    The weight gradient accumulates inside the matmul (addmm_ into the accumulator, no [vocab, dim]
    temporary per chunk), in the weights' dtype: fp32 stays fp32, bf16 is rounded once per chunk
    rather than once in all (Liger-Kernel's choice; the test bounds its error against fp64)."""

    @staticmethod
    def chunk_rows(n_rows: int, vocab: int, dim: int) -> int:
        """Rows per chunk: max(dim, 2^22 logits), the chunks balanced so that none is a sliver."""
        rows = min(n_rows, max(dim, (1 << 22) // vocab, 1))
        chunks = -(-n_rows // rows)
        return -(-n_rows // chunks)

    @staticmethod
    def forward(ctx, h, w, targets):
        want_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        rows = LinearCrossEntropy.chunk_rows(h.shape[0], w.shape[0], w.shape[1])
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        gh = torch.empty_like(h) if want_grad else None
        gw = torch.zeros_like(w) if want_grad else None
        for i in range(0, h.shape[0], rows):
            hc, t = h[i:i + rows], targets[i:i + rows]
            valid = t != -100
            t = t.masked_fill(~valid, 0)[:, None]
            logits = hc @ w.t()
            if logits.dtype == torch.float32 and logits.device.type == "cpu":
                # fp32 on CPU: the log-softmax overwrites the logits (its kernel reads a row whole
                # before writing it; bit-equal, tests/test_model.py): one [rows, vocab] buffer, not two
                logp = torch.ops.aten._log_softmax.out(logits, -1, False, out=logits)
            else:
                logp = torch.log_softmax(logits, dim=-1, dtype=torch.float32)   # = .float() first
            del logits
            total -= (logp.gather(1, t).squeeze(1) * valid).sum()
            if want_grad:        # d(sum of losses)/d(logits) = softmax - one_hot(target)
                g = logp.exp_().scatter_add_(1, t, torch.full(t.shape, -1.0, device=t.device)).to(h.dtype)
                del logp
                keep = valid[:, None].to(h.dtype)      # ignored rows: masked on the [rows, dim] side
                torch.mm(g, w, out=gh[i:i + rows]).mul_(keep)
                gw.addmm_(g.t(), hc * keep)
        ctx.save_for_backward(gh, gw)
        return total

    @staticmethod
    def backward(ctx, grad):
        gh, gw = ctx.saved_tensors
        return gh.mul_(grad.to(gh.dtype)), gw.mul_(grad.to(gw.dtype)), None


def num_params(cfg: ModelConfig, embeddings: bool = True) -> int:
    d, L, f, v = cfg.dim, cfg.n_layers, cfg.ffn_dim, cfg.vocab_size
    qkv = d * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    per_layer = qkv + cfg.n_heads * cfg.head_dim * d + 3 * d * f + 2 * d
    heads = 1 if cfg.tie_embeddings else 2
    return L * per_layer + d + (heads * v * d if embeddings else v * d)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 per weight (forward 2, backward 4) for every matmul weight
    (the embedding lookup is not a matmul), plus causal attention scores and values:
    6 * n_layers * seq_len * dim (12 * L * T * d halved because the mask is causal)."""
    matmul_weights = num_params(cfg, embeddings=False) - (2 * cfg.n_layers + 1) * cfg.dim   # minus norms
    return 6 * matmul_weights + 6 * cfg.n_layers * seq_len * cfg.dim
