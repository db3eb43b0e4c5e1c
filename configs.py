"""Typed configuration for nanotrn: dataclasses, named presets, command-line overrides, validation.

A run is described by one `Config`. Presets give the starting values; `--section.key=value`
overrides change them, type-checked. `validate()` rejects any layout that cannot work before a
process group, a tokenizer or a model is touched.

    python train.py --preset tiny --model.n_layers=2 --optim.lr=1e-3
    python configs.py show --preset llama2_7b
    python configs.py plan --preset llama2_70b
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import sys
from dataclasses import dataclass, field, fields


@dataclass
class ModelConfig:
    vocab_size: int = 4096
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4          # GQA: n_kv_heads < n_heads shares each K/V head over a group of Q heads
    ffn_dim: int = 704           # SwiGLU hidden size
    max_seq_len: int = 256       # RoPE is computed from positions, this only bounds them
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02       # Llama's initializer_range
    checkpointing: str = "none"  # activation checkpointing: none | selective (attention core) | full (whole block)
    attention: str = "sdpa"      # sdpa: F.scaled_dot_product_attention | explicit: NxD's core attention (model.py)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


@dataclass
class ParallelConfig:
    tp: int = 1                  # tensor parallel degree (inside one trn1 instance: NeuronLink)
    pp: int = 1                  # pipeline parallel degree
    dp: int = -1                 # data parallel degree; -1 = world_size / (tp * pp)
    sp: bool = False             # sequence parallelism inside the TP group (needs tp > 1 to matter)
    zero1: bool = False          # shard optimizer states over the DP group (HLAT 70B)
    pp_schedule: str = "1f1b"    # 1f1b | gpipe
    pp_p2p: str = "send"         # send (dist.send/recv) | allgather (what NxD does on XLA)
    pp_cuts: str = ""            # explicit stage boundaries, e.g. "3,6" for 8 layers on 3 stages
    cores: int = 0               # planner only: NeuronCores it lays out (0 = 4096, the blog's 128 trn1.32xlarge)


@dataclass
class OptimConfig:
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 20
    decay_steps: int = 280       # cosine from lr to min_lr over these steps after warmup
    constant_steps: int = 0      # the blog's "constant step": hold lr after warmup before decay
    max_steps: int = 300
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-5
    weight_decay: float = 0.1
    decay_norms: bool = True     # the blog decayed all parameters, norm weights included
    grad_clip: float = 1.0
    precision: str = "fp32"      # fp32 | mixed | bf16 | bf16_sr


@dataclass
class DataConfig:
    data: str = "stdlib"         # "stdlib" (embedded corpus), or files / dirs / globs, comma-separated
    tokenizer: str = ""          # a sentencepiece .model; empty = train one on the corpus and cache it
    text_field: str = "text"     # column / JSON key holding the text
    doc_per_line: bool = False   # .txt: one document per line instead of one per file
    seq_len: int = 256
    global_batch: int = 16       # sequences per optimizer step, over all DP ranks and microbatches
    micro_batch: int = 8         # sequences per rank per forward/backward
    bos: bool = True
    eos: bool = True
    val_fraction: float = 0.01   # held-out share of documents, never trained on
    seed: int = 1234
    cache_dir: str = ".cache"


@dataclass
class CheckpointConfig:
    dir: str = "out/ckpt"
    interval: int = 0            # steps between saves; 0 = only at the end
    keep: int = 3                # keep the last K complete checkpoints
    async_save: bool = True
    resume: bool = True          # continue from the newest complete checkpoint if there is one
    reset_data: bool = False     # resuming at another DP degree: start the data stream afresh


@dataclass
class LogConfig:
    interval: int = 10
    eval_interval: int = 100
    eval_windows: int = 8
    tensorboard: str = "out/tb"  # empty = no event files
    sample_tokens: int = 64      # length of the sample printed at the end
    on_nonfinite: str = "stop"   # stop | skip
    peak_tflops: float = 0.0     # per-device peak for MFU; 0 = trn1 datasheet on Neuron, a measured matmul elsewhere


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    seed: int = 1337
    device: str = "auto"         # auto | cpu | cuda | xla
    out_dir: str = "out"
    preset: str = "tiny"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- presets

def tiny() -> Config:
    """The CPU default: a 5M-parameter Llama that learns Python visibly in a few minutes."""
    return Config(preset="tiny")


def _llama2(model: ModelConfig, parallel: ParallelConfig, lr: float, min_lr: float) -> Config:
    # The blog's table (and HLAT): seq 4096, GBS 1024, per-core batch 1, cosine lr with 2000
    # warmup and 480k decay steps over 500k steps, AdamW (0.9, 0.95) eps 1e-5, wd 0.1 on all
    # parameters including norms, clip 1.0, BF16 with stochastic rounding, selective checkpointing.
    return Config(
        preset="",
        model=model,
        parallel=parallel,
        optim=OptimConfig(lr=lr, min_lr=min_lr, warmup_steps=2000, decay_steps=480_000,
                          constant_steps=0, max_steps=500_000, beta1=0.9, beta2=0.95, eps=1e-5,
                          weight_decay=0.1, decay_norms=True, grad_clip=1.0, precision="bf16_sr"),
        data=DataConfig(seq_len=4096, global_batch=1024, micro_batch=1, tokenizer=""),
        ckpt=CheckpointConfig(interval=1000, keep=3),
        log=LogConfig(interval=1, eval_interval=1000, eval_windows=32),
    )


def llama2_7b() -> Config:
    # TP=8 PP=1 with SP: the blog's fastest 7B layout, four model copies per trn1.32xlarge.
    # Explicit attention, as NxD's Llama: torch-xla runs SDPA's bf16 matmuls in fp32 (tests/test_xla.py).
    c = _llama2(ModelConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                            ffn_dim=11008, max_seq_len=4096, checkpointing="selective",
                            attention="explicit"),
                ParallelConfig(tp=8, pp=1, sp=True), lr=3e-4, min_lr=3e-5)
    c.preset = "llama2_7b"
    return c


def llama2_70b() -> Config:
    # HLAT 70B: TP=32 PP=8 with ZeRO-1 (fp32 master weights: precision "mixed").
    # lr 1.5e-4 to 1.5e-5 comes from the HLAT 70B scripts; every other setting is the blog's.
    c = _llama2(ModelConfig(vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                            ffn_dim=28672, max_seq_len=4096, checkpointing="selective",
                            attention="explicit"),
                ParallelConfig(tp=32, pp=8, sp=True, zero1=True), lr=1.5e-4, min_lr=1.5e-5)
    c.optim.precision = "mixed"
    c.preset = "llama2_70b"
    return c


PRESETS = {"tiny": tiny, "llama2_7b": llama2_7b, "llama2_70b": llama2_70b}

CHOICES = {
    "model.checkpointing": ("none", "selective", "full"),
    "model.attention": ("sdpa", "explicit"),
    "parallel.pp_schedule": ("1f1b", "gpipe"),
    "parallel.pp_p2p": ("send", "allgather"),
    "optim.precision": ("fp32", "mixed", "bf16", "bf16_sr"),
    "log.on_nonfinite": ("stop", "skip"),
    "device": ("auto", "cpu", "cuda", "xla"),
}

# Short flags a reader types most; each maps to one dotted key.
ALIASES = {"tp": "parallel.tp", "pp": "parallel.pp", "dp": "parallel.dp", "sp": "parallel.sp",
           "zero1": "parallel.zero1", "lr": "optim.lr", "steps": "optim.max_steps",
           "precision": "optim.precision", "data": "data.data", "tokenizer": "data.tokenizer",
           "seq_len": "data.seq_len", "global_batch": "data.global_batch",
           "micro_batch": "data.micro_batch"}


class ConfigError(ValueError):
    """A configuration that cannot work. Raised before any work starts."""


# ----------------------------------------------------------------------------- overrides

def _all_keys(cfg: Config) -> dict[str, tuple[object, dataclasses.Field]]:
    """Every settable dotted key -> (the dataclass that holds it, its field)."""
    keys = {}
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            for g in fields(value):
                keys[f"{f.name}.{g.name}"] = (value, g)
        else:
            keys[f.name] = (cfg, f)
    return keys


def _parse_value(key: str, text: str, typ) -> object:
    typ = {"int": int, "float": float, "bool": bool, "str": str}.get(typ, typ) if isinstance(typ, str) else typ
    try:
        if typ is bool:
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if typ is int:
            return int(text.replace("_", ""))
        if typ is float:
            return float(text)
        return text
    except ValueError:
        raise ConfigError(f"--{key}={text!r}: expected a {typ.__name__}") from None


def apply_overrides(cfg: Config, args: list[str]) -> Config:
    """Apply `--section.key=value` (or `--key value`) arguments to cfg, type-checked."""
    keys = _all_keys(cfg)
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --model.n_layers=4")
        body = arg[2:]
        if "=" in body:
            key, text = body.split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            key, text = body, args[i + 1]
            i += 1
        else:
            key, text = body, "true"          # a bare --flag sets a bool
        key = ALIASES.get(key.replace("-", "_"), key.replace("-", "_"))
        if key not in keys:
            close = difflib.get_close_matches(key, list(keys) + list(ALIASES), n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join('--' + c for c in close)}?" if close else ""
            raise ConfigError(f"unknown config key --{key}{hint} (python configs.py show lists them all)")
        holder, f = keys[key]
        value = _parse_value(key, text, f.type)
        if key in CHOICES and value not in CHOICES[key]:
            raise ConfigError(f"--{key}={value!r}: choose one of {', '.join(CHOICES[key])}")
        setattr(holder, f.name, value)
        i += 1
    return cfg


def from_args(argv: list[str]) -> Config:
    """Build a Config from a preset (--preset NAME) and overrides."""
    argv = list(argv)
    name = "tiny"
    for i, a in enumerate(argv):
        if a.startswith("--preset"):
            if "=" in a:
                name = a.split("=", 1)[1]
                del argv[i]
            else:
                if i + 1 >= len(argv):
                    raise ConfigError("--preset needs a name: " + ", ".join(PRESETS))
                name = argv[i + 1]
                del argv[i:i + 2]
            break
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=2)
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}"
                          + (f" (did you mean {close[0]}?)" if close else ""))
    return apply_overrides(PRESETS[name](), argv)


# ----------------------------------------------------------------------------- validation

def resolve_dp(cfg: Config, world_size: int) -> int:
    """The data-parallel degree for this world size (checks world = TP x PP x DP)."""
    p = cfg.parallel
    if p.tp < 1 or p.pp < 1:
        raise ConfigError(f"tp={p.tp} and pp={p.pp} must be >= 1")
    if world_size % (p.tp * p.pp) != 0:
        raise ConfigError(f"world size {world_size} is not divisible by tp*pp = {p.tp}*{p.pp}; "
                          f"launch a multiple of {p.tp * p.pp} processes or change --tp/--pp")
    dp = world_size // (p.tp * p.pp)
    if p.dp not in (-1, dp):
        raise ConfigError(f"world size {world_size} != tp*pp*dp = {p.tp}*{p.pp}*{p.dp}; launch "
                          f"{p.tp * p.pp * p.dp} processes or set --dp={dp} (or -1 to infer it)")
    return dp


def grad_accum_steps(cfg: Config, dp: int) -> int:
    """Microbatches per optimizer step on each DP rank."""
    d = cfg.data
    if d.global_batch % (d.micro_batch * dp) != 0:
        raise ConfigError(f"global batch {d.global_batch} is not divisible by micro_batch*dp = "
                          f"{d.micro_batch}*{dp}; pick a global batch that is a multiple of "
                          f"{d.micro_batch * dp}")
    return d.global_batch // (d.micro_batch * dp)


def validate(cfg: Config, world_size: int = 1) -> None:
    """Reject a configuration that cannot work. Called before any process group or model exists."""
    m, p, o, d = cfg.model, cfg.parallel, cfg.optim, cfg.data
    for key, allowed in CHOICES.items():
        section, _, name = key.rpartition(".")
        value = getattr(getattr(cfg, section) if section else cfg, name)
        if value not in allowed:
            raise ConfigError(f"--{key}={value!r}: choose one of {', '.join(allowed)}")
    if m.dim % m.n_heads != 0:
        raise ConfigError(f"dim {m.dim} is not divisible by n_heads {m.n_heads}")
    if m.head_dim % 2 != 0:
        raise ConfigError(f"head_dim {m.head_dim} must be even for RoPE")
    if m.n_heads % m.n_kv_heads != 0:
        raise ConfigError(f"n_heads {m.n_heads} is not divisible by n_kv_heads {m.n_kv_heads} (GQA groups)")
    if m.n_heads % p.tp != 0:
        raise ConfigError(f"n_heads {m.n_heads} is not divisible by tp {p.tp}: each TP rank must hold "
                          f"whole attention heads; pick tp from the divisors of {m.n_heads}")
    if m.n_kv_heads % p.tp != 0 and p.tp % m.n_kv_heads != 0:
        # tp > n_kv_heads works when each KV head is replicated on tp / n_kv_heads ranks (NxD does
        # this for 70B: 8 KV heads at TP=32); anything else would split a KV head.
        raise ConfigError(f"n_kv_heads {m.n_kv_heads} and tp {p.tp}: one must divide the other "
                          f"so every TP rank holds whole KV groups")
    if p.pp > m.n_layers:
        raise ConfigError(f"pp {p.pp} is larger than n_layers {m.n_layers}")
    if p.pp_cuts:
        try:
            cuts = [int(c) for c in p.pp_cuts.split(",")]
        except ValueError:
            raise ConfigError(f"pp_cuts {p.pp_cuts!r} must be comma-separated layer indices, e.g. 3,6") from None
        if len(cuts) != p.pp - 1 or cuts != sorted(set(cuts)) or not (0 < cuts[0] and cuts[-1] < m.n_layers):
            raise ConfigError(f"pp_cuts {p.pp_cuts!r} must be {p.pp - 1} increasing layer indices "
                              f"strictly between 0 and n_layers {m.n_layers}")
    elif m.n_layers % p.pp != 0:
        raise ConfigError(f"n_layers {m.n_layers} is not divisible by pp {p.pp}; change pp or give "
                          f"explicit stage boundaries with --parallel.pp_cuts")
    if p.sp and p.tp > 1 and (d.seq_len % p.tp != 0):
        raise ConfigError(f"sequence parallelism splits seq_len {d.seq_len} over tp {p.tp}: not divisible")
    if d.seq_len > m.max_seq_len:
        raise ConfigError(f"seq_len {d.seq_len} exceeds model.max_seq_len {m.max_seq_len}")
    dp = resolve_dp(cfg, world_size)
    accum = grad_accum_steps(cfg, dp)
    if p.pp > 1 and accum < p.pp:
        raise ConfigError(f"pipeline of {p.pp} stages needs at least {p.pp} microbatches per step, "
                          f"got {accum} (global_batch / (micro_batch * dp)); raise the global batch "
                          f"or lower micro_batch")
    if not (0 <= o.min_lr <= o.lr):
        raise ConfigError(f"need 0 <= min_lr ({o.min_lr}) <= lr ({o.lr})")
    if o.max_steps < 1 or o.warmup_steps < 0 or o.decay_steps < 0:
        raise ConfigError("max_steps must be >= 1 and warmup/decay steps >= 0")
    if not 0.0 <= d.val_fraction < 1.0:
        raise ConfigError(f"val_fraction {d.val_fraction} must be in [0, 1)")


def describe(cfg: Config) -> str:
    return json.dumps(cfg.to_dict(), indent=2)


# ----------------------------------------------------------------------------- planner
# `python configs.py plan`: what one NeuronCore holds, computes and sends for a layout on trn1, and
# which layouts fit, fastest first. Arithmetic on the config only: no model is built.
# Hardware: the Neuron docs' trn1.32xlarge page. Every judgment call is marked "assumption".

HBM_PER_CORE = 16 * 2**30       # 32 GiB per Trainium chip, two NeuronCores per chip
RESERVE = 2 * 2**30             # assumption: runtime, compiled program, collective buffers, compiler
                                # scratch. Neuron publishes no figure, and users report HBM OOM at compile
                                # time for layouts that fit by arithmetic (aws-neuron-sdk #884, #1014)
PEAK_FLOPS = {"bf16": 95e12, "fp32": 23.75e12}   # per core: 190 / 47.5 TFLOPS per chip
CORES_PER_NODE = 32
NEURONLINK_BW = 192 * 2**30     # bytes/s per core: 384 GiB/s NeuronLink-v2 per chip, shared by 2 cores
EFA_BW = 800e9 / 8              # bytes/s per trn1.32xlarge (8 x 100 Gbps EFA)
STATED_MFU = 0.40               # the MFU the headline step time is quoted at
COMPUTE_EFFICIENCY = 0.50       # assumption: share of peak the compiled matmuls sustain; recompute,
                                # pipeline bubble and exposed communication then lower the real MFU
# Bytes per parameter (weights, gradients, optimizer states) and per activation, as optim.py stores
# them: mixed keeps bf16 weights and grads plus an fp32 master copy and fp32 moments; bf16 and
# bf16_sr store everything in bf16 (SR changes only how updates are rounded).
PRECISION_BYTES = {"fp32": (4, 4, 8, 4), "mixed": (2, 2, 12, 2), "bf16": (2, 2, 4, 2), "bf16_sr": (2, 2, 4, 2)}


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
    peak: float = PEAK_FLOPS["bf16"]

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


def _comm_seconds(per_core: float, stride: int, size: int, world: int, ring: bool) -> tuple[float, str]:
    """Time for a collective whose groups are `size` ranks `stride` apart. Inside one instance it
    runs on NeuronLink at each core's share. Across instances the instance's EFA carries, per
    group touching it, one ring crossing (ring) or every core's own bytes (pipeline send/recv)."""
    if size == 1:
        return 0.0, "-"
    if stride * size <= CORES_PER_NODE or world <= CORES_PER_NODE:
        return per_core / NEURONLINK_BW, "NeuronLink"
    ranks_here = max(1, min(size, CORES_PER_NODE // stride))      # of one group, on one instance
    node_bytes = per_core * (CORES_PER_NODE // ranks_here if ring else CORES_PER_NODE)
    return node_bytes / EFA_BW, "EFA"


def estimate(cfg: Config, layout: Layout | None = None, world: int | None = None,
             attention: str = "math") -> Estimate:
    """Memory, time and traffic per core of `layout` (default: the configured one) on `world` cores."""
    from model import LinearCrossEntropy, flops_per_token     # model.py imports configs: import at call time
    m, d, p = cfg.model, cfg.data, cfg.parallel
    world = world or p.cores or 4096
    L = layout or Layout(p.tp, p.pp, max(1, world // (p.tp * p.pp)), p.sp and p.tp > 1, p.zero1,
                         m.checkpointing, d.micro_batch)
    wb, gb, ob, ab = PRECISION_BYTES[cfg.optim.precision]
    mbs = max(1, d.global_batch // (L.micro_batch * L.dp))   # < 1 only in what-if tables
    layers = -(-m.n_layers // L.pp)
    embed = -(-m.vocab_size // L.tp) * m.dim       # vocabulary padded to a TP multiple
    in_flight = 1 if L.pp == 1 else (min(L.pp, mbs) if p.pp_schedule == "1f1b" else mbs)
    rows = d.seq_len * L.micro_batch
    # Pipeline: the first stage holds the embedding and (1F1B) up to PP microbatches in flight;
    # the last stage holds the head, one microbatch, and the loss. Report the fuller one.
    stages = []
    for first, last in ([(True, True)] if L.pp == 1 else [(True, False), (False, True)]):
        n = layers * _layer_params(m, L.tp) + (embed if first else 0) + (embed + m.dim if last else 0)
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
    peak = PEAK_FLOPS["fp32" if ab == 4 else "bf16"] * COMPUTE_EFFICIENCY
    compute = (flops + recompute * d.global_batch * d.seq_len / world) / peak
    bubble = compute * (L.pp - 1) / mbs
    # Per microbatch and layer, TP moves 4 activations forward and 4 back (all-gather/reduce-scatter
    # with SP, all-reduces without: the same bytes), 4 more for full recompute; +4 for embed/head.
    act_msg = rows * m.dim * ab
    n_msgs = mbs * (layers * (12 if L.checkpointing == "full" else 8) + 4)
    tp_bytes = n_msgs * act_msg * (L.tp - 1) / L.tp
    pp_bytes = 0 if L.pp == 1 else 2 * mbs * act_msg / (L.tp if L.sp else 1)
    dp_bytes = 2 * (L.dp - 1) / L.dp * n * max(gb, wb)          # all-reduce, or reduce-scatter + all-gather
    tp_s = tp_bytes / NEURONLINK_BW
    pp_s, pp_link = _comm_seconds(pp_bytes, L.tp * L.dp, L.pp, world, ring=False)
    dp_s, dp_link = _comm_seconds(dp_bytes, L.tp, L.dp, world, ring=True)
    # Assumption: TP and PP transfers block compute; the DP reduction overlaps the last microbatch's backward.
    dp_s = max(0.0, dp_s - compute / mbs * 2 / 3)
    return Estimate(L, mbs, n, n * wb, n * gb, n * ob / (L.dp if L.zero1 else 1), act, loss, total,
                    total <= HBM_PER_CORE - RESERVE, flops, compute, bubble, tp_bytes, pp_bytes,
                    dp_bytes, tp_s, pp_s, dp_s, pp_link, dp_link, stage, peak / COMPUTE_EFFICIENCY)


def _tps(m: ModelConfig) -> list[int]:
    """TP degrees inside one instance that keep whole attention heads and whole KV groups per rank."""
    return [t for t in (1, 2, 4, 8, 16, 32)
            if m.n_heads % t == 0 and (m.n_kv_heads % t == 0 or t % m.n_kv_heads == 0)]


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
             for tp in _tps(cfg.model) for pp in range(1, cfg.model.n_layers + 1)
             for sp in (False, True) for z in (False, True) for ckpt in ("none", "selective", "full")
             for mb in {1, 2, 4, cfg.data.micro_batch}}
    return sorted(x for x in found if x is not None)


def plan(cfg: Config, world: int | None = None, top: int = 10) -> str:
    """The report `python configs.py plan` prints."""
    from model import flops_per_token, num_params
    m, d = cfg.model, cfg.data
    world = world or cfg.parallel.cores or 4096
    gib = lambda b: f"{b / 2**30:6.2f}"
    e = estimate(cfg, world=world)
    L, fpt, tokens = e.layout, flops_per_token(m, d.seq_len), d.global_batch * d.seq_len
    peak = PEAK_FLOPS["fp32" if cfg.optim.precision == "fp32" else "bf16"]
    lines = [
        f"plan: {cfg.preset or 'custom'} on {world} NeuronCores ({world / CORES_PER_NODE:g} trn1.32xlarge), "
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
        f"  total                           {gib(e.total)} of {(HBM_PER_CORE - RESERVE) / 2**30:.0f} usable "
        f"(16 GiB - {RESERVE / 2**30:.0f} GiB reserve): {'fits' if e.fits else 'DOES NOT FIT'}",
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
    for tp in _tps(m):
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


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("show", "plan"):
        sys.exit("usage: python configs.py show|plan [--preset NAME] [--section.key=value ...]")
    cmd, rest = sys.argv[1], sys.argv[2:]
    try:
        cfg = from_args(rest)
    except ConfigError as e:
        sys.exit(f"config error: {e}")
    if cmd == "show":
        print(describe(cfg))
    else:
        print(plan(cfg))
