"""Tensor, sequence and data parallelism on torch.distributed: how HLAT splits a Llama over NeuronCores,
named as in Megatron-LM and NeuronX Distributed (how each parameter is split over TP: sharding.py).
Sequence parallelism (the blog's SP=8 with TP=8) splits the residual stream along the sequence
between TP regions, so norms and residual adds run on 1/tp of the tokens.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import configs
from configs import Config, ConfigError
import model as llama
import sharding

BUCKET_BYTES = 64 * 2**20   # DP all-reduce bucket: big enough to amortize latency, small enough in memory


# ----------------------------------------------------------------------------- 1. the rank grid

def rank_groups(world: int, tp: int, pp: int, kv_replicas: int = 1, tied: bool = False) -> dict[str, list[list[int]]]:
    """Every group of each kind, as lists of ranks of ranks = arange(world).reshape(PP, DP, TP) (NxD's:
    TP on one instance's NeuronLink). "kv": TP ranks holding copies of one KV head (tp > n_kv_heads);
    "embed": each pipeline's first and last stage, holding a tied embedding and its copy (Megatron)."""
    dp = world // (tp * pp)
    grid = torch.arange(world).reshape(pp, dp, tp)
    groups = {
        "tp": grid.reshape(pp * dp, tp).tolist(),
        "dp": grid.permute(0, 2, 1).reshape(pp * tp, dp).tolist(),
        "pp": grid.permute(1, 2, 0).reshape(dp * tp, pp).tolist(),
    }
    if kv_replicas > 1:
        groups["kv"] = grid.reshape(-1, kv_replicas).tolist()
    if tied and pp > 1:
        groups["embed"] = [[g[0], g[-1]] for g in groups["pp"]]
    return groups


@dataclass
class Grid:
    """This rank's coordinates and process groups; a group of degree 1 is None (collectives no-op)."""
    world: int = 1
    rank: int = 0
    tp: int = 1
    pp: int = 1
    dp: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    tp_group: object = None
    dp_group: object = None
    pp_group: object = None
    kv_group: object = None      # TP ranks sharing one replicated KV head (only when tp > n_kv_heads)
    embed_group: object = None   # first and last pipeline stage, with tied embeddings
    backend: str = ""
    host_group: object = None    # gloo over all ranks, for barriers on xla (None: the default group)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def host_device(self) -> str:
        """Where a tensor for host_group lives: the CPU, but the default group of nccl takes CUDA's."""
        return "cuda" if self.backend == "nccl" else "cpu"


def backend_for(device_type: str) -> str:
    return {"cpu": "gloo", "cuda": "nccl", "xla": "xla"}[device_type]


def launch_env() -> tuple[int, int]:
    """(WORLD_SIZE, RANK) from torchrun (unset: one process), checked: else int('x'), a ZeroDivisionError or a hang."""
    env = {k: os.environ.get(k, "0" if "RANK" in k else "1") for k in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK")}
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if not (all(v.isdigit() for v in env.values()) and int(env["RANK"]) < int(env["WORLD_SIZE"]) > 0
            and int(env["LOCAL_WORLD_SIZE"]) > 0 and (int(env["WORLD_SIZE"]) == 1 or addr and port.isdigit()
                                                      and 0 < int(port) < 65536)):     # torchrun --master_port=0: a hang
        raise ConfigError(", ".join(f"{k}={v!r}" for k, v in {**env, "MASTER_ADDR": addr, "MASTER_PORT": port}.items()) +
                          ": torchrun sets these (RANK below WORLD_SIZE; a rendezvous host and a port "
                          "from 1 to 65535: not --master_port=0); or unset them")
    return int(env["WORLD_SIZE"]), int(env["RANK"])


def init_distributed(cfg: Config, device: torch.device | str) -> Grid:
    """Validate the layout, then create this torchrun process's groups on the backend of `device`
    (hardware.pick_device decides it; it refuses XLA:CPU for several). World 1: Grid(), no process group."""
    world, rank = launch_env()
    backend = backend_for(torch.device(device).type)
    configs.validate(cfg, world, backend)     # bad input fails here, before any process group work
    if world == 1:
        return Grid()
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    # A collective that waits longer than --parallel.timeout_s raises (gloo, nccl) instead of
    # hanging forever; the xla backend has no such timeout (monitor.Watchdog covers it).
    timeout = datetime.timedelta(seconds=cfg.parallel.timeout_s)
    if backend == "xla":
        import torch_xla.distributed.xla_backend  # noqa: F401  registers "xla" and patches new_group
        dist.init_process_group("xla", init_method="xla://", timeout=timeout)
    else:
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # A key prefix per torchrun restart where workers share the agent's store (the default): it
        # still holds the dead attempt's addresses. env.sh (multi-node): a fresh store, no prefix.
        store, _, _ = next(dist.rendezvous("env://"))
        shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "True") == "True"
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if shared else "-"
        dist.init_process_group(backend, store=dist.PrefixStore(f"attempt_{attempt}", store),
                                rank=rank, world_size=world, timeout=timeout)
    grid = new_grid(world, rank, tp, pp, sharding.kv_replicas(cfg.model, tp), backend, cfg.model.tie_embeddings)
    if backend == "xla":     # its barrier returns at once: barriers (checkpoint renames) need gloo
        grid.host_group = new_host_group(timeout)
    return grid


def new_host_group(timeout: datetime.timedelta | None = None):
    """Gloo over all ranks for host-side barriers on XLA (its own is a no-op); lazy, so a rank opens
    ~2*log2(world) sockets, 24 at 4096 ranks, not 4095 (NxD: xm.rendezvous, trainer/checkpoint.py)."""
    os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")
    return dist.new_group(backend="gloo", timeout=timeout)


def group_options(backend: str, mesh: list[list[int]]):
    """pg_options of a group of `mesh` (all groups of its kind): XLA's verifier wants every rank's
    replica groups (XLA's CheckReplicaGroups; NxD's mesh). tests/xla_rules.py replaces it to check gloo groups."""
    return {"xla_pg_options": {"mesh": mesh}} if backend == "xla" else None


def new_grid(world: int, rank: int, tp: int, pp: int, kv_reps: int, backend: str, tied: bool = False) -> Grid:
    """Create every group (new_group is collective: all ranks, same order); keep this rank's."""
    dp = world // (tp * pp)
    mine = {}
    for kind, lists in rank_groups(world, tp, pp, kv_reps, tied).items():
        if len(lists[0]) == 1:
            continue
        opts = group_options(backend, lists)
        for ranks in lists:
            group = dist.new_group(ranks, pg_options=opts)
            if rank in ranks:
                mine[kind] = group
    return Grid(world=world, rank=rank, tp=tp, pp=pp, dp=dp, tp_rank=rank % tp,
                dp_rank=(rank // tp) % dp, pp_rank=rank // (tp * dp), tp_group=mine.get("tp"),
                dp_group=mine.get("dp"), pp_group=mine.get("pp"), kv_group=mine.get("kv"),
                embed_group=mine.get("embed"), backend=backend)


def barrier(grid: Grid) -> None:
    if grid.world > 1 and dist.is_initialized():
        dist.barrier(group=grid.host_group)     # on xla, gloo: the xla backend's barrier is a no-op


def destroy(grid: Grid) -> None:
    if grid.world > 1 and dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- 2. collectives

def all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce (SUM by default) over group; returns t. A no-op when group is None."""
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t


def broadcast(t: torch.Tensor, src: int, group) -> torch.Tensor:
    """In place: global rank src's t on all ranks of group, a SUM of it and zeros (a where: garbage x 0 is NaN). The xla
    backend's dist.broadcast on a sub-group gave zeros on trn1 (aws-neuron-sdk#1240; pytorch/xla#9657, group vs global src)."""
    keep = torch.tensor(group is None or dist.get_rank() == src, device=t.device)
    return all_reduce(t.copy_(torch.where(keep, t, torch.zeros((), dtype=t.dtype, device=t.device))), group)


def _all_gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Concatenate every rank's x along dim (collectives concatenate along dim 0: move dim there)."""
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((dist.get_world_size(group) * x.shape[0],) + tuple(x.shape[1:]))
    dist.all_gather_into_tensor(out, x, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Sum x over the group and keep this rank's 1/n slice along dim."""
    n = dist.get_world_size(group)
    if x.shape[dim] % n != 0:
        raise ValueError(f"sequence parallelism: dim {dim} of size {x.shape[dim]} is not divisible by "
                         f"tp {n}; use a sequence length that is a multiple of tp")
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // n,) + tuple(x.shape[1:]))
    dist.reduce_scatter_tensor(out, x, group=group)
    return out.movedim(0, dim)


# ----------------------------------------------------------------------------- 3. region operators
# Tensors are [batch, seq, features]; SEQ is the dimension sequence parallelism splits.
# Collectives write in place, so each works on a copy: autograd may hold the original.

SEQ = 1


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """f: identity forward; backward all-reduces the column-parallel ranks' input-gradient shares."""
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.clone(), ctx.group), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """g: all-reduce forward (sum the row-parallel partial outputs); identity backward."""
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _LinearWithSequenceParallel(torch.autograd.Function):
    """SP column-parallel linear y = all_gather(x) @ W.T that saves only x's sequence shard, tp times
    less than the gathered input, and all-gathers it again for grad_W in backward (Megatron's
    LinearWithGradAccumulationAndAsyncCommunication; NxD's linear_with_async_allreduce)."""
    @staticmethod
    def forward(ctx, x, weight, group):
        ctx.group = group
        ctx.save_for_backward(x, weight)
        return F.linear(_all_gather(x, group, dim=SEQ), weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        x_full = _all_gather(x, ctx.group, dim=SEQ)          # Megatron issues it first (async)
        grad_x = _reduce_scatter(grad.matmul(weight), ctx.group, dim=SEQ)
        grad_w = grad.reshape(-1, grad.shape[-1]).t().matmul(x_full.reshape(-1, x_full.shape[-1]))
        return grad_x, grad_w, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """SP after a row-parallel linear: reduce-scatter to sequence shards; backward all-gathers."""
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group, dim=SEQ)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group, dim=SEQ), None


# Megatron's functional names, each (x, group) -> tensor.
copy_to_tensor_parallel_region = _CopyToTensorParallelRegion.apply
reduce_from_tensor_parallel_region = _ReduceFromTensorParallelRegion.apply
reduce_scatter_to_sequence_parallel_region = _ReduceScatterToSequenceParallelRegion.apply
linear_with_sequence_parallel = _LinearWithSequenceParallel.apply    # (x, weight, group)


# ----------------------------------------------------------------------------- 4. parallel layers

class ColumnParallelLinear(nn.Module):
    """y[..., shard] = x @ W[shard].T on `out_local` rows of W; input replicated, or a sequence shard (SP)."""
    def __init__(self, in_features: int, out_local: int, group, sequence_parallel: bool):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_local, in_features))

    def forward(self, x):
        if self.sequence_parallel:
            return linear_with_sequence_parallel(x, self.weight, self.group)
        return llama.linear(copy_to_tensor_parallel_region(x, self.group), self.weight)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x[..., shard] @ W[:, shard].T on `in_local` columns of W: g, or SP's reduce-scatter."""
    def __init__(self, in_local: int, out_features: int, group, sequence_parallel: bool):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features, in_local))

    def forward(self, x):
        y = llama.linear(x, self.weight)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(y, self.group)
        return reduce_from_tensor_parallel_region(y, self.group)


class VocabParallelEmbedding(nn.Module):
    """V_local rows of the padded table: own tokens looked up, zeros for others, summed over ranks."""
    def __init__(self, vocab_local: int, dim: int, tp_rank: int, group, sequence_parallel: bool):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.vocab_start = tp_rank * vocab_local
        self.weight = nn.Parameter(torch.empty(vocab_local, dim))

    def forward(self, tokens):
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[..., None], 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(x, self.group)
        return reduce_from_tensor_parallel_region(x, self.group)


class VocabParallelHead(ColumnParallelLinear):
    """lm_head split over the vocabulary: logits [B, T, V_local]. Padding columns get model.MASK_VALUE
    (finite, as every mask on trn1), so no softmax, loss or sampler gives them probability."""
    def __init__(self, dim: int, vocab_local: int, n_real: int, vocab_start: int, group, sequence_parallel: bool):
        super().__init__(dim, vocab_local, group, sequence_parallel)
        self.n_real, self.vocab_start = n_real, vocab_start     # n_real: non-padding entries in this rank's slice

    def forward(self, x):
        logits = super().forward(x)
        if self.n_real < logits.shape[-1]:
            pad = torch.arange(logits.shape[-1], device=logits.device) >= self.n_real
            logits = logits.masked_fill(pad, llama.MASK_VALUE)
        return logits

    def loss_sum(self, h, targets, grad_scale=None):   # unused: the fp32 backward scales before it rounds
        """model.LMHead.loss_sum over the vocabulary shards: every TP rank returns the same sum."""
        return _VocabParallelCrossEntropy.apply(self(h), targets, self.group, self.vocab_start)


# ----------------------------------------------------------------------------- 5. building the model

def tensor_parallelize(model: llama.Llama, grid: Grid, sequence_parallel: bool) -> llama.Llama:
    """Swap the Llama's layers for their TP (and SP) versions, holding this rank's share."""
    m, tp, group = model.cfg, grid.tp, grid.tp_group
    hd, n_kv_local = m.head_dim, sharding.kv_heads_per_rank(m, tp)
    v_local = sharding.padded_vocab(m.vocab_size, tp) // tp
    n_real = min(v_local, max(0, m.vocab_size - grid.tp_rank * v_local))
    model.embed = VocabParallelEmbedding(v_local, m.dim, grid.tp_rank, group, sequence_parallel)
    for block in model.layers:
        attn, mlp = block.attn, block.mlp
        attn.n_heads, attn.n_kv_heads = m.n_heads // tp, n_kv_local     # the forward reads these
        attn.qkv_proj = ColumnParallelLinear(m.dim, (attn.n_heads + 2 * n_kv_local) * hd, group, sequence_parallel)
        attn.o_proj = RowParallelLinear(attn.n_heads * hd, m.dim, group, sequence_parallel)
        mlp.gate_up_proj = ColumnParallelLinear(m.dim, 2 * m.ffn_dim // tp, group, sequence_parallel)
        mlp.down_proj = RowParallelLinear(m.ffn_dim // tp, m.dim, group, sequence_parallel)
    model.lm_head = VocabParallelHead(m.dim, v_local, n_real, grid.tp_rank * v_local, group, sequence_parallel)
    if m.tie_embeddings:        # the same vocabulary rows on each rank: the shards tie as the whole does
        model.lm_head.weight = model.embed.weight
    return model


def tie_embeddings(model: nn.Module) -> None:
    """Make a tied head's weight the embedding's Parameter again (Llama 3.2): Module.to_empty() and
    .to() make a Parameter per module, and the two would train apart (issue 26)."""
    embed, head = getattr(model, "embed", None), getattr(model, "lm_head", None)
    if model.cfg.tie_embeddings and embed is not None and head is not None:
        head.weight = embed.weight


def check_tied(model: nn.Module) -> None:
    """Raise unless a tied head and embedding are one Parameter on one storage."""
    embed, head = getattr(model, "embed", None), getattr(model, "lm_head", None)
    if model.cfg.tie_embeddings and embed is not None and head is not None and not (
            head.weight is embed.weight and head.weight.data_ptr() == embed.weight.data_ptr()):
        raise RuntimeError("tied embeddings came untied: lm_head.weight is not embed.weight "
                           "(a move made new Parameters; call parallel.tie_embeddings after it)")


def to_device(tensors: list[torch.Tensor], device) -> list[torch.Tensor]:
    """Host tensors onto device; on XLA in one batched transfer, as torch-xla's loader does."""
    device = torch.device(device)
    if device.type == "xla" and all(t.device.type == "cpu" for t in tensors):
        import torch_xla.core.xla_model as xm
        return xm.send_cpu_data_to_device(tensors, device)
    return [t.to(device) for t in tensors]


@torch.no_grad()
def move_model(model: nn.Module, device) -> nn.Module:
    """Move every parameter, each Parameter once (a tied pair stays one Parameter, where Module.to()
    would make two), keeping its tags (sharding.mark); then check the tie. On the device already
    (CPU, CUDA: build_model allocated it there) nothing is copied."""
    params = list(model.parameters())              # each tied matrix once
    moved = {id(p): nn.Parameter(t, requires_grad=p.requires_grad)
             for p, t in zip(params, to_device([p.detach() for p in params], device))}
    for p in params:
        moved[id(p)].__dict__.update(p.__dict__)
    for mod in model.modules():
        for k, p in mod._parameters.items():
            if p is not None:
                mod._parameters[k] = moved[id(p)]
        for k, b in mod._buffers.items():
            if b is not None:
                mod._buffers[k] = b.to(device)
    check_tied(model)
    return model


def build_model(cfg: Config, grid: Grid, device, stage=None, dtype: torch.dtype | None = None) -> llama.Llama:
    """This rank's Llama, TP/SP-parallelized for grid, its weights allocated but not filled (train.py
    fills them from one source, then move_model puts them on the device). Built on the meta device:
    no rank ever holds the full model. Allocated on the host on XLA (the blog: "initialized on CPU and
    offloaded to Trainium"; in-place copies into XLA tensors leave views that recompile graphs at
    each save and after evals), elsewhere on the device. stage: pipeline.py's hook, meta model -> the
    part this rank keeps (only that is allocated); dtype: the parameters' (optim.param_dtype), on meta."""
    device = torch.device(device)
    sp = cfg.parallel.sp and grid.tp > 1
    with torch.device("meta"):                # the parallel layers too: nothing is allocated yet
        model = llama.Llama(cfg.model)
        if grid.tp > 1:
            tensor_parallelize(model, grid, sp)
    if stage is not None:
        model = stage(model)
    if dtype is not None:
        model.to(dtype)
    host = torch.device("cpu") if device.type == "xla" else device
    # Module.to_empty, but torch.empty, not empty_like: empty_like of a meta tensor runs torch's Python reference,
    # whose stride logic imported sympy (with nn.Linear's meta init: 0.65 s CPU a rank); same contiguous tensors
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=host))
    tie_embeddings(model)                     # to_empty from meta made two Parameters of the tied one
    sharding.mark(model, grid.tp, sp)
    return model


@torch.no_grad()
def init_weights(model: nn.Module, cfg: Config, grid: Grid) -> nn.Module:
    """Fill build_model's weights from cfg.seed: every layout holds the same full weights. Each rank
    generates only its shard, from the stream that generates the full tensor (the same values as
    cutting it from init_param's full tensor, bit for bit: tests/test_sharding.py)."""
    full = llama.param_shapes(cfg.model)
    for name, p in model.named_parameters():      # a tied matrix once, as embed.weight
        rows, cols = sharding.index(name, full[name], cfg.model, grid.tp, grid.tp_rank)
        p.copy_(llama.init_param_part(name, full[name], cfg.model, cfg.seed, rows, cols))
    return model


# ----------------------------------------------------------------------------- 6. loss

class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross entropy of vocabulary-split logits without gathering them (Megatron): the global max and
    sum of exponentials, and the target logit from its one rank: two all-reduces of [B, T] numbers."""
    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start):
        ctx.dtype = logits.dtype
        logits = logits.float()
        v_local = logits.shape[-1]
        top = logits.max(dim=-1).values
        all_reduce(top, group, op=dist.ReduceOp.MAX)
        exp = (logits - top.unsqueeze(-1)).exp()
        local_t = targets - vocab_start
        mine = (local_t >= 0) & (local_t < v_local)
        local_t = local_t.clamp(0, v_local - 1)          # -100 and other ranks' targets: any column
        picked = logits.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) - top
        picked = torch.where(mine, picked, torch.zeros_like(picked))   # other ranks' targets: 0
        sum_exp, target_logit = all_reduce(torch.stack((exp.sum(-1), picked)), group)
        valid = targets != -100
        loss = torch.where(valid, sum_exp.log() - target_logit, torch.zeros_like(target_logit))
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_t, mine & valid, valid)
        return loss.sum()

    @staticmethod
    def backward(ctx, grad):
        softmax, local_t, hit, valid = ctx.saved_tensors
        # d loss / d logit = softmax - one_hot(target), on valid positions only
        g = softmax * valid.unsqueeze(-1)
        g.scatter_add_(-1, local_t.unsqueeze(-1), -hit.unsqueeze(-1).to(g.dtype))
        return (g * grad).to(ctx.dtype), None, None, None


# ----------------------------------------------------------------------------- 7. gradients

def _buckets(tensors: list[torch.Tensor], bucket_bytes: int):
    """Consecutive runs of same-dtype tensors of at most bucket_bytes (a larger tensor goes alone)."""
    bucket, size = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and (size + nbytes > bucket_bytes or t.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket


def _all_reduce_flat(tensors: list[torch.Tensor], group, scale: float = 1.0) -> None:
    """Sum tensors over group in ONE collective: flatten, scale, all-reduce, copy back."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    all_reduce(flat.mul_(scale) if scale != 1.0 else flat, group)
    for t, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(piece.view_as(t))


def grad_of(p: torch.nn.Parameter) -> torch.Tensor | None:
    """The gradient to reduce, clip and apply: mixed precision's fp32 p.main_grad, else p.grad."""
    return g if (g := getattr(p, "main_grad", None)) is not None else p.grad


@torch.no_grad()
def reduce_tp_replicated_gradients(model: nn.Module, grid: Grid) -> None:
    """Sum over TP the gradients of weights TP ranks hold copies of: SP norm weights (each saw its
    sequence shard; NxD allreduce_sequence_parallel_gradients) and replicated KV heads (each copy saw
    its own q heads). Once per step, after the last microbatch; ZeRO-1 too."""
    params = [p for p in model.parameters() if grad_of(p) is not None]
    sp = [grad_of(p) for p in params if getattr(p, "sequence_parallel", False)]
    if sp and grid.tp_group is not None:
        _all_reduce_flat(sp, grid.tp_group)
    kv = [grad_of(p)[p.q_rows:] for p in params if getattr(p, "kv_replicas", 1) > 1]
    if kv and grid.kv_group is not None:
        _all_reduce_flat(kv, grid.kv_group)


@torch.no_grad()
def reduce_gradients(model: nn.Module, grid: Grid, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Once per step, after the last microbatch: the TP sums above, then SUM over the DP group in
    flat buckets scaled 1/DP. Never 1/world: xm.reduce_gradients divides by the world size even
    with DP groups, the bug that made HLAT's run diverge (the blog): 8 times too small at TP=8."""
    reduce_tp_replicated_gradients(model, grid)
    if grid.dp_group is None:
        return
    grads = [g for g in map(grad_of, model.parameters()) if g is not None]    # fp32 in mixed
    for bucket in _buckets(grads, bucket_bytes):
        _all_reduce_flat(bucket, grid.dp_group, scale=1.0 / grid.dp)


def global_norm(pieces, grid: Grid, device, over_dp: bool = False) -> torch.Tensor:
    """L2 norm of a whole-model quantity from this rank's [(tensor, weight)] (sharding.tp_pieces'
    weights), summed over TP and PP, and over DP when DP ranks hold disjoint shards (ZeRO-1). Its sum
    starts on `device`, the model's: a ZeRO-1 rank may hold no piece (N < ~DP^2), and nccl or xla
    all-reduce only their device's tensors (it was the CPU's there)."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for t, weight in pieces:
        if weight:
            total += t.float().pow(2).sum() * weight
    for group in (grid.tp_group, grid.pp_group, grid.dp_group if over_dp else None):
        all_reduce(total, group)
    return total.sqrt()


def _norm_of(params, tensors, grid: Grid) -> torch.Tensor:
    return global_norm([(t.reshape(-1)[a:b], w) for p, t in zip(params, tensors)
                        for a, b, _, w in sharding.tp_pieces(p, grid.tp_rank)], grid, params[0].device)


@torch.no_grad()
def param_norm(model: nn.Module, grid: Grid) -> torch.Tensor:
    """The global L2 norm of the weights (the blog watched it: about 1,600 at init for 7B)."""
    params = list(model.parameters())
    return _norm_of(params, [p.detach() for p in params], grid)


@torch.no_grad()
def replica_spread(value: torch.Tensor, grid: Grid) -> torch.Tensor:
    """max - min of a per-rank scalar (the parameter norm) over the DP replicas: MAX of [v, -v]."""
    t = torch.stack([value.float(), -value.float()])
    all_reduce(t, grid.dp_group, op=dist.ReduceOp.MAX)
    return t[0] + t[1]


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, grid: Grid) -> torch.Tensor:
    """Scale gradients to a global L2 norm of at most max_norm; returns the norm before (no host sync)."""
    params = [p for p in parameters if grad_of(p) is not None]
    if not params:
        return torch.zeros(())
    grads = [grad_of(p) for p in params]
    norm = _norm_of(params, grads, grid)
    if max_norm > 0:
        scale_to_norm_(grads, norm, max_norm)
    return norm


def scale_to_norm_(grads: list, norm: torch.Tensor, max_norm: float) -> None:
    """grads x min(1, max_norm / norm), torch's formula and foreach multiply: the fp32 coefficient multiplies each bf16
    element in fp32, rounded once (CPU, CUDA, XLA). Rounded to bf16 first, it clipped to up to 1.004 x max_norm."""
    torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))


# ----------------------------------------------------------------------------- 8. full state dicts

@torch.no_grad()
def gather_full_state_dict(model: nn.Module, grid: Grid, grads: bool = False, masters: dict | None = None) -> dict:
    """Full-shape weights (or gradients) on every TP rank: tests, HF export, tiny runs (7B: from a checkpoint).
    masters: optim.AdamW.masters(), each param's fp32 master in place of the param (a mixed run's export)."""
    out = {}
    for name, p in model.state_dict(keep_vars=True).items():      # tied: both names, as state_dict
        if (t := grad_of(p) if grads else (masters or {}).get(id(p), p)) is None:
            continue
        t = t.detach()
        if grid.tp > 1 and sharding.kind(name) != "replicated":
            t = sharding.join(name, list(_all_gather(t, grid.tp_group, dim=0).chunk(grid.tp)), model.cfg)
        out[name] = t.clone()
    return out
