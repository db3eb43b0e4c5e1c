"""Hugging Face, both ways: load a transformers Llama folder into any layout, export a complete one.

Loading refuses, by name and before any weight is read, whatever nanotrn's Llama would compute differently (another
architecture, biases, a sliding window, another rope scaling, a tensor nothing consumes, a shape the config does not
imply): training on wrong logits is the failure it prevents. Weights convert by row bookkeeping only (`_hf_rows`);
`load_sharded` reads from the safetensors files only this rank's rows, so at 4096 ranks each reads about 1/(TP*PP) of
the model and none holds it whole. The export (`save_hf`) is a folder AutoModelForCausalLM, AutoTokenizer,
lm-evaluation-harness and llama.cpp's converter load with no other argument.
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

import sharding
from ckptdir import STEP_DIR, interrupted, scan
from configs import DOMAINS, Config, ConfigError, ModelConfig, path_kind
from model import num_params, param_shapes


class HFError(ConfigError):
    """A Hugging Face folder that nanotrn cannot load exactly."""


# Keys nanotrn does not implement that change the computation: the value that means "not used", what any other means.
UNSUPPORTED = {
    "attention_bias": (False, "q/k/v/o projections with biases"), "mlp_bias": (False, "MLP projections with biases"),
    "hidden_act": ("silu", "an MLP activation other than SwiGLU's silu"),
    "attention_dropout": (0.0, "dropout on attention probabilities"),
    "partial_rotary_factor": (1.0, "RoPE on part of each head"), "use_qk_norm": (False, "RMSNorm on queries and keys"),
    "no_rope_layers": (None, "layers without RoPE"), "attn_logit_softcapping": (None, "soft-capped attention scores"),
    "final_logit_softcapping": (None, "soft-capped logits"), "embedding_multiplier": (1.0, "a scaled embedding"),
    "residual_multiplier": (1.0, "scaled residual branches"), "logits_scaling": (1.0, "scaled logits"),
    "quantization_config": (None, "quantized weights (GPTQ, AWQ, FP8...)")}
ARCHITECTURES = {      # model_type -> why it is not a Llama, for the ones users try most
    "qwen2": "q/k/v biases and sliding-window layers", "qwen3": "q/k norms",
    "phi3": "fused projections and partial RoPE variants", "mixtral": "mixture-of-experts MLPs",
    "gemma": "GeLU MLPs and a scaled embedding", "gemma2": "soft-capping and sliding windows"}
# A key config.json leaves out is what transformers' LlamaConfig / MistralConfig default to (not one guess for both)
DEFAULTS = {"llama": {"max_position_embeddings": 2048},
            "mistral": {"max_position_embeddings": 131072, "sliding_window": 4096, "num_key_value_heads": 8}}
LLAMA3_ROPE = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")  # Llama 3.1 rope_scaling
LLAMA3_FIELDS = ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_len")   # ours, in order
RUN_MODEL_KEYS = ("checkpointing", "attention", "max_seq_len")    # what a run may set over --init_from's config
EXPORT_TMP = ".export.tmp"      # save_hf writes into it first: a killed export's is removed by the next
GENERATION = "generation_config.json"
EXPORT_FILES = {"config.json", "model.safetensors", GENERATION, "tokenizer.json", "tokenizer.model",
                "tokenizer_config.json", "special_tokens_map.json", EXPORT_TMP}
# The LlamaConfig format hf_config writes: the oldest transformers requirements-dev.txt allows
# (tests/test_hf.py keeps them equal). Without a stamp <= 4.57.2, transformers 4.57.3-4.57.6 warn
# wrongly that Llama 3's tokenizer.json tokenizes badly (transformers #44031).
TRANSFORMERS_FORMAT = "4.45.0"


def model_config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """Our ModelConfig from a config.json dict (transformers 4 or 5), or HFError naming the first
    difference. overrides: the run's ModelConfig fields (checkpointing, attention, max_seq_len)."""
    kind = hf.get("model_type")
    if kind not in ("llama", "mistral"):
        why = ARCHITECTURES.get(kind, "")
        raise HFError(f"model_type {kind!r} is not supported{' (' + why + ')' if why else ''}: nanotrn "
                      f"loads model_type 'llama' (Llama 2, 3, 3.1, 3.2) and 'mistral' without a sliding window")
    if hf.get("hidden_act") == "swish":     # transformers' ACT2FN computes "swish" as silu (one module)
        hf = {**hf, "hidden_act": "silu"}
    for key, (off, what) in UNSUPPORTED.items():
        if hf.get(key) is not None and hf[key] != off:
            raise HFError(f"{key}={hf[key]!r} means {what}, which nanotrn's Llama does not implement; "
                          f"load a checkpoint with {key}={off!r} (Llama 2 and 3 have it)")
    said, hf = hf, {**DEFAULTS[kind], **hf}
    # The shape as whole numbers, the rest as numbers: else a ZeroDivisionError or a TypeError later.
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    for key in (*required, "num_key_value_heads", "max_position_embeddings", "head_dim", "sliding_window"):
        if (key in required or hf.get(key) is not None) and not (type(hf.get(key)) is int and hf[key] >= 1):
            raise HFError(f"{key}={hf[key]!r}: a Llama config gives a whole number >= 1" if key in hf else
                          f"no {key}: a Llama config.json gives {', '.join(required)}")
    for key in ("rms_norm_eps", "initializer_range"):    # null too: a TypeError later; 10**400, NaN: no float
        if key in hf and not (type(hf[key]) in (int, float) and -1e308 < hf[key] < 1e308):
            raise HFError(f"{key}={hf[key]!r}: a Llama config gives a finite number")
    positions = hf["max_position_embeddings"] or DEFAULTS[kind]["max_position_embeddings"]     # null: as absent
    max_len, window = overrides.get("max_seq_len", positions), hf.get("sliding_window")
    if window is not None and (hf.get("use_sliding_window", True) and window < max_len):
        default = "" if "sliding_window" in said else " (transformers' default: config.json gives none)"
        raise HFError(f"sliding_window={window}{default} is shorter than the sequence ({max_len}): nanotrn has no "
                      f"sliding-window attention; train with sequences of at most {window} tokens "
                      f"(--model.max_seq_len={window}) or use a checkpoint without one")
    heads, kv = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    if heads % kv:                      # else a reshape error deep in the loader
        raise HFError(f"num_key_value_heads={kv} does not divide num_attention_heads={heads}: each KV head serves a "
                      f"whole group of query heads in a Llama; config.json is damaged, re-download it")
    rope = _rope(hf)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    fields = dict(vocab_size=hf["vocab_size"], dim=hf["hidden_size"], ffn_dim=hf["intermediate_size"],
                  n_layers=hf["num_hidden_layers"], n_heads=heads, n_kv_heads=kv,
                  max_seq_len=positions, norm_eps=hf.get("rms_norm_eps", 1e-6),
                  init_std=hf.get("initializer_range", 0.02), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                  head_dim_override=head_dim if head_dim * heads != hf["hidden_size"] else 0, **rope)
    # configs.py's domains, named by config.json's keys: validate named --model.* flags, which --init_from refuses
    named = {"rope_theta": "rope_theta", "norm_eps": "rms_norm_eps", "init_std": "initializer_range",
             **{f: f"rope_scaling {k}" for f, k in zip(LLAMA3_FIELDS, LLAMA3_ROPE) if f in fields}}
    for ours, theirs in named.items():
        if not DOMAINS[f"model.{ours}"][0](v := fields[ours]):     # (finite numbers: checked above)
            raise HFError(f"{theirs}={v!r}: must be {DOMAINS[f'model.{ours}'][1]}; config.json is damaged, re-download it")
    fields.update(overrides)
    return ModelConfig(**fields)


def _rope(hf: dict) -> dict:
    """RoPE settings from transformers 5's rope_parameters or 4's rope_theta + rope_scaling."""
    params = hf.get("rope_parameters")
    if params is not None:              # transformers 5
        if "rope_theta" not in params and all(isinstance(v, dict) for v in params.values()):
            raise HFError(f"rope_parameters per layer type ({', '.join(params)}): nanotrn uses one RoPE for all layers")
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    else:
        params, theta = hf.get("rope_scaling") or {}, hf.get("rope_theta", 10000.0)
    if not (type(theta) in (int, float) and -1e308 < theta < 1e308 and isinstance(params, dict)):   # null, text, NaN
        raise HFError(f"rope_theta={theta!r}, rope scaling {params!r}: a Llama config gives a finite number and an object (or null)")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return {"rope_theta": float(theta), "rope_scaling": "none"}
    if kind != "llama3" or params.get("attention_factor", 1.0) != 1.0:
        raise HFError(f"rope scaling {kind!r} ({params}) is not implemented: nanotrn implements none and "
                      f"'llama3' (Llama 3.1 and later); load a checkpoint that uses one of them")
    if missing := [k for k in LLAMA3_ROPE if not (type(v := params.get(k)) in (int, float) and -1e308 < v < 1e308)]:
        raise HFError(f"rope scaling 'llama3' without a number for {', '.join(missing)} ({params}): "
                      f"config.json is incomplete; give all of {', '.join(LLAMA3_ROPE)}")
    if not params["high_freq_factor"] > params["low_freq_factor"]:      # configs.py's rule, named by these keys
        raise HFError(f"rope_scaling high_freq_factor={params['high_freq_factor']} must be above low_freq_factor="
                      f"{params['low_freq_factor']} (llama3 rope scaling blends between them); config.json is damaged")
    ours = {f: float(params[k]) for f, k in zip(LLAMA3_FIELDS, LLAMA3_ROPE)}
    return {"rope_theta": float(theta), "rope_scaling": "llama3", **ours, "rope_original_max_len": int(ours["rope_original_max_len"])}


def hf_config(cfg: ModelConfig, dtype: torch.dtype = torch.float32, bos_id: int | None = None,
              eos_id: int | None = None, pad_id: int | None = None) -> dict:
    """config.json for transformers' LlamaForCausalLM (the transformers 4 format, which 5 reads)."""
    out = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
           "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
           "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
           "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
           "rope_theta": cfg.rope_theta, "rope_scaling": None, "initializer_range": cfg.init_std,
           "hidden_act": "silu", "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
           "mlp_bias": False, "torch_dtype": str(dtype).removeprefix("torch."), "bos_token_id": bos_id,
           "eos_token_id": eos_id, "pad_token_id": pad_id, "transformers_version": TRANSFORMERS_FORMAT}
    if cfg.rope_scaling == "llama3":
        out["rope_scaling"] = {"rope_type": "llama3", **{k: getattr(cfg, f) for f, k in zip(LLAMA3_FIELDS, LLAMA3_ROPE)}}
    return out


def _hf_rows(name: str, cfg: ModelConfig) -> tuple[list[str], torch.Tensor]:
    """Our tensor `name` as rows of HF tensors: (their names, a [rows, 2] table of (index into the names, row in that
    tensor)) in our row order. qkv_proj: per KV group g, [q heads of g | k_g | v_g]; gate_up_proj: [gate | up]."""
    def rows(n, src=0):
        return torch.stack((torch.full((n,), src), torch.arange(n)), dim=1)
    hd, d = cfg.head_dim, cfg.dim
    if name in ("embed.weight", "lm_head.weight"):
        tied = name == "embed.weight" or cfg.tie_embeddings
        return ["model.embed_tokens.weight" if tied else "lm_head.weight"], rows(cfg.vocab_size)
    if name == "norm.weight":
        return ["model.norm.weight"], rows(d)
    i, rest = name.split(".")[1], name.split(".", 2)[2]
    h = f"model.layers.{i}."
    if rest == "attn.qkv_proj.weight":
        kv, rep = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads
        q = rows(cfg.n_heads * hd, 0).reshape(kv, rep, hd, 2)
        k, v = rows(kv * hd, 1).reshape(kv, 1, hd, 2), rows(kv * hd, 2).reshape(kv, 1, hd, 2)
        return [h + "self_attn.q_proj.weight", h + "self_attn.k_proj.weight", h + "self_attn.v_proj.weight"], \
            torch.cat((q, k, v), dim=1).reshape(-1, 2)
    if rest == "mlp.gate_up_proj.weight":
        return [h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"], torch.cat((rows(cfg.ffn_dim, 0), rows(cfg.ffn_dim, 1)))
    src = {"attn.o_proj.weight": "self_attn.o_proj.weight", "mlp.down_proj.weight": "mlp.down_proj.weight",
           "attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight"}[rest]
    return [h + src], rows(d)


def to_hf_state_dict(sd: dict, cfg: ModelConfig) -> dict:
    """Ours -> Hugging Face LlamaForCausalLM weights (no lm_head.weight when tied, as HF saves it)."""
    out = {}
    for name in (n for n in param_shapes(cfg) if n != "lm_head.weight" or not cfg.tie_embeddings):
        srcs, table = _hf_rows(name, cfg)
        for i, s in enumerate(srcs):
            mine = table[:, 0] == i
            out[s] = sd[name][mine][table[mine, 1].argsort()].contiguous()
    return out


def json_object(path: str, fix: str) -> dict:
    """The JSON object in `path`, else HFError naming it and `fix` (a download cut short, another file)."""
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:      # ValueError: not JSON, or not UTF-8
        obj = e
    if not isinstance(obj, dict):
        what = obj if isinstance(obj, Exception) else f"a JSON {type(obj).__name__}"
        raise HFError(f"{path} is not a readable JSON object ({str(what):.80}): {fix}")
    return obj


def read_config(folder: str, **overrides) -> ModelConfig:
    path = os.path.join(folder, "config.json")
    if os.path.isdir(folder) and not os.access(folder, os.R_OK | os.X_OK):     # another user's 0700: "no config.json"
        raise HFError(f"{folder} cannot be read by this user: fix its permissions, or copy the model to your own")
    if not os.path.isfile(path):        # nanotrn's (a run's --out_dir, a --ckpt.dir or one step of it): say how to use them
        if os.path.isfile(os.path.join(folder, "hf", "config.json")):      # the export train.py wrote into <out_dir>/hf
            raise HFError(f"{folder} is a run's --out_dir: give its export, --init_from={os.path.join(folder, 'hf')}")
        d = os.path.abspath(folder)
        d = os.path.dirname(d) if STEP_DIR.match(os.path.basename(d)) else d
        ours = [c for c in (d, os.path.join(d, "ckpt")) if os.path.isdir(c) and any(STEP_DIR.match(n) for n in os.listdir(c))]
        raise HFError(f"{folder} has no config.json: give a Hugging Face model folder (save_pretrained's output)" + (
            f"; it holds nanotrn checkpoints: continue that run with --ckpt.dir={ours[0]}, or start from its weights "
            f"with python checkpoint.py export {ours[0]} OUT and --init_from=OUT" if ours else ""))
    hf = json_object(path, "give a Hugging Face model folder")
    try:
        return model_config_from_hf(hf, **overrides)
    except HFError as e:
        raise HFError(f"{path}: {e}") from None


class SafetensorsFolder:
    """A folder's *.safetensors tensors, read by name and row range (a slice reads only its bytes)."""

    def __init__(self, folder: str):
        from safetensors import safe_open
        index = os.path.join(folder, "model.safetensors.index.json")
        # What transformers reads, in its order: model.safetensors, else the index's files (not consolidated.*)
        files = [n for n in ("model.safetensors",) if os.path.isfile(os.path.join(folder, n))]
        if not files and os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as f:
                    files = sorted(set(json.load(f)["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise HFError(f"{index} is not a safetensors index ({type(e).__name__}: {e}); re-download "
                              f"it or give another --init_from") from None
        if not files:
            raise HFError(f"no .safetensors files in {folder} (model.safetensors, or an index): download the model's "
                          f"*.safetensors beside its config.json, or re-save a .bin with save_pretrained(..., safe_serialization=True)")
        try:
            self.files = {n: safe_open(os.path.join(folder, n), framework="pt") for n in files}
        except Exception as e:          # safetensors' own error type: a truncated or foreign file
            if bad := [os.path.join(folder, n) for n in files if not os.access(os.path.join(folder, n), os.R_OK)]:
                raise HFError(f"{bad[0]} is not readable by this user: fix its permissions" if os.path.exists(bad[0]) else
                              f"{bad[0]}, which {os.path.basename(index)} names, is missing ({len(bad)} of {len(files)} "
                              f"files): download the model's files again") from None
            raise HFError(f"{folder}: cannot read its weights ({e}); re-download them or give another "
                          f"--init_from") from None
        self.where = {k: f for f in self.files.values() for k in f.keys()}

    def shape(self, name: str) -> list[int]:
        return list(self.where[name].get_slice(name).get_shape())

    def rows(self, name: str, start: int, end: int, cols: slice = slice(None)) -> torch.Tensor:
        return self.where[name].get_slice(name)[start:end, cols] if len(self.shape(name)) == 2 \
            else self.where[name].get_slice(name)[start:end]


@torch.no_grad()
def load_sharded(model: torch.nn.Module, folder: str, cfg: ModelConfig, tp: int = 1, tp_rank: int = 0,
                 masters: dict | None = None) -> None:
    """Copy the weights of `folder` into this rank's model (a Llama, its TP shard or a pipeline stage, with the whole
    model's parameter names), reading only this rank's rows and columns (sharding.index). masters: filled with the
    file's values in fp32, a mixed run's masters (bf16 params round fp16/fp32 files: Llama 2's are fp16), held on the
    host until the optimizer takes them: 4 bytes a local param (7B at TP=8: 3.4 GB a rank, 108 GB of a trn1 node's 512)."""
    st, tables = check_weights(folder, cfg)
    full = param_shapes(cfg)
    for name, p in model.named_parameters():       # a tied matrix once, as embed.weight
        srcs, table = tables[name]
        # This rank's rows of the (source, row) table by the TP rule (padding, -1: zero); row-parallel: its columns
        rows, cols = sharding.index(name, full[name], cfg, tp, tp_rank)
        mine = table if rows is None else torch.where((rows >= 0).view(-1, 1), table[rows.clamp(min=0)], -1)
        cols = slice(None) if cols is None else cols
        out = torch.zeros(p.shape, dtype=p.dtype if masters is None else torch.float32)
        for i, s in enumerate(srcs):
            sel = mine[:, 0] == i
            if sel.any():
                r = mine[sel, 1]
                lo, hi = int(r.min()), int(r.max()) + 1        # a rank's rows of one source are contiguous
                out[sel] = st.rows(s, lo, hi, cols)[r - lo].to(out.dtype)
        p.copy_(out.to(p.device))
        if masters is not None:
            masters[name] = out


def check_weights(folder: str, cfg: ModelConfig) -> tuple[SafetensorsFolder, dict]:
    """The folder's tensors are exactly those of a Llama of cfg, in the shapes it implies: checked from
    the safetensors headers alone (apply_init_from: before any work; each rank reads them, kilobytes)."""
    st, full = SafetensorsFolder(folder), param_shapes(cfg)
    tables = {name: _hf_rows(name, cfg) for name in full}      # tied: both names, one source
    want = {s for srcs, _ in tables.values() for s in srcs}
    if missing := sorted(want - set(st.where)):
        raise HFError(f"{folder} lacks {len(missing)} tensors a Llama of this config.json needs, e.g. "
                      f"{', '.join(missing[:3])}: the weights and config.json do not belong together")
    if extra := sorted(n for n in set(st.where) - want if not n.endswith("rotary_emb.inv_freq")
                       and not (n == "lm_head.weight" and cfg.tie_embeddings)):
        raise HFError(f"{folder} has {len(extra)} tensors nanotrn's Llama would not use, e.g. "
                      f"{', '.join(extra[:3])}: they belong to an architecture it does not implement")
    for name, (srcs, table) in tables.items():
        for i, s in enumerate(srcs):        # the shapes the config implies
            want = [int((table[:, 0] == i).sum()), *full[name][1:]]
            if st.shape(s) != want:
                raise HFError(f"{folder}: {s} has shape {st.shape(s)} but config.json implies {want}: the weights "
                              f"and config.json do not belong together")
    return st, tables


def save_hf(model_sd: dict, cfg: ModelConfig, folder: str, dtype: torch.dtype = torch.float32,
            tokenizer=None, overwrite: bool = False, bos: bool = True, gen_dir: str = "") -> None:
    """config.json, model.safetensors in `dtype`, generation_config.json and the run's tokenizer files
    (BOS added where the run did: bos, its --data.bos). Refuses a non-empty folder unless overwrite. Written
    into <folder>/.export.tmp, moved in once complete: a full disk or a kill leaves an earlier export as it was."""
    from safetensors.torch import save_file
    if os.path.isdir(folder) and set(os.listdir(folder)) - {EXPORT_TMP} and not overwrite:
        raise HFError(f"{folder} is not empty: export into a new folder, or pass --overwrite "
                      f"(python checkpoint.py export --overwrite ...) to replace what is there")
    ids = special_ids(tokenizer) if tokenizer is not None else {}
    sd = to_hf_state_dict({k: v.detach().to("cpu", dtype) for k, v in model_sd.items()}, cfg)
    conf = hf_config(cfg, dtype, ids.get("bos"), ids.get("eos"), ids.get("pad"))
    # The model folder's own generation_config.json is kept (gen_dir's: the copy kept with the checkpoints, else the
    # one beside the tokenizer): sampling settings and EOS ids chosen with the weights. Else: generate pads finished
    # sequences of a batch with EOS when the tokenizer has no pad.
    theirs = os.path.join(gen_dir or os.path.dirname(tokenizer.path), GENERATION) if gen_dir or tokenizer is not None else ""
    pad = conf["pad_token_id"] if conf["pad_token_id"] is not None else conf["eos_token_id"]
    gen = json_object(theirs, "re-download it, or remove it") if os.path.isfile(theirs) else {
        "bos_token_id": conf["bos_token_id"], "eos_token_id": conf["eos_token_id"], "pad_token_id": pad,
        "do_sample": True, "temperature": 0.8, "top_k": 50, "max_length": cfg.max_seq_len}
    tmp = os.path.join(folder, EXPORT_TMP)
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        save_file(sd, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        # safetensors 0.8 writes its file 0600: made readable as the other files are (the umask's), by
        # another user of a shared file system (a serving job). os.umask returns it only by setting one.
        umask = os.umask(0o22)
        os.umask(umask)
        os.chmod(os.path.join(tmp, "model.safetensors"), 0o666 & ~umask)
        for name, obj in (("config.json", conf), (GENERATION, gen)):
            with open(os.path.join(tmp, name), "w") as f:
                json.dump(obj, f, indent=2)
        if isinstance(tokenizer, HFTokenizer):
            tokenizer.save_hf(tmp, cfg.max_seq_len, bos)
        elif tokenizer is not None:
            save_sentencepiece(tokenizer, tmp, cfg.max_seq_len, bos)
    except Exception as e:          # safetensors and tokenizers raise their own types for an I/O error
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(e, OSError) and "(os error" not in str(e):
            raise
        full = getattr(e, "errno", None) == errno.ENOSPC or "(os error 28)" in str(e)
        raise HFError(f"could not write the export into {folder}: {'disk full' if full else e} (an export is written "
                      f"whole before it replaces an earlier one, which stays as it was); free space, or export "
                      f"elsewhere from the checkpoint with python checkpoint.py export CKPT_DIR OUT") from None
    for name in EXPORT_FILES - set(os.listdir(tmp)):       # no stale file of an earlier export
        if os.path.isfile(path := os.path.join(folder, name)):
            os.remove(path)
    for name in os.listdir(tmp):
        os.replace(os.path.join(tmp, name), os.path.join(folder, name))
    os.rmdir(tmp)


def _token_text(t) -> str | None:
    return t.get("content") if isinstance(t, dict) else t


class HFTokenizer:
    """A tokenizer.json (Llama 3's format) with data.Tokenizer's interface. BOS and EOS are the
    tokenizer's own: tokenizer_config.json beside it, else the BOS its post-processor inserts."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer as Fast
        folder, file = (path, os.path.join(path, "tokenizer.json")) if os.path.isdir(path) else (os.path.dirname(path), path)
        try:
            self.tk = Fast.from_file(file)
        except Exception as e:       # tokenizers raises its own Exception type for bad files
            raise HFError(f"{file}: not a Hugging Face tokenizer.json ({e}); give one with --data.tokenizer") from None
        self.path = file
        self.vocab_size = self.tk.get_vocab_size(with_added_tokens=True)
        conf_path = os.path.join(folder, "tokenizer_config.json")
        self.config = json_object(conf_path, "re-download it, or remove it") if os.path.isfile(conf_path) else {}
        self.named = {k: _token_text(self.config.get(f"{k}_token")) for k in ("bos", "eos")}   # tokenizer_config's
        self.bos_id, self.eos_id = self._id(self.named["bos"]), self._id(self.named["eos"])
        if self.named["bos"] is None:      # the token the post-processor puts first (Llama 3's: "<|begin_of_text|> $A")
            self.bos_id = (self.tk.encode("", add_special_tokens=True).ids or [-1])[0]
        self.fingerprint = hashlib.sha256(Path(file).read_bytes()).hexdigest()[:16]

    def _id(self, token: str | None) -> int:
        i = self.tk.token_to_id(token) if token else None
        return -1 if i is None else i

    def encode(self, text: str) -> list[int]:
        return self.tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tk.decode([int(i) for i in ids], skip_special_tokens=False)

    def use_threads(self, threads: int) -> None:
        """Tokenize on `threads` cores, set before the first encode_batch starts the library's rayon
        pool (one thread per host core by default: 32 ranks x 128 threads on a trn1 node). The
        user's RAYON_NUM_THREADS / TOKENIZERS_PARALLELISM are kept (tokenizers/src/utils/parallelism.rs)."""
        os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
        if threads == 1:
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    def encode_batch(self, texts: list[str], bos: bool, eos: bool, threads: int = 1):
        import numpy as np
        head, tail = [self.bos_id] if bos else [], [self.eos_id] if eos else []
        return [np.asarray(head + e.ids + tail, np.int32) for e in self.tk.encode_batch(texts, add_special_tokens=False)]

    def save_hf(self, folder: str, max_len: int, bos: bool = True) -> None:
        """tokenizer.json, and a tokenizer_config.json naming its BOS/EOS for AutoTokenizer. Training
        starts each document with bos_id (unless --data.bos=false); where the post-processor does not
        put it first (GPT-NeoX's tokenizer.json: BOS named only in tokenizer_config.json), the export's
        gets a template that does, and where the run added none, none: AutoTokenizer gives the run's ids."""
        from tokenizers import Tokenizer, processors
        adds = self.bos_id >= 0 and self.tk.encode("", add_special_tokens=True).ids[:1] == [self.bos_id]
        tk = Tokenizer.from_str(self.tk.to_str())
        if bos and self.bos_id >= 0 and not adds:
            b = self.tk.id_to_token(self.bos_id)
            template = processors.TemplateProcessing(single=f"{b} $A", pair=f"{b} $A {b} $B",
                                                     special_tokens=[(b, self.bos_id)])
            own = tk.post_processor
            tk.post_processor = template if own is None else processors.Sequence([own, template])
            tk.save(os.path.join(folder, "tokenizer.json"))
        elif adds and not bos:
            tk.post_processor = None
            tk.save(os.path.join(folder, "tokenizer.json"))
        else:
            shutil.copyfile(self.path, os.path.join(folder, "tokenizer.json"))
        ids = special_ids(self)
        conf = {**self.config, "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
                "model_input_names": ["input_ids", "attention_mask"]}   # not token_type_ids: a Llama's generate refuses them
        for name, i in (("bos", ids["bos"]), ("eos", ids["eos"]), ("pad", ids["pad"] if ids["pad"] is not None else ids["eos"])):
            if i is not None:            # the tokenizer pads with EOS when it has no pad (lm-eval batches)
                conf[f"{name}_token"] = self.tk.id_to_token(i)
        conf.pop("added_tokens_decoder", None), conf.pop("auto_map", None)
        Path(folder, "tokenizer_config.json").write_text(json.dumps(conf, indent=2))


def prompt_ids(tok, text: str, bos: bool = True) -> list[int]:
    """The ids AutoTokenizer gives `text` on the export (BOS first, where the tokenizer has one and
    the run starts documents with it, bos: --data.bos): a prompt for our generate as transformers'."""
    return [tok.bos_id] * (bos and tok.bos_id >= 0) + tok.encode(text)


def special_ids(tok) -> dict:
    """bos/eos/pad ids of a data.Tokenizer or HFTokenizer (None where it has none). pad is only the
    tokenizer's own: transformers never trains config.json's pad row (padding_idx), so never EOS."""
    bos, eos = (i if i >= 0 else None for i in (tok.bos_id, tok.eos_id))
    pad = tok.tk.token_to_id(p) if (p := _token_text(getattr(tok, "config", {}).get("pad_token"))) else None
    return {"bos": bos, "eos": eos, "pad": pad if pad not in (bos, eos) else None}   # an export's own pads with EOS


def save_sentencepiece(tok, folder: str, max_len: int, bos: bool = True) -> None:
    """A sentencepiece model as Llama 2's tokenizer files: tokenizer.model, tokenizer.json (what
    AutoTokenizer loads without sentencepiece) and a LlamaTokenizer config adding BOS (if bos), not EOS. No
    `add_prefix_space`: LlamaTokenizerFast would rebuild tokenizer.json without the normalizer."""
    shutil.copyfile(tok.path, os.path.join(folder, "tokenizer.model"))
    sentencepiece_json(tok.path, bos).save(os.path.join(folder, "tokenizer.json"))
    piece = lambda i: tok.sp.id_to_piece(i) if i >= 0 else None     # noqa: E731
    conf = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": bos, "add_eos_token": False,
            "bos_token": piece(tok.bos_id), "eos_token": piece(tok.eos_id), "unk_token": piece(tok.sp.unk_id()),
            "pad_token": piece(tok.eos_id), "legacy": True, "clean_up_tokenization_spaces": False,
            "model_max_length": max_len, "split_special_tokens": True}   # "</s>" in text is text, as in training
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(conf, f, indent=2)


SPM_TYPES = {1: "unigram", 2: "bpe", 3: "word", 4: "char"}
# Text the export must encode as sentencepiece does (check_sentencepiece_export): words, code,
# whitespace runs, accents, a ligature NFKC rewrites, CJK, an emoji (byte fallback or <unk>).
PROBE = ["The quick brown fox jumps over the lazy dog.", "  two  spaces\tand a tab\n\nnew lines ",
         "def f(x):\n    return x ** 2  # squared", "Grüße aus Köln: 12,345.67 € — “quoted” ﬁne",
         "中文 日本語 한국어 😀 ok", "x", ""]


def sentencepiece_json(path: str, bos: bool = True):
    """The sentencepiece model at `path` as a `tokenizers` Tokenizer that encodes as it does: its own normalizer;
    unigram -> Unigram, bpe -> BPE with the merges its pieces' scores imply (as transformers' converter), char -> BPE
    without merges. `word` is refused: sentencepiece fuses a run of unknown words into one <unk>; no tokenizers model does."""
    from sentencepiece import sentencepiece_model_pb2 as pb
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, processors
    m = pb.ModelProto()
    with open(path, "rb") as f:
        m.ParseFromString(f.read())
    t, ns, kind = m.trainer_spec, m.normalizer_spec, SPM_TYPES.get(m.trainer_spec.model_type)
    if kind not in ("unigram", "bpe", "char"):
        raise HFError(f"{path} is a sentencepiece model of type {kind or m.trainer_spec.model_type}, which "
                      f"cannot be exported for transformers with the ids training reads (sentencepiece merges a "
                      f"run of unknown words into one <unk>; no Hugging Face tokenizer does): use a unigram, bpe "
                      f"or char model (or leave --data.tokenizer empty to train one)")
    pieces = [(p.piece, p.score) for p in m.pieces]
    vocab = {p: i for i, (p, _) in enumerate(pieces)}
    if kind == "unigram":     # a document's <s>, <unk>, <0x41> is text to sentencepiece: those pieces scored below any text
        low = [(p, -1e6 if m.pieces[i].type in (2, 3, 5, 6) else score) for i, (p, score) in enumerate(pieces)]
        tk = Tokenizer(models.Unigram(low, unk_id=t.unk_id, byte_fallback=t.byte_fallback))
    else:
        merges = []
        if kind == "bpe":            # every split of a normal piece into two pieces; higher score first
            for i, (p, score) in enumerate(pieces):
                if m.pieces[i].type == 1 and len(p) > 1:
                    merges += [(-score, vocab[p[:k]], vocab[p[k:]], p[:k], p[k:]) for k in range(1, len(p))
                               if p[:k] in vocab and p[k:] in vocab]
            merges = [(a, b) for *_, a, b in sorted(merges)]
        tk = Tokenizer(models.BPE(vocab, merges, unk_token=pieces[t.unk_id][0], fuse_unk=True,
                                  byte_fallback=t.byte_fallback))
    norm = [normalizers.Precompiled(ns.precompiled_charsmap)] if ns.precompiled_charsmap else []
    if ns.remove_extra_whitespaces:      # sentencepiece: spaces only (not tabs or newlines)
        norm += [normalizers.Replace(Regex(" {2,}"), " "), normalizers.Replace(Regex(r"\A | \z"), "")]
    norm += [normalizers.Prepend("▁")] if ns.add_dummy_prefix else []
    tk.normalizer = normalizers.Sequence(norm + [normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                   + ([decoders.Strip(" ", 1, 0)] if ns.add_dummy_prefix else []))
    tk.add_tokens([AddedToken(p.piece, normalized=False, special=p.type == 3) for p in m.pieces if p.type in (3, 4)])
    if t.bos_id >= 0 and bos:            # AutoTokenizer adds BOS, as training does at a document's start
        bos = pieces[t.bos_id][0]
        tk.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                          special_tokens=[(bos, t.bos_id)])
    return tk


def check_sentencepiece_export(tok) -> None:
    """Before the first step: the export of this sentencepiece model encodes PROBE as it does, or
    the run is refused now rather than after its last step (a fraction of a second)."""
    fast = sentencepiece_json(tok.path)
    for text in PROBE:
        ours, theirs = tok.encode(text), fast.encode(text, add_special_tokens=False).ids
        if ours != theirs:
            raise HFError(f"{tok.path}: its Hugging Face export would encode {text!r} as {theirs[:12]}, but "
                          f"training reads {ours[:12]}: a sentencepiece setting the export does not reproduce; "
                          f"use a model trained with default normalization, or leave --data.tokenizer empty")


def apply_init_from(cfg, argv: list[str] = (), share: tuple[int, int] = (0, 1)) -> None:
    """--init_from=FOLDER: the model is the folder's config.json (with the run's RUN_MODEL_KEYS), the
    tokenizer its own unless --data.tokenizer names one. Runs before validation, so that a refused
    config fails before any work; a --model.* key that would change the architecture is refused (share: RANK, WORLD)."""
    if not cfg.init_from:
        return
    given = {a[2:].split("=")[0].replace("-", "_").removeprefix("model.") for a in argv if a.startswith("--model.")}
    if other := sorted(given - set(RUN_MODEL_KEYS)):
        raise HFError(f"--model.{other[0]} with --init_from: the architecture is {cfg.init_from}/config.json's; "
                      f"drop it (a run may set only --model.{', --model.'.join(RUN_MODEL_KEYS)})")
    run = {k: getattr(cfg.model, k) for k in RUN_MODEL_KEYS if k in given or k != "max_seq_len"}
    if not os.path.exists(cfg.init_from):              # read_config would say only 'has no config.json'
        for _, step in scan(cfg.ckpt.dir) if cfg.ckpt.resume else []:    # a resume of a run started from it: the
            try:                                # checkpoints hold the model's config, its tokenizer is kept there
                saved = json.loads((step / "meta.json").read_text())["config"]
            except (OSError, ValueError, KeyError):     # a save cut short: an older one may hold it
                continue
            if saved.get("init_from") == cfg.init_from and not interrupted(step, share):   # resume would load the folder
                cfg.model = dataclasses.replace(ModelConfig(**{k: v for k, v in saved["model"].items() if hasattr(cfg.model, k)}), **run)
                return
        hub = cfg.init_from.count("/") == 1 and not cfg.init_from.startswith((".", "/", "~"))    # owner/name, as transformers takes
        raise HFError(f"--init_from={cfg.init_from} does not exist: give a Hugging Face model folder (save_pretrained's output)"
                      + (f"; a hub id is downloaded first: hf download {cfg.init_from} --local-dir DIR, then --init_from=DIR" * hub))
    export = os.path.join(cfg.out_dir, "hf")           # where train.py writes the final export
    if os.path.isdir(export) and os.path.isdir(cfg.init_from) and os.path.samefile(export, cfg.init_from):
        raise HFError(f"--init_from={cfg.init_from} is this run's export folder (<out_dir>/hf): the final "
                      f"export would replace the weights it starts from; copy them elsewhere or set another --out_dir")
    cfg.model = read_config(cfg.init_from, **run)
    check_weights(cfg.init_from, cfg.model)
    if os.path.isfile(gen := os.path.join(cfg.init_from, GENERATION)):    # the export keeps it: checked now
        json_object(gen, "re-download it, or remove it (the export then writes defaults)")
    if not cfg.data.tokenizer:
        cfg.data.tokenizer = cfg.init_from


def export_dtype(choice: str, cfg: ModelConfig) -> torch.dtype:
    auto = torch.bfloat16 if num_params(cfg) > 1e9 else torch.float32
    return {"auto": auto, "fp32": torch.float32, "bf16": torch.bfloat16}[choice]


def check_export_dir(cfg: Config, share: tuple[int, int] = (0, 1)) -> str:
    """<out_dir>/hf, the run's final export (returned), checked before any work: only an earlier export's files, none of
    the run's other folders in it, a model only if this run continues a checkpoint. share: (RANK, WORLD), as check's."""
    folder = os.path.join(cfg.out_dir, "hf")
    if os.path.lexists(folder) and not os.path.isdir(folder):     # else makedirs fails after the whole run
        raise HFError(f"{folder} is {path_kind(folder)}, where the export goes: move it, or choose another --out_dir")
    there = set(os.listdir(folder)) if os.path.isdir(folder) else set()
    if there and not there <= EXPORT_FILES:
        raise HFError(f"{folder} holds files that are not a nanotrn export ({', '.join(sorted(there - EXPORT_FILES)[:3])}): "
                      f"move them, or choose another --out_dir")
    for key, path in (("ckpt.dir", cfg.ckpt.dir), ("log.tensorboard", cfg.log.tensorboard),
                      ("data.cache_dir", cfg.data.cache_dir)):
        if path and Path(path).resolve().is_relative_to(Path(folder).resolve()):
            raise ConfigError(f"--{key}={path} is inside the export folder {folder} (<out_dir>/hf): the "
                              f"next run would refuse the mixed folder; give another --{key}")
    # A folder resume takes: not one set aside (scan), nor a save cut short (resume sets it aside, starts afresh).
    if os.path.exists(os.path.join(folder, "config.json")) and not (cfg.ckpt.resume and any(
            not interrupted(d, share) for _, d in scan(cfg.ckpt.dir))):
        raise ConfigError(f"{folder} holds a model exported by an earlier run, and this run starts afresh "
                          f"({'--ckpt.resume=false' if not cfg.ckpt.resume else f'no complete checkpoint in {cfg.ckpt.dir}'}):"
                          f" it would be overwritten at the end; move it away or give another --out_dir")
    return folder

