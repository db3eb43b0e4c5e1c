"""How each parameter of the Llama is split over the TP ranks: the one place that knows it.

By parameter name (Megatron-LM's and NxD's layouts):
  embed, lm_head     "vocab": rows split, the vocabulary padded with zero rows to a TP multiple
  qkv_proj           "qkv": rows are [q heads of group g | k_g | v_g] per KV group g; a rank holds
                     whole groups, or (tp > n_kv_heads, 70B at TP=32) n_heads/tp q heads of one
                     group and a copy of its k and v
  gate_up_proj       "gate_up": [gate | up] -> [gate shard | up shard] on each rank
  o_proj, down_proj  "row": input features (columns) split
  norm weights       "replicated"
`cut` takes a rank's piece of the full tensor, `join` is its inverse (reshard, export), `index`
says where a piece lies (the seeded init and hf.load_sharded read only those rows), and
`tp_pieces` which of a rank's elements other ranks hold copies of (norms, clipping, ZeRO-1).
"""
from __future__ import annotations

import torch

from configs import ModelConfig


def padded_vocab(vocab_size: int, tp: int) -> int:
    return -(-vocab_size // tp) * tp


def kv_replicas(m: ModelConfig, tp: int) -> int:
    """How many TP ranks hold a copy of each KV head: 1 unless tp > n_kv_heads."""
    return max(1, tp // m.n_kv_heads)


def kv_heads_per_rank(m: ModelConfig, tp: int) -> int:
    """KV heads on each TP rank: n_kv_heads / tp, or one copy when tp > n_kv_heads."""
    return max(1, m.n_kv_heads // tp)


def kind(name: str) -> str:
    """How the parameter `name` of model.Llama is split over TP (the table above)."""
    if name.endswith(("embed.weight", "lm_head.weight")):
        return "vocab"
    for suffix, k in (("qkv_proj.weight", "qkv"), ("gate_up_proj.weight", "gate_up"),
                      ("o_proj.weight", "row"), ("down_proj.weight", "row")):
        if name.endswith(suffix):
            return k
    return "replicated"


def _qkv_view(w: torch.Tensor, n_kv: int, rep: int, m: ModelConfig) -> torch.Tensor:
    """Rows of qkv_proj as [KV group, q heads of the group + k + v, head_dim, dim]."""
    return w.view(n_kv, rep + 2, m.head_dim, w.shape[-1])


def cut(name: str, full: torch.Tensor, m: ModelConfig, tp: int, tp_rank: int) -> torch.Tensor:
    """This TP rank's piece of the full-shape parameter `name`."""
    k = kind(name)
    if tp == 1 or k == "replicated":
        return full
    if k == "vocab":                    # pad rows with zeros to a TP multiple, then split rows
        padded = full.new_zeros((padded_vocab(full.shape[0], tp),) + tuple(full.shape[1:]))
        padded[:full.shape[0]] = full
        return padded.chunk(tp)[tp_rank]
    if k == "row":
        return full.chunk(tp, dim=1)[tp_rank]
    if k == "gate_up":
        gate, up = full.chunk(2)
        return torch.cat((gate.chunk(tp)[tp_rank], up.chunk(tp)[tp_rank]))
    rep, r = m.n_heads // m.n_kv_heads, kv_replicas(m, tp)
    groups = _qkv_view(full, m.n_kv_heads, rep, m)
    if r == 1:                          # n_kv_heads % tp == 0: whole KV groups per rank
        return groups.chunk(tp)[tp_rank].reshape(-1, full.shape[1])
    g, j, q_local = tp_rank // r, tp_rank % r, m.n_heads // tp
    q = groups[g, j * q_local:(j + 1) * q_local]
    return torch.cat((q, groups[g, rep:rep + 2])).reshape(-1, full.shape[1])


def join(name: str, pieces: list[torch.Tensor], m: ModelConfig) -> torch.Tensor:
    """Inverse of cut: the full-shape parameter from every TP rank's piece, in rank order."""
    tp, k = len(pieces), kind(name)
    if tp == 1 or k == "replicated":
        return pieces[0]
    if k == "vocab":
        return torch.cat(pieces)[:m.vocab_size]
    if k == "row":
        return torch.cat(pieces, dim=1)
    if k == "gate_up":
        halves = [p.chunk(2) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    r, d = kv_replicas(m, tp), pieces[0].shape[1]
    if r == 1:
        return torch.cat(pieces)
    q_local, full = m.n_heads // tp, []
    for g in range(m.n_kv_heads):       # q heads from each copy, k and v from the first
        views = [_qkv_view(p, 1, q_local, m)[0] for p in pieces[g * r:(g + 1) * r]]
        full += [v[:q_local] for v in views] + [views[0][q_local:]]
    return torch.cat(full).reshape(-1, d)


def index(name: str, shape: tuple, m: ModelConfig, tp: int, tp_rank: int):
    """Where cut's piece lies in the full tensor, as model.init_param_part takes it: (rows, cols),
    the full row of each piece row (-1: vocabulary padding) or None for all rows, and a slice of
    columns (row-parallel weights) or None. cut applied to row numbers: the two cannot disagree."""
    k = kind(name)
    if tp == 1 or k == "replicated":
        return None, None
    if k == "row":
        width = -(-shape[1] // tp)
        return None, slice(tp_rank * width, min((tp_rank + 1) * width, shape[1]))
    return cut(name, (torch.arange(shape[0]) + 1).view(-1, 1), m, tp, tp_rank).view(-1) - 1, None


def mark(model: torch.nn.Module, tp: int, sequence_parallel: bool) -> None:
    """Tag the parameters of a TP model as NxD does, for the gradient sums and tp_pieces:
    p.tensor_model_parallel: split over TP (each rank's piece is distinct);
    p.sequence_parallel: replicated over TP but fed by sequence shards (grads summed over TP);
    p.kv_replicas, p.q_rows: qkv rows past q_rows are a KV head copied on kv_replicas ranks."""
    if tp == 1:
        return
    m = model.cfg
    for name, p in model.named_parameters():
        k = kind(name)
        p.tensor_model_parallel = k != "replicated"
        if k == "replicated" and sequence_parallel:
            p.sequence_parallel = True
        if k == "qkv" and kv_replicas(m, tp) > 1:
            p.kv_replicas, p.q_rows = kv_replicas(m, tp), m.n_heads // tp * m.head_dim


def tp_pieces(p: torch.nn.Parameter, tp_rank: int) -> list[tuple[int, int, str, float]]:
    """The one rule for counting each weight once over TP (clipping, param norm, ZeRO-1): p's flat
    elements as runs (start, end, sharing, weight). `sharing` names the ranks holding identical
    copies (optim.py rounds those identically). Replicated weights count on TP rank 0 only; a KV
    head copied on r ranks counts 1/r on each; the last pipeline stage's copy of a tied embedding
    (p.tied_copy) counts zero: the first stage counts it."""
    n = p.numel()
    if not getattr(p, "tensor_model_parallel", False):
        pieces = [(0, n, "tp*", 1.0 if tp_rank == 0 else 0.0)]
    elif getattr(p, "kv_replicas", 1) == 1:
        pieces = [(0, n, f"tp{tp_rank}", 1.0)]
    else:
        r, q_end = p.kv_replicas, p.q_rows * (n // p.shape[0])
        pieces = [(0, q_end, f"tp{tp_rank}", 1.0), (q_end, n, f"kv{tp_rank // r}", 1.0 / r)]
    if getattr(p, "tied_copy", False):
        pieces = [(a, b, sharing, 0.0) for a, b, sharing, _ in pieces]
    return pieces
