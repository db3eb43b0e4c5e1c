"""model.py against transformers' LlamaForCausalLM, document masking, scaled init, checkpointing."""
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model as llama  # noqa: E402
from configs import ModelConfig  # noqa: E402

transformers = pytest.importorskip("transformers")


def tiny_cfg(n_kv_heads=4, **kw):
    base = dict(vocab_size=101, dim=64, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, ffn_dim=96,
                max_seq_len=64, rope_theta=10000.0, norm_eps=1e-5)
    base.update(kw)
    return ModelConfig(**base)


def hf_model(cfg):
    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in llama.hf_config(cfg).items()
                                         if k not in ("architectures", "model_type", "torch_dtype")})
    hf_cfg._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(hf_cfg).eval()


def max_rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1], ids=["mha", "gqa2", "mqa"])
def test_hf_to_ours_logits_match(n_kv_heads):
    """Hugging Face weights -> our fused layout: same logits to 1e-5 (fp32)."""
    torch.manual_seed(0)
    cfg = tiny_cfg(n_kv_heads, rope_theta=5000.0)
    hf = hf_model(cfg)
    ours = llama.Llama(cfg).eval()
    ours.load_state_dict(llama.from_hf_state_dict(hf.state_dict(), cfg))
    tokens = torch.randint(0, cfg.vocab_size, (2, 24))
    with torch.no_grad():
        ref = hf(tokens).logits
        got = ours(tokens)
    assert max_rel_err(got, ref) < 1e-5


@pytest.mark.parametrize("n_kv_heads", [4, 2], ids=["mha", "gqa"])
def test_ours_to_hf_roundtrip_through_files(tmp_path, n_kv_heads):
    """Our weights -> a Hugging Face folder that transformers loads -> same logits; and back."""
    torch.manual_seed(1)
    cfg = tiny_cfg(n_kv_heads)
    ours = llama.Llama(cfg).init_weights(seed=7).eval()
    llama.save_hf(ours, str(tmp_path))
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    back = llama.load_hf(str(tmp_path)).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 20))
    with torch.no_grad():
        ref = ours(tokens)
        assert max_rel_err(hf(tokens).logits, ref) < 1e-5
        assert torch.equal(back(tokens), ref)
    for k, v in ours.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_per_document_positions_match_hf_position_ids():
    """Positions restarting at a document start are the same RoPE positions HF gets as position_ids."""
    torch.manual_seed(2)
    cfg = tiny_cfg(2)
    hf = hf_model(cfg)
    ours = llama.Llama(cfg).eval()
    ours.load_state_dict(llama.from_hf_state_dict(hf.state_dict(), cfg))
    tokens = torch.randint(0, cfg.vocab_size, (1, 16))
    pos = torch.arange(16)[None] + 5
    with torch.no_grad():
        assert max_rel_err(ours(tokens, positions=pos), hf(tokens, position_ids=pos).logits) < 1e-5


def test_document_masking_isolates_documents():
    """Changing the tokens of one packed document leaves every other document's logits unchanged,
    and each document's logits equal those of the document run on its own."""
    torch.manual_seed(3)
    cfg = tiny_cfg(2)
    m = llama.Llama(cfg).init_weights(seed=3).eval()
    lengths = [5, 9, 7, 11]
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    tokens = torch.randint(0, cfg.vocab_size, (1, sum(lengths)))
    changed = tokens.clone()
    start, end = lengths[0], lengths[0] + lengths[1]              # rewrite document 1
    changed[0, start:end] = torch.randint(0, cfg.vocab_size, (lengths[1],))
    assert not torch.equal(changed, tokens)
    with torch.no_grad():
        a = m(tokens, positions, doc_ids)
        b = m(changed, positions, doc_ids)
        outside = torch.ones(sum(lengths), dtype=torch.bool)
        outside[start:end] = False
        assert torch.allclose(a[0, outside], b[0, outside], atol=1e-6, rtol=0)
        assert not torch.allclose(a[0, start:end], b[0, start:end])
        # Each document alone, from position 0, gives the same logits as inside the pack.
        offset = 0
        for n in lengths:
            alone = m(tokens[:, offset:offset + n])
            assert torch.allclose(alone, a[:, offset:offset + n], atol=1e-5, rtol=0)
            offset += n


def test_without_doc_ids_is_plain_causal():
    torch.manual_seed(4)
    cfg = tiny_cfg(2)
    m = llama.Llama(cfg).init_weights(seed=4).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        one_doc = torch.zeros_like(tokens)
        assert torch.allclose(m(tokens), m(tokens, doc_ids=one_doc), atol=1e-6)
        # causality: the future does not change the past
        t2 = tokens.clone()
        t2[:, 8:] = (t2[:, 8:] + 1) % cfg.vocab_size
        assert torch.allclose(m(tokens)[:, :8], m(t2)[:, :8], atol=1e-6)


def test_scaled_init_std_matches_formula():
    """Output projections of attention and MLP: std = init_std / sqrt(2 * n_layers); the others init_std."""
    cfg = ModelConfig(vocab_size=512, dim=256, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=512)
    m = llama.Llama(cfg).init_weights(seed=0)
    scaled = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    for name, p in m.named_parameters():
        std = p.detach().std().item()
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert abs(std - scaled) / scaled < 0.03, (name, std, scaled)
        else:
            assert abs(std - cfg.init_std) / cfg.init_std < 0.03, (name, std)


def test_init_depends_only_on_seed_and_name():
    cfg = tiny_cfg(2)
    a, b = llama.Llama(cfg).init_weights(5), llama.Llama(cfg).init_weights(5)
    c = llama.Llama(cfg).init_weights(6)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
        if not n.endswith("norm.weight"):
            assert not torch.equal(pa, pc), n
    w = llama.init_param("layers.1.attn.qkv_proj.weight", (128, 64), cfg, 5)
    assert torch.equal(w, a.layers[1].attn.qkv_proj.weight)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_checkpointing_same_gradients(mode):
    torch.manual_seed(5)
    ref = llama.Llama(tiny_cfg(2)).init_weights(9)
    ck = llama.Llama(tiny_cfg(2, checkpointing=mode)).init_weights(9)
    tokens = torch.randint(0, 101, (2, 16))
    doc_ids = (torch.arange(16) >= 6).long().expand(2, 16)
    for m in (ref, ck):
        llama.loss_sum(m(tokens[:, :-1], doc_ids=doc_ids[:, :-1]), tokens[:, 1:]).backward()
    for (n, p), q in zip(ref.named_parameters(), ck.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-5), n


def test_generate_extends_prompt():
    torch.manual_seed(6)
    m = llama.Llama(tiny_cfg(2)).init_weights(1).eval()
    out = m.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=5)
    assert out.shape == (1, 8) and torch.equal(out[:, :3], torch.tensor([[1, 2, 3]]))


def test_flops_per_token_counts_matmul_weights():
    cfg = tiny_cfg(2)
    m = llama.Llama(cfg)
    matmul_weights = sum(p.numel() for n, p in m.named_parameters()
                         if p.dim() == 2 and not n.startswith("embed"))
    assert llama.num_params(cfg) == sum(p.numel() for p in m.parameters())
    assert llama.flops_per_token(cfg, 32) == 6 * matmul_weights + 6 * cfg.n_layers * 32 * cfg.dim
