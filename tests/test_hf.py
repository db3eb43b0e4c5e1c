"""hf.py: loading refuses what it cannot represent; Llama 3 (rope scaling, tied embeddings, explicit
head_dim) against transformers both ways; transformers 5 configs."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import hf as hf_io  # noqa: E402
from conftest import load_hf, max_rel_err  # noqa: E402
import model as llama  # noqa: E402
from configs import Config, ConfigError, ModelConfig  # noqa: E402

transformers = pytest.importorskip("transformers")

BASE = {"model_type": "llama", "vocab_size": 101, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}


@pytest.mark.parametrize("change, expected", [
    ({"model_type": "qwen2"}, "model_type 'qwen2'"),
    ({"model_type": "phi3"}, "model_type 'phi3'"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"mlp_bias": True}, "mlp_bias=True"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"attention_dropout": 0.1}, "attention_dropout=0.1"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"model_type": "mistral", "sliding_window": 32}, "sliding_window=32"),
    # text where a whole number goes, beside a window (Mistral's default 4096 too): was a TypeError traceback
    ({"model_type": "mistral", "max_position_embeddings": "8192"}, "max_position_embeddings='8192': a Llama config"),
    ({"model_type": "mistral", "sliding_window": "4096"}, "sliding_window='4096': a Llama config gives a whole"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope scaling 'linear'"),
    ({"rope_parameters": {"full_attention": {"rope_theta": 1e4}, "sliding_attention": {"rope_theta": 1e4}}},
     "per layer type"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3 does not divide num_attention_heads=4"),   # was a reshape error
    ({"rope_theta": None}, "rope_theta=None"),            # null or text where a number goes: was a TypeError
    ({"rope_parameters": {"rope_type": "default", "rope_theta": None}}, "rope_theta=None"),
    ({"rope_scaling": "llama3"}, "rope scaling 'llama3'"),
    ({"rms_norm_eps": None}, "rms_norm_eps=None"),
    ({"initializer_range": None}, "initializer_range=None"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config=.* means quantized weights"),   # was "an architecture"
    # Outside configs.py's domains: were refused later naming --model.* flags, which --init_from refuses
    ({"rope_theta": 0.5}, "rope_theta=0.5: must be > 1"),
    ({"rope_theta": float("nan")}, "rope_theta=nan, .*a finite number"),
    ({"rope_theta": 10**400}, "rope_theta=1000.*a finite number"),        # JSON's whole number no float holds: was an
    ({"rms_norm_eps": 10**400}, "rms_norm_eps=1000.*a finite number"),     # OverflowError traceback
    ({"rope_scaling": {**LLAMA31_ROPE, "factor": 10**400}}, "without a number for factor"),
    ({"rms_norm_eps": 0}, "rms_norm_eps=0: must be >= 1.4e-45"),
    ({"initializer_range": -0.02}, "initializer_range=-0.02: must be >= 1.4e-45"),
    ({"rope_scaling": {**LLAMA31_ROPE, "factor": 0}}, "rope_scaling factor=0.0: must be >= 1"),
    ({"rope_scaling": {**LLAMA31_ROPE, "original_max_position_embeddings": 0}}, "original_max_position_embeddings=0: must be >= 1"),
    ({"rope_scaling": {**LLAMA31_ROPE, "low_freq_factor": 4.0}}, "high_freq_factor=4.0 must be above .*low_freq_factor=4.0"),
])
def test_refused_config_keys_are_named(change, expected):
    with pytest.raises(hf_io.HFError, match=expected.replace("(", r"\(")) as e:
        hf_io.model_config_from_hf({**BASE, **change})
    assert "\n" not in str(e.value) and not re.search(r"--model\.(?!max_seq_len)", str(e.value))   # a flag --init_from takes


def test_mistral_without_a_window_explicit_head_dim_and_both_rope_formats_load():
    """Mistral with no effective window, explicit head_dim, and both config formats' rope."""
    m = hf_io.model_config_from_hf({**BASE, "model_type": "mistral", "sliding_window": None})
    assert m.rope_theta == 10000.0 and m.rope_scaling == "none"
    assert hf_io.model_config_from_hf({**BASE, "model_type": "mistral", "sliding_window": 4096}).max_seq_len == 64
    assert hf_io.model_config_from_hf({**BASE, "model_type": "mistral", "sliding_window": 64}).max_seq_len == 64  # = the sequence
    assert hf_io.model_config_from_hf({**BASE, "head_dim": 24}).head_dim == 24
    # No max_position_embeddings (or null): transformers' LlamaConfig / MistralConfig default (2048 / 131072), not 4096
    for kind, hf_class in (("llama", transformers.LlamaConfig), ("mistral", transformers.MistralConfig)):
        absent = {k: v for k, v in BASE.items() if k != "max_position_embeddings"} | {"model_type": kind, "sliding_window": None}
        theirs = hf_class.from_dict(absent).max_position_embeddings
        assert hf_io.model_config_from_hf(absent).max_seq_len == theirs == {"llama": 2048, "mistral": 131072}[kind]
        assert hf_io.model_config_from_hf({**absent, "max_position_embeddings": None}).max_seq_len == theirs
    # A Mistral config.json without sliding_window: transformers' 4096, so a longer sequence is refused (it loaded)
    assert transformers.MistralConfig.from_dict({**BASE, "model_type": "mistral"}).sliding_window == 4096
    long = {**BASE, "model_type": "mistral", "max_position_embeddings": 8192}
    with pytest.raises(hf_io.HFError, match=r"^sliding_window=4096 \(transformers' default: config.json gives none\) "
                                            r"is shorter than the sequence \(8192\)"):
        hf_io.model_config_from_hf(long)
    assert hf_io.model_config_from_hf(long, max_seq_len=4096).max_seq_len == 4096
    v5 = {k: v for k, v in BASE.items() if k != "rope_theta"}
    assert hf_io.model_config_from_hf({**v5, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}).rope_theta == 500000.0
    m = hf_io.model_config_from_hf({**v5, "rope_parameters": {**LLAMA31_ROPE, "rope_theta": 500000.0}})
    assert (m.rope_theta, m.rope_scaling, m.rope_factor, m.rope_original_max_len) == (500000.0, "llama3", 4.0, 32)


def test_a_key_config_json_leaves_out_is_what_transformers_defaults_it_to():
    """hf.DEFAULTS' rule for every key a Llama or Mistral config.json may leave out: the model built is the one
    transformers' LlamaConfig / MistralConfig builds from the same file (its defaults, not ours: nanotrn's own
    norm_eps is 1e-5 where both classes default rms_norm_eps to 1e-6; MistralConfig gives 8 KV heads)."""
    ours_of = {"num_key_value_heads": "n_kv_heads", "rms_norm_eps": "norm_eps", "rope_theta": "rope_theta",
               "initializer_range": "init_std", "tie_word_embeddings": "tie_embeddings", "head_dim": "head_dim"}
    full = {**BASE, "num_attention_heads": 16, "num_key_value_heads": 4, "rms_norm_eps": 1e-5, "rope_theta": 5e5,
            "initializer_range": 0.01, "tie_word_embeddings": True, "head_dim": 16, "sliding_window": None}
    for kind, hf_class in (("llama", transformers.LlamaConfig), ("mistral", transformers.MistralConfig)):
        for key, field in ours_of.items():
            absent = {k: v for k, v in full.items() if k != key} | {"model_type": kind}
            theirs = getattr(hf_class.from_dict(absent), key)
            theirs = 64 // 16 if key == "head_dim" and theirs is None else theirs     # MistralConfig: None
            assert getattr(hf_io.model_config_from_hf(absent), field) == theirs != full[key], (kind, key, theirs)


def test_hidden_act_swish_is_silu_and_loads(tmp_path):
    """transformers computes hidden_act "swish" as silu (activations.ACT2FN: one SiLU module for both):
    it loads, to transformers' logits, and the export names it silu; "gelu" stays refused."""
    torch.manual_seed(0)
    hf = llama3_hf(hidden_act="swish")
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf(str(tmp_path / "hf")).eval()
    tokens = torch.randint(0, 101, (2, 20))
    with torch.no_grad():
        assert max_rel_err(ours(tokens), hf(tokens).logits) < 1e-5
    assert hf_io.hf_config(ours.cfg)["hidden_act"] == "silu"


def test_transformers5_config_file_loads_with_its_theta(tmp_path):
    """A folder whose config.json is in the transformers 5 format (rope_parameters, no rope_theta):
    our logits equal transformers 4's for the same weights at theta 500000, not at the default 10000."""
    torch.manual_seed(0)
    hf = llama3_hf(rope_theta=500000.0, rope_scaling=None, tie_word_embeddings=False)
    hf.save_pretrained(tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    conf.pop("rope_theta"), conf.pop("rope_scaling", None)
    conf["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    (tmp_path / "config.json").write_text(json.dumps(conf))
    ours = load_hf(str(tmp_path)).eval()
    assert ours.cfg.rope_theta == 500000.0
    tokens = torch.randint(0, 101, (2, 40))
    with torch.no_grad():
        assert max_rel_err(ours(tokens), hf(tokens).logits) < 1e-5


def llama3_hf(**kw):
    """A tiny transformers Llama 3.x: llama3 rope scaling (the short original context puts the
    frequencies in all three regimes), tied embeddings, head_dim 24 != 64 / 4, GQA."""
    args = {**{k: v for k, v in BASE.items() if k != "model_type"}, "head_dim": 24,
            "rope_scaling": LLAMA31_ROPE, "tie_word_embeddings": True, "attn_implementation": "eager"}
    args.update(kw)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**args)).eval()


def test_llama3_both_ways_match_transformers(tmp_path):
    """transformers -> our loader -> same logits (fp32, 1e-5); ours -> our export -> transformers'
    from_pretrained -> same logits, with the tie kept (one matrix, no lm_head tensor in the file).
    Llama 3's rope_theta and rms_norm_eps, not BASE's defaults: an export that wrote the defaults passed."""
    torch.manual_seed(0)
    hf = llama3_hf(rope_theta=500000.0, rms_norm_eps=1e-6)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf(str(tmp_path / "hf")).eval()
    assert ours.cfg.tie_embeddings and ours.lm_head.weight is ours.embed.weight and ours.cfg.head_dim == 24
    assert (ours.cfg.rope_scaling, ours.cfg.rope_theta, ours.cfg.norm_eps) == ("llama3", 500000.0, 1e-6)
    tokens = torch.randint(0, 101, (2, 48))
    with torch.no_grad():
        ref = hf(tokens).logits
        assert max_rel_err(ours(tokens), ref) < 1e-5
    ours.init_weights(seed=3)                      # new weights, exported and read by transformers
    hf_io.save_hf(ours.state_dict(), ours.cfg, str(tmp_path / "ours"))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        assert max_rel_err(back(tokens).logits, ours(tokens)) < 1e-5
    assert torch.allclose(llama.rope_frequencies(ours.cfg), back.model.rotary_emb.inv_freq, rtol=1e-6)


def test_generate_stops_at_eos_and_pads_as_transformers_generate(tmp_path):
    """Greedy generate with an EOS id equals transformers' generate with it as eos and pad: a row
    that produced EOS goes on with EOS, and generation ends once every row has (train.py's sample
    stops where transformers' generate on the export would)."""
    torch.manual_seed(0)
    ref = llama3_hf()
    ref.save_pretrained(tmp_path)
    ours = load_hf(str(tmp_path)).eval()
    prompt = torch.randint(2, 101, (2, 5))
    with torch.no_grad():
        free = ref.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
        eos = int(free[0, 5 + 3])                  # row 0's 4th new token: row 0 ends there
        want = ref.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        got = ours.generate(prompt, 8, temperature=1.0, top_k=1, eos_id=eos)
    assert torch.equal(got, want), (got, want)
    assert torch.equal(ours.generate(prompt, 8, temperature=1.0, top_k=1), free)     # no EOS: 8 tokens


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    llama3_hf(tie_word_embeddings=False).save_pretrained(folder)
    return folder


def _edit(saved, tmp_path, config=None, tensors=None):
    """A copy of the saved folder with config changes and/or tensor changes (name -> tensor or None)."""
    from safetensors.torch import load_file, save_file
    conf = {**json.loads((saved / "config.json").read_text()), **(config or {})}
    sd = load_file(saved / "model.safetensors")
    for k, v in (tensors or {}).items():
        sd.pop(k) if v is None else sd.__setitem__(k, v)
    (tmp_path / "config.json").write_text(json.dumps(conf))
    save_file(sd, tmp_path / "model.safetensors")
    return str(tmp_path)


@pytest.mark.parametrize("config, tensors, expected", [
    (None, {"model.layers.0.self_attn.q_proj.bias": torch.zeros(96)}, "would not use, e.g. model.layers.0.self_attn.q_proj.bias"),
    ({"num_hidden_layers": 1}, None, "would not use, e.g. model.layers.1."),
    ({"num_hidden_layers": 3}, None, "lacks 9 tensors"),
    (None, {"lm_head.weight": None}, "lacks 1 tensors .* lm_head.weight"),
    ({"intermediate_size": 128}, None, "gate_proj.weight has shape \\[96, 64\\] but config.json implies \\[128, 64\\]"),
])
def test_mixed_up_checkpoint_is_refused(saved, tmp_path, config, tensors, expected):
    with pytest.raises(hf_io.HFError, match=expected) as e:
        load_hf(_edit(saved, tmp_path, config, tensors))
    assert str(e.value).startswith(str(tmp_path)), str(e.value)        # which folder (the shape's named none)


@pytest.mark.parametrize("kv, tp, vocab, tie", [(1, 4, 101, True), (2, 2, 103, False), (1, 2, 101, False)])
def test_each_tp_rank_reads_its_own_piece_of_a_folder(tmp_path, kv, tp, vocab, tie):
    """load_sharded at each TP rank (in one process: no collective is involved) equals sharding.cut of the whole
    model: the vocabulary padded to a TP multiple (zero rows), KV heads replicated where tp > n_kv_heads (MQA),
    tied or not; an old transformers' rotary_emb.inv_freq in the file is passed over."""
    import sharding
    from safetensors.torch import load_file, save_file
    torch.manual_seed(0)
    llama3_hf(num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=tie).save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(12)
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    full, cfg = load_hf(str(tmp_path)).state_dict(), hf_io.read_config(str(tmp_path))
    for rank in range(tp):
        piece = llama.Llama(cfg)
        for name, p in piece.named_parameters():
            p.data = torch.full_like(sharding.cut(name, full[name], cfg, tp, rank), float("nan"))
        hf_io.load_sharded(piece, str(tmp_path), cfg, tp, rank)
        for name, p in piece.named_parameters():
            assert torch.equal(p.detach(), sharding.cut(name, full[name], cfg, tp, rank)), (rank, name)
    assert sharding.padded_vocab(vocab, tp) > vocab


def test_a_folder_without_weights_is_told_to_download_them(saved, tmp_path):
    # config.json alone (a download that skipped the weights) was told it was "a .bin checkpoint: re-save it"
    (tmp_path / "config.json").write_text((saved / "config.json").read_text())
    with pytest.raises(hf_io.HFError, match=r"no .safetensors files in .*: download the model's \*.safetensors"):
        hf_io.check_weights(str(tmp_path), hf_io.read_config(str(tmp_path)))


def test_head_dim_and_tie_in_our_config_match_num_params():
    cfg = hf_io.model_config_from_hf({**BASE, "head_dim": 24, "tie_word_embeddings": True})
    assert llama.num_params(cfg) == sum(p.numel() for p in llama.Llama(cfg).parameters())
    assert llama.num_params(ModelConfig()) == sum(p.numel() for p in llama.Llama(ModelConfig()).parameters())


# The released config.json files (meta-llama/Meta-Llama-3-8B, meta-llama/Llama-3.2-1B), abridged to
# the keys that shape the model.
LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 8192,
             "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
             "rope_theta": 500000.0, "rope_scaling": None, "tie_word_embeddings": False, "vocab_size": 128256,
             "hidden_act": "silu", "attention_bias": False, "bos_token_id": 128000, "eos_token_id": 128001}
LLAMA32_1B = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "max_position_embeddings": 131072,
              "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "head_dim": 64,
              "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": True, "vocab_size": 128256,
              "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"},
              "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "bos_token_id": 128000}


@pytest.mark.parametrize("preset, released, billions", [("llama3_8b", LLAMA3_8B, 8.03), ("llama3_2_1b", LLAMA32_1B, 1.24)])
def test_llama3_presets_are_the_released_models(preset, released, billions):
    import configs
    m = configs.PRESETS[preset]().model
    assert hf_io.model_config_from_hf(released, checkpointing=m.checkpointing, attention=m.attention) == m
    assert round(llama.num_params(m) / 1e9, 2) == billions
    configs.validate(configs.PRESETS[preset](), 4096)


@pytest.mark.parametrize("preset", ["tiny", "llama2_7b", "llama2_70b", "llama3_8b", "llama3_2_1b"])
def test_every_presets_config_json_reads_back_as_the_same_model(preset):
    """The export's config.json (hf_config) read back (model_config_from_hf, as --init_from and transformers read
    it) is the model trained: every field, norm_eps (1e-5 here, transformers' default 1e-6), rope theta and scaling,
    tied embeddings, init_std, an explicit head_dim."""
    import dataclasses
    import configs
    m = configs.PRESETS[preset]().model
    for m in (m, dataclasses.replace(m, init_std=0.01, head_dim_override=2 * m.head_dim)):
        back = hf_io.model_config_from_hf(hf_io.hf_config(m), checkpointing=m.checkpointing, attention=m.attention)
        assert back == m, (back, m)


def test_the_auto_export_dtype_is_bf16_above_a_billion_parameters_only():
    """--export_dtype=auto (docs/huggingface.md): bf16 above 1B parameters (half a 7B export's 27 GB), else fp32, which
    a small model's logits compare in; fp32 and bf16 as given."""
    import configs
    models = {p: configs.PRESETS[p]().model for p in ("tiny", "llama3_2_1b", "llama2_7b")}
    assert {p: hf_io.export_dtype("auto", m) for p, m in models.items()} == {
        "tiny": torch.float32, "llama3_2_1b": torch.bfloat16, "llama2_7b": torch.bfloat16}
    assert hf_io.export_dtype("fp32", models["llama2_7b"]) == torch.float32
    assert hf_io.export_dtype("bf16", models["tiny"]) == torch.bfloat16


# ----------------------------------------------------------------------------- tokenizers, runs, exports

TEXTS = [f"def f{i}(x):\n    return x * {i} + {i * i}  # line {i} of the corpus, über ünïcode 中文\n" * (1 + i % 5)
         for i in range(60)]


def llama3_tokenizer(folder, config=True):
    """A Llama 3 style tokenizer.json (byte-level BPE; the post-processor puts <|begin_of_text|>
    first), trained here, with the tokenizer_config.json Meta ships beside it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tk.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)])
    os.makedirs(folder, exist_ok=True)
    tk.save(os.path.join(folder, "tokenizer.json"))
    if config:
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
                       "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    return tk.get_vocab_size()


THREADS = r"""
import os, sys
sys.path.insert(0, sys.argv[1])
import data
from configs import DataConfig
tok = data.load_tokenizer(sys.argv[2])
before = len(os.listdir("/proc/self/task"))
cfg = DataConfig(data=sys.argv[3], seq_len=16, cache_dir=sys.argv[4], val_fraction=0.0)
loader = data.PackedLoader(cfg, tok, prefetch=0, threads=int(sys.argv[5]))
for _ in range(2):          # its first reads' encode_batch starts the pool
    next(loader)
tok.encode_batch(["a few words of text"] * 4000, False, False, int(sys.argv[5]))
print(len(os.listdir("/proc/self/task")) - before)      # the pool's threads stay after the calls
"""


@pytest.mark.slow                 # two Python processes that load torch: a third of the fast tier's time
def test_tokenizer_json_tokenizes_on_the_loaders_threads(tmp_path, monkeypatch):
    """A rank's tokenizer.json runs on the loader's threads (1 by default), not on a thread per core
    of the host (32 ranks of a trn1 node: 32x oversubscribed): the threads the process starts to
    tokenize, counted in /proc/self/task, in a fresh process (the pool starts once per process)."""
    llama3_tokenizer(str(tmp_path / "tok"))
    (tmp_path / "input.txt").write_text(" ".join(TEXTS * 20))
    env = {k: v for k, v in os.environ.items() if k not in ("RAYON_NUM_THREADS", "TOKENIZERS_PARALLELISM")}
    def started(threads):
        out = subprocess.run([sys.executable, "-c", THREADS, ROOT, str(tmp_path / "tok"), str(tmp_path / "input.txt"),
                              str(tmp_path / "cache"), str(threads)], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return int(out.stdout.split()[-1])
    many = (os.cpu_count() or 1) + 1                 # not what the pool would take by itself (a thread a core)
    assert started(1) == 0 and started(many) == many
    monkeypatch.setenv("RAYON_NUM_THREADS", "2")     # values the user set are kept
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    hf_io.HFTokenizer(str(tmp_path / "tok")).use_threads(1)
    assert (os.environ["RAYON_NUM_THREADS"], os.environ["TOKENIZERS_PARALLELISM"]) == ("2", "true")



def test_a_tiktoken_tokenizer_model_is_named_and_its_tokenizer_json_taken(tmp_path):
    """Llama 3's original tokenizer.model is tiktoken's text format ('base64-bytes rank' a line), not sentencepiece:
    it was refused as 'not a sentencepiece model (could not parse ModelProto ...); give a sentencepiece .model', the
    wrong fix, even in a folder whose tokenizer.json nanotrn reads. Now the folder's tokenizer.json is taken, and
    the file alone is refused in one line naming it and the fix."""
    import base64
    import data
    llama3_tokenizer(tmp_path / "m")
    tiktoken = "".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256))
    (tmp_path / "m" / "tokenizer.model").write_text(tiktoken)
    tok = data.load_tokenizer(str(tmp_path / "m"))
    assert isinstance(tok, hf_io.HFTokenizer) and tok.path == str(tmp_path / "m" / "tokenizer.json")
    (tmp_path / "alone").mkdir()
    (tmp_path / "alone" / "tokenizer.model").write_text(tiktoken)
    for given in (tmp_path / "alone", tmp_path / "alone" / "tokenizer.model", tmp_path / "m" / "tokenizer.model"):
        with pytest.raises(data.DataError) as e:
            data.load_tokenizer(str(given))
        assert str(e.value) == (f"{given if given.name == 'tokenizer.model' else given / 'tokenizer.model'} is a "
                                f"tiktoken file (Llama 3's original tokenizer.model), which nanotrn does not read: give "
                                f"the model's Hugging Face tokenizer.json instead (--data.tokenizer, or beside config.json for "
                                f"--init_from)")

def test_hf_tokenizer_json_ids_and_specials(tmp_path):
    import data
    n = llama3_tokenizer(tmp_path / "a", config=False)
    tok = data.load_tokenizer(str(tmp_path / "a"))              # a folder: its tokenizer.json
    assert isinstance(tok, hf_io.HFTokenizer) and tok.vocab_size == n
    assert (tok.bos_id, tok.eos_id) == (0, -1)                   # BOS from the post-processor; no EOS known
    llama3_tokenizer(tmp_path / "b")
    tok = data.load_tokenizer(str(tmp_path / "b" / "tokenizer.json"))
    assert (tok.bos_id, tok.eos_id) == (0, 1)                    # tokenizer_config.json names both
    ids = tok.encode_batch(TEXTS[:3], bos=True, eos=True)
    assert [list(x) for x in ids] == [[0] + tok.encode(t) + [1] for t in TEXTS[:3]]
    assert tok.decode(tok.encode(TEXTS[7])) == TEXTS[7]
    with pytest.raises(data.DataError, match="neither tokenizer.model nor tokenizer.json: put the model's tokenizer "
                                            "file there, or name one with --data.tokenizer"):   # it named no fix
        data.load_tokenizer(str(tmp_path))
    for text in ("{cut short", "[1, 2]"):          # was a JSONDecodeError / AttributeError traceback
        (tmp_path / "b" / "tokenizer_config.json").write_text(text)
        with pytest.raises(hf_io.HFError, match=r"b/tokenizer_config.json is not a readable JSON object \(.*re-download it"):
            data.load_tokenizer(str(tmp_path / "b"))
    (tmp_path / "b" / "tokenizer.json").write_text("")    # cut short: it named no fix
    with pytest.raises(hf_io.HFError, match=r"b/tokenizer.json: not a Hugging Face tokenizer.json \(.*\); give one with --data.tokenizer"):
        data.load_tokenizer(str(tmp_path / "b"))


def test_an_export_started_from_an_export_gives_config_json_no_eos_pad_row(tmp_path):
    """The export's tokenizer_config.json pads with EOS (for batching), and a run started from that export read it
    as the tokenizer's own pad: its export's config.json said pad_token_id = EOS, and transformers makes that row
    padding_idx (never trained by fine-tuning the export). pad_token_id stays the tokenizer's own pad, never EOS/BOS."""
    import data
    llama3_tokenizer(tmp_path / "src")
    cfg = ModelConfig(vocab_size=400, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=64)
    sd = llama.Llama(cfg).init_weights(0).state_dict()
    hf_io.save_hf(sd, cfg, str(tmp_path / "first"), tokenizer=data.load_tokenizer(str(tmp_path / "src")))
    assert json.loads((tmp_path / "first" / "tokenizer_config.json").read_text())["pad_token"] == "<|end_of_text|>"
    hf_io.save_hf(sd, cfg, str(tmp_path / "second"), tokenizer=data.load_tokenizer(str(tmp_path / "first")))
    for out in ("first", "second"):
        assert json.loads((tmp_path / out / "config.json").read_text())["pad_token_id"] is None, out
        assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / out).model.embed_tokens.padding_idx is None
        assert transformers.AutoTokenizer.from_pretrained(tmp_path / out).pad_token_id == 1      # batches still pad
    conf = json.loads((tmp_path / "src" / "tokenizer_config.json").read_text())
    llama3_tokenizer(tmp_path / "own")      # a tokenizer with a pad token of its own keeps it
    (tmp_path / "own" / "tokenizer_config.json").write_text(json.dumps({**conf, "pad_token": "e"}))
    tok = data.load_tokenizer(str(tmp_path / "own"))
    assert hf_io.special_ids(tok)["pad"] == tok.tk.token_to_id("e") not in (None, 0, 1)


@pytest.mark.parametrize("name", ["bos", "eos"])
def test_a_tokenizer_config_token_that_tokenizer_json_lacks_names_both_files(tmp_path, name):
    """tokenizer_config.json naming a bos_token / eos_token that tokenizer.json does not have (another model's
    config beside it) said only 'tokenizer.json has no BOS piece; set --data.bos=false': now it names the token,
    both files and the fix. A tokenizer.json with no such token and nothing named keeps the short line."""
    import data
    from configs import DataConfig
    n = llama3_tokenizer(tmp_path)
    named = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", f"{name}_token": {"content": "<s>"}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(named))
    with pytest.raises(data.DataError) as e:
        data.build_tokenizer(DataConfig(tokenizer=str(tmp_path)), n)
    assert str(e.value) == (f"{tmp_path}/tokenizer_config.json names {name}_token '<s>', which {tmp_path}/tokenizer.json "
                            f"does not have: make the two agree (one model's pair), or set --data.{name}=false")
    data.build_tokenizer(DataConfig(tokenizer=str(tmp_path), **{name: False}), n)      # the fix it names
    (tmp_path / "tokenizer_config.json").unlink()     # no EOS named, none known: the short line
    with pytest.raises(data.DataError, match="tokenizer.json has no EOS piece; set --data.eos=false"):
        data.build_tokenizer(DataConfig(tokenizer=str(tmp_path)), n)


def test_tokenizer_json_without_a_bos_processor_exports_the_runs_bos(tmp_path):
    """A tokenizer.json whose post-processor puts no BOS first (GPT-NeoX's kind: a ByteLevel one, or
    none) while tokenizer_config.json names a bos_token: training starts every document with that
    BOS, so the export's AutoTokenizer must too (it gave the ids without it: lm-eval would score
    the model on text it never saw that way)."""
    import data
    from tokenizers import Tokenizer, processors
    llama3_tokenizer(tmp_path / "t")
    for post in (None, processors.ByteLevel(trim_offsets=False)):
        tk = Tokenizer.from_file(str(tmp_path / "t" / "tokenizer.json"))
        tk.post_processor = post
        tk.save(str(tmp_path / "t" / "tokenizer.json"))
        tok = data.load_tokenizer(str(tmp_path / "t"))
        assert tok.bos_id == 0 and list(tok.encode_batch(TEXTS[:1], bos=True, eos=False)[0][:1]) == [0]
        cfg = ModelConfig(vocab_size=512, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=64)
        out = tmp_path / f"out{post is None}"
        hf_io.save_hf(llama.Llama(cfg).init_weights(0).state_dict(), cfg, str(out), tokenizer=tok)
        auto = transformers.AutoTokenizer.from_pretrained(out)
        for text in TEXTS[:3] + ["x"]:
            assert auto(text)["input_ids"] == [0] + tok.encode(text) == hf_io.prompt_ids(tok, text), (post, text)
        assert data.load_tokenizer(str(out)).encode(TEXTS[5]) == tok.encode(TEXTS[5])     # --init_from the export


def test_a_run_without_bos_exports_a_tokenizer_without_it(tmp_path):
    """--data.bos=false: no training document starts with BOS, so neither do the export's
    AutoTokenizer ids (sentencepiece and tokenizer.json kinds), nor the end-of-run sample's prompt;
    before, the export added BOS whatever the run did."""
    import sentencepiece as spm
    import data
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([line for t in TEXTS for line in t.split("\n") if line]), model_prefix=str(tmp_path / "sp"),
        vocab_size=300, model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    llama3_tokenizer(tmp_path / "t")
    cfg = ModelConfig(vocab_size=512, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=64)
    for path in (tmp_path / "sp.model", tmp_path / "t"):
        tok = data.load_tokenizer(str(path))
        for bos in (False, True):
            out = tmp_path / f"out-{path.name}-{bos}"
            hf_io.save_hf(llama.Llama(cfg).init_weights(0).state_dict(), cfg, str(out), tokenizer=tok, bos=bos)
            auto = transformers.AutoTokenizer.from_pretrained(out)
            for text in TEXTS[:2] + ["x"]:
                assert auto(text)["input_ids"] == [tok.bos_id] * bos + tok.encode(text) == hf_io.prompt_ids(tok, text, bos)


def test_a_tokenizer_json_export_generates_with_the_docs_command(tmp_path):
    """docs/huggingface.md's `m.generate(**t('def ', return_tensors='pt'), ...)` on the export of a run
    with a tokenizer.json: PreTrainedTokenizerFast's default inputs hold token_type_ids, which a Llama's
    generate refuses (ValueError: model_kwargs not used); the export names the two a Llama takes."""
    import data
    llama3_tokenizer(tmp_path / "t")
    cfg = ModelConfig(vocab_size=512, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=64)
    hf_io.save_hf(llama.Llama(cfg).init_weights(0).state_dict(), cfg, str(tmp_path / "out"),
                  tokenizer=data.load_tokenizer(str(tmp_path / "t")))
    t = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    m = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    prompt = t("def ", return_tensors="pt")
    assert m.generate(**prompt, max_new_tokens=2, do_sample=False).shape[1] == prompt["input_ids"].shape[1] + 2


def test_kept_tokenizer_can_be_the_runs_tokenizer(tmp_path):
    """A run resumed with --tokenizer=<ckpt dir>/tokenizer (the copy the first run kept) keeps it
    again: copying a file onto itself must not stop the run."""
    import checkpoint
    import data
    llama3_tokenizer(tmp_path / "t")
    kept = tmp_path / "ckpt" / "tokenizer"
    checkpoint.keep_tokenizer(data.load_tokenizer(str(tmp_path / "t")), str(kept))
    tok = data.load_tokenizer(str(kept))
    checkpoint.keep_tokenizer(tok, str(kept))
    assert data.load_tokenizer(str(kept)).encode(TEXTS[0]) == tok.encode(TEXTS[0]) and tok.bos_id == 0


def test_the_model_folders_generation_config_is_kept_by_both_exports(tmp_path):
    """A model folder's generation_config.json (Llama 3's samples at temperature 0.6, top_p 0.9 and
    stops at two EOS ids) is kept by the export of a run started from it: save_hf with the folder's
    tokenizer (train.py's end) and with the copy kept beside the checkpoints (checkpoint.py export).
    Before, both wrote their defaults over it (temperature 0.8, top_k 50, one EOS); a broken one is
    refused by --init_from before any work."""
    import checkpoint
    import data
    llama3_tokenizer(tmp_path / "src")
    theirs = {"bos_token_id": 0, "eos_token_id": [1, 7], "do_sample": True, "temperature": 0.6, "top_p": 0.9}
    (tmp_path / "src" / "generation_config.json").write_text(json.dumps(theirs))
    cfg = ModelConfig(vocab_size=512, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=64)
    sd = llama.Llama(cfg).init_weights(0).state_dict()
    kept = tmp_path / "ckpt" / "tokenizer"
    checkpoint.keep_tokenizer(data.load_tokenizer(str(tmp_path / "src")), str(kept))
    for i, folder in enumerate((tmp_path / "src", kept)):
        hf_io.save_hf(sd, cfg, str(tmp_path / f"out{i}"), tokenizer=data.load_tokenizer(str(folder)))
        assert json.loads((tmp_path / f"out{i}" / "generation_config.json").read_text()) == theirs
        got = transformers.GenerationConfig.from_pretrained(tmp_path / f"out{i}")
        assert (got.temperature, got.top_p, got.eos_token_id) == (0.6, 0.9, [1, 7])
    torch.manual_seed(0)
    llama3_hf().save_pretrained(tmp_path / "init")
    (tmp_path / "init" / "generation_config.json").write_text("{cut short")
    with pytest.raises(hf_io.HFError, match=r"init/generation_config.json is not a readable JSON object .*re-download it"):
        hf_io.apply_init_from(Config(init_from=str(tmp_path / "init")))
    # beside a --data.tokenizer of its own (no --init_from): the export reads it there too, so a broken one was
    # refused only by the export, after the whole run (HFError at train.py's end); now by check_tokenizer, before
    import configs
    import train
    (tmp_path / "src" / "generation_config.json").write_text("{cut short")
    for given in (tmp_path / "src", tmp_path / "src" / "tokenizer.json"):
        cfg = configs.from_args([f"--data.tokenizer={given}", f"--out_dir={tmp_path / 'run'}"])
        with pytest.raises(hf_io.HFError, match=r"src/generation_config.json is not a readable JSON object .*re-download"):
            train.check_tokenizer(cfg)


def test_sentencepiece_export_loads_in_auto_tokenizer_to_the_same_ids(tmp_path):
    """A run's sentencepiece tokenizer (Llama 2 settings) exported: AutoTokenizer gives its ids."""
    import sentencepiece as spm
    import data
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([line for t in TEXTS for line in t.split("\n") if line]), model_prefix=str(tmp_path / "sp"),
        vocab_size=300, model_type="bpe", byte_fallback=True, split_digits=True, normalization_rule_name="identity",
        add_dummy_prefix=True, remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    tok = data.load_tokenizer(str(tmp_path / "sp.model"))
    cfg = ModelConfig(vocab_size=300, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=64)
    hf_io.save_hf(llama.Llama(cfg).init_weights(0).state_dict(), cfg, str(tmp_path / "out"), tokenizer=tok)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    slow = transformers.AutoTokenizer.from_pretrained(tmp_path / "out", use_fast=False)
    # the special pieces' text in a document (HTML's <s> strike tag) is text to sentencepiece, as it trained
    for text in TEXTS[:5] + ["  two  spaces\tand tab\n\nnew lines", "x", "<s>struck</s> x</s>y <unk>"]:
        assert auto(text)["input_ids"] == slow(text)["input_ids"] == [tok.bos_id] + tok.encode(text), text
    assert hf_io.prompt_ids(tok, "def ") == auto("def ")["input_ids"]     # train.py's sample prompt
    conf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (conf["bos_token_id"], conf["eos_token_id"], conf["pad_token_id"]) == (1, 2, None)
    gen = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (1, 2, 2)
    gguf = pytest.importorskip("gguf")
    from pathlib import Path
    assert gguf.vocab.SentencePieceVocab(Path(tmp_path / "out")).vocab_size == 300
    with pytest.raises(hf_io.HFError, match="is not empty"):
        hf_io.save_hf(llama.Llama(cfg).state_dict(), cfg, str(tmp_path / "out"), tokenizer=tok)


@pytest.mark.slow             # ~5 s of CPU each: a 1,000-piece tokenizer trained, 30 files encoded three ways
@pytest.mark.parametrize("legacy", [True, False])
def test_a_llama2_folder_with_both_tokenizer_files_reads_as_auto_tokenizer_and_its_export(tmp_path, legacy):
    """A Llama 2 folder holds tokenizer.model and tokenizer.json (transformers' LlamaConverter's): training reads the
    first (sentencepiece), AutoTokenizer the second. Built here (a Llama 2-style BPE trained on stdlib files, converted
    by transformers with legacy true and false, as Llama 2's folders were), the two give the same ids on real text,
    and so does AutoTokenizer on the run's export (its own tokenizer.json: hf.sentencepiece_json). Measured at 4,096
    and 32,000 pieces on 448 stdlib documents (8.0M characters): 0 differ (docs/huggingface.md)."""
    import data
    from sources import stdlib_files
    from transformers import LlamaTokenizer, LlamaTokenizerFast
    from transformers.convert_slow_tokenizer import convert_slow_tokenizer
    docs = [open(p, encoding="utf-8").read() for p in stdlib_files()[::60]]         # 30 files
    train = data.DataConfig(data=",".join(stdlib_files()[::60]), cache_dir=str(tmp_path / "c"), val_fraction=0.0)
    sp = data.build_tokenizer(train, 1000)      # nanotrn's: Llama 2's settings
    folder = tmp_path / "llama2"
    slow = LlamaTokenizer(sp.path, legacy=legacy)               # add_prefix_space: its default, as Llama 2's folders
    LlamaTokenizerFast(tokenizer_object=convert_slow_tokenizer(slow), legacy=legacy, bos_token="<s>", eos_token="</s>",
                       unk_token="<unk>").save_pretrained(folder)
    shutil.copyfile(sp.path, folder / "tokenizer.model")
    tok = data.load_tokenizer(str(folder))
    assert tok.path == str(folder / "tokenizer.model") and isinstance(tok, data.Tokenizer)
    cfg = ModelConfig(vocab_size=1024, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=64)
    hf_io.save_hf(llama.Llama(cfg).init_weights(0).state_dict(), cfg, str(tmp_path / "out"), tokenizer=tok)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    export = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    for doc in docs:
        ids = tok.encode(doc)
        assert theirs(doc, add_special_tokens=False)["input_ids"] == ids and export(doc)["input_ids"] == [tok.bos_id] + ids


def test_a_unigram_export_reads_a_documents_literal_special_pieces_as_text(tmp_path):
    """A unigram model's <s>, </s>, <unk> written in a document (HTML's <s> strike tag) are text to sentencepiece, as
    training read them; the export's Unigram matched those pieces (score 0, the best) and gave ids 1, 2, 0."""
    import sentencepiece as spm
    import data
    lines = [line for t in TEXTS for line in t.split("\n") if line] + ["if a < b or b > c: print('<b>', 1 << 2, a / b, 'unknown')"]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(tmp_path / "sp"), model_type="unigram",
                                   vocab_size=100, character_coverage=1.0, minloglevel=2)
    tok = data.load_tokenizer(str(tmp_path / "sp.model"))
    cfg = ModelConfig(vocab_size=100, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=64)
    hf_io.save_hf(llama.Llama(cfg).init_weights(0).state_dict(), cfg, str(tmp_path / "out"), tokenizer=tok)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    for text in ["<s>struck</s> x</s>y <unk>", "a <s> b", *TEXTS[:3]]:
        assert auto(text)["input_ids"] == [tok.bos_id] + tok.encode(text), text
    assert auto.decode(auto("<s>x</s>")["input_ids"], skip_special_tokens=True) == "<s>x</s>"


def test_a_byte_fallback_unigram_export_reads_a_documents_literal_byte_pieces_as_text(tmp_path):
    """A byte-fallback unigram model's byte pieces (<0x41>) written in a document are text to sentencepiece; the
    export's Unigram matched them (ids 3-258) where training read '<', '0', 'x', ..."""
    import sentencepiece as spm
    import data
    lines = [line for t in TEXTS for line in t.split("\n") if line] + ["if a < b or b > c: print('<b>', 0x41, 1 << 2)"]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(tmp_path / "sp"), model_type="unigram",
                                   vocab_size=400, hard_vocab_limit=False, byte_fallback=True, character_coverage=1.0,
                                   minloglevel=2)
    tok = data.load_tokenizer(str(tmp_path / "sp.model"))
    cfg = ModelConfig(vocab_size=tok.vocab_size, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=64)
    hf_io.save_hf(llama.Llama(cfg).init_weights(0).state_dict(), cfg, str(tmp_path / "out"), tokenizer=tok)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    for text in ["<0x41> x <0x14>", "a <s> b 😀", *TEXTS[:3]]:
        assert auto(text)["input_ids"] == [tok.bos_id] + tok.encode(text), text


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_export_stamps_its_transformers_format_and_a_llama3_vocabulary_loads_without_the_regex_warning(tmp_path):
    """config.json carries transformers_version, the oldest release requirements-dev.txt allows. Without
    it, transformers 4.57.3+ takes a tokenizer.json above 100k entries (Llama 3's 128256) for a broken
    Mistral one and warns it tokenizes wrongly (the control below, on the versions that do)."""
    import logging
    from packaging.version import Version
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    import data
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({f"<|reserved_{i}|>": i for i in range(len(vocab), 128256)})
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    os.makedirs(tmp_path / "tok")
    tk.save(str(tmp_path / "tok" / "tokenizer.json"))
    tok = data.load_tokenizer(str(tmp_path / "tok"))
    cfg = ModelConfig(vocab_size=128256, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32, max_seq_len=64)
    out = tmp_path / "out"
    hf_io.save_hf(llama.Llama(cfg).state_dict(), cfg, str(out), tokenizer=tok)
    conf = json.loads((out / "config.json").read_text())
    with open(os.path.join(ROOT, "requirements-dev.txt")) as f:
        oldest = re.search(r"^transformers>=([0-9.]+)", f.read(), re.M).group(1)
    assert conf["transformers_version"] == hf_io.TRANSFORMERS_FORMAT and Version(oldest) == Version(hf_io.TRANSFORMERS_FORMAT)
    assert transformers.AutoConfig.from_pretrained(out).transformers_version == hf_io.TRANSFORMERS_FORMAT

    def regex_warning() -> bool:
        seen, handler = [], logging.Handler()
        handler.emit = lambda record: seen.append(record.getMessage())
        logger = logging.getLogger("transformers.tokenization_utils_base")
        logger.addHandler(handler)
        try:
            auto = transformers.AutoTokenizer.from_pretrained(out)
        finally:
            logger.removeHandler(handler)
        assert auto.vocab_size == 128256 and auto("x y")["input_ids"] == tok.encode("x y")
        return any("incorrect regex pattern" in m for m in seen)

    assert not regex_warning()
    if Version("4.57.3") <= Version(transformers.__version__) < Version("5"):    # the control
        del conf["transformers_version"]
        (out / "config.json").write_text(json.dumps(conf))
        assert regex_warning()


def _mixed_init_from(rank: int, port: int, args: list, src: str):
    """A rank of a mixed-precision run --init_from an fp32 folder: its optimizer's fp32 masters, as built, are the
    folder's values of this rank's piece (sharding.cut of the full fp32 weights), its bf16 params their rounding."""
    import optim
    import sharding
    import train
    if port:            # a spawned rank (in the test's own process the thread count stays as it is)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                          LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
        torch.set_num_threads(1)
    full, build, seen = load_hf(src).state_dict(), optim.build_optimizer, []

    def record(model, cfg, grid, *rest, **kwargs):
        opt = build(model, cfg, grid, *rest, **kwargs)
        kept = opt.masters()
        for name, p in model.named_parameters():
            want = sharding.cut(name, full[name], cfg.model, grid.tp, grid.tp_rank)
            assert torch.equal(kept[id(p)], want), f"{name}: the master is not the folder's fp32 values"
            assert torch.equal(p.detach(), want.to(p.dtype)), f"{name}: the bf16 param is not their rounding"
        seen.append(len(kept))
        return opt
    optim.build_optimizer = record
    try:
        train.main(args)
    finally:
        optim.build_optimizer = build
    assert seen and seen[0] > 0


@pytest.mark.parametrize("layout", ["one process", pytest.param("tp2", marks=pytest.mark.slow),
                                    pytest.param("zero1 dp2", marks=pytest.mark.slow)])
def test_a_mixed_run_from_an_fp32_folder_starts_its_masters_from_the_files_values(tmp_path, layout):
    """--optim.precision=mixed --init_from=FOLDER built its fp32 master weights from the bf16 params, the file's values
    rounded: an fp32 (or Llama 2's fp16) checkpoint lost its low bits at the start of continued pretraining, the
    rounding the master copy exists to avoid. The master now starts from the file's values at every layout."""
    from gloo_spawn import free_ports, spawn
    src = tmp_path / "fp32"
    vocab = llama3_tokenizer(src)
    torch.manual_seed(0)
    llama3_hf(vocab_size=vocab, bos_token_id=0, eos_token_id=1, max_position_embeddings=64).save_pretrained(src)
    with open(tmp_path / "docs.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in TEXTS)
    args = [f"--init_from={src}", f"--data={tmp_path}/docs.jsonl", "--data.seq_len=32", "--data.global_batch=4",
            "--data.micro_batch=2", "--optim.max_steps=1", "--optim.precision=mixed", "--log.eval_interval=0",
            "--log.sample_tokens=0", "--device=cpu", f"--out_dir={tmp_path}/run", "--log.tensorboard=",
            f"--data.cache_dir={tmp_path}/cache", "--log.peak_tflops=1"]
    if layout == "one process":
        _mixed_init_from(0, 0, args, str(src))
    else:
        extra = ["--tp=2"] if layout == "tp2" else ["--parallel.zero1=true"]
        spawn(_mixed_init_from, (free_ports(1)[0], args + extra, str(src)), 2, timeout_s=300)


@pytest.mark.slow
def test_continued_pretraining_at_tp2_and_complete_export(tmp_path):
    """train.py --init_from=HF_FOLDER at TP=2 (Llama 3.x: tied embeddings, llama3 rope, tokenizer.json):
    its first loss is transformers' loss on the same batch. Its export then loads in AutoTokenizer and
    AutoModelForCausalLM with no other argument, gives our ids, logits and greedy continuation, and
    gguf's vocabulary readers accept it; `checkpoint.py export` writes it in bf16 and refuses a full folder."""
    import subprocess
    import data
    import configs
    src = tmp_path / "llama3"
    vocab = llama3_tokenizer(src)
    torch.manual_seed(0)
    ref = llama3_hf(vocab_size=vocab, bos_token_id=0, eos_token_id=1, max_position_embeddings=64)
    ref.save_pretrained(src)
    with open(tmp_path / "docs.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in TEXTS)
    args = [f"--init_from={src}", f"--data={tmp_path}/docs.jsonl", "--data.seq_len=32", "--data.global_batch=4",
            "--data.micro_batch=4", "--optim.max_steps=2", "--optim.warmup_steps=0", "--log.interval=1",
            "--log.eval_interval=0", "--log.sample_tokens=0", "--tp=2", "--device=cpu", f"--out_dir={tmp_path}/run",
            f"--ckpt.dir={tmp_path}/run/ckpt", "--log.tensorboard=", f"--data.cache_dir={tmp_path}/cache"]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        os.path.join(ROOT, "train.py"), *args], capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    first = float(re.search(r"step\s+1 \| loss ([0-9.]+)", r.stdout).group(1))

    # transformers' loss on the run's first batch: each packed document on its own, from position 0.
    cfg = configs.from_args(args[1:5] + [f"--data.cache_dir={tmp_path}/cache"])
    cfg.data.tokenizer = str(src)
    tok = data.load_tokenizer(str(src))
    batch = next(iter(data.PackedLoader(cfg.data, tok, 0, 1, split="train")))
    total, count = 0.0, 0
    with torch.no_grad():
        for row in range(batch["tokens"].shape[0]):
            for d in batch["doc_ids"][row].unique():
                sel = batch["doc_ids"][row] == d
                logits = ref(batch["tokens"][row][sel][None]).logits[0]
                t = batch["targets"][row][sel]
                total += torch.nn.functional.cross_entropy(logits, t, ignore_index=-100, reduction="sum").item()
                count += int((t != -100).sum())
    assert abs(first - total / count) < 1e-4, (first, total / count)

    out = tmp_path / "run" / "hf"
    auto_tok = transformers.AutoTokenizer.from_pretrained(out)
    auto = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert auto.config.tie_word_embeddings and auto.config.rope_scaling["rope_type"] == "llama3"
    for text in TEXTS[:4]:
        assert auto_tok(text)["input_ids"] == [tok.bos_id] + tok.encode(text)
    assert hf_io.prompt_ids(tok, "def ") == auto_tok("def ")["input_ids"]     # train.py's sample prompt
    m = configs.ModelConfig(**json.loads((tmp_path / "run" / "ckpt" / "step_00000002" / "meta.json").read_text())["config"]["model"])
    import reshard
    ours = llama.Llama(m).eval()
    ours.load_state_dict(reshard.full_model_state(tmp_path / "run" / "ckpt" / "step_00000002", m))
    prompt = torch.tensor([auto_tok(TEXTS[3][:40])["input_ids"]])
    with torch.no_grad():
        assert max_rel_err(auto(prompt).logits, ours(prompt)) < 1e-5
        greedy = auto.generate(prompt, max_new_tokens=8, do_sample=False)
        assert torch.equal(greedy, ours.generate(prompt, 8, temperature=1.0, top_k=1))
    gguf = pytest.importorskip("gguf")
    from pathlib import Path
    assert gguf.vocab.BpeVocab(Path(out)).vocab_size == vocab
    special = gguf.vocab.SpecialVocab(Path(out), load_merges=True)
    assert (special.special_token_ids["bos"], special.special_token_ids["eos"]) == (0, 1) and special.merges

    cmd = [sys.executable, os.path.join(ROOT, "checkpoint.py"), "export", "--dtype=bf16", str(tmp_path / "run" / "ckpt")]
    r = subprocess.run(cmd + [str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode != 0 and "is not empty" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    r = subprocess.run(cmd + [str(tmp_path / "bf16")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    from safetensors.torch import load_file
    assert {v.dtype for v in load_file(tmp_path / "bf16" / "model.safetensors").values()} == {torch.bfloat16}
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", torch_dtype="auto")
    assert again.dtype == torch.bfloat16 and transformers.AutoTokenizer.from_pretrained(tmp_path / "bf16")(TEXTS[0])["input_ids"] == auto_tok(TEXTS[0])["input_ids"]

    # The folder gone, the run resumes (here at TP=1): the model's config and tokenizer are the checkpoint's.
    src.rename(tmp_path / "moved_away")
    again = [a.replace("--tp=2", "--tp=1").replace("max_steps=2", "max_steps=3") for a in args]
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *again], capture_output=True, text=True,
                       timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0 and re.search(r"step\s+3 \| loss", r.stdout), r.stdout[-2000:] + r.stderr[-2000:]
    assert "resum" in (r.stdout + r.stderr).lower()


def test_init_from_takes_the_folders_model_and_refuses_architecture_overrides(saved, tmp_path):
    import configs
    cfg = configs.from_args([f"--init_from={saved}", "--model.checkpointing=full", "--model.max_seq_len=32"])
    hf_io.apply_init_from(cfg, ["--model.checkpointing=full", "--model.max_seq_len=32"])
    assert (cfg.model.head_dim, cfg.model.rope_scaling, cfg.model.checkpointing, cfg.model.max_seq_len) == (24, "llama3", "full", 32)
    assert cfg.data.tokenizer == str(saved)
    with pytest.raises(hf_io.HFError, match="--model.n_layers with --init_from"):
        hf_io.apply_init_from(configs.from_args([f"--init_from={saved}"]), ["--model.n_layers=4"])
    (tmp_path / "hf").symlink_to(saved)                  # --init_from=out/hf with --out_dir=out
    with pytest.raises(hf_io.HFError, match="replace the weights it starts from"):
        hf_io.apply_init_from(configs.from_args([f"--init_from={saved}", f"--out_dir={tmp_path}"]), [])
    given = ["--model.max-seq-len=32"]                     # spelled with dashes, as configs.py accepts
    cfg = configs.from_args([f"--init_from={saved}", *given])
    hf_io.apply_init_from(cfg, given)
    assert cfg.model.max_seq_len == 32
    cfg = configs.from_args([f"--init_from={saved}", "--seq_len=16"])   # not given: the folder's, in the export too
    hf_io.apply_init_from(cfg, [])
    claimed = json.loads((saved / "config.json").read_text())["max_position_embeddings"]
    assert hf_io.hf_config(cfg.model)["max_position_embeddings"] == claimed != 32
    # tied across stages with ZeRO-1 and bf16_sr: accepted, the copies kept one by pipeline.sync_tied_embedding
    # (test_pipeline's zero1_and_software_stochastic_rounding case)
    tied = configs.from_args(["--model.tie_embeddings", "--pp=2", "--zero1", "--precision=bf16_sr", "--model.n_layers=2",
                              "--micro_batch=2"])
    configs.validate(tied, 4)


def test_a_resume_needs_no_init_from_folder_its_checkpoints_hold_the_model(saved, tmp_path):
    """A run started --init_from=FOLDER could not resume once FOLDER was gone (a download deleted after the
    start, a node without the mount): the folder is read only for the model's config and tokenizer, which
    the checkpoints hold (meta.json) and keep (ckpt/tokenizer). A fresh run still needs the folder."""
    import dataclasses
    import configs
    cfg = configs.from_args([f"--init_from={saved}"])
    hf_io.apply_init_from(cfg, [])
    gone = str(tmp_path / "moved_away")                 # the folder the run started from, deleted since
    step = tmp_path / "ckpt" / "step_00000004"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"config": {**cfg.to_dict(), "init_from": gone}}))
    (step / "rank00000.done").write_text(json.dumps({"step": 4, "rank": 0, "world": 1, "files": {}, "format": 2}))
    (step / "manifest.json").write_text(json.dumps({"format": 2, "step": 4, "world": 1, "lineage": "a"}))
    cut = tmp_path / "ckpt" / "step_00000008"           # a save cut short (no manifest): resume passes it over
    cut.mkdir()
    (cut / "meta.json").write_text(json.dumps({"config": {**cfg.to_dict(), "init_from": gone, "model": {"n_layers": 9}}}))
    again = configs.from_args([f"--init_from={gone}", f"--ckpt.dir={tmp_path}/ckpt", "--model.checkpointing=full"])
    hf_io.apply_init_from(again, ["--model.checkpointing=full"])
    assert again.model == dataclasses.replace(cfg.model, checkpointing="full") and not again.data.tokenizer
    # Still refused in one line: a fresh run, a run told not to resume, another folder (a typo) beside the checkpoints
    for args in ([f"--init_from={gone}", f"--ckpt.dir={tmp_path}/none"],
                 [f"--init_from={gone}", f"--ckpt.dir={tmp_path}/ckpt", "--ckpt.resume=false"],
                 [f"--init_from={tmp_path}/moved_awya", f"--ckpt.dir={tmp_path}/ckpt"]):
        with pytest.raises(hf_io.HFError, match="does not exist"):
            hf_io.apply_init_from(configs.from_args(args), [])
    with pytest.raises(hf_io.HFError, match=r"hf download meta-llama/Llama-3.2-1B --local-dir DIR, then --init_from=DIR$"):
        hf_io.apply_init_from(configs.from_args(["--init_from=meta-llama/Llama-3.2-1B"]), [])     # a hub id: no download
    os.remove(step / "manifest.json")     # every save cut short: resume would fall back to the folder (a traceback)
    with pytest.raises(hf_io.HFError, match="does not exist"):
        hf_io.apply_init_from(configs.from_args([f"--init_from={gone}", f"--ckpt.dir={tmp_path}/ckpt"]), [])


def test_sharded_checkpoint_follows_its_index(tmp_path):
    """save_pretrained's shards are read through model.safetensors.index.json; Mistral's extra
    consolidated.safetensors (Meta's names) beside them is not part of the model."""
    from safetensors.torch import save_file
    torch.manual_seed(0)
    hf = llama3_hf()
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    save_file({"layers.0.attention.wq.weight": torch.zeros(2, 2)}, tmp_path / "consolidated.safetensors")
    tokens = torch.randint(0, 101, (1, 20))
    with torch.no_grad():
        assert max_rel_err(load_hf(str(tmp_path)).eval()(tokens), hf(tokens).logits) < 1e-5
    # Saved whole, then sharded into the same folder (save_pretrained keeps the old model.safetensors):
    # transformers reads model.safetensors, not the index, and so must --init_from (it read the shards).
    torch.manual_seed(1)
    llama3_hf().save_pretrained(tmp_path)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        assert max_rel_err(hf(tokens).logits, theirs(tokens).logits) > 0.1         # not the sharded model
        assert max_rel_err(load_hf(str(tmp_path)).eval()(tokens), theirs(tokens).logits) < 1e-5


def test_a_shard_the_index_names_but_the_folder_lacks_is_called_missing(tmp_path):
    """A download cut short (one shard of save_pretrained's not there): it was called 'not readable by this
    user: fix its permissions' (os.access is False for a file that does not exist), the wrong fix."""
    torch.manual_seed(0)
    llama3_hf().save_pretrained(tmp_path, max_shard_size="40KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    shards[1].unlink()
    with pytest.raises(hf_io.HFError) as e:
        hf_io.check_weights(str(tmp_path), hf_io.read_config(str(tmp_path)))
    assert str(e.value) == (f"{shards[1]}, which model.safetensors.index.json names, is missing (1 of {len(shards)} "
                            f"files): download the model's files again")


def test_a_run_replaces_only_its_own_export(tmp_path):
    """train.py checks out/hf before any work: a continued run's earlier export may be replaced, anything else not."""
    cfg = Config(out_dir=str(tmp_path))
    cfg.ckpt.dir = str(tmp_path / "ckpt")
    step = tmp_path / "ckpt" / "step_00000002"                     # a run that continues (a complete save)
    step.mkdir(parents=True)
    (step / "rank00000.done").write_text(json.dumps({"step": 2, "rank": 0, "world": 1, "files": {}, "format": 2}))
    (step / "manifest.json").write_text(json.dumps({"format": 2, "step": 2, "world": 1, "lineage": "a"}))
    (tmp_path / "hf").mkdir()
    assert hf_io.check_export_dir(cfg) == str(tmp_path / "hf")      # empty
    (tmp_path / "hf" / "config.json").write_text("{}")
    hf_io.check_export_dir(cfg)      # an earlier export
    fresh = Config(out_dir=str(tmp_path))
    fresh.ckpt.dir = str(tmp_path / "new")
    with pytest.raises(ConfigError, match="starts afresh"):      # not a fresh run's to replace
        hf_io.check_export_dir(fresh)
    over = Config(out_dir=str(tmp_path))       # --ckpt.start_fresh moves the checkpoints aside, not the export
    over.ckpt.dir, over.ckpt.resume, over.ckpt.start_fresh = str(tmp_path / "ckpt"), False, True
    with pytest.raises(ConfigError, match=r"starts afresh \(--ckpt.resume=false\)"):
        hf_io.check_export_dir(over)
    aside = Config(out_dir=str(tmp_path))     # only folders a resume set aside (corrupt, incomplete): it starts afresh
    aside.ckpt.dir = str(tmp_path / "aside")
    for name in ("step_00000004.bad1700000000", "step_00000003.incomplete1700000000"):
        (tmp_path / "aside" / name).mkdir(parents=True)
    with pytest.raises(ConfigError, match=f"starts afresh \\(no complete checkpoint in {tmp_path / 'aside'}\\)"):
        hf_io.check_export_dir(aside)       # (they counted as a run to continue: the export overwritten at the end)
    for cut in ("step_00000004", "step_00000003"):  # save cut short (no manifest, no marker): resume sets them aside,
        (tmp_path / "aside" / cut).mkdir()      # warns and starts afresh: they continued the run and the export of
    (tmp_path / "aside" / "step_00000004" / "rank00000.done").write_bytes((step / "rank00000.done").read_bytes())
    with pytest.raises(ConfigError, match="starts afresh"):        # the run before was overwritten at the end
        hf_io.check_export_dir(aside)
    (tmp_path / "hf" / "notes.txt").write_text("mine")
    with pytest.raises(hf_io.HFError, match="notes.txt"):
        hf_io.check_export_dir(cfg)


@pytest.mark.parametrize("tokenizer, expected", [(None, "holds neither tokenizer.model nor tokenizer.json"),
                                                   ("json", "tokenizer.json has no EOS piece; set --data.eos=false")])
def test_a_folder_without_a_usable_tokenizer_is_refused_before_the_corpus_is_indexed(tmp_path, tokenizer, expected):
    """--init_from a folder of weights only, or whose tokenizer.json names no EOS (no tokenizer_config.json), no
    --data.tokenizer: refused in one line before any work. Both were refused only after the corpus was indexed
    (every line of a 10 GB file found, its spans written to the cache) by build_tokenizer."""
    import train
    torch.manual_seed(0)
    if tokenizer:
        llama3_tokenizer(tmp_path / "model", config=False)
    llama3_hf(vocab_size=400).save_pretrained(tmp_path / "model")
    with open(tmp_path / "docs.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in TEXTS)
    with pytest.raises(SystemExit) as e:
        train.cli([f"--init_from={tmp_path}/model", f"--data={tmp_path}/docs.jsonl", "--seq_len=32", "--device=cpu",
                   f"--out_dir={tmp_path}/run", f"--data.cache_dir={tmp_path}/cache", "--log.tensorboard="])
    msg = str(e.value.code)
    assert expected in msg and "--data." in msg and "\n" not in msg, msg
    assert not os.path.exists(tmp_path / "cache") or not os.listdir(tmp_path / "cache"), os.listdir(tmp_path / "cache")


def test_the_init_from_folders_generation_config_is_kept_with_a_tokenizer_given_from_elsewhere(tmp_path):
    """--init_from=MODEL --data.tokenizer=ELSEWHERE: the export keeps MODEL's generation_config.json (its sampling
    settings and EOS ids, chosen with the weights), not ELSEWHERE's. Both exports wrote the tokenizer folder's
    instead: defaults (temperature 0.8, top_k 50, one EOS) where it had none, another model's where it had one."""
    import checkpoint
    import train
    llama3_tokenizer(tmp_path / "model")
    torch.manual_seed(0)
    llama3_hf(vocab_size=400, bos_token_id=0, eos_token_id=1).save_pretrained(tmp_path / "model")
    theirs = {"bos_token_id": 0, "eos_token_id": [1, 7], "do_sample": True, "temperature": 0.6, "top_p": 0.9}
    (tmp_path / "model" / "generation_config.json").write_text(json.dumps(theirs))
    with open(tmp_path / "docs.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in TEXTS)
    for i, other in enumerate((None, {"eos_token_id": 1, "temperature": 1.5})):     # ELSEWHERE without one, with one
        tok = tmp_path / f"tok{i}"
        llama3_tokenizer(tok)
        if other:
            (tok / "generation_config.json").write_text(json.dumps(other))
        run = tmp_path / f"run{i}"
        train.main([f"--init_from={tmp_path}/model", f"--data.tokenizer={tok}/tokenizer.json", f"--data={tmp_path}/docs.jsonl",
                    "--seq_len=32", "--global_batch=2", "--micro_batch=2", "--steps=1", "--log.eval_interval=0",
                    "--log.sample_tokens=0", "--log.tensorboard=", "--ckpt.async_save=false", "--device=cpu",
                    f"--out_dir={run}", f"--ckpt.dir={run}/ckpt", f"--data.cache_dir={tmp_path}/cache",
                    "--log.peak_tflops=1"])     # MFU's peak stated, not measured: not this test's claim
        checkpoint.main(["export", f"{run}/ckpt", f"{run}/again"])
        for out in (run / "hf", run / "again"):
            assert json.loads((out / "generation_config.json").read_text()) == theirs, (i, out)
    # A run killed before its first checkpoint leaves its tokenizer/ kept; the next one in that --ckpt.dir, from
    # another model with the same tokenizer (Llama 3 and 3.1), kept the first model's generation_config.json
    def rerun_in_run0(export: str) -> dict:
        """run0's --ckpt.dir without its checkpoints (its tokenizer/ kept): train, export; {folder: generation config}."""
        for step in (tmp_path / "run0" / "ckpt").glob("step_*"):
            shutil.rmtree(step)
        os.remove(tmp_path / "run0" / "ckpt" / "latest")
        shutil.rmtree(tmp_path / "run0" / "hf")
        train.main([f"--init_from={tmp_path}/model", f"--data={tmp_path}/docs.jsonl", "--seq_len=32", "--global_batch=2",
                    "--micro_batch=2", "--steps=1", "--log.eval_interval=0", "--log.sample_tokens=0", "--log.tensorboard=",
                    "--ckpt.async_save=false", "--device=cpu", f"--out_dir={tmp_path}/run0",
                    f"--ckpt.dir={tmp_path}/run0/ckpt", f"--data.cache_dir={tmp_path}/cache",
                    f"--data.tokenizer={tmp_path}/tok0/tokenizer.json", "--log.peak_tflops=1"])
        checkpoint.main(["export", f"{tmp_path}/run0/ckpt", f"{tmp_path}/run0/{export}"])
        return {out: json.loads((tmp_path / "run0" / out / "generation_config.json").read_text()) for out in ("hf", export)}
    (tmp_path / "model" / "generation_config.json").write_text(json.dumps({**theirs, "temperature": 0.7}))
    for out, gen in rerun_in_run0("third").items():
        assert gen["temperature"] == 0.7, out
    # ... and from a model folder without one, the earlier model's kept copy (0.7) was shipped: now the defaults
    os.remove(tmp_path / "model" / "generation_config.json")
    for out, gen in rerun_in_run0("fourth").items():
        assert (gen["temperature"], gen["eos_token_id"]) == (0.8, 1), (out, gen)


def test_a_model_padded_far_past_its_own_tokenizer_trains_and_another_tokenizer_is_refused(tmp_path):
    """DeepSeek-Coder 1.x (LlamaForCausalLM) has 32,022 pieces and 32,256 embedding rows, more than a multiple of 128
    pads (32,128): --init_from it with its own tokenizer was refused, "they do not belong together; give its
    tokenizer with --data.tokenizer" (a fix that is what it did). Its own tokenizer is taken with the model's rows
    (the export keeps them); a tokenizer from elsewhere that far from the rows is still refused as not the model's."""
    import configs
    import train
    llama3_tokenizer(tmp_path / "model")                    # 400 pieces
    torch.manual_seed(0)
    llama3_hf(vocab_size=640, bos_token_id=0, eos_token_id=1).save_pretrained(tmp_path / "model")
    with open(tmp_path / "docs.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in TEXTS)
    args = [f"--init_from={tmp_path}/model", f"--data={tmp_path}/docs.jsonl", "--seq_len=32", "--global_batch=2",
            "--micro_batch=2", "--steps=1", "--log.eval_interval=0", "--log.sample_tokens=0", "--log.tensorboard=",
            "--ckpt.async_save=false", "--device=cpu", f"--data.cache_dir={tmp_path}/cache",
            "--log.peak_tflops=1"]      # MFU's peak stated, not measured (15 matmul shapes, twice): not this test's
    train.main([*args, f"--out_dir={tmp_path}/run"])
    assert json.loads((tmp_path / "run" / "hf" / "config.json").read_text())["vocab_size"] == 640
    assert (tmp_path / "run" / "hf" / "tokenizer.json").read_bytes() == (tmp_path / "model" / "tokenizer.json").read_bytes()
    (tmp_path / "other").mkdir()
    shutil.copy(tmp_path / "model" / "tokenizer.json", tmp_path / "other")
    with pytest.raises(hf_io.HFError, match="has 400 pieces but .*vocab_size is 640: they do not belong together"):
        train.main([*args, f"--out_dir={tmp_path}/run2", f"--data.tokenizer={tmp_path}/other/tokenizer.json"])
    # within the padding to a multiple of 128 (400 pieces, 512 rows: as nanotrn pads its own), one from elsewhere is taken
    shutil.copy(tmp_path / "model" / "tokenizer_config.json", tmp_path / "other")
    llama3_hf(vocab_size=512, bos_token_id=0, eos_token_id=1).save_pretrained(tmp_path / "padded")
    argv = [f"--init_from={tmp_path}/padded", *args[1:], f"--out_dir={tmp_path}/run3", f"--data.tokenizer={tmp_path}/other"]
    cfg = configs.from_args(argv)
    hf_io.apply_init_from(cfg, argv)
    train.check_tokenizer(cfg)      # (the check before any work; the run itself as above)
    assert cfg.model.vocab_size == 512


# The user's own sentencepiece model, of each type, with sentencepiece's default settings (NFKC,
# extra whitespace removed): what AutoTokenizer must reproduce, or what must be refused up front.
SPM_TYPE_TEXTS = ["def f(x):\n    return x * 2  # über", "  two  spaces\tand a tab\n\nnew lines ", "ﬁne ①中文 😀 zzqq",
                  "unseen ∮ symbols ⌘ and  more", *TEXTS[:5]]


@pytest.mark.parametrize("kind", ["unigram", "bpe", "char", "word"])
def test_every_sentencepiece_type_trains_and_exports_or_is_refused_before_step_1(kind, tmp_path, capsys):
    """train.py with a sentencepiece model of each type: two steps, then its export loads in
    AutoTokenizer with the very ids training read (unigram, bpe, char); or (word: sentencepiece fuses a
    run of unknown words into one <unk>, which no Hugging Face model does) refused with one line
    before the first step, nothing written."""
    import sentencepiece as spm
    import data
    import train
    (tmp_path / "corpus").mkdir()
    for i, t in enumerate(TEXTS):
        (tmp_path / "corpus" / f"{i:02d}.txt").write_text(t)
    extra = {"unigram": {"vocab_size": 100}, "bpe": {"vocab_size": 200}}.get(kind, {"use_all_vocab": True})
    spm.SentencePieceTrainer.train(sentence_iterator=iter([x for t in TEXTS for x in t.split("\n") if x]),
                                   model_prefix=str(tmp_path / "sp"), model_type=kind, minloglevel=2, **extra)
    tok = data.load_tokenizer(str(tmp_path / "sp.model"))
    argv = ["--model.n_layers=1", "--model.dim=32", "--model.n_heads=2", "--model.n_kv_heads=1", "--model.ffn_dim=64",
            "--seq_len=32", "--model.max_seq_len=32", "--global_batch=2", "--micro_batch=2", "--steps=2",
            f"--model.vocab_size={tok.vocab_size}", "--log.eval_interval=0", "--log.sample_tokens=0",
            "--log.peak_tflops=1", "--log.tensorboard=", "--ckpt.async_save=false", "--optim.warmup_steps=1",
            "--device=cpu", f"--data={tmp_path}/corpus", f"--data.tokenizer={tmp_path}/sp.model", f"--out_dir={tmp_path}/run",
            f"--ckpt.dir={tmp_path}/run/ckpt", f"--data.cache_dir={tmp_path}/cache"]
    if kind == "word":
        with pytest.raises(SystemExit) as e:
            train.cli(argv)
        msg = str(e.value.code)
        assert "type word" in msg and "unigram, bpe or char" in msg and "\n" not in msg, msg
        assert "step" not in capsys.readouterr().out and not os.path.exists(tmp_path / "run" / "hf")
        return
    train.main(argv)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "run" / "hf")
    assert type(auto).__name__ == "LlamaTokenizerFast"
    for text in SPM_TYPE_TEXTS:
        assert auto(text)["input_ids"] == [tok.bos_id] + tok.encode(text), (kind, text)
    if kind == "unigram":       # resumed without --data.tokenizer: the run's own 100 pieces, not refused as too few to train
        train.main([a for a in argv if not a.startswith("--data.tokenizer=")] + ["--steps=3"])
        assert "resuming from" in capsys.readouterr().out


def test_a_tied_model_saved_with_a_copy_of_its_lm_head_loads(tmp_path):
    """A tied checkpoint whose file also holds lm_head.weight (some savers write the tied matrix twice): the
    copy is no tensor of another architecture; it loads, the embedding read from model.embed_tokens.weight."""
    from safetensors.torch import load_file, save_file
    cfg = ModelConfig(vocab_size=101, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=64,
                      tie_embeddings=True)
    hf_io.save_hf(llama.Llama(cfg).init_weights(0).state_dict(), cfg, str(tmp_path / "m"))
    f = tmp_path / "m" / "model.safetensors"
    sd = load_file(f)
    save_file({**sd, "lm_head.weight": sd["model.embed_tokens.weight"].clone()}, f, metadata={"format": "pt"})
    assert hf_io.read_config(str(tmp_path / "m")).tie_embeddings
    hf_io.check_weights(str(tmp_path / "m"), cfg)


def test_an_export_into_a_folder_holding_only_a_killed_exports_leftover_needs_no_overwrite(tmp_path):
    """A killed export leaves <folder>/.export.tmp; the next export into that folder (checkpoint.py export without
    --overwrite: its own check leaves the leftover out) replaces it rather than calling the folder not empty."""
    cfg = ModelConfig(vocab_size=101, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=64)
    (tmp_path / "out" / hf_io.EXPORT_TMP).mkdir(parents=True)
    (tmp_path / "out" / hf_io.EXPORT_TMP / "model.safetensors").write_bytes(b"half")
    hf_io.save_hf(llama.Llama(cfg).init_weights(0).state_dict(), cfg, str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "generation_config.json", "model.safetensors"]


def test_an_export_over_an_earlier_one_leaves_none_of_its_files(tmp_path):
    """--overwrite over an earlier export with a tokenizer: the new export (here without one) leaves none of the
    earlier files behind (a stale tokenizer.model beside another model's weights would load with them)."""
    import sentencepiece as spm
    import data
    spm.SentencePieceTrainer.train(sentence_iterator=iter([t for t in TEXTS if t]), model_prefix=str(tmp_path / "sp"),
                                   vocab_size=120, model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    cfg = ModelConfig(vocab_size=128, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=64)
    sd, out = llama.Llama(cfg).init_weights(0).state_dict(), str(tmp_path / "out")
    hf_io.save_hf(sd, cfg, out, tokenizer=data.load_tokenizer(str(tmp_path / "sp.model")))
    assert {"tokenizer.model", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))
    hf_io.save_hf(sd, cfg, out, overwrite=True)
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
