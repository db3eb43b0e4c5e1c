"""The cluster planner: what one NeuronCore holds, computes and sends for a layout, and which
layouts fit, fastest first. Arithmetic on the config only: no model is built, nothing is launched.

    python plan.py                                        # the blog's run: llama2_7b on 128 trn1
    python plan.py --preset llama2_70b --parallel.cores=2048
    python plan.py --preset llama2_7b --instance trn2      # trn2.48xlarge: 64 logical cores each
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

from configs import INSTANCES, Config, ConfigError, Instance, ModelConfig, check_layout, check_values, from_args
from model import LinearCrossEntropy, flops_per_token, num_params

# Hardware: configs.INSTANCES (the Neuron docs' figures). Every judgment call is marked "assumption".

RESERVE = 2 * 2**30             # assumption: runtime, compiled program, collective buffers, compiler
                                # scratch. Neuron publishes no figure, and users report HBM OOM at compile
                                # time for layouts that fit by arithmetic (aws-neuron-sdk #884, #1014)
STATED_MFU = 0.40               # the MFU the headline step time is quoted at
COMPUTE_EFFICIENCY = 0.50       # assumption: share of peak the compiled matmuls sustain; recompute,
                                # pipeline bubble and exposed communication then lower the real MFU
# Bytes per parameter (weights, gradients, optimizer states) and per activation, as optim.py stores
# them: mixed keeps bf16 weights, fp32 gradients (accumulated in fp32: optim.accumulate_grads_in_fp32)
# plus an fp32 master copy and fp32 moments; bf16 and bf16_sr store everything in bf16 (SR changes
# only how updates are rounded).
PRECISION_BYTES = {"fp32": (4, 4, 8, 4), "mixed": (2, 4, 12, 2), "bf16": (2, 2, 4, 2), "bf16_sr": (2, 2, 4, 2)}


@dataclass(frozen=True, order=True)
class Layout:
    tp: int
    pp: int
    dp: int
    sp: bool
    zero1: bool
    checkpointing: str
    micro_batch: int

    def __str__(self):
        return (f"TP={self.tp} PP={self.pp} DP={self.dp}{' SP' if self.sp else ''}"
                f"{' ZeRO-1' if self.zero1 else ''} {self.checkpointing} mb={self.micro_batch}")


@dataclass
class Estimate:
    layout: Layout
    microbatches: int             # per DP rank per optimizer step
    params: int                   # on the busiest core
    weights: float                # bytes per core (the busiest stage) ...
    grads: float
    optimizer: float
    activations: float
    loss: float                   # logits, softmax and their gradients (last stage)
    total: float
    fits: bool
    flops: float                  # model FLOPs per core per step (6N + attention)
    compute_s: float              # with recompute, at COMPUTE_EFFICIENCY
    bubble_s: float
    tp_bytes: float               # per core per step, and the link each kind crosses
    pp_bytes: float
    dp_bytes: float
    tp_s: float
    pp_s: float
    dp_s: float                   # exposed part (the rest overlaps the last backward)
    pp_link: str
    dp_link: str
    stage: str = "all"            # the pipeline stage these bytes are for: first, last or all
    peak: float = INSTANCES["trn1"].bf16_flops

    @property
    def step_s(self) -> float:
        return self.compute_s + self.bubble_s + self.tp_s + self.pp_s + self.dp_s

    @property
    def mfu(self) -> float:
        return self.flops / (self.step_s * self.peak)


def _layer_params(m: ModelConfig, tp: int) -> int:
    kv_heads = max(m.n_kv_heads // tp, 1)           # tp > n_kv_heads: each rank keeps one KV head copy
    attn = 2 * (m.n_heads // tp) * m.head_dim * m.dim + 2 * kv_heads * m.head_dim * m.dim
    return attn + 3 * m.dim * m.ffn_dim // tp + 2 * m.dim


def _layer_act_bytes(m: ModelConfig, seq: int, tp: int, sp: bool, ckpt: str, ab: int, attention: str) -> float:
    """Bytes one layer keeps for backward per token of its microbatch. Korthikanti et al.'s method
    ("Reducing Activation Recomputation", 2022: list every tensor autograd saves) applied to our
    block; their 34sbh + 5as^2b is the same count for GPT-3's block (fused LayerNorm, dropout masks,
    4h GeLU MLP). Ours: per RMSNorm its fp32 input, normalized and output (the next matmul's input);
    q, k, v (k and v after the GQA repeat), the o_proj input; gate|up, silu(gate) and their
    product; and, without checkpointing, the softmax probabilities (XLA's SDPA is the math path) or,
    for the flash kernel CPU PyTorch uses, its output and logsumexp. Selective checkpointing drops
    the attention core; full keeps only the layer input (see activation_bytes).
    Assumption: under SP the column-parallel layers save their input as the sequence shard and
    all-gather it again in backward (Megatron, NxD), so everything outside TP regions divides by tp.
    Saving the gathered input instead costs 2 * h * ab * (1 - 1/tp) more per token and layer."""
    h, f = m.dim, m.ffn_dim
    outside = 2 * (4 + 2 * ab) * h
    inside = (4 * h + 4 * f) * ab
    if ckpt == "none":
        inside += m.n_heads * seq * ab if attention == "math" else h * ab + 4 * m.n_heads
    return outside / (tp if sp else 1) + inside / tp


def activation_bytes(m: ModelConfig, seq: int, mb: int, tp: int, sp: bool, ckpt: str, ab: int,
                     layers: int, in_flight: int, attention: str = "math") -> float:
    """Activations of one pipeline stage holding `in_flight` microbatches of `layers` layers."""
    rows = seq * mb
    if ckpt == "full":       # each layer's input, plus one layer recomputed in full during backward
        kept = in_flight * layers * m.dim * ab / (tp if sp else 1)
        return rows * (kept + _layer_act_bytes(m, seq, tp, sp, "none", ab, attention))
    return rows * in_flight * layers * _layer_act_bytes(m, seq, tp, sp, ckpt, ab, attention)


def _comm_seconds(hw: Instance, per_core: float, stride: int, size: int, world: int, ring: bool) -> tuple[float, str]:
    """Time for a collective whose groups are `size` ranks `stride` apart. Inside one instance it
    runs on NeuronLink at each core's share. Across instances the instance's EFA carries, per
    group touching it, one ring crossing (ring) or every core's own bytes (pipeline send/recv)."""
    if size == 1:
        return 0.0, "-"
    n = hw.cores
    if stride * size <= n or world <= n:
        return per_core / hw.link_bw, "NeuronLink"
    ranks_here = max(1, min(size, n // stride))      # of one group, on one instance
    node_bytes = per_core * (n // ranks_here if ring else n)
    return node_bytes / hw.efa_bw, "EFA"


def estimate(cfg: Config, layout: Layout | None = None, world: int | None = None,
             attention: str = "math") -> Estimate:
    """Memory, time and traffic per core of `layout` (default: the configured one) on `world` cores."""
    m, d, p = cfg.model, cfg.data, cfg.parallel
    hw = INSTANCES[p.instance]
    world = world or p.cores or 128 * hw.cores
    L = layout or Layout(p.tp, p.pp, max(1, world // (p.tp * p.pp)), p.sp and p.tp > 1, p.zero1,
                         m.checkpointing, d.micro_batch)
    wb, gb, ob, ab = PRECISION_BYTES[cfg.optim.precision]
    if cfg.optim.precision == "mixed" and not cfg.optim.fp32_grad_acc:
        gb = 2                                       # --optim.fp32_grad_acc=false: bf16 gradients
    mbs = max(1, d.global_batch // (L.micro_batch * L.dp))   # < 1 only in what-if tables
    layers = -(-m.n_layers // L.pp)
    embed = -(-m.vocab_size // L.tp) * m.dim       # vocabulary padded to a TP multiple
    in_flight = 1 if L.pp == 1 else (min(L.pp, mbs) if p.pp_schedule == "1f1b" else mbs)
    rows = d.seq_len * L.micro_batch
    # Pipeline: the first stage holds the embedding and (1F1B) up to PP microbatches in flight;
    # the last stage holds the head, one microbatch, and the loss. Report the fuller one.
    stages = []
    for first, last in ([(True, True)] if L.pp == 1 else [(True, False), (False, True)]):
        head = 0 if first and m.tie_embeddings else embed          # tied on one stage: one matrix
        n = layers * _layer_params(m, L.tp) + (embed if first else 0) + (head + m.dim if last else 0)
        act = activation_bytes(m, d.seq_len, L.micro_batch, L.tp, L.sp, L.checkpointing, ab, layers,
                               in_flight if first else 1, attention)
        loss = 0.0
        if last and L.tp > 1:   # final norm; vocab-parallel logits + fp32 softmax + two fp32 gradients
            loss = rows * ((4 + 2 * ab) * m.dim / (L.tp if L.sp else 1) + (ab + 12) * embed / m.dim)
        elif last:              # final norm; the fused loss: its kept gradients, one chunk of logits
            chunk = min(rows, max(1, LinearCrossEntropy.CHUNK_LOGITS // m.vocab_size)) * m.vocab_size
            loss = rows * (4 + 3 * ab) * m.dim + 4 * embed + (2 * ab + 4) * chunk
        states = n * (wb + gb + ob / (L.dp if L.zero1 else 1))
        # Full checkpointing recomputes a layer only after the loss's buffers are freed: not both at once.
        overlap = min(loss, rows * _layer_act_bytes(m, d.seq_len, L.tp, L.sp, "none", ab, attention)
                      ) if L.checkpointing == "full" else 0.0
        stages.append((states + act + loss - overlap, n, act, loss, "all" if last and first else "first" if first else "last"))
    total, n, act, loss, stage = max(stages)
    flops = flops_per_token(m, d.seq_len) * d.global_batch * d.seq_len / world
    recompute = {"none": 0, "selective": 2 * m.n_layers * d.seq_len * m.dim,
                 "full": flops_per_token(m, d.seq_len) / 3}[L.checkpointing]
    peak = (hw.fp32_flops if ab == 4 else hw.bf16_flops) * COMPUTE_EFFICIENCY
    compute = (flops + recompute * d.global_batch * d.seq_len / world) / peak
    bubble = compute * (L.pp - 1) / mbs
    # Per microbatch and layer, TP moves 4 activations forward and 4 back (all-gather/reduce-scatter
    # with SP, all-reduces without: the same bytes), 4 more for full recompute; +4 for embed/head.
    act_msg = rows * m.dim * ab
    n_msgs = mbs * (layers * (12 if L.checkpointing == "full" else 8) + 4)
    tp_bytes = n_msgs * act_msg * (L.tp - 1) / L.tp
    pp_bytes = 0 if L.pp == 1 else 2 * mbs * act_msg / (L.tp if L.sp else 1)
    # all-reduce of the grads, or (ZeRO-1) reduce-scatter of the grads + all-gather of the weights
    dp_bytes = (L.dp - 1) / L.dp * n * (gb + (wb if L.zero1 else gb))
    tp_s = tp_bytes / hw.link_bw
    pp_s, pp_link = _comm_seconds(hw, pp_bytes, L.tp * L.dp, L.pp, world, ring=False)
    dp_s, dp_link = _comm_seconds(hw, dp_bytes, L.tp, L.dp, world, ring=True)
    # Assumption: TP and PP transfers block compute; the DP reduction overlaps the last microbatch's backward.
    dp_s = max(0.0, dp_s - compute / mbs * 2 / 3)
    return Estimate(L, mbs, n, n * wb, n * gb, n * ob / (L.dp if L.zero1 else 1), act, loss, total,
                    total <= hw.hbm - RESERVE, flops, compute, bubble, tp_bytes, pp_bytes,
                    dp_bytes, tp_s, pp_s, dp_s, pp_link, dp_link, stage, peak / COMPUTE_EFFICIENCY)


def _tps(m: ModelConfig, hw: Instance) -> list[int]:
    """TP degrees inside one instance that keep whole attention heads and whole KV groups per rank."""
    return [t for t in (1, 2, 4, 8, 16, 32, 64) if t <= hw.cores
            and m.n_heads % t == 0 and (m.n_kv_heads % t == 0 or t % m.n_kv_heads == 0)]


def _layout(cfg: Config, world: int, tp: int, pp: int, sp: bool, zero1: bool, ckpt: str, mb: int):
    """The Layout, or None when validate() would reject it (batch, stages, sequence split)."""
    dp, g = world // (tp * pp), cfg.data.global_batch
    if world % (tp * pp) or cfg.model.n_layers % pp or g % (mb * dp) or (pp > 1 and g // (mb * dp) < pp):
        return None
    return Layout(tp, pp, dp, sp and tp > 1 and cfg.data.seq_len % tp == 0, zero1 and dp > 1, ckpt, mb)


def layouts(cfg: Config, world: int) -> list[Layout]:
    """Every layout to consider on `world` cores: TP from _tps, PP dividing the layers, with and
    without SP and ZeRO-1, each checkpointing mode, micro-batches 1, 2, 4 and the configured one."""
    found = {_layout(cfg, world, tp, pp, sp, z, ckpt, mb)
             for tp in _tps(cfg.model, INSTANCES[cfg.parallel.instance]) for pp in range(1, cfg.model.n_layers + 1)
             for sp in (False, True) for z in (False, True) for ckpt in ("none", "selective", "full")
             for mb in {1, 2, 4, cfg.data.micro_batch}}
    return sorted(x for x in found if x is not None)


def plan(cfg: Config, world: int | None = None, top: int = 10) -> str:
    """The report `python plan.py` prints."""
    m, d = cfg.model, cfg.data
    hw = INSTANCES[cfg.parallel.instance]
    world = world or cfg.parallel.cores or 128 * hw.cores
    gib = lambda b: f"{b / 2**30:6.2f}"
    e = estimate(cfg, world=world)
    L, fpt, tokens = e.layout, flops_per_token(m, d.seq_len), d.global_batch * d.seq_len
    peak = hw.fp32_flops if cfg.optim.precision == "fp32" else hw.bf16_flops
    lines = [
        f"plan: {cfg.preset or 'custom'} on {world} NeuronCores ({world / hw.cores:g} {hw.name}), "
        f"seq {d.seq_len}, global batch {d.global_batch}, precision {cfg.optim.precision}",
        f"model: {num_params(m) / 1e9:.2f}B parameters, {fpt / 1e9:.2f} GFLOP per token (6N + attention), "
        f"{tokens / 1e6:.2f}M tokens per step",
        f"step time at {STATED_MFU:.0%} MFU ({peak / 1e12:g} TFLOPS per core): "
        f"{fpt * tokens / (world * peak * STATED_MFU):.2f} s",
        "", f"configured layout: {L}, {e.microbatches} microbatches per step"
        + ("" if _layout(cfg, world, L.tp, L.pp, L.sp, L.zero1, L.checkpointing, L.micro_batch) else
           f" (cannot run on {world} cores: TP x PP must divide them and the global batch split over DP)"),
        f"  per NeuronCore ({'every core' if L.pp == 1 else e.stage + ' stage, the fuller'})      GiB",
        f"  weights      {e.params / 1e6:8.1f}M params  {gib(e.weights)}",
        f"  gradients                       {gib(e.grads)}",
        f"  optimizer    {'sharded over DP' if L.zero1 else 'replicated'.ljust(15)}   {gib(e.optimizer)}",
        f"  activations  {L.checkpointing + (' + SP' if L.sp else '')}".ljust(34) + gib(e.activations),
        f"  logits/loss                     {gib(e.loss)}",
        f"  total                           {gib(e.total)} of {(hw.hbm - RESERVE) / 2**30:.0f} usable "
        f"({hw.hbm / 2**30:.0f} GiB - {RESERVE / 2**30:.0f} GiB reserve): {'fits' if e.fits else 'DOES NOT FIT'}",
        f"  traffic per core per step: TP {e.tp_bytes / 1e9:.2f} GB NeuronLink, PP {e.pp_bytes / 1e9:.2f} GB "
        f"{e.pp_link}, DP {e.dp_bytes / 1e9:.2f} GB {e.dp_link}",
        f"  estimated step {e.step_s:.2f} s = compute {e.compute_s:.2f} + bubble {e.bubble_s:.2f} + TP "
        f"{e.tp_s:.2f} + PP {e.pp_s:.2f} + exposed DP {e.dp_s:.2f} (MFU {e.mfu:.0%})",
        "", f"  activations per core (GiB) at TP={L.tp} PP={L.pp}:",
        "  checkpointing " + "".join(f"  mb={b}: SP off  SP on" for b in (1, 2, 4))]
    for ckpt in ("none", "selective", "full"):
        row = [estimate(cfg, Layout(L.tp, L.pp, L.dp, sp, L.zero1, ckpt, mb), world).activations
               for mb in (1, 2, 4) for sp in (False, L.tp > 1)]
        lines.append(f"  {ckpt:13s}" + "".join(f"       {gib(row[i])} {gib(row[i + 1])}" for i in range(0, 6, 2)))
    lines += ["", "  same settings on other layouts:   TP  PP   DP  states  activ.   total  (GiB per core)"]
    for tp in _tps(m, hw):
        for pp in sorted({1, L.pp}):
            if world % (tp * pp) == 0 and m.n_layers % pp == 0:   # memory even where the batch can't split
                dp = world // (tp * pp)
                x = Layout(tp, pp, dp, L.sp and tp > 1, L.zero1 and dp > 1, L.checkpointing, L.micro_batch)
                y, runs = estimate(cfg, x, world), _layout(cfg, world, tp, pp, L.sp, L.zero1, L.checkpointing, L.micro_batch)
                lines.append(f"  {'':33s}{tp:3d} {pp:3d} {dp:4d}  {gib(y.weights + y.grads + y.optimizer)} "
                             f"{gib(y.activations)}  {gib(y.total)}  {'fits' if y.fits else 'no'}"
                             + ("" if runs else f" (and global batch {d.global_batch} < micro-batch x DP)"))
    every = layouts(cfg, world)
    fit = sorted((x for x in (estimate(cfg, y, world) for y in every) if x.fits), key=lambda x: x.step_s)
    lines += ["", f"layouts that fit, fastest first ({len(fit)} of {len(every)}):",
              "   TP  PP   DP  SP  ZeRO-1 ckpt       mb    GiB  step s  MFU   TP GB  PP GB  DP GB"]
    for x in fit[:top]:
        y = x.layout
        lines.append(f"  {y.tp:3d} {y.pp:3d} {y.dp:4d}  {'yes' if y.sp else 'no ':3s} {'yes' if y.zero1 else 'no ':6s} "
                     f"{y.checkpointing:9s} {y.micro_batch:3d} {gib(x.total)} {x.step_s:7.2f} {x.mfu:4.0%} "
                     f"{x.tp_bytes / 1e9:7.2f} {x.pp_bytes / 1e9:6.2f} {x.dp_bytes / 1e9:6.2f}")
    if not fit:
        lines.append(f"  none: give more cores (--parallel.cores), or a global batch ({d.global_batch}) that "
                     f"splits into micro-batches over the data-parallel ranks")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if not any(a == "--preset" or a.startswith("--preset=") for a in argv):
        argv = ["--preset", "llama2_7b", *argv]    # the tiny CPU preset cannot be planned on 4096 cores
    try:
        cfg = from_args(argv)
        check_values(cfg)                   # the keys' domains and the model: what train.py refuses
        world = cfg.parallel.cores or 128 * INSTANCES[cfg.parallel.instance].cores
        try:                                # the configured layout must be one a launch could run
            check_layout(cfg, world)
        except ConfigError as e:
            raise ConfigError(f"{e} (planning for --parallel.cores={world})") from None
    except ConfigError as e:
        sys.exit(f"config error: {e}")
    try:
        print(plan(cfg))
    except KeyboardInterrupt:
        sys.exit("interrupted")


if __name__ == "__main__":
    main(sys.argv[1:])
