"""model.py against transformers' LlamaForCausalLM, document masking, scaled init, checkpointing."""
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import hf as hf_io  # noqa: E402
import model as llama  # noqa: E402
from configs import ModelConfig  # noqa: E402
from conftest import load_hf, loss_sum, max_rel_err  # noqa: E402

transformers = pytest.importorskip("transformers")


def tiny_cfg(n_kv_heads=4, **kw):
    base = dict(vocab_size=101, dim=64, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, ffn_dim=96,
                max_seq_len=64, rope_theta=10000.0, norm_eps=1e-5)
    base.update(kw)
    return ModelConfig(**base)


def hf_model(cfg):
    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in hf_io.hf_config(cfg).items()
                                         if k not in ("architectures", "model_type", "torch_dtype")})
    hf_cfg._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(hf_cfg).eval()


def load_ours(hf, cfg, folder):
    """transformers' weights -> our fused layout through the loading path (a saved folder, hf.load_sharded)."""
    hf.save_pretrained(folder)
    return load_hf(str(folder), attention=cfg.attention)


ATTENTION = ["sdpa", "explicit"]


@pytest.fixture(autouse=True)
def several_query_blocks(monkeypatch):
    """Explicit attention in query blocks of 10 rows, so that these short sequences span several
    blocks and end with a partial one (the default, 128, would make every test a single block)."""
    monkeypatch.setattr(llama.ExplicitAttention, "QUERY_BLOCK", 10)


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("n_kv_heads", [4, 2, 1], ids=["mha", "gqa2", "mqa"])
def test_hf_to_ours_logits_match(n_kv_heads, attention, tmp_path):
    """Hugging Face weights -> our fused layout: same logits to 1e-5 (fp32)."""
    torch.manual_seed(0)
    cfg = tiny_cfg(n_kv_heads, rope_theta=5000.0, attention=attention)
    hf = hf_model(cfg)
    ours = load_ours(hf, cfg, tmp_path).eval()
    assert ours.cfg == cfg
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
    hf_io.save_hf(ours.state_dict(), cfg, str(tmp_path), overwrite=True)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    back = load_hf(str(tmp_path)).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 20))
    with torch.no_grad():
        ref = ours(tokens)
        assert max_rel_err(hf(tokens).logits, ref) < 1e-5
        assert torch.equal(back(tokens), ref)
    for k, v in ours.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("n_kv_heads", [4, 2], ids=["mha", "gqa"])
def test_training_gradients_match_hf(n_kv_heads, attention, tmp_path):
    """The training path (hand-written backwards of RMSNorm, RoPE, explicit attention, and the
    fused head + loss) gives HF autograd's loss and every gradient to 1e-5 (fp32)."""
    torch.manual_seed(10)
    cfg = tiny_cfg(n_kv_heads, attention=attention)
    hf = hf_model(cfg).train()
    ours = load_ours(hf, cfg, tmp_path).train()
    tokens = torch.randint(0, cfg.vocab_size, (2, 25))
    targets = tokens[:, 1:].clone()
    targets[0, :3] = -100
    ref = torch.nn.functional.cross_entropy(hf(tokens[:, :-1]).logits.flatten(0, 1), targets.flatten(),
                                            ignore_index=-100, reduction="sum")
    ref.backward()
    loss = ours(tokens[:, :-1], targets=targets)
    loss.backward()
    assert abs(loss.item() - ref.item()) / ref.item() < 1e-6
    grads = hf_io.to_hf_state_dict({k: p.grad for k, p in ours.named_parameters()}, cfg)
    for k, p in hf.named_parameters():
        assert max_rel_err(grads[k], p.grad) < 1e-5, k


def test_per_document_positions_match_hf_position_ids(tmp_path):
    """Positions restarting at a document start are the same RoPE positions HF gets as position_ids."""
    torch.manual_seed(2)
    cfg = tiny_cfg(2)
    hf = hf_model(cfg)
    ours = load_ours(hf, cfg, tmp_path).eval()
    tokens = torch.randint(0, cfg.vocab_size, (1, 16))
    pos = torch.arange(16)[None] + 5
    with torch.no_grad():
        assert max_rel_err(ours(tokens, positions=pos), hf(tokens, position_ids=pos).logits) < 1e-5


@pytest.mark.parametrize("attention", ATTENTION)
def test_document_masking_isolates_documents(attention):
    """Changing the tokens of one packed document leaves every other document's logits unchanged,
    and each document's logits equal those of the document run on its own."""
    torch.manual_seed(3)
    cfg = tiny_cfg(2, attention=attention)
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


@pytest.mark.parametrize("attention", ATTENTION)
def test_without_doc_ids_is_plain_causal(attention):
    torch.manual_seed(4)
    cfg = tiny_cfg(2, attention=attention)
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


def test_a_meta_build_draws_nothing_and_a_real_one_keeps_torchs_init(monkeypatch):
    """On the meta device (parallel.build_model, param_shapes) the layers draw no initial weights: torch's
    draws there (nn.Linear's kaiming_uniform_, nn.Embedding's normal_) imported sympy and torch._dynamo,
    ~1 s CPU of every rank's start-up, for values init_weights or a checkpoint replaces. Off meta, torch's."""
    drawn = []
    for name in ("kaiming_uniform_", "normal_", "uniform_"):
        real = getattr(torch.nn.init, name)
        monkeypatch.setattr(torch.nn.init, name, lambda *a, _n=name, _f=real, **k: (drawn.append(_n), _f(*a, **k))[1])
    with torch.device("meta"):
        llama.Llama(tiny_cfg())
    assert drawn == []
    llama.Llama(tiny_cfg())
    assert {"kaiming_uniform_", "normal_"} <= set(drawn)
    torch.manual_seed(3)
    ours = llama.Linear(8, 4).weight
    torch.manual_seed(3)
    assert torch.equal(ours, torch.nn.Linear(8, 4, bias=False).weight)


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


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_checkpointing_same_gradients(mode, attention):
    torch.manual_seed(5)
    ref = llama.Llama(tiny_cfg(2, attention=attention)).init_weights(9)
    ck = llama.Llama(tiny_cfg(2, checkpointing=mode, attention=attention)).init_weights(9)
    tokens = torch.randint(0, 101, (2, 16))
    doc_ids = (torch.arange(16) >= 6).long().expand(2, 16)
    for m in (ref, ck):
        loss_sum(m(tokens[:, :-1], doc_ids=doc_ids[:, :-1]), tokens[:, 1:]).backward()
    for (n, p), q in zip(ref.named_parameters(), ck.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-5), n


def test_generate_extends_prompt():
    torch.manual_seed(6)
    m = llama.Llama(tiny_cfg(2)).init_weights(1).eval()
    out = m.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=5)
    assert out.shape == (1, 8) and torch.equal(out[:, :3], torch.tensor([[1, 2, 3]]))


def test_generate_past_the_context_reads_the_last_max_seq_len_tokens():
    """A prompt longer than max_seq_len: each new token is the model's on the LAST max_seq_len tokens
    (the first ones would give every step the same context)."""
    m = llama.Llama(tiny_cfg(2, max_seq_len=8)).init_weights(1).eval()
    prompt = torch.randint(0, 101, (2, 11), generator=torch.Generator().manual_seed(0))
    out, want = m.generate(prompt, 4, temperature=1.0, top_k=1), prompt
    with torch.no_grad():
        for _ in range(4):
            want = torch.cat((want, m(want[:, -8:])[:, -1].argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(out, want), (out[:, 11:], want[:, 11:])


def test_generate_with_eos_goes_on_with_eos_in_a_row_that_sampled_it():
    """Sampled rows (a random tiny model's greedy rows repeat one token, which hides it): a row that
    drew eos_id goes on with it while the others sample, and sampling ends once every row has it."""
    m = llama.Llama(tiny_cfg(2)).init_weights(1).eval()
    prompt = torch.randint(2, 101, (3, 4), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(2)
    free = m.generate(prompt, 12, temperature=1.0, top_k=0)
    eos = int(free[0, 6])                                   # row 0 draws it by its third new token
    torch.manual_seed(2)                                    # the same draws up to there
    out = m.generate(prompt, 12, temperature=1.0, top_k=0, eos_id=eos)
    first = [int((row[4:] == eos).nonzero()[0]) + 4 if (row[4:] == eos).any() else None for row in out]
    assert first[0] is not None and first[0] <= 6 and torch.equal(out[0, :first[0]], free[0, :first[0]])
    for row, f in zip(out, first):
        assert f is None or bool((row[f:] == eos).all()), (row, eos)
    assert out.shape[1] == 16 or None not in first
    assert any(f is None or f > first[0] for f in first[1:]), first       # another row went on sampling


def test_flops_per_token_counts_matmul_weights():
    cfg = tiny_cfg(2)
    m = llama.Llama(cfg)
    matmul_weights = sum(p.numel() for n, p in m.named_parameters()
                         if p.dim() == 2 and not n.startswith("embed"))
    assert llama.num_params(cfg) == sum(p.numel() for p in m.parameters())
    assert llama.flops_per_token(cfg, 32) == 6 * matmul_weights + 6 * cfg.n_layers * 32 * cfg.dim


def test_flops_per_token_attention_is_the_score_matmuls_counted(monkeypatch):
    """The attention term is what torch's FLOP counter sees the explicit path's score and value
    matmuls (bmm) do, forward and backward, halved for causality (T <= one query block: the whole
    T x T square is computed). Their width is heads x head_dim, which an explicit head_dim (a
    config.json's) makes differ from dim."""
    from torch.utils.flop_counter import FlopCounterMode
    T = 64
    monkeypatch.setattr(llama.ExplicitAttention, "QUERY_BLOCK", T)        # one block: the full square
    for kw in ({}, {"head_dim_override": 32}, {"head_dim_override": 8, "n_kv_heads": 2}):
        cfg = tiny_cfg(attention="explicit", **kw)
        m = llama.Llama(cfg).init_weights(0)
        tokens = torch.randint(0, cfg.vocab_size, (1, T))
        with FlopCounterMode(display=False) as counter:
            m(tokens, targets=tokens).backward()
        bmm = sum(v for op, v in counter.get_flop_counts()["Global"].items() if "bmm" in str(op))
        matmul_weights = sum(p.numel() for n, p in m.named_parameters() if p.dim() == 2 and not n.startswith("embed"))
        assert llama.flops_per_token(cfg, T) == 6 * matmul_weights + bmm / T / 2, kw


# ----------------------------------------------------------------------------- hand-written backwards

def test_rms_norm_function_is_torch_rms_norm():
    """Forward bit-equal to F.rms_norm (fp32 and bf16); backward equal to autograd through it."""
    torch.manual_seed(11)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        x = torch.randn(3, 7, 48).to(dtype).requires_grad_()
        w = (1 + 0.1 * torch.randn(48)).to(dtype).requires_grad_()
        dy = torch.randn(3, 7, 48).to(dtype)
        ref = torch.nn.functional.rms_norm(x, (48,), w, 1e-5)
        ref_dx, ref_dw = torch.autograd.grad(ref, (x, w), dy)
        got = llama.RMSNormFunction.apply(x, w, 1e-5)
        dx, dw = torch.autograd.grad(got, (x, w), dy)
        assert torch.equal(got, ref), dtype
        assert max_rel_err(dx.float(), ref_dx.float()) < tol and max_rel_err(dw.float(), ref_dw.float()) < tol, dtype
    x32 = torch.randn(2, 5, 16)             # fp32 input: x.float() would be x itself; it must stay untouched
    before = x32.clone()
    llama.RMSNormFunction.apply(x32, torch.ones(16), 1e-5)
    assert torch.equal(x32, before)


def test_rope_function_matches_rotate_half():
    torch.manual_seed(12)
    x = torch.randn(2, 8, 5, 16).transpose(1, 2).requires_grad_()          # [B, H, T, hd], strided like q
    cos, sin = llama.rope_cos_sin(torch.arange(8).expand(2, 8), ModelConfig(dim=64, n_heads=4), torch.float32)
    x1, x2 = x.chunk(2, dim=-1)
    ref = x * cos + torch.cat((-x2, x1), dim=-1) * sin
    got = llama.RoPE.apply(x, cos, sin)
    dy = torch.randn_like(ref)
    assert max_rel_err(got, ref) < 1e-6
    assert max_rel_err(torch.autograd.grad(got, x, dy)[0], torch.autograd.grad(ref, x, dy)[0]) < 1e-6


def test_swiglu_function_is_autograd_through_chunk_silu_mul():
    """Forward and both halves of the gradient bit-equal to autograd through the plain ops (fp32 and
    bf16)."""
    torch.manual_seed(13)
    for dtype in (torch.float32, torch.bfloat16):
        gu = torch.randn(3, 7, 2 * 40).to(dtype).requires_grad_()
        dy = torch.randn(3, 7, 40).to(dtype)
        gate, up = gu.chunk(2, dim=-1)
        ref = torch.nn.functional.silu(gate) * up
        got = llama.SwiGLU.apply(gu)
        assert torch.equal(got, ref), dtype
        assert torch.equal(torch.autograd.grad(got, gu, dy)[0], torch.autograd.grad(ref, gu, dy)[0]), dtype


def test_linear_function_saves_the_weight_itself():
    """model.LinearFunction (the projections on XLA): forward bit-equal to F.linear, gradients those
    of F.linear's autograd (fp32 and bf16), and what it keeps for backward is the input and the
    weight itself (same storage, same strides), not a transposed view: on XLA a saved tensor is an
    output of the forward graph, and W^T was a copy of each weight per pipeline microbatch."""
    torch.manual_seed(14)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        x = torch.randn(3, 7, 24).to(dtype).requires_grad_()
        w = torch.randn(40, 24).to(dtype).requires_grad_()
        dy = torch.randn(3, 7, 40).to(dtype)
        got, ref = llama.LinearFunction.apply(x, w), torch.nn.functional.linear(x, w)
        assert torch.equal(got, ref), dtype
        saved_x, saved_w = got.grad_fn.saved_tensors
        assert saved_w.data_ptr() == w.data_ptr() and saved_w.stride() == w.stride(), dtype
        assert saved_x.data_ptr() == x.data_ptr()
        for a, b in zip(torch.autograd.grad(got, (x, w), dy), torch.autograd.grad(ref, (x, w), dy)):
            assert max_rel_err(a.float(), b.float()) < tol, dtype
    layer = llama.Linear(24, 40)
    assert layer.bias is None and layer(x.float().detach()).grad_fn.name() != "LinearFunctionBackward"   # CPU: F.linear


def test_cpu_bf16_softmax_is_fp32_softmax_rounded_once():
    """softmax_fp32 relies on it: on CPU, torch's bf16 softmax equals the fp32 softmax of the same
    numbers rounded once to bf16, so the explicit upcast (which XLA needs) would only cost time."""
    s = (torch.randn(4, 3, 64, 64) * 5).bfloat16()
    assert torch.equal(torch.softmax(s, -1), torch.softmax(s.float(), -1).bfloat16())


def test_explicit_attention_bf16_as_accurate_as_sdpa():
    """bf16 against an fp64 reference: the explicit path's output and gradients are within 2x of
    the error of torch's SDPA (flash) kernel on the same inputs, causal and document-masked."""
    torch.manual_seed(13)
    B, H, T, hd = 2, 3, 64, 32
    q, k, v = (torch.randn(B, H, T, hd).bfloat16().requires_grad_() for _ in range(3))
    dy = torch.randn(B, H, T, hd).bfloat16()
    doc = (torch.arange(T) >= 40).long().expand(B, T)
    for mask in (None, llama.document_mask(doc)):
        exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref_out = llama.attention_core(*exact, mask)
        ref = [ref_out, *torch.autograd.grad(ref_out, exact, dy.double())]
        errs = {}
        for explicit in (False, True):
            out = llama.attention_core(q, k, v, mask, explicit)
            got = [out, *torch.autograd.grad(out, (q, k, v), dy)]
            errs[explicit] = [(a.double() - b).abs().max().item() for a, b in zip(got, ref)]
        assert all(e <= 2 * max(s, 1e-3) for e, s in zip(errs[True], errs[False])), errs


def test_fused_loss_is_loss_sum(monkeypatch):
    """LMHead.loss_sum over several chunks equals loss_sum on the full logits: the loss to 1e-6, the
    gradients to 1e-5 (fp32); targets of -100 ignored; without grad the same loss."""
    torch.manual_seed(14)
    head = llama.LMHead(32, 101)
    h = torch.randn(3, 40, 32, requires_grad=True)
    targets = torch.randint(0, 101, (3, 40))
    targets[1, 5:17] = -100
    ref = loss_sum(head(h), targets)
    ref_grads = torch.autograd.grad(ref * 0.3, (h, head.weight))
    # 16 rows a chunk: 8 chunks, the last partial
    monkeypatch.setattr(llama.LinearCrossEntropy, "chunk_rows", staticmethod(lambda n, v, d: 16))
    got = head.loss_sum(h, targets)
    grads = torch.autograd.grad(got * 0.3, (h, head.weight))
    with torch.no_grad():
        no_grad = head.loss_sum(h, targets)
    assert abs(got.item() - ref.item()) / ref.item() < 1e-6 and no_grad.item() == got.item()
    for g, r in zip(grads, ref_grads):
        assert max_rel_err(g, r) < 1e-5
    assert h.grad is None and grads[0][1, 5:17].abs().max() == 0


def test_fused_loss_without_grad_costs_the_logits_matmul_only():
    """Evaluation (train.evaluate, under no_grad) takes the loss the fused way too: it must run only
    the head's forward matmul, not the two gradient matmuls training folds into the forward, nor
    allocate the [vocab, dim] weight gradient (Llama 3's 128k x 4096: 2 GiB in fp32)."""
    from torch.utils.flop_counter import FlopCounterMode
    torch.manual_seed(14)
    head = llama.LMHead(32, 101)
    h, targets = torch.randn(3, 40, 32, requires_grad=True), torch.randint(0, 101, (3, 40))
    with torch.no_grad(), FlopCounterMode(display=False) as logits_only:
        head(h)
    with torch.no_grad(), FlopCounterMode(display=False) as fused:
        loss = head.loss_sum(h, targets)
    assert fused.get_total_flops() == logits_only.get_total_flops() == 2 * 3 * 40 * 32 * 101
    assert loss.item() == pytest.approx(loss_sum(head(h), targets).item(), rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("vocab", [512, 32000, 128256])
def test_fused_loss_equals_log_softmax_nll(vocab, dtype):
    """The fused loss at its own chunking (1, 2 and 5 chunks here) against log_softmax + NLL on the
    full fp32 logits, targets partly ignored: the value and both gradients. fp32: to 1e-6 and
    1e-5. bf16: both paths round the same bf16 matmuls, so the loss agrees to 1e-5; the gradients
    are within 2x of the reference's own error against fp64 (the weight gradient is rounded to
    bf16 once per chunk, the reference's once)."""
    torch.manual_seed(15)
    # dim 40 > 2^22 / 128256 = 32: at Llama 3's vocabulary a chunk is dim rows, at 32000 it is 2^22 / vocab (a bf16
    # matmul on a CPU without bf16 units costs ~n * dim * vocab: 300 x 64 took 25 s of CPU at 128256, this 7.8 s)
    n, dim = 200, 40
    h = torch.randn(n, dim).to(dtype).requires_grad_()
    w = (torch.randn(vocab, dim) * 0.3).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (n,))
    targets[::7] = -100
    assert -(-n // llama.LinearCrossEntropy.chunk_rows(n, vocab, dim)) == {512: 1, 32000: 2, 128256: 5}[vocab]

    def reference(h, w):
        logp = torch.log_softmax((h @ w.t()).float(), dim=-1)
        return torch.nn.functional.nll_loss(logp, targets, ignore_index=-100, reduction="sum")

    ref = reference(h, w)
    ref_grads = torch.autograd.grad(ref * 0.5, (h, w))
    got = llama.LinearCrossEntropy.apply(h, w, targets)
    grads = torch.autograd.grad(got * 0.5, (h, w))
    assert got.dtype == torch.float32 and grads[0].dtype == grads[1].dtype == dtype
    assert grads[0][::7].abs().max() == 0                    # ignored rows get no gradient
    if dtype == torch.float32:
        assert abs(got.item() - ref.item()) / ref.item() < 1e-6
        for g, r in zip(grads, ref_grads):
            assert max_rel_err(g, r) < 1e-5
        return
    assert abs(got.item() - ref.item()) / ref.item() < 1e-5
    exact = [t.detach().double().requires_grad_() for t in (h, w)]
    truth = torch.autograd.grad(reference(*exact) * 0.5, exact)
    for g, r, t in zip(grads, ref_grads, truth):
        err, ref_err = (g.double() - t).abs().max().item(), (r.double() - t).abs().max().item()
        assert err <= 2 * ref_err, (err, ref_err)


@pytest.mark.parametrize("seed", range(4))
def test_fused_loss_scales_its_bf16_gradient_before_it_rounds(seed, monkeypatch):
    """bf16, at the scale training uses (dp / global valid tokens, here 1/1751, not a power of two):
    given grad_scale, the fused loss's input gradient is within 1.1x the plain path's max-abs error
    against fp64 (both round the same fp32 softmax - one_hot, scaled, once, then one bf16 matmul: the
    10% is a matmul kernel's summation order). Scaled in the backward instead, the bf16 gradient is
    rounded twice: 1.3-1.5x here. The value is the unscaled sum, and the gradients stay right when
    the loss is then scaled by something else (the backward multiplies by grad / grad_scale)."""
    torch.manual_seed(seed)
    # vocab 8000 in 3 chunks of 100 rows, as its own chunking cuts 300 rows at 32000 (a bf16 matmul on a CPU
    # without bf16 units costs ~n * dim * vocab: 32000 took 4x the CPU)
    n, dim, vocab = 300, 64, 8000
    monkeypatch.setattr(llama.LinearCrossEntropy, "chunk_rows", staticmethod(lambda n, v, d: 100))
    h = torch.randn(n, dim).bfloat16().requires_grad_()
    w = (torch.randn(vocab, dim) * 0.3).bfloat16().requires_grad_()
    targets = torch.randint(0, vocab, (n,))
    targets[::7] = -100
    scale = torch.tensor(1 / 1751)

    def reference(h, w):
        return loss_sum((h @ w.t())[None], targets[None])

    plain = torch.autograd.grad(reference(h, w) * scale, h)[0]
    exact = h.detach().double().requires_grad_()
    truth = torch.autograd.grad(reference(exact, w.detach().double()) * scale.double(), exact)[0]
    got = llama.LinearCrossEntropy.apply(h, w, targets, True, scale)
    fused = torch.autograd.grad(got * scale, h)[0]
    err, plain_err = (fused.double() - truth).abs().max().item(), (plain.double() - truth).abs().max().item()
    assert err <= 1.1 * plain_err, (err, plain_err)
    with torch.no_grad():
        assert got.item() == llama.LinearCrossEntropy.apply(h, w, targets, False).item()
    other = torch.autograd.grad(llama.LinearCrossEntropy.apply(h, w, targets, True, scale) * 3.0, h)[0]
    assert max_rel_err(other.double(), truth * (3.0 / scale.double())) < 2e-2


@pytest.mark.parametrize("chunks", [8, 16])
def test_fused_loss_sums_many_chunks_weight_gradients_in_fp32(chunks, monkeypatch):
    """bf16: past three chunks the head's weight gradient adds the chunks' products in fp32. Its error against fp64,
    over transformers' (one bf16 matmul over all tokens), seeds 0-5 (measured 2026-11-29): a bf16 running sum
    1.40-1.45x at 8 chunks, 1.79-1.88x at 16; in fp32 1.12-1.14x at both. Bound 1.25x: half way, fails before."""
    monkeypatch.setattr(llama.LinearCrossEntropy, "chunk_rows", staticmethod(lambda n, v, d: 64))
    for seed in range(3):
        torch.manual_seed(seed)
        n, vocab = 64 * chunks, 4096
        h, w = torch.randn(n, 64).bfloat16(), (torch.randn(vocab, 64) * 0.3).bfloat16().requires_grad_()
        targets, scale = torch.randint(0, vocab, (n,)), torch.tensor(1.0 / n)
        exact = torch.softmax(h.double() @ w.detach().double().t(), -1)
        exact[torch.arange(n), targets] -= 1
        truth = (exact * scale.double()).t() @ h.double()
        p = torch.softmax((h @ w.detach().t()).float(), -1)
        p[torch.arange(n), targets] -= 1
        one_matmul = (p * scale).bfloat16().t() @ h
        got = torch.autograd.grad(llama.LinearCrossEntropy.apply(h, w, targets, True, scale) * scale, w)[0]
        ratio = ((got.double() - truth).norm() / (one_matmul.double() - truth).norm()).item()
        assert ratio < 1.25, (seed, ratio)

@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("kv_heads", [3, 1])
@pytest.mark.parametrize("kind", ["causal", "document", "document-block-mask", "explicit"])
def test_attention_equals_explicit_reference(kind, kv_heads):
    """attention_core as the model calls it (SDPA's causal kernel without a mask, SDPA with the
    boolean document mask, FlexAttention with the BlockMask CUDA uses, the explicit Function)
    against softmax(QK^T/sqrt(d), masked) V written out in fp64: output and the three gradients to
    1e-5 (fp32). 300 tokens and documents of 7 to 140 tokens, so that the block mask has full,
    partial and empty 128-blocks. GQA (3 query heads over 1 KV head): the reference repeats the KV
    head; the kernels read it in place (enable_gqa), the explicit path repeats it."""
    torch.manual_seed(16)
    B, H, T, hd = 2, 3, 300, 16
    q = torch.randn(B, H, T, hd, requires_grad=True)
    k, v = (torch.randn(B, kv_heads, T, hd, requires_grad=True) for _ in range(2))
    dy = torch.randn(B, H, T, hd)
    starts = torch.zeros(B, T, dtype=torch.long)
    starts[0, [7, 60, 200]] = 1
    starts[1, [140, 141, 290]] = 1
    doc = starts.cumsum(1)
    mask = {"causal": None, "document": llama.document_mask(doc), "explicit": llama.document_mask(doc),
            "document-block-mask": llama.document_block_mask(doc)}[kind]
    allowed = llama.document_mask(doc if kind != "causal" else torch.zeros_like(doc))
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ek, ev = (t.repeat_interleave(H // kv_heads, dim=1) for t in exact[1:])
    scores = (exact[0] @ ek.transpose(-1, -2) / hd ** 0.5).masked_fill(~allowed, float("-inf"))
    ref = torch.softmax(scores, -1) @ ev
    ref_grads = torch.autograd.grad(ref, exact, dy.double())
    got = llama.attention_core(q, k, v, mask, kind == "explicit")
    grads = torch.autograd.grad(got, (q, k, v), dy)
    assert max_rel_err(got.double(), ref) < 1e-5
    for g, r in zip(grads, ref_grads):
        assert max_rel_err(g.double(), r) < 1e-5


def test_explicit_attention_at_most_eight_query_blocks(monkeypatch):
    """Seq 4096 runs 8 blocks of 512 queries, not 32 of 128 (each block is unrolled into the
    graph: 1221 HLO instructions instead of 4293 on XLA:CPU, model.py); short sequences keep
    blocks of QUERY_BLOCK. At 300 tokens with blocks of at least 10 (this file's fixture): 8 blocks
    of 38, the last partial, against the fp64 reference, output and gradients to 1e-5."""
    assert llama.ExplicitAttention.block(300) == 38
    monkeypatch.setattr(llama.ExplicitAttention, "QUERY_BLOCK", 128)
    assert [llama.ExplicitAttention.block(t) for t in (256, 1024, 4096, 8192)] == [128, 128, 512, 1024]
    monkeypatch.setattr(llama.ExplicitAttention, "QUERY_BLOCK", 10)
    torch.manual_seed(17)
    B, H, T, hd = 1, 2, 300, 8
    q, k, v = (torch.randn(B, H, T, hd, requires_grad=True) for _ in range(3))
    dy = torch.randn(B, H, T, hd)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = torch.softmax((exact[0] @ exact[1].transpose(-1, -2) / hd ** 0.5).masked_fill(~causal, float("-inf")), -1) @ exact[2]
    ref_grads = torch.autograd.grad(ref, exact, dy.double())
    got = llama.ExplicitAttention.apply(q, k, v, causal)
    assert max_rel_err(got.double(), ref) < 1e-5
    for g, r in zip(torch.autograd.grad(got, (q, k, v), dy), ref_grads):
        assert max_rel_err(g.double(), r) < 1e-5
