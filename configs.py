"""Typed configuration: one `Config` a run, named presets, `--section.key=value` overrides (type-checked),
and `validate`, the one place that rejects what the config alone shows cannot work, before a process
group, a tokenizer or a model is touched. Each field's end-of-line comment is its --help text.

    python configs.py show --preset llama2_7b [--section.key=value ...]
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import signal
import sys
import tempfile
from dataclasses import dataclass, field, fields


@dataclass
class ModelConfig:
    vocab_size: int = 4096       # token ids the embedding and the head cover (at least the tokenizer's)
    dim: int = 256               # model width (hidden size)
    n_layers: int = 4            # transformer blocks
    n_heads: int = 8             # query heads
    n_kv_heads: int = 4          # GQA: n_kv_heads < n_heads shares each K/V head over a group of Q heads
    ffn_dim: int = 704           # SwiGLU hidden size
    max_seq_len: int = 256       # RoPE is computed from positions, this only bounds them
    rope_theta: float = 10000.0  # RoPE base (Llama 2: 1e4, Llama 3: 5e5)
    norm_eps: float = 1e-5       # RMSNorm epsilon
    init_std: float = 0.02       # Llama's initializer_range
    checkpointing: str = "none"  # activation checkpointing: none | selective (attention core) | full (whole block)
    attention: str = "sdpa"      # sdpa: F.scaled_dot_product_attention | explicit: NxD's core attention (model.py)
    tie_embeddings: bool = False # the head is the embedding matrix (Llama 3.2 1B and 3B)
    head_dim_override: int = 0   # 0 = dim // n_heads; a Hugging Face config may set head_dim otherwise
    rope_scaling: str = "none"   # none | llama3 (Llama 3.1+): slows RoPE's long wavelengths, see model.py
    rope_factor: float = 8.0     # llama3 rope_scaling: long wavelengths' frequencies are divided by this
    rope_low_freq_factor: float = 1.0    # ... those longer than original_max_len / this
    rope_high_freq_factor: float = 4.0   # ... those shorter than original_max_len / this are kept; blended between
    rope_original_max_len: int = 8192    # ... the context the model was first trained at

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.dim // self.n_heads


@dataclass
class ParallelConfig:
    tp: int = 1                  # tensor parallel degree (inside one trn1 instance: NeuronLink)
    pp: int = 1                  # pipeline parallel degree
    dp: int = -1                 # data parallel degree; -1 = world_size / (tp * pp)
    sp: bool = False             # sequence parallelism inside the TP group (needs tp > 1 to matter)
    zero1: bool = False          # shard optimizer states over the DP group (HLAT 70B)
    zero1_bucket_mb: float = 130.0   # ZeRO-1's reduce-scatter/all-gather bucket cap (NxD: 130; 0 = one bucket)
    pp_schedule: str = "1f1b"    # 1f1b | gpipe
    pp_p2p: str = "send"         # send (batched isend/irecv) | allgather (what NxD does on XLA; the only one there)
    pp_cuts: str = ""            # explicit stage boundaries, e.g. "3,6" for 8 layers on 3 stages
    instance: str = "trn1"       # trn1 | trn1n | trn2: the instance type (planner/instances.py): the planner, the MFU peak, ranks per node
    cores: int = 0               # planner only: NeuronCores it lays out (0 = 128 instances, the blog's cluster)
    timeout_s: float = 1800.0    # torch.distributed's collective timeout (gloo, nccl; on xla the gloo host group's)


@dataclass
class OptimConfig:
    lr: float = 1e-3             # peak learning rate, reached after warmup
    min_lr: float = 1e-4         # the cosine's floor, held after decay
    warmup_steps: int = 20       # linear warmup to lr over these steps
    decay_steps: int = 280       # cosine from lr to min_lr over these steps after warmup (and constant_steps)
    constant_steps: int = 0      # hold lr after warmup, before the cosine (NxD's constant_steps instead hold min_lr after it)
    max_steps: int = 300         # optimizer steps of the whole run
    beta1: float = 0.9           # AdamW's first-moment decay
    beta2: float = 0.95          # AdamW's second-moment decay
    eps: float = 1e-5            # AdamW's epsilon
    weight_decay: float = 0.1    # AdamW's decoupled weight decay
    decay_norms: bool = True     # the blog decayed all parameters, norm weights included
    grad_clip: float = 1.0       # clip the global gradient norm to this (0 = no clipping)
    precision: str = "fp32"      # fp32 | mixed | bf16 | bf16_sr
    fp32_grad_acc: bool = True   # mixed: accumulate and reduce gradients in fp32 (NxD's use_fp32_grad_acc)


@dataclass
class DataConfig:
    data: str = "stdlib"         # "stdlib" (embedded corpus), or files / dirs / globs, comma-separated
    tokenizer: str = ""          # a sentencepiece .model, a tokenizer.json or a folder with one; empty = train one and cache it
    text_field: str = "text"     # column / JSON key holding the text: one for all sources, or one per --data source
    split: str = "train"         # the split read from a DatasetDict folder or a dataset repository
    doc_per_line: bool = False   # .txt: one document per line instead of one per file
    seq_len: int = 256           # tokens per training sequence
    global_batch: int = 16       # sequences per optimizer step, over all DP ranks and microbatches
    micro_batch: int = 8         # sequences per rank per forward/backward
    bos: bool = True             # start each document with the tokenizer's BOS
    eos: bool = True             # end each document with the tokenizer's EOS
    document_mask: bool = True   # attend within each packed document, positions restarting (Llama 3); false: causal over the whole window, positions 0..seq_len-1 (NxD's Llama 2), the causal kernel
    val_fraction: float = 0.01   # held-out share of documents, never trained on
    shuffle: int = 8             # documents in flight per sequence of the batch, each window drawn from one at random (1: stream order)
    seed: int = 1234             # seeds the data order (which documents the windows come from)
    cache_dir: str = ".cache"    # trained tokenizers, span indexes and converted files


@dataclass
class CheckpointConfig:
    dir: str = "out/ckpt"        # follows --out_dir unless given: <out_dir>/ckpt
    interval: int = 0            # steps between saves; 0 = only at the end
    keep: int = 3                # keep the last K complete checkpoints (0 = keep them all)
    async_save: bool = True      # write checkpoints from a background thread after staging them in host memory
    resume: bool = True          # continue from the newest complete checkpoint if there is one
    reset_data: bool = False     # on resume, start the data stream afresh (needed after a change of global batch)
    start_fresh: bool = False    # with --ckpt.resume=false: move the directory's checkpoints aside (never deleted) and start over
    grace_s: float = 30.0        # the launcher's grace period from SIGTERM/SIGUSR1 to SIGKILL (torchrun: 30, fixed)


@dataclass
class LogConfig:
    interval: int = 10           # steps between log lines (each one reads the device)
    eval_interval: int = 100     # steps between evaluations on held-out windows, and one after the last step (0 = none)
    eval_windows: int = 8        # held-out windows of seq_len tokens each evaluation reads
    tensorboard: str = "out/tb"  # empty = no event files; follows --out_dir unless given: <out_dir>/tb
    sample_tokens: int = 64      # length of the sample printed at the end
    on_nonfinite: str = "stop"   # stop | skip
    peak_tflops: float = 0.0     # per-device peak for MFU; 0 = the --instance datasheet on Neuron, the model's matmuls measured elsewhere
    hang_factor: float = 20.0    # watchdog: no step done in this many median step times = a hang (0 = off)
    hang_min_s: float = 300.0    # ... but never less than this many seconds
    hang_startup_s: float = 7200.0   # ... nor, before the first steps and around a save or an evaluation, less than this (compiles)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    seed: int = 1337             # the model's init, stochastic rounding, the global RNGs (the data order: --data.seed)
    device: str = "auto"         # auto | cpu | cuda | xla
    out_dir: str = "out"         # the final Hugging Face export (<out_dir>/hf); ckpt.dir and log.tensorboard follow it
    preset: str = "tiny"         # the named starting values (PRESETS), given as --preset NAME
    init_from: str = ""          # a Hugging Face Llama folder: start from its weights, config and tokenizer
    export_dtype: str = "auto"   # the final Hugging Face export: auto (bf16 above 1B parameters, else fp32) | fp32 | bf16

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- presets

def tiny() -> Config:
    """The CPU default: a 5M-parameter Llama that learns Python visibly in a few minutes."""
    return Config(preset="tiny")


def _llama2(name: str, model: ModelConfig, parallel: ParallelConfig, lr: float, min_lr: float, precision: str = "bf16_sr") -> Config:
    """The blog's and HLAT's table (sources: README, Presets). Log every 10 steps: a log line waits for the device. Its
    "LR decay steps 480,000" count from step 0 as NxD's CosineAnnealing max_steps (examples/training/llama/lr.py)."""
    return Config(preset=name, model=model, parallel=parallel,
                  optim=OptimConfig(lr=lr, min_lr=min_lr, warmup_steps=2000, decay_steps=478_000,   # after warmup
                                    constant_steps=0, max_steps=500_000, beta1=0.9, beta2=0.95, eps=1e-5,
                                    weight_decay=0.1, decay_norms=True, grad_clip=1.0, precision=precision),
                  data=DataConfig(seq_len=4096, global_batch=1024, micro_batch=1, tokenizer=""),
                  ckpt=CheckpointConfig(interval=1000, keep=3),
                  log=LogConfig(interval=10, eval_interval=1000, eval_windows=32))


def _llama3(name: str, model: ModelConfig, parallel: ParallelConfig, lr: float) -> Config:
    """The Llama 3 paper's schedule (3.4.1); AdamW as Llama 2's, which the paper does not restate."""
    c = _llama2(name, model, parallel, lr=lr, min_lr=lr / 100)
    c.optim.warmup_steps, c.optim.decay_steps, c.optim.max_steps = 8000, 1_192_000, 1_200_000
    c.data.seq_len, c.data.global_batch = 8192, 512
    return c


def llama2_7b() -> Config:
    # The blog's fastest 7B layout; explicit attention as NxD's (XLA runs SDPA's bf16 matmuls in fp32).
    return _llama2("llama2_7b", ModelConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                                            ffn_dim=11008, max_seq_len=4096, checkpointing="selective", attention="explicit"),
                   ParallelConfig(tp=8, pp=1, sp=True), lr=3e-4, min_lr=3e-5)


def llama2_70b() -> Config:
    # HLAT 70B: TP=32 PP=8, ZeRO-1 with fp32 master weights, NxD's all-gather point-to-point on XLA.
    return _llama2("llama2_70b", ModelConfig(vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                                             ffn_dim=28672, max_seq_len=4096, checkpointing="selective", attention="explicit"),
                   ParallelConfig(tp=32, pp=8, sp=True, zero1=True, pp_p2p="allgather"), lr=1.5e-4, min_lr=1.5e-5, precision="mixed")


def llama3_8b() -> Config:
    # The paper's Table 3; TP=8 with ZeRO-1, the planner's fastest layout that fits (12 GiB a core).
    return _llama3("llama3_8b", ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                                            ffn_dim=14336, max_seq_len=8192, rope_theta=500000.0, checkpointing="selective", attention="explicit"),
                   ParallelConfig(tp=8, pp=1, sp=True, zero1=True), lr=3e-4)


def llama3_2_1b() -> Config:
    # Llama 3.2 1B's released config.json, trained with Llama 3 8B's schedule (Meta published none).
    return _llama3("llama3_2_1b", ModelConfig(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                                              ffn_dim=8192, max_seq_len=131072, rope_theta=500000.0,
                                              tie_embeddings=True, rope_scaling="llama3", rope_factor=32.0,
                                              rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_len=8192,
                                              checkpointing="selective", attention="explicit"),
                   ParallelConfig(tp=8, pp=1, sp=True), lr=3e-4)


# A fork's own preset: a function like those above, added here; --preset takes its name, --help lists it.
PRESETS = {f.__name__: f for f in (tiny, llama2_7b, llama2_70b, llama3_8b, llama3_2_1b)}

CHOICES = {"model.checkpointing": ("none", "selective", "full"), "model.attention": ("sdpa", "explicit"),
           "model.rope_scaling": ("none", "llama3"), "parallel.pp_schedule": ("1f1b", "gpipe"), "parallel.pp_p2p": ("send", "allgather"),
           "parallel.instance": ("trn1", "trn1n", "trn2"), "optim.precision": ("fp32", "mixed", "bf16", "bf16_sr"),
           "log.on_nonfinite": ("stop", "skip"), "device": ("auto", "cpu", "cuda", "xla"), "export_dtype": ("auto", "fp32", "bf16")}

# Short flags a reader types most; each maps to one dotted key.
ALIASES = {"tp": "parallel.tp", "pp": "parallel.pp", "dp": "parallel.dp", "sp": "parallel.sp", "zero1": "parallel.zero1",
           "instance": "parallel.instance", "lr": "optim.lr", "steps": "optim.max_steps", "precision": "optim.precision", "data": "data.data",
           "tokenizer": "data.tokenizer", "seq_len": "data.seq_len", "global_batch": "data.global_batch", "micro_batch": "data.micro_batch"}
# Other trainers' names for ours (nanoGPT, torchtitan, Hugging Face) that no spelling brings near: the typo hint's.
SYNONYMS = {"learning_rate": "lr", "batch_size": "global_batch micro_batch", "block_size": "seq_len", "n_embd": "dim",
            "hidden_size": "dim", "lr_decay_iters": "decay_steps", "max_norm": "grad_clip", "max_grad_norm": "grad_clip",
            "gradient_accumulation_steps": "global_batch micro_batch", "per_device_train_batch_size": "micro_batch",
            "dtype": "precision", "intermediate_size": "ffn_dim", "num_attention_heads": "n_heads", "save_steps": "ckpt.interval"}


class ConfigError(ValueError):
    """A configuration that cannot work. Raised before any work starts."""


# ----------------------------------------------------------------------------- overrides

def _all_keys(cfg: Config) -> dict[str, tuple[object, dataclasses.Field]]:
    """Every settable dotted key -> (the dataclass that holds it, its field)."""
    keys = {}
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        keys.update({f"{f.name}.{g.name}": (value, g) for g in fields(value)} if dataclasses.is_dataclass(value) else {f.name: (cfg, f)})
    return keys


BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
READERS = {bool: lambda t: BOOLS[("true" if t is None else t).lower()], int: lambda t: int(t.replace("_", "")),
           float: float, str: str}      # a bare --flag (t None) sets a bool


def _parse_value(key: str, text: str | None, typ) -> object:
    typ = {"int": int, "float": float, "bool": bool, "str": str}.get(typ, typ) if isinstance(typ, str) else typ
    if text is None and typ is not bool:    # a bare --flag other than a bool's (it was told "--model.dim='true': expected an int")
        raise ConfigError(f"--{key} was given no value: set it as --{key}=VALUE")
    try:
        value = READERS.get(typ, str)(text)
    except (KeyError, ValueError):
        raise ConfigError(f"--{key}={text!r}: expected {({int: 'an int', float: 'a number'}).get(typ, 'true or false')}") from None
    mantissa = text.lower().partition("e")[0] if typ is float else ""     # 1e-400 reads as 0.0, 1e400 as inf
    if value in (0, math.inf, -math.inf) and "inf" not in mantissa and set(mantissa) & set("123456789"):
        raise ConfigError(f"--{key}={text.strip()} is beyond a float's range (read as {value}): give one from 1e-300 "
                          f"to 1e300")
    return value


def apply_overrides(cfg: Config, args: list[str]) -> Config:
    """Apply `--section.key=value` (or `--key value`) arguments to cfg, type-checked."""
    keys, given, i = _all_keys(cfg), set(), 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --model.n_layers=4")
        if "=" in (body := arg[2:]):
            key, text = body.split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            key, text = body, args[i + 1]
            i += 1
        else:
            key, text = body, None            # a bare --flag sets a bool
        key = ALIASES.get(key.replace("-", "_"), key.replace("-", "_"))
        if key not in keys:     # hint: another trainer's name for it (SYNONYMS), else a key or alias spelled near its last part
            names, last = {**{n: k for k in keys for n in (k.rpartition(".")[2], k)}, **ALIASES}, key.rpartition(".")[2]
            # each name's key, and every key that ends in it: --interval, --log.interval and --ckpt.interval
            near = dict.fromkeys(k for n in SYNONYMS.get(last, "").split()
                                 or difflib.get_close_matches(last, names, n=3, cutoff=0.65)
                                 for k in [names[n]] + [j for j in keys if j.endswith("." + n)])
            hint = ", ".join(f"--{k}" + "".join(f" (--{a})" for a in ALIASES if ALIASES[a] == k) for k in near)
            raise ConfigError(f"unknown config key --{key}{f'; did you mean {hint}?' if hint else ''} (--help lists them all)")
        holder, f = keys[key]
        value = _parse_value(key, text, f.type)
        if key in ("data.data", "data.tokenizer", "data.cache_dir", "init_from", "out_dir", "ckpt.dir", "log.tensorboard"):
            value = expand_home(value)
        if key in CHOICES and value not in CHOICES[key]:
            raise ConfigError(f"--{key}={value!r}: choose one of {', '.join(CHOICES[key])}")
        setattr(holder, f.name, value)
        given.add(key)
        i += 1
    # --out_dir places the checkpoints and TensorBoard files under it unless set too: else --out_dir=run2 resumes out/ckpt.
    if "out_dir" in given and "ckpt.dir" not in given:
        cfg.ckpt.dir = f"{cfg.out_dir.rstrip('/')}/ckpt"
    if "out_dir" in given and "log.tensorboard" not in given and cfg.log.tensorboard:
        cfg.log.tensorboard = f"{cfg.out_dir.rstrip('/')}/tb"
    return cfg


def from_args(argv: list[str]) -> Config:
    """Build a Config from a preset (--preset NAME or --preset=NAME; default tiny) and overrides."""
    argv, name = list(argv), "tiny"
    i = next((i for i, a in enumerate(argv) if a == "--preset" or a.startswith("--preset=")), None)
    if i is not None:
        if "=" not in argv[i] and i + 1 >= len(argv):
            raise ConfigError("--preset needs a name: " + ", ".join(PRESETS))
        name = argv[i].split("=", 1)[1] if "=" in argv[i] else argv.pop(i + 1)
        del argv[i]
    if again := [a for a in argv if a == "--preset" or a.startswith("--preset=")]:     # else it sets only the name
        raise ConfigError(f"--preset {name} and {again[0]}: give one preset, then --section.key=value overrides")
    if name not in PRESETS:
        close = "".join(f" (did you mean {c}?)" for c in difflib.get_close_matches(name, PRESETS, n=1))
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}{close}")
    return apply_overrides(PRESETS[name](), argv)


def wants_help(argv: list[str]) -> bool:
    return "-h" in argv or "--help" in argv


def field_comments() -> dict[tuple[str, str], str]:
    """(dataclass name, field name) -> the field's end-of-line comment here: help written next to its field."""
    import ast, inspect, io, tokenize
    src = inspect.getsource(sys.modules[__name__])
    comments = {t.start[0]: t.string.lstrip("#").strip()
                for t in tokenize.generate_tokens(io.StringIO(src).readline) if t.type == tokenize.COMMENT}
    return {(c.name, s.target.id): comments.get(s.lineno, "") for c in ast.parse(src).body if isinstance(c, ast.ClassDef)
            for s in c.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


def help_text(intro: str, argv: list[str]) -> str:
    """--help: intro, then every key, its value under the preset and flags given, and its comment."""
    cfg, comments = from_args([a for a in argv if a not in ("-h", "--help")]), field_comments()
    short = {key: alias for alias, key in ALIASES.items()}
    lines = [intro.strip(), "", f"presets (--preset NAME): {', '.join(PRESETS)}. Below: every key, its value "
             f"under --preset {cfg.preset} and the flags given, and what it sets.",
             "Set a key with --section.key=VALUE or --section.key VALUE; a bare --flag sets a bool."]
    section = None
    for key, (holder, f) in _all_keys(cfg).items():
        if section != (section := key.rpartition(".")[0] or "run"):      # (the old section, then the new one)
            lines += ["", f"{section}:"]
        value = getattr(holder, f.name)
        flag = f"--{key}={str(value).lower() if isinstance(value, bool) else value}"
        flag += f" (--{short[key]})" if key in short else ""
        text = comments.get((type(holder).__name__, f.name), "")
        if key in CHOICES and not all(c in text for c in CHOICES[key]):
            text += f"{'; ' if text else ''}one of {' | '.join(CHOICES[key])}"
        lines.append(f"  {flag:36s} {text}".rstrip() if len(flag) < 37 else f"  {flag}\n  {'':36s} {text}".rstrip())
    return "\n".join(lines)


# ----------------------------------------------------------------------------- validation

def validate(cfg: Config, world_size: int = 1, backend: str = "") -> None:
    """Reject a config that cannot work, before any work. backend: "xla" on Trainium, "" if not known."""
    check_values(cfg)
    check_layout(cfg, world_size, backend)


def resolve_dp(cfg: Config, world_size: int) -> int:
    """The data-parallel degree for this world size (checks world = TP x PP x DP)."""
    p = cfg.parallel                        # tp, pp >= 1: check_values ran first
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
                          f"{d.micro_batch}*{dp}; pick a global batch that is a multiple of {d.micro_batch * dp}")
    return d.global_batch // (d.micro_batch * dp)


# Every numeric key's domain: (test, what it must be). Checked first: a zero divisor or a negative seed is a
# message naming the key, never a ZeroDivisionError deep inside a run (nor torch's OverflowError past a 64-bit int).
_AT_LEAST_1, _NON_NEGATIVE = (lambda v: 1 <= v < 2**63, ">= 1 and below 2**63"), (lambda v: v >= 0, ">= 0")
_POSITIVE, _FRACTION = (lambda v: v > 0, "> 0"), (lambda v: 0 <= v < 1, "in [0, 1)")
# Where the run computes in float32, a positive value below its least, 1.4e-45, is 0 (eps 1e-50: 0/0 = NaN at step 1).
_POSITIVE_F32 = (lambda v: v >= 2.0 ** -149, ">= 1.4e-45 (float32's least positive value: the run would use 0)")
# Seconds: a timedelta, faulthandler's timer and a thread's wait overflow past ~9.2e9 (2 * hang_startup_s included).
_SECONDS = (lambda v: 0 < v <= 1e9, "> 0 and at most 1e9 (about 30 years)")
DOMAINS = {
    **dict.fromkeys(("model.vocab_size", "model.dim", "model.n_layers", "model.n_heads", "model.n_kv_heads", "model.ffn_dim",
                     "model.max_seq_len", "parallel.tp", "parallel.pp", "optim.max_steps", "data.seq_len", "data.global_batch",
                     "data.micro_batch", "log.interval", "log.eval_windows", "model.rope_original_max_len", "data.shuffle",
                     "model.rope_factor"), _AT_LEAST_1),
    # ... and at most 1: a stabilizer larger than what it guards replaces it; past float32's largest it is inf there,
    # and every normalized activation (norm_eps) or AdamW update (eps) is 0 from step 1: nothing trains.
    **dict.fromkeys(("model.norm_eps", "optim.eps"), (lambda v: 2.0 ** -149 <= v <= 1,
                    _POSITIVE_F32[1] + " and at most 1 (Llama: 1e-5)")),
    **dict.fromkeys(("model.rope_low_freq_factor", "model.rope_high_freq_factor"), _POSITIVE),
    **dict.fromkeys(("model.init_std", "optim.lr"),
                    (lambda v: 2.0 ** -149 <= v <= 1, ">= 1.4e-45 (float32's least) and at most 1 (Llama 0.02, 3e-4)")),
    "model.rope_theta": (lambda v: v > 1, "> 1 (RoPE's base, its powers the wavelengths: Llama 2 1e4, Llama 3 5e5)"),
    **dict.fromkeys(("model.head_dim_override", "parallel.cores", "optim.min_lr", "optim.warmup_steps",
                     "optim.decay_steps", "optim.constant_steps", "optim.weight_decay", "optim.grad_clip",
                     "ckpt.interval", "parallel.zero1_bucket_mb", "ckpt.keep", "log.eval_interval"), _NON_NEGATIVE),
    "log.peak_tflops": (lambda v: 0 <= v <= 1e5, ">= 0 and at most 100000 (per device: a trn1 NeuronCore 95, an H100 989; "
                        "TFLOP/s, not FLOP/s)"),
    "log.sample_tokens": (lambda v: 0 <= v <= 10_000, ">= 0 and at most 10000 (the sample at the end: a forward pass per token)"),
    **dict.fromkeys(("ckpt.grace_s", "log.hang_min_s", "log.hang_startup_s"), _SECONDS),
    "parallel.timeout_s": (lambda v: 1e-3 <= v <= 1e9, "at least 0.001 (torch counts milliseconds: below, 0, and the "
                           "first collective times out) and at most 1e9 (about 30 years)"),
    "log.hang_factor": (lambda v: v == 0 or v >= 2, ">= 2 (median step times), or 0 to turn the watchdog off"),
    **dict.fromkeys(("optim.beta1", "optim.beta2", "data.val_fraction"), _FRACTION),
    "parallel.dp": (lambda v: v == -1 or v >= 1, ">= 1, or -1 to infer it from the world size"),
    "data.seed": (lambda v: 0 <= v < 2**63, "in [0, 2**63) (the data order hashes it as a 64-bit integer)"),
    "seed": (lambda v: 0 <= v < 2**32, "in [0, 2**32) (numpy's global seed range)"),
    "data.data": (lambda v: v.replace(",", "").strip(), "a source (a file, a folder, stdlib) or a mixture a:0.7,b:0.3"),
}
NON_EMPTY = ("data.data", "data.text_field", "data.cache_dir", "ckpt.dir", "out_dir")


def check_values(cfg: Config, flag=lambda key: f"--{key}") -> None:
    """What holds at any world size: every key's domain (named as flag(key): data.py tokenizer's own flags
    for its keys), the model's shape alone and against TP/PP."""
    for key, (holder, f) in _all_keys(cfg).items():
        if isinstance(value := getattr(holder, f.name), float) and not math.isfinite(value):
            raise ConfigError(f"{flag(key)}={value}: must be a finite number")
        if key in NON_EMPTY and not str(value).strip():
            raise ConfigError(f"{flag(key)} is empty: give a value (default {f.default!r})")
        if key in DOMAINS and not DOMAINS[key][0](value):       # (--data=, too: a mixture of no source)
            raise ConfigError(f"{flag(key)}={value!r}: must be {DOMAINS[key][1]}")
        if key in CHOICES and value not in CHOICES[key]:
            raise ConfigError(f"{flag(key)}={value!r}: choose one of {', '.join(CHOICES[key])}")
    m, p, o, d = cfg.model, cfg.parallel, cfg.optim, cfg.data
    if not o.min_lr <= o.lr:
        raise ConfigError(f"--optim.min_lr={o.min_lr} is above --optim.lr={o.lr} (the schedule decays lr to it): lower min_lr")
    if o.lr * o.weight_decay >= 1:          # AdamW's decoupled decay: every step, each weight times 1 - lr*weight_decay
        raise ConfigError(f"--optim.weight_decay={o.weight_decay} with --optim.lr={o.lr}: each step multiplies every weight "
                          f"by 1 - lr*weight_decay = {1 - o.lr * o.weight_decay:.3g}; lower weight_decay below {1 / o.lr:g}")
    if 0 < o.grad_clip < o.eps:             # each clipped gradient element <= grad_clip; AdamW divides by sqrt(v) + eps
        raise ConfigError(f"--optim.grad_clip={o.grad_clip} is below --optim.eps={o.eps}: every update would shrink by "
                          f"grad_clip/eps (1e-300: none at all); raise it (Llama: 1.0), or 0 for no clipping")
    if d.val_fraction == 0 and cfg.log.eval_interval:     # no document is ever held out (spans.held_out)
        raise ConfigError("--data.val_fraction=0 holds no text out to evaluate on: raise it, or set --log.eval_interval=0")
    if cfg.ckpt.start_fresh and cfg.ckpt.resume:
        raise ConfigError("--ckpt.start_fresh moves the checkpoints aside to start over: it goes with --ckpt.resume=false (drop it to resume them)")
    if m.rope_scaling == "llama3" and not m.rope_high_freq_factor > m.rope_low_freq_factor:
        raise ConfigError(f"--model.rope_high_freq_factor={m.rope_high_freq_factor} must be above --model.rope_low_"
                          f"freq_factor={m.rope_low_freq_factor} (llama3 rope scaling interpolates between them)")
    if m.dim % m.n_heads != 0 and not m.head_dim_override:
        raise ConfigError(f"--model.dim={m.dim} is not divisible by --model.n_heads={m.n_heads}: pick n_heads among its divisors")
    if m.head_dim % 2 != 0:
        raise ConfigError(f"head_dim {m.head_dim} (dim {m.dim} / n_heads {m.n_heads}, or --model.head_dim_override) "
                          f"must be even for RoPE; change --model.dim or --model.n_heads")
    if m.n_heads % m.n_kv_heads != 0:
        raise ConfigError(f"--model.n_heads={m.n_heads} is not divisible by --model.n_kv_heads={m.n_kv_heads}: GQA shares "
                          f"each KV head by a whole group of query heads; pick n_kv_heads among the divisors of n_heads")
    if m.n_heads % p.tp != 0:
        raise ConfigError(f"n_heads {m.n_heads} is not divisible by tp {p.tp}: each TP rank must hold "
                          f"whole attention heads; pick tp from the divisors of {m.n_heads}")
    if m.n_kv_heads % p.tp != 0 and p.tp % m.n_kv_heads != 0:
        # tp > n_kv_heads replicates each KV head on tp / n_kv_heads ranks (NxD's 70B: 8 at TP=32).
        raise ConfigError(f"n_kv_heads {m.n_kv_heads} and tp {p.tp}: one must divide the other (each TP rank holds whole KV groups)")
    if m.ffn_dim % p.tp != 0:
        raise ConfigError(f"--model.ffn_dim={m.ffn_dim} is not divisible by --tp={p.tp}: gate_up_proj and "
                          f"down_proj are split over the TP ranks; pick tp from the divisors of ffn_dim")
    if p.pp > m.n_layers:
        raise ConfigError(f"--pp={p.pp} is above --model.n_layers={m.n_layers}: each pipeline stage needs a layer; lower --pp")
    if p.pp_cuts:
        try:
            cuts = [int(c) for c in p.pp_cuts.split(",")]
        except ValueError:
            raise ConfigError(f"pp_cuts {p.pp_cuts!r} must be comma-separated layer indices, e.g. 3,6") from None
        if len(cuts) != p.pp - 1 or cuts != sorted(set(cuts)) or not (0 < cuts[0] and cuts[-1] < m.n_layers):
            raise ConfigError(f"pp_cuts {p.pp_cuts!r} must be {p.pp - 1} increasing layer indices (for --pp={p.pp} "
                              f"stages) strictly between 0 and n_layers {m.n_layers}")
    elif m.n_layers % p.pp != 0:
        raise ConfigError(f"n_layers {m.n_layers} is not divisible by pp {p.pp}; change pp or give "
                          f"explicit stage boundaries with --parallel.pp_cuts")
    if p.sp and p.tp > 1 and (d.seq_len % p.tp != 0):
        raise ConfigError(f"sequence parallelism splits --seq_len={d.seq_len} over --tp={p.tp}: not divisible; "
                          f"pick a seq_len that is a multiple of tp, or --sp=false")
    if d.seq_len > m.max_seq_len:
        raise ConfigError(f"--seq_len={d.seq_len} exceeds --model.max_seq_len={m.max_seq_len}; raise max_seq_len or lower seq_len")


def check_layout(cfg: Config, world_size: int, backend: str = "") -> None:
    """The layout on world_size ranks (TP x PP x DP, the batch over DP), and torch-xla's backend rules."""
    m, p = cfg.model, cfg.parallel
    accum = grad_accum_steps(cfg, resolve_dp(cfg, world_size))
    if p.pp > 1 and accum < p.pp:
        raise ConfigError(f"pipeline of {p.pp} stages needs at least {p.pp} microbatches per step, got {accum} "
                          f"(global_batch / (micro_batch * dp)); raise the global batch or lower micro_batch")
    if backend != "xla" or p.pp == 1:
        return
    # torch 2.9's isend passes the group-local peer, which ProcessGroupXla.send takes for a global
    # rank (torch_xla/distributed/xla_backend.py): NxD's pipeline all-gathers over rank pairs instead.
    if p.pp_p2p == "send":
        raise ConfigError("--parallel.pp_p2p='send' does not work on the xla backend (send/recv "
                          "take group-local peers as global ranks); use --parallel.pp_p2p=allgather")
    # XLA's verifier accepts a mesh of groups only if it names every rank once: the pairs [s, s+1] of one parity
    # (with the wrap-around [pp-1, 0]) need an even pp; the embedding group (first, last stage) leaves out the middle.
    if m.tie_embeddings and p.pp > 2:
        raise ConfigError(f"tied embeddings with pp {p.pp} on the xla backend: the embedding group (first and last "
                          f"stage) leaves out the middle stages, which XLA's verifier rejects; use pp 2, or untied embeddings")
    if p.pp % 2:
        raise ConfigError(f"pp {p.pp} on the xla backend must be even: the all-gather pipeline's "
                          f"pair groups must cover every rank once (NxD's rule); use pp {p.pp - 1} or {p.pp + 1}")


def warnings(cfg: Config) -> list[str]:
    """Settings that work but are seldom meant, said before the run starts (a pre-compile pass may mean them)."""
    o, end = cfg.optim, cfg.optim.warmup_steps + cfg.optim.constant_steps + cfg.optim.decay_steps
    if o.warmup_steps > o.max_steps:
        return [f"--optim.warmup_steps={o.warmup_steps} is longer than the run (--optim.max_steps={o.max_steps}): the lr "
                f"never reaches its peak {o.lr:g}; lower warmup_steps unless this run stops a longer schedule early on purpose"]
    fit = o.max_steps - o.warmup_steps - o.constant_steps          # the decay_steps that end the cosine with the run
    sched = f"(warmup {o.warmup_steps} + constant {o.constant_steps} + decay {o.decay_steps} = {end} steps)"
    fix = f"set --optim.decay_steps={fit} to end the cosine with the run" if fit > 0 else "shorten warmup and constant"
    if o.min_lr < o.lr and o.max_steps < end:      # the schedule should end with the run (nanoGPT: lr_decay_iters ~= max_iters)
        return [f"--optim.max_steps={o.max_steps} ends before the lr schedule {sched} decays to --optim.min_lr={o.min_lr:g}; "
                f"{fix}, unless this run stops a longer schedule early on purpose"]
    if o.min_lr < o.lr and o.max_steps > end + o.max_steps // 10:     # (the blog's table: its last 4% at min_lr)
        return [f"--optim.max_steps={o.max_steps} runs {o.max_steps - end} steps at --optim.min_lr={o.min_lr:g} after the lr "
                f"schedule {sched}; {fix}"]
    return []


# ----------------------------------------------------------------------------- paths: what needs the file system

def path_kind(path: str) -> str:
    """What is at path, in words (a FIFO is named a FIFO, not "does not exist")."""
    import stat
    if any("\udc80" <= c <= "\udcff" for c in path):      # undecodable bytes (surrogateescape): Arrow, sentencepiece
        return "a name not in UTF-8 (rename it)"             # and every JSON file a run writes fail on them later
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:           # a link to nothing is not nothing: makedirs would fail on it
        return f"a broken symbolic link (to {os.readlink(path)})" if os.path.islink(path) else "nothing"
    except OSError as e:
        return f"unreadable ({e.strerror})"
    return ("a directory" if stat.S_ISDIR(mode) else "a file" if stat.S_ISREG(mode) else
            "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device")


def expand_home(paths: str) -> str:      # bash expands ~ only at a word's start: --data=~/x came as '~/x'
    return ",".join(map(os.path.expanduser, paths.split(",")))


def check_dir(key: str, path: str) -> None:
    """path is a directory this process can create or write into."""
    if not path.strip():                # "" or spaces: the current directory, or a folder named "   " in it
        raise ConfigError(f"--{key}={path!r} names no directory: give one")
    parent = os.path.abspath(path)
    while not os.path.lexists(parent):         # the nearest existing ancestor is what gets written
        parent = os.path.dirname(parent)
    if parent != os.path.abspath(path) and os.path.isdir(parent) and not os.access(parent, os.X_OK):   # lexists: EACCES
        raise ConfigError(f"--{key}={path!r}: {parent} is a folder this user cannot search: fix its permissions (x for this user), or give another path")
    if (kind := path_kind(path)) not in ("nothing", "a directory") and (os.path.isdir(parent) or parent == os.path.abspath(path)):
        raise ConfigError(f"--{key}={path!r} is {kind}, not a directory; remove it or give another path")  # (under a file: below)
    if not os.path.isdir(parent):
        raise ConfigError(f"--{key}={path!r}: {parent} is {path_kind(parent)}, not a directory; give another path")
    try:        # os.access lets root write anywhere, yet /proc, /sys and read-only mounts refuse even root: a real try
        os.rmdir(tempfile.mkdtemp(prefix=".nanotrn-check-", dir=parent))    # 4096 ranks x 4 folders x 2 ops: ~33k at start
    except OSError as e:            # a read-only mount: no user's rights would help
        why = "on a read-only file system" if os.statvfs(parent).f_flag & os.ST_RDONLY else f"not writable ({e.strerror})"
        raise ConfigError(f"--{key}={path!r}: {parent} is {why}; give another path") from None


def check_paths(cfg: Config) -> None:
    """Every directory a run writes and the tokenizer it reads: else a bad path fails the first save, hours in."""
    dirs = (("out_dir", cfg.out_dir), ("ckpt.dir", cfg.ckpt.dir), ("data.cache_dir", cfg.data.cache_dir))
    ckpt = os.path.realpath(cfg.ckpt.dir)
    for key, path in dirs + ((("log.tensorboard", cfg.log.tensorboard),) if cfg.log.tensorboard else ()):
        check_dir(key, path)        # (an empty out_dir, ckpt.dir or cache_dir: refused by check_values)
        under = os.path.relpath(os.path.realpath(path), ckpt).split(os.sep)[0]     # its folder right under ckpt.dir
        if under.startswith("step_") and under[5:13].isdigit():
            raise ConfigError(f"--{key}={path} is inside {os.path.join(cfg.ckpt.dir, under)}, a checkpoint's folder: "
                              f"a save writes into it, and it is deleted when it is pruned; give another --{key}")
    if (tok := cfg.data.tokenizer) and (kind := path_kind(tok)) != "a directory":   # a model folder, else a readable file
        if kind != "a file":
            raise ConfigError(f"--data.tokenizer={tok!r} is {'missing' if kind == 'nothing' else kind}: give a file")
        if not os.access(tok, os.R_OK):
            raise ConfigError(f"--data.tokenizer={tok!r} is not readable by this user")


def main(argv: list[str]) -> None:
    if argv[:1] == ["plan"]:    # issue 10's spelling of `python plan.py ...`: the planner, imported only when asked
        return __import__("planner.report", fromlist=["main"]).main(argv[1:])
    try:                                # --help reads the flags too: `--help --bogus` is the same one line
        if wants_help(argv):
            return print(help_text(__doc__, [a for a in argv if a != "show"]))
        if not argv or argv[0] != "show":
            sys.exit("usage: python configs.py show [--preset NAME] [--section.key=value ...]  (the planner: python configs.py plan, or plan.py)")
        check_values(cfg := from_args(argv[1:]))
    except ConfigError as e:
        sys.exit(f"config error: {e}")
    print(json.dumps(cfg.to_dict(), indent=2))


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)     # `show | head`: ends as cat does, not with a BrokenPipeError
    main(sys.argv[1:])
