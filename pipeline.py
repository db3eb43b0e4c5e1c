"""Pipeline parallelism (HLAT 70B: TP=32 x PP=8): the Llama cut into stages over PP ranks, trained
with a 1F1B or GPipe schedule (docs/parallelism.md). Top to bottom:
1. Stages: layers split evenly or at --parallel.pp_cuts; the embedding on the first stage, norm,
   head and loss on the last. Parameters keep their whole-model names (layers.{global i}): init,
   state dicts and checkpoints do not depend on the stage layout.
2. Point-to-point between neighbours: "send" (isend/irecv) or "allgather" (NxD's, the only one on XLA:
   its send/recv, slow collective-permutes, take torch's group-local peer as a global rank); shapes from the config.
3. Schedules: GPipe (all forwards, then all backwards) and 1F1B (never more than PP microbatches'
   activations alive); both idle (PP - 1) / (m + PP - 1) of the time.
4. A step's gradients: each backward scaled as train.py scales it, so PP and non-PP gradients are
   identical (not grad_acc times larger: torchtitan #2972, picotron's PP path).
5. Full state dicts (export) and evaluation through the pipeline.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

import model as llama
import monitor
import parallel
from configs import Config, ConfigError
from parallel import Grid


# ----------------------------------------------------------------------------- 1. stages

def stage_bounds(cfg: Config) -> list[tuple[int, int]]:
    """[start, end) of the layers of each stage: even, or cut at cfg.parallel.pp_cuts
    ("3,6": stages [0,3), [3,6), [6,n_layers)); both checked by configs.check_values."""
    n, pp, cuts = cfg.model.n_layers, cfg.parallel.pp, cfg.parallel.pp_cuts
    edges = [0] + [int(c) for c in cuts.split(",")] + [n] if cuts else [n // pp * s for s in range(pp + 1)]
    return list(zip(edges, edges[1:]))


def stage_of(name: str, bounds: list[tuple[int, int]]) -> int:
    if name.startswith("embed."):
        return 0
    if name.startswith("layers."):
        i = int(name.split(".")[1])
        return next(s for s, (a, b) in enumerate(bounds) if a <= i < b)
    return len(bounds) - 1                                  # norm, lm_head


class PipelineStage(nn.Module):
    """The embedding if first, layers [start, end) keyed by their global index, norm and head if
    last. forward: tokens or the previous stage's hidden states -> hidden states, or on the last
    stage logits (summed loss given targets). Each stage computes RoPE and the document mask from
    the batch (every stage reads it), so only hidden states travel."""

    def __init__(self, model: llama.Llama, bounds: list[tuple[int, int]], pp_rank: int):
        super().__init__()
        start, end = bounds[pp_rank]
        self.cfg, self.bounds = model.cfg, bounds
        self.first, self.last = pp_rank == 0, pp_rank == len(bounds) - 1
        self.embed = model.embed if self.first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(start, end)})
        self.norm = model.norm if self.last else None
        self.lm_head = model.lm_head if self.last else None
        self.comm: Comm | None = None          # set by build_model
        self.recompute_fn = llama.recompute  # full checkpointing; use_xla_checkpointing swaps it on XLA

    def forward(self, x, positions, doc_ids=None, targets=None, grad_scale=None):
        # The same steps as model.Llama.forward, restricted to this stage's part.
        if self.first:
            x = self.embed(x)
        x = llama.run_layers(self, self.layers.values(), x, positions, doc_ids)
        if not self.last:
            return x
        if targets is not None:
            return self.lm_head.loss_sum(self.norm(x), targets, grad_scale)
        return self.lm_head(self.norm(x))


def build_model(cfg: Config, grid: Grid, device, dtype: torch.dtype | None = None) -> PipelineStage:
    """This rank's stage, empty as parallel.build_model builds it (the caller fills it, by the whole
    model's parameter names), and its links. Collective: the "allgather" pairs' groups are made here."""
    bounds = stage_bounds(cfg)
    # Only this stage's layers are ever materialized: no rank holds the whole model.
    stage = parallel.build_model(cfg, grid, device, stage=lambda model: PipelineStage(model, bounds, grid.pp_rank),
                                 dtype=dtype)
    if cfg.model.tie_embeddings and grid.pp > 1 and stage.last:
        stage.lm_head.weight.tied_copy = True    # a copy of stage 0's embedding (reduce_tied_embedding)
    stage.comm = Comm.create(cfg, grid)
    return stage


@torch.no_grad()
def reduce_tied_embedding(model: PipelineStage, grid: Grid) -> None:
    """Tied embeddings across stages: the first stage's embedding and the last stage's copy each get
    only their own use's gradient; summed over the pair (Megatron's _allreduce_embedding_grads),
    both take the same update. One [V/TP, dim] all-reduce between two ranks, whatever the scale."""
    if grid.embed_group is None:
        return
    p = model.embed.weight if model.first else model.lm_head.weight
    grad = parallel.grad_of(p)               # fp32 in mixed (optim.accumulate_grads_in_fp32)
    if grad is not None:
        parallel.all_reduce(grad, grid.embed_group)


@torch.no_grad()
def sync_tied_embedding(model: PipelineStage, grid: Grid, optimizer) -> None:
    """After the update: the last stage's copy of a tied embedding takes the first stage's weights where the two may
    round apart. Rounded in software (optim.stochastic_round_) both draw one stream (AdamW._sr_key): bit-identical,
    nothing to do, unless ZeRO-1 shards them: the stages' DP shards cut the two at other points, and each slot draws
    its own stream. Trainium rounds bf16_sr in hardware, each NeuronCore from its own generator, whose position at the
    embedding's update follows all its stage's graph rounded before: the copies would drift apart by bf16 ulps, for
    good. NxD syncs shared weights once, at the start (pipeline/model.py _sync_shared_weights), then all-reduces their
    gradients only, as reduce_tied_embedding does. Costs one [V/TP, dim] broadcast between two ranks a step (the
    gradient's all-reduce again), under bf16_sr only."""
    if grid.embed_group is None or getattr(optimizer, "precision", None) != "bf16_sr" or (
            optimizer.use_sr and not optimizer.zero1):
        return
    p = model.embed.weight if model.first else model.lm_head.weight
    parallel.broadcast(p.data, grid.rank % (grid.tp * grid.dp), grid.embed_group)    # from the first stage's rank


# ----------------------------------------------------------------------------- 2. point-to-point

@dataclass
class Comm:
    """How this rank exchanges activations with its neighbours (same TP and DP coordinates)."""
    impl: str                                    # "send" | "allgather"
    prev: int | None                             # global rank of the previous stage; None on the first
    next: int | None                             # global rank of the next stage; None on the last
    shape: tuple[int, ...]                       # every message: [micro_batch, seq (/tp with SP), dim]
    group: object = None                         # the PP group ("send")
    pairs: dict = field(default_factory=dict)    # peer -> (two-rank group, peer's index in it) ("allgather")
    dtype: torch.dtype = torch.float32           # of the stage's parameters (set by reset: on XLA the
    device: torch.device = torch.device("cpu")   #   stage is built on the host, then moved)
    cut: object = None                           # ends the traced graph after each exchange (reset)
    wait_s: float = 0.0                          # seconds spent in p2p since the last reset

    def reset(self, model: nn.Module, cut) -> None:
        """Before a step: the params' dtype and device, the caller's graph cut, the wait at zero."""
        p = next(model.parameters())
        self.dtype, self.device, self.cut, self.wait_s = p.dtype, p.device, cut, 0.0

    @staticmethod
    def create(cfg: Config, grid: Grid) -> "Comm":
        seq = cfg.data.seq_len // grid.tp if cfg.parallel.sp and grid.tp > 1 else cfg.data.seq_len
        stride = grid.tp * grid.dp                 # ranks = arange(world).reshape(PP, DP, TP)
        comm = Comm(impl=cfg.parallel.pp_p2p,
                    prev=grid.rank - stride if grid.pp_rank > 0 else None,
                    next=grid.rank + stride if grid.pp_rank < grid.pp - 1 else None,
                    shape=(cfg.data.micro_batch, seq, cfg.model.dim), group=grid.pp_group)
        if comm.impl == "allgather":
            with monitor.quiet_gloo():             # not gloo's lines for each pair group on each rank
                comm.pairs = _pair_groups(grid)
        return comm


def pair_meshes(world: int, tp: int, pp: int) -> list[list[list[int]]]:
    """The "allgather" pairs as two meshes, as NxD's get_pipeline_model_parallel_sr_group builds
    them: for each pipeline r_0..r_(pp-1), [r_i, r_((i+1) % pp)] for i of one parity; the link of
    stages s, s+1 lies in mesh s % 2. The wrap-around pair never carries data, but XLA's verifier
    wants each mesh to name every rank exactly once (an even pp: configs.validate on xla)."""
    pp_groups = parallel.rank_groups(world, tp, pp)["pp"]
    return [[[g[i], g[(i + 1) % pp]] for g in pp_groups for i in range(parity, pp, 2)] for parity in (0, 1)]


def _pair_groups(grid: Grid) -> dict[int, tuple[object, int]]:
    """peer's global rank -> (two-rank group, peer's index in it). Every rank creates every pair in
    the same order (new_group is collective), each with its whole mesh (XLA compiles a collective
    with all ranks' replica groups: tests/xla_rules.py)."""
    mine = {}
    for mesh in pair_meshes(grid.world, grid.tp, grid.pp):
        opts = parallel.group_options(grid.backend, mesh)
        for pair in mesh:
            group = dist.new_group(pair, pg_options=opts)
            if grid.rank in pair and pair[0] < pair[1]:      # a link [r_s, r_(s+1)], not the wrap-around
                peer = pair[1] if pair[0] == grid.rank else pair[0]
                mine[peer] = (group, pair.index(peer))
    return mine


def p2p(comm: Comm, send: torch.Tensor | None, peer: int | None, recv: bool) -> torch.Tensor | None:
    """Send `send` to `peer` and/or receive one message (comm.shape) from it, in one blocking exchange
    (peer None, past either end: nothing). Both neighbours call it in the same order: "allgather" is
    a collective of the pair."""
    if peer is None or (send is None and not recv):
        return None
    t0 = time.perf_counter()
    if comm.impl == "send":
        ops, buf = [], None
        if send is not None:
            ops.append(dist.P2POp(dist.isend, send.contiguous(), peer, comm.group))
        if recv:
            buf = torch.empty(comm.shape, dtype=comm.dtype, device=comm.device)
            ops.append(dist.P2POp(dist.irecv, buf, peer, comm.group))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    else:
        # NxD on XLA: all-gather over the pair; a side with nothing to send contributes zeros.
        group, peer_index = comm.pairs[peer]
        mine = send if send is not None else torch.zeros(comm.shape, dtype=comm.dtype, device=comm.device)
        both = torch.empty(2 * mine.numel(), dtype=mine.dtype, device=mine.device)
        # The seam where scripts/pp_graphs.py stands in for the neighbour (one process, all stages).
        dist.all_gather_into_tensor(both, mine.contiguous().view(-1), group=group)
        buf = both.view(2, *comm.shape)[peer_index].clone() if recv else None   # only the peer's half stays alive
    # Each exchange is its own graph, as in NxD's NxDPPModel (pipeline/comm.py: "Isolate the CC graph
    # to prevent hanging": neighbours reach the steady state at different microbatches, so a
    # collective fused with compute would sit in graphs the peer never runs).
    comm.cut()
    comm.wait_s += time.perf_counter() - t0
    return buf


# ----------------------------------------------------------------------------- 3. schedules

class _Microbatches:
    """One step's forward/backward on this stage: the microbatches in flight (input leaf, output),
    their peak count, the summed loss. cut() after each task: a graph each, as NxDPPModel."""

    def __init__(self, stage: PipelineStage, batches: list[dict], scale: torch.Tensor, grid: Grid, cut):
        self.stage, self.batches, self.scale, self.grid, self.cut = stage, batches, scale, grid, cut
        self.next_fwd = 0
        self.live: list[tuple[torch.Tensor | None, torch.Tensor]] = []
        self.max_live = 0
        self.loss_sum = torch.zeros((), device=scale.device)

    def forward(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """The next microbatch, from x (the previous stage's output; None on the first stage)."""
        b = self.batches[self.next_fwd]
        self.next_fwd += 1
        if self.stage.first:
            inp, x = None, b["tokens"]
        else:
            inp = x = x.detach().requires_grad_()      # a leaf: its .grad goes back to the previous stage
        out = self.stage(x, b["positions"], b.get("doc_ids"), b["targets"], self.scale)
        if self.stage.last:                             # out is the microbatch's summed loss
            self.loss_sum += out.detach()
            out = out * self.scale                      # the same normalization as train.train_step
        self.live.append((inp, out))
        self.max_live = max(self.max_live, len(self.live))
        self.cut()
        return None if self.stage.last else out.detach()

    def backward(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """The oldest microbatch in flight, from d loss / d output (None on the last stage)."""
        inp, out = self.live.pop(0)
        torch.autograd.backward(out, grad_tensors=grad)
        self.cut()
        return None if inp is None else inp.grad


def gpipe(mb: _Microbatches, comm: Comm) -> None:
    """All forwards, then all backwards (1F1B warmed up with every microbatch): holds all their activations."""
    one_f_one_b(mb, comm, warmup=len(mb.batches))


def one_f_one_b(mb: _Microbatches, comm: Comm, warmup: int | None = None) -> None:
    """1F1B (PipeDream-flush, Megatron's non-interleaved): stage s runs PP - s - 1 warm-up forwards,
    then one forward and one backward in turn (at most PP - s microbatches alive), then the last
    backwards. A send and a receive at the same moment go as one exchange: neighbours meet in order."""
    m, grid = len(mb.batches), mb.grid
    warmup = min(grid.pp - grid.pp_rank - 1, m) if warmup is None else warmup
    for _ in range(warmup):
        x = p2p(comm, None, comm.prev, recv=True)
        p2p(comm, mb.forward(x), comm.next, recv=False)
    steady = m - warmup
    x = p2p(comm, None, comm.prev, recv=True) if steady else None
    for i in range(steady):
        y = mb.forward(x)
        dy = p2p(comm, y, comm.next, recv=True)
        dx = mb.backward(dy)
        last = i == steady - 1
        x = p2p(comm, dx, comm.prev, recv=not last)
    for _ in range(warmup):
        dy = p2p(comm, None, comm.next, recv=True)
        p2p(comm, mb.backward(dy), comm.prev, recv=False)


SCHEDULES = {"1f1b": one_f_one_b, "gpipe": gpipe}


# ----------------------------------------------------------------------------- 4. the gradients of a step

def no_cut() -> None:
    """The default graph cut: nothing (eager devices); train.py passes its sync on XLA."""


def forward_backward(model: PipelineStage, batches: list[dict], scale: torch.Tensor, grid: Grid, cfg: Config,
                     cut) -> tuple[torch.Tensor, dict]:
    """train.forward_backward through the pipeline: this rank's microbatches through the schedule,
    each backward scaled by `scale`, then the tied embedding's copies summed. Returns the summed token
    loss (every stage: the others add zeros) and the stats: bubble, (PP - 1) / (m + PP - 1); idle, the
    share of the schedule this rank waited in p2p (host clock: lazy on XLA, use a profile there);
    max_live, the peak activation sets held."""
    if len(batches) < grid.pp:
        raise ConfigError(f"pipeline of {grid.pp} stages needs at least {grid.pp} microbatches per step, "
                          f"got {len(batches)}; raise the global batch or lower micro_batch")
    t0 = time.perf_counter()
    mb = _Microbatches(model, batches, scale, grid, cut)
    comm = model.comm
    comm.reset(model, cut)
    SCHEDULES[cfg.parallel.pp_schedule](mb, comm)
    schedule_s = time.perf_counter() - t0
    reduce_tied_embedding(model, grid)
    return parallel.all_reduce(mb.loss_sum, grid.pp_group), {
        "bubble": (grid.pp - 1) / (len(batches) + grid.pp - 1), "idle": comm.wait_s / max(schedule_s, 1e-9),
        "max_live": mb.max_live}


# ----------------------------------------------------------------------------- 5. state dicts, evaluation

@torch.no_grad()
def gather_full_state_dict(model: PipelineStage, grid: Grid, grads: bool = False, masters: dict | None = None) -> dict:
    """Full-shape weights (or gradients, or fp32 masters: parallel's) of the WHOLE model on every rank: each stage
    gathers its TP shards, then broadcasts each tensor over PP (parallel.broadcast: XLA too). One full model a rank."""
    mine = parallel.gather_full_state_dict(model, grid, grads, masters)
    cfg = model.cfg
    shapes = llama.param_shapes(cfg)                  # tied: both names
    ranks = next(g for g in parallel.rank_groups(grid.world, grid.tp, grid.pp)["pp"] if grid.rank in g)
    p = next(iter(mine.values())) if mine else next(model.parameters())    # the dtype: the masters' (fp32) or not
    out = {}
    for name, shape in shapes.items():
        s = stage_of(name, model.bounds)
        t = mine[name] if s == grid.pp_rank else torch.empty(shape, dtype=p.dtype, device=p.device)
        parallel.broadcast(t, ranks[s], grid.pp_group)     # not dist.broadcast: wrong on xla sub-groups
        out[name] = t
    return out


@torch.no_grad()
def evaluate(model: PipelineStage, loader, n_batches: int, grid: Grid, device: torch.device,
             cut=no_cut) -> torch.Tensor:
    """train.evaluate through the pipeline, the same value on every rank: the last stage computes
    the loss, the others add zeros. cut() after each forward and each exchange, as in training."""
    model.eval()
    loader.reset()
    comm = model.comm
    comm.reset(model, cut)
    total = torch.zeros((), device=device)
    count = torch.zeros((), device=device)          # float: Neuron's all-reduce adds in f32 (train.train_step)
    for _ in range(n_batches):
        b = next(loader)
        b = dict(zip(b, parallel.to_device(list(b.values()), device)))     # XLA: one batched transfer
        x = p2p(comm, None, comm.prev, recv=True)
        out = model(b["tokens"] if model.first else x, b["positions"], b.get("doc_ids"), b["targets"])
        if model.last:
            total += out
        count += (b["targets"] != -100).sum(dtype=torch.float32)
        cut()
        if not model.last:
            p2p(comm, out, comm.next, recv=False)
    model.train()
    total = parallel.all_reduce(parallel.all_reduce(total, grid.pp_group), grid.dp_group)
    return total / parallel.all_reduce(count, grid.dp_group).clamp(min=1)
