"""The planner's cost model: for a layout, the bytes one NeuronCore holds (weights, gradients,
optimizer states, activations, the loss) and the seconds a step takes (matmuls, attention, TP/PP/DP
collectives, the update), from the config and the datasheets alone; three constants are fitted
(planner/calibrate.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from configs import Config, ModelConfig
import sharding
from model import LinearCrossEntropy, flops_per_token
import pipeline
from planner.instances import INSTANCES, Instance, tp_degrees

# Hardware: planner.instances.INSTANCES (the Neuron docs' figures). Every judgment call is marked "assumption".

RESERVE = 2 * 2**30             # assumption: runtime, compiled program, collective buffers, compiler
                                # scratch. Neuron publishes no figure, and users report HBM OOM at compile
                                # time for layouts that fit by arithmetic (aws-neuron-sdk #884, #1014)
STATED_MFU = 0.40               # the MFU the headline step time is quoted at
# Bytes per parameter (weights, gradients, optimizer states) and per activation, as optim.py stores
# them: mixed keeps bf16 weights, fp32 gradients (accumulated in fp32: optim.accumulate_grads_in_fp32)
# plus an fp32 master copy and fp32 moments; bf16 and bf16_sr store everything in bf16 (SR changes
# only how updates are rounded).
PRECISION_BYTES = {"fp32": (4, 4, 8, 4), "mixed": (2, 4, 12, 2), "bf16": (2, 2, 4, 2), "bf16_sr": (2, 2, 4, 2)}


# Step time. A microbatch on one pipeline stage is priced op by op from its shapes and the
# datasheets: the matmuls (a roofline of TensorEngine FLOPs and HBM bytes), the attention core, the
# TP collectives on NeuronLink and the stage-to-stage sends, plus a fixed cost per microbatch; the
# step adds the pipeline bubble, the DP reduction and the optimizer update. Three constants are
# fitted to Neuron's published trn1 throughput of NxD Llama 2 7B and 13B (planner/trn1_training.csv)
# by planner/calibrate.py, whose output they are (tests/test_plan.py reruns it); everything else is
# a datasheet or a measurement, cited. `python plan.py --validate` prints the published rows
# against these estimates, the 70B and Llama 3.1 rows predicted, not fitted.
MATMUL_EFFICIENCY = 0.483      # fitted: share of the bf16 peak a large matmul sustains on trn1
MICROBATCH_OVERHEAD = 0.0145   # fitted: seconds per microbatch and stage (graph launches, syncs)
# (and SCORE_PASSES below)
# Per-core HBM bandwidth: trn1 and trn1n 820 GiB/s per chip of 2 cores ("Trainium Architecture";
# 13,120 GiB/s per instance in "Amazon EC2 Trn1/Trn1n Architecture"); trn2.48xlarge 46.4 TB/s per
# instance of 64 logical cores ("Amazon EC2 Trn2 Architecture").
HBM_BW = {"trn1": 820 * 2**30 / 2, "trn1n": 820 * 2**30 / 2, "trn2": 46.4e12 / 64}
# Collectives: the Neuron nccom-test guide's example (2.16 docs, trn1 and inf2 only then): a 2-rank
# all-reduce of 1 GiB on one instance sustains 52.83 GiB/s of bus bandwidth, a per-rank figure
# that the guide defines independent of the rank count, so a ring of r ranks moves (r-1)/r of a
# buffer per rank at that rate: 27.5% of the NeuronLink share in instances.INSTANCES (the same share
# is assumed on trn2, which has no published measurement). Latency, from the same trn1 examples
# (the guide of Neuron 2.15-2.23, e.g. aws-neuron-sdk@8907253c tools/neuron-sys-tools/nccom-test.rst):
# a 2-rank all-reduce of 1-64 KiB takes 58 us, a 32-rank all-gather of 1-64 KiB 149-151 us. As a
# ring, a fixed start plus one hop per step (an all-gather or reduce-scatter of r ranks is r - 1
# steps, an all-reduce 2(r - 1)): 51.6 us + 3.2 us per step, 74 us at TP=8 and 151 us at TP=32.
# (The 6.16 us 32-rank all-gather the guide shows from Neuron 2.24 names no instance and came with
# trn2 and a newer runtime; the published trn1 rows ran on the runtimes of 2.16-2.24. trn2 reuses
# the trn1 figures.)
LINK_EFFICIENCY = 52.83 / 192
LATENCY_START, LATENCY_STEP = 51.6e-6, 3.2e-6


def _latency(steps: int) -> float:
    """Seconds a collective of `steps` ring steps costs beyond its bytes."""
    return LATENCY_START + steps * LATENCY_STEP
TILE = 128                     # NeuronCore-v2's TensorEngine is a 128 x 128 systolic array: a matmul
                               # dimension that is not a multiple of 128 leaves part of it idle
# Attention without a fused kernel writes the [heads, T, T] scores and probabilities to HBM and
# reads them back. Our ExplicitAttention (written out like NxD's CoreAttention) materializes 15
# passes per layer and microbatch under recompute: forward 4 (scores written, read by the softmax,
# probabilities written, read by P@V), backward 7 (dP written, dP and P read, dS written, dS read
# twice, P read), the recomputed forward 4; without recompute 11. A compiler that fuses the mask
# and softmax into the matmuls makes fewer, so the count is fitted: Neuron's 7B rows of 2.16-2.18
# (NxD's CoreAttention) and 2.20-2.21 (its flash kernel) differ by no more than the full square's
# extra matmuls, and the fit finds no score traffic beyond them (0). A flash kernel (NxD's
# nki_flash_attn_func) keeps the scores on chip: none.
SCORE_PASSES = 0.0             # fitted: passes per layer and microbatch under recompute
WRITTEN_PASSES = {"none": 11, "recompute": 15}


def _tile(n: int) -> float:
    return n / (TILE * -(-n // TILE))


def _matmul_s(M: int, K: int, N: int, peak: float, hbm: float, ab: int, eff: float,
              acc_bytes: int = 0) -> float:
    """[M, K] @ [K, N]: its FLOPs at the sustained TensorEngine rate or its HBM bytes, whichever
    takes longer (the roofline): small per-core shapes at high TP are bandwidth-bound. A weight
    gradient (acc_bytes > 0) is added into its accumulation buffer: read and written."""
    flops = 2.0 * M * K * N / (_tile(K) * _tile(N))
    moved = ab * (M * K + K * N) + (2 * acc_bytes if acc_bytes else ab) * M * N
    return max(flops / (peak * eff), moved / hbm)


def _linear_s(M: int, K: int, N: int, peak: float, hbm: float, ab: int, gb: int,
              eff: float) -> tuple[float, float, float]:
    """Forward, input gradient ([M, N] @ [N, K]) and weight gradient ([K, M] @ [M, N])."""
    return (_matmul_s(M, K, N, peak, hbm, ab, eff), _matmul_s(M, N, K, peak, hbm, ab, eff),
            _matmul_s(K, M, N, peak, hbm, ab, eff, acc_bytes=gb))


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
    compute_s: float              # matmuls and attention, recompute included (the busiest stage)
    bubble_s: float
    tp_bytes: float               # per core per step, and the link each kind crosses
    pp_bytes: float
    dp_bytes: float
    tp_s: float
    pp_s: float
    dp_s: float                   # after the last microbatch, before the update: not overlapped
    opt_s: float                  # the AdamW update (and clipping) over this core's shard
    overhead_s: float             # MICROBATCH_OVERHEAD per microbatch
    pp_link: str
    dp_link: str
    stage: str = "all"            # the pipeline stage these bytes are for: first, last, middle #s or all
    peak: float = INSTANCES["trn1"].bf16_flops
    bucket: float = 0.0           # ZeRO-1's collective bucket in flight (in total, not in optimizer)
    overlap: float = 0.0          # full checkpointing: loss buffers and a recomputed layer never at once

    @property
    def step_s(self) -> float:
        return self.compute_s + self.bubble_s + self.tp_s + self.pp_s + self.dp_s + self.opt_s + self.overhead_s

    @property
    def mfu(self) -> float:
        return self.flops / (self.step_s * self.peak)


def _layer_params(m: ModelConfig, tp: int) -> int:
    kv_heads = sharding.kv_heads_per_rank(m, tp)
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
    runs on NeuronLink at each core's measured share (LINK_EFFICIENCY). Across instances the
    instance's EFA (its datasheet rate: no published measurement) carries, per group touching it,
    one ring crossing (ring) or every core's own bytes (pipeline send/recv)."""
    if size == 1:
        return 0.0, "-"
    n = hw.cores
    if stride * size <= n or world <= n:
        return per_core / (hw.link_bw * LINK_EFFICIENCY), "NeuronLink"
    ranks_here = max(1, min(size, n // stride))      # of one group, on one instance
    node_bytes = per_core * (n // ranks_here if ring else n)
    return node_bytes / hw.efa_bw, "EFA"


def estimate(cfg: Config, layout: Layout | None = None, world: int | None = None,
             attention: str | None = None, calibration: tuple[float, float, float] | None = None) -> Estimate:
    """Memory, time and traffic per core of `layout` (default: the configured one) on `world` cores.
    attention: the kernel, default the model's (explicit; sdpa is XLA's math path), or "flash" (a
    fused kernel: NxD's on trn1, PyTorch's on CPU). calibration: (MATMUL_EFFICIENCY,
    MICROBATCH_OVERHEAD, SCORE_PASSES) instead of the shipped ones (planner/calibrate.py)."""
    m, d, p = cfg.model, cfg.data, cfg.parallel
    kernel = attention or ("explicit" if m.attention == "explicit" else "math")
    attention = "flash" if kernel == "flash" else "math"       # memory: the probabilities kept or not
    hw = INSTANCES[p.instance]
    world = world or p.cores or 128 * hw.cores
    L = layout or Layout(p.tp, p.pp, max(1, world // (p.tp * p.pp)), p.sp and p.tp > 1, p.zero1,
                         m.checkpointing, d.micro_batch)
    wb, gb, ob, ab = PRECISION_BYTES[cfg.optim.precision]
    if cfg.optim.precision == "mixed" and not cfg.optim.fp32_grad_acc:
        gb = 2                                       # --optim.fp32_grad_acc=false: bf16 gradients
    mbs = max(1, d.global_batch // (L.micro_batch * L.dp))   # < 1 only in what-if tables
    embed = sharding.padded_vocab(m.vocab_size, L.tp) // L.tp * m.dim
    rows = d.seq_len * L.micro_batch
    # Pipeline: the first stage holds the embedding, the last the head and the loss. Microbatches in
    # flight on stage s (pipeline.py): 1F1B min(PP - s, microbatches), so PP on the first and one on
    # the last; GPipe runs every forward before any backward: all of them, on every stage. Report the fuller.
    stages = []
    for s, layers in stage_layers(cfg, L.pp):
        first, last = s == 0, s == L.pp - 1
        in_flight = 1 if L.pp == 1 else min(L.pp - s, mbs) if p.pp_schedule == "1f1b" else mbs
        head = 0 if first and m.tie_embeddings else embed          # tied on one stage: one matrix
        n = layers * _layer_params(m, L.tp) + (embed if first else 0) + (head + m.dim if last else 0)
        act = activation_bytes(m, d.seq_len, L.micro_batch, L.tp, L.sp, L.checkpointing, ab, layers,
                               in_flight, attention)
        loss = 0.0             # what each microbatch in flight keeps, + the transient of one
        if last and L.tp > 1:   # final norm and the fp32 softmax kept; the logits and two fp32 gradients
            loss = rows * (in_flight * ((4 + 2 * ab) * m.dim / (L.tp if L.sp else 1) + 4 * embed / m.dim)
                           + (ab + 8) * embed / m.dim)
        elif last:              # final norm and the fused loss's input gradient kept; its weight's gradient
            # (the weights' dtype), one chunk of logits (in ab, their log-softmax in fp32, its gradient in ab)
            chunk_rows = LinearCrossEntropy.chunk_rows(rows, m.vocab_size, m.dim)
            chunk = chunk_rows * m.vocab_size
            loss = in_flight * rows * (4 + 3 * ab) * m.dim + wb * embed + (2 * ab + 4) * chunk
            if wb < 4 and 3 * chunk_rows < rows:    # 16-bit weights over three chunks: its sum in fp32 too
                loss += 4 * embed
        states = n * (wb + gb + ob / (L.dp if L.zero1 else 1))
        # + one collective bucket in flight (optim.Zero1AdamW; 0: the whole gradient)
        bucket = min(p.zero1_bucket_mb * 2**20 or n * gb, n * gb) if L.zero1 else 0.0
        # Full checkpointing recomputes a layer only after the loss's buffers are freed: not both at once.
        overlap = min(loss, rows * _layer_act_bytes(m, d.seq_len, L.tp, L.sp, "none", ab, attention)
                      ) if L.checkpointing == "full" else 0.0
        name = "all" if last and first else "first" if first else "last" if last else f"middle #{s}"
        stages.append((states + bucket + act + loss - overlap, n, act, loss, name, bucket, overlap))
    total, n, act, loss, stage, bucket, overlap = max(stages)
    t = _step_time(cfg, L, world, mbs, every_stage(cfg, L.pp), n, kernel, calibration)
    return Estimate(L, mbs, n, n * wb, n * gb, n * ob / (L.dp if L.zero1 else 1), act, loss, total,
                    total <= hw.hbm - RESERVE, flops_per_token(m, d.seq_len) * d.global_batch * d.seq_len / world,
                    **t, stage=stage, peak=hw.fp32_flops if ab == 4 else hw.bf16_flops, bucket=bucket, overlap=overlap)


def every_stage(cfg: Config, pp: int) -> list[int]:
    """The layers of each stage: even (what-if tables: rounded up), or the configured --parallel.pp_cuts
    (pipeline.stage_bounds)."""
    p, n = cfg.parallel, cfg.model.n_layers
    if pp != p.pp or not p.pp_cuts:
        return [-(-n // pp)] * pp
    return [b - a for a, b in pipeline.stage_bounds(cfg)]


def stage_layers(cfg: Config, pp: int) -> list[tuple[int, int]]:
    """(stage, its layers) for the stages that can be the fullest: the first (the most microbatches in
    flight), the last (the head, the loss), and any stage given more layers than the first."""
    counts = every_stage(cfg, pp)
    return [(s, k) for s, k in enumerate(counts) if s in (0, pp - 1) or k > counts[0]]


def _step_time(cfg: Config, L: Layout, world: int, mbs: int, counts: list[int], n: int,
               attention: str, calibration: tuple[float, float, float] | None) -> dict:
    """Seconds per optimizer step, by part, for stages of `counts` layers: paced by the slowest
    (evenly split: the last, its layers and the head), filled and drained through the others."""
    m, d, hw = cfg.model, cfg.data, INSTANCES[cfg.parallel.instance]
    eff, per_mb, score_passes = calibration or (MATMUL_EFFICIENCY, MICROBATCH_OVERHEAD, SCORE_PASSES)
    wb, gb, ob, ab = PRECISION_BYTES[cfg.optim.precision]
    if cfg.optim.precision == "mixed" and not cfg.optim.fp32_grad_acc:
        gb = 2
    peak, hbm = (hw.fp32_flops if ab == 4 else hw.bf16_flops), HBM_BW[cfg.parallel.instance]
    T, tp, ck = d.seq_len, L.tp, L.checkpointing
    M, h, hd = T * L.micro_batch, m.n_heads // tp, m.head_dim
    kv = sharding.kv_heads_per_rank(m, tp)
    # Per layer and microbatch. The four projections at their per-core shapes (SP gathers the whole
    # sequence before the column-parallel ones): forward, backward, and what checkpointing recomputes
    # ("selective+mlp": NxD at seq 8192 also checkpoints the MLP, run_llama_nxd.py).
    qkv, o, up, down = [_linear_s(M, K, N, peak, hbm, ab, gb, eff) for K, N in
                        ((m.dim, (h + 2 * kv) * hd), (h * hd, m.dim), (m.dim, 2 * m.ffn_dim // tp),
                                     (m.ffn_dim // tp, m.dim))]
    linear = sum(sum(x) for x in (qkv, o, up, down))
    linear += {"full": qkv[0] + o[0] + up[0] + down[0], "selective+mlp": up[0] + down[0]}.get(ck, 0.0)
    # The attention core: QK^T and PV over the causal half of the scores (our ExplicitAttention's
    # query blocks, a flash kernel's skipped tiles; SDPA's math path on XLA computes the full square).
    # Matmuls of [T, hd] x [hd, T] size: forward 2 (Q K^T, P V), backward 4 (dV, dP, dQ, dK), and the
    # forward again under checkpointing; a flash kernel keeps no scores and recomputes only Q K^T in its
    # backward, checkpointed or not: 7 (NxD's nki_flash_attn_func -> neuronxcc's flash_attn_bwd, steps 1-5).
    square = T * T * (1 if attention == "math" else 0.5)
    recompute = ck != "none"
    matmuls = 7 if attention == "flash" else 6 + 2 * recompute
    attn_flops = 2 * square * hd * h * L.micro_batch * matmuls
    written = 1 if recompute else WRITTEN_PASSES["none"] / WRITTEN_PASSES["recompute"]
    passes = 0 if attention == "flash" else score_passes * written
    attn = attn_flops / (peak * eff * _tile(hd)) + passes * square * h * L.micro_batch * ab / hbm
    # The head (last stage): logits [M, V/tp], their fp32 softmax and gradient (three passes).
    vocab = sharding.padded_vocab(m.vocab_size, tp) // tp
    head = sum(_linear_s(M, m.dim, vocab, peak, hbm, ab, gb, eff)) + 3 * 4 * M * vocab / hbm
    # TP, per layer. With SP: forward, an all-gather of [M, dim] before each column-parallel
    # projection (qkv, gate_up) and a reduce-scatter after each row-parallel one (o, down); backward,
    # an all-gather of each row-parallel output's gradient, and for each column-parallel projection
    # a re-gather of its saved sequence shard and a reduce-scatter of its input gradient. Those two
    # run beside its matmuls, as NxD's LinearWithAsyncCommunication.backward (and our
    # _LinearWithSequenceParallel) order them: the gather while the input gradient is computed, the
    # reduce-scatter while the weight gradient is; only what outlasts the matmul shows. Without SP,
    # all-reduces (twice the bytes): 2 forward, and 2 backward beside the weight gradients.
    # Recomputed projections gather and scatter again; embedding and head add 5 (2 on a first stage, 3 on a last).
    # A recompute that ends with the MLP (full, selective+mlp) starts once the MLP's output gradient is
    # there (torch_xla's checkpoint puts an optimization barrier on its inputs and that gradient), beside
    # the backward: the gather of that gradient (token-free: xm.all_gather without output=) runs while the
    # recomputed gate_up matmul does, and the recomputed reduce-scatter after down_proj, whose result
    # feeds nothing but the collectives' token, while the backward's down_proj matmuls do (torch-xla 2.1
    # and 2.5 torch_xla/utils/checkpoint.py, core/xla_model.py). Without SP: that reduce-scatter is an
    # all-reduce, and the row-parallel backward gathers nothing. Only what outlasts those matmuls shows.
    one = M * m.dim * ab * (tp - 1) / tp / (hw.link_bw * LINK_EFFICIENCY) + _latency(tp - 1)
    per_layer = n_layer = 0
    if tp > 1:
        recomputed = {"full": 4, "selective+mlp": 2}.get(ck, 0)
        beside = sum(down[1:]) if recomputed else 0.0         # the backward's down_proj matmuls
        if L.sp:
            outlast = sum(max(0.0, one - dx) + max(0.0, one - dw) for _, dx, dw in (qkv, up))
            if recomputed:
                outlast += max(0.0, one - up[0]) + max(0.0, one - beside) - 2 * one
            per_layer, n_layer = (6 + recomputed) * one + outlast, 10 + recomputed
        else:
            outlast = sum(max(0.0, 2 * one - dw) for _, _, dw in (qkv, up))
            if recomputed:
                outlast += max(0.0, 2 * one - beside) - 2 * one
            per_layer, n_layer = (4 + recomputed) * one + outlast, 8 + recomputed
    # Per microbatch, each stage's matmuls and TP time (the head on the last); the slowest paces the step.
    paced = []
    for s, layers in enumerate(counts):
        extra = 0 if tp == 1 else (2 if s == 0 else 0) + (3 if s == L.pp - 1 else 0)
        on_stage = layers * (linear + attn) + (head if s == L.pp - 1 else 0.0)
        paced.append((on_stage + layers * per_layer + extra * one, on_stage, layers * per_layer + extra * one,
                      layers * n_layer + extra))
    _, compute, tp_mb, n_coll = max(paced)
    coll_bytes = M * m.dim * ab * (tp - 1) / tp
    # PP: each microbatch sends its activation forward and its gradient back (a sequence shard under SP).
    pp_bytes = 0 if L.pp == 1 else 2 * mbs * M * m.dim * ab / (tp if L.sp else 1)
    pp_s, pp_link = _comm_seconds(hw, pp_bytes, tp * L.dp, L.pp, world, ring=False)
    pp_s += 0 if L.pp == 1 else 2 * mbs * _latency(1)     # NxD sends as a 2-rank all-gather (pipeline/comm.py)
    # The slowest stage runs its microbatches back to back; the pipeline fills and drains through every
    # other stage once (1F1B, NxD's Train1F1BSchedule and ours, and GPipe alike): step = microbatches x
    # the slowest stage's slot + the other stages' slots. Even stages: (pp - 1) slots of one.
    fill = sum(x[0] for x in paced) - max(paced)[0] + (L.pp - 1) * (pp_s / mbs + per_mb)
    # DP after the last microbatch, in the update's graph as in NxD and optim.py (not overlapped):
    # all-reduce of the gradients, or (ZeRO-1) reduce-scatter of the gradients + all-gather of the weights.
    dp_bytes = (L.dp - 1) / L.dp * n * (gb + (wb if L.zero1 else gb))
    dp_s, dp_link = _comm_seconds(hw, dp_bytes, tp, L.dp, world, ring=True)
    # AdamW over this core's shard reads the gradient and the states and writes the states and the
    # weight (bandwidth-bound); clipping reads every local gradient and zeroing writes it.
    shard = n / (L.dp if L.zero1 else 1)
    opt_s = (shard * (gb + 2 * ob + wb) + 2 * n * gb) / hbm
    return dict(compute_s=mbs * compute, bubble_s=fill, tp_bytes=mbs * n_coll * coll_bytes,
                pp_bytes=pp_bytes, dp_bytes=dp_bytes, tp_s=mbs * tp_mb, pp_s=pp_s, dp_s=dp_s, opt_s=opt_s,
                overhead_s=mbs * per_mb, pp_link=pp_link, dp_link=dp_link)


def cannot_run(cfg: Config, world: int, tp: int, pp: int, mb: int) -> str:
    """Why validate() would reject TP x PP at micro-batch mb on `world` cores (cores, stages, batch), or ""."""
    dp, g, n = world // (tp * pp), cfg.data.global_batch, cfg.model.n_layers
    cut = pp == cfg.parallel.pp and cfg.parallel.pp_cuts       # pipeline.stage_bounds: uneven stages
    if world % (tp * pp):
        return f"TP x PP = {tp * pp} does not divide {world} cores"
    if n % pp and not cut:
        return f"{n} layers do not split over {pp} stages"
    if g % (mb * dp):
        return f"global batch {g} does not split over micro-batch x DP = {mb * dp}"
    m = g // (mb * dp)
    return f"{m} microbatch{'es' * (m != 1)} per step, fewer than {pp} stages" if m < pp else ""


def runnable(cfg: Config, world: int, tp: int, pp: int, sp: bool, zero1: bool, ckpt: str, mb: int):
    """The Layout, or None when validate() would reject it (cannot_run); SP only where the sequence splits."""
    if cannot_run(cfg, world, tp, pp, mb):
        return None
    dp = world // (tp * pp)
    return Layout(tp, pp, dp, sp and tp > 1 and cfg.data.seq_len % tp == 0, zero1 and dp > 1, ckpt, mb)


def layouts(cfg: Config, world: int) -> list[Layout]:
    """Every layout to consider on `world` cores: TP from tp_degrees, PP dividing the layers, with and
    without SP and ZeRO-1, each checkpointing mode, micro-batches 1, 2, 4 and the configured one."""
    # PP divides the layers and the world: the divisors of their gcd (range(n_layers) never ends at 10^9 layers)
    g = math.gcd(cfg.model.n_layers, world)
    found = {runnable(cfg, world, tp, pp, sp, z, ckpt, mb)
             for tp in tp_degrees(cfg.model, INSTANCES[cfg.parallel.instance])
             for pp in {d for i in range(1, math.isqrt(g) + 1) if g % i == 0 for d in (i, g // i)}
             for sp in (False, True) for z in (False, True) for ckpt in ("none", "selective", "full")
             for mb in {1, 2, 4, cfg.data.micro_batch}}
    return sorted(x for x in found if x is not None)
