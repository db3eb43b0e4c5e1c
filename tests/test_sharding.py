"""sharding.py, the one rule of how each parameter is split over TP ranks: cut and join are
inverses, index points at exactly cut's rows, and tp_pieces counts every element once over TP."""
import pytest
import torch

import model as llama
import parallel
import sharding
from configs import ModelConfig


@pytest.mark.parametrize("tp,n_kv", [(2, 2), (4, 2), (2, 1), (4, 4), (8, 2)])
def test_shard_unshard_roundtrip(tp, n_kv):
    m = ModelConfig(vocab_size=97, dim=64, n_layers=1, n_heads=8, n_kv_heads=n_kv, ffn_dim=128)
    shapes = {n: tuple(p.shape) for n, p in llama.Llama(m).named_parameters()}
    for name, shape in shapes.items():
        full = torch.randn(shape)
        shards = [sharding.cut(name, full, m, tp, r) for r in range(tp)]
        assert len({s.shape for s in shards}) == 1, f"{name}: unequal shards"
        assert torch.equal(sharding.join(name, shards, m), full), name


@pytest.mark.parametrize("chunk", [32, 100, 1 << 22])
def test_shard_init_is_todays_full_init_then_cut(chunk):
    """build_model generates each TP rank's shard alone (model.init_param_part at sharding.index);
    it must equal, bit for bit, cutting the shard out of the full init_param tensor for every
    parameter at TP 1, 2, 4: vocabulary padding, replicated KV heads (n_kv_heads 2 and 1 < tp 4),
    row-parallel columns, tails of numel % 16 != 0 (97 x 24), chunks of 32 and 100 elements (the
    stream walked and skipped in pieces) and the default (small tensors made whole)."""
    for m in (ModelConfig(vocab_size=97, dim=24, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=40, max_seq_len=16),
              ModelConfig(vocab_size=101, dim=32, n_layers=2, n_heads=4, n_kv_heads=1, ffn_dim=72, max_seq_len=16,
                          tie_embeddings=True)):
        with torch.device("meta"):
            shapes = {n: tuple(p.shape) for n, p in llama.Llama(m).state_dict().items()}
        for tp in (1, 2, 4):
            for r in range(tp):
                for name, shape in shapes.items():
                    want = sharding.cut(name, llama.init_param(name, shape, m, 7), m, tp, r)
                    rows, cols = sharding.index(name, shape, m, tp, r)
                    got = llama.init_param_part(name, shape, m, 7, rows, cols, chunk=chunk)
                    assert torch.equal(got, want), f"{name} at tp {tp} rank {r}, chunk {chunk}"


@pytest.mark.parametrize("tp,n_kv,sp", [(2, 2, False), (4, 2, True), (4, 1, False)])
def test_tp_pieces_count_every_element_once_over_tp(tp, n_kv, sp):
    """The TP model's parameters as build_model tags them (sharding.mark): summed over the TP ranks,
    tp_pieces' weights cover each full parameter exactly once (norms on rank 0, a KV head copied on
    tp / n_kv_heads ranks 1/copies on each), so clipping, the param norm and ZeRO-1 see the model."""
    m = ModelConfig(vocab_size=97, dim=32, n_layers=1, n_heads=4, n_kv_heads=n_kv, ffn_dim=64)
    with torch.device("meta"):
        full = {n: p.numel() for n, p in llama.Llama(m).named_parameters()}
        counted = dict.fromkeys(full, 0.0)
        for r in range(tp):
            model = parallel.tensor_parallelize(llama.Llama(m), parallel.Grid(tp=tp, tp_rank=r), sp)
            sharding.mark(model, tp, sp)
            for name, p in model.named_parameters():
                counted[name] += sum((b - a) * w for a, b, _, w in sharding.tp_pieces(p, r))
    padding = {n: (sharding.padded_vocab(m.vocab_size, tp) - m.vocab_size) * m.dim
               for n in full if sharding.kind(n) == "vocab"}
    assert counted == {n: full[n] + padding.get(n, 0) for n in full}


@pytest.mark.parametrize("vocab,tp", [(96, 2), (96, 4), (97, 2), (97, 4), (32000, 8), (128256, 32)])
def test_the_vocabulary_is_padded_only_up_to_the_next_tp_multiple(vocab, tp):
    """Each TP rank of the embedding and head holds ceil(vocab / tp) rows, the real rows first and at
    most tp - 1 zero rows in all: Llama 2's 32000 at TP=8 has none (a padding row more per rank would
    change every rank's shapes, its checkpoint files and the hardware model's head, for nothing)."""
    m = ModelConfig(vocab_size=vocab, dim=8, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=16)
    full = torch.arange(1, vocab + 1, dtype=torch.float32).view(-1, 1)
    rows = -(-vocab // tp)
    pieces = [sharding.cut("embed.weight", full, m, tp, r) for r in range(tp)]
    assert [p.shape[0] for p in pieces] == [rows] * tp
    assert torch.equal(torch.cat(pieces)[:vocab], full) and not torch.cat(pieces)[vocab:].any()
    with torch.device("meta"):
        model = parallel.tensor_parallelize(llama.Llama(m), parallel.Grid(tp=tp, tp_rank=tp - 1), False)
    assert model.embed.weight.shape[0] == rows


@pytest.mark.parametrize("tp,n_kv", [(4, 2), (4, 1), (8, 2)])
def test_tp_pieces_names_a_kv_copy_as_the_ranks_that_hold_the_same_head(tp, n_kv):
    """Where tp > n_kv_heads each KV head lies on tp / n_kv_heads ranks: tp_pieces' sharing name of a rank's KV rows
    is what optim.py rounds identically (bf16_sr: one random stream per name), so two ranks share it exactly
    when cut gave them the same KV head; else the copies of one head drift apart, or two heads round alike."""
    m = ModelConfig(vocab_size=97, dim=32, n_layers=1, n_heads=8, n_kv_heads=n_kv, ffn_dim=64)
    name = "layers.0.attn.qkv_proj.weight"
    full = torch.randn(dict(llama.Llama(m).named_parameters())[name].shape)
    kv = {}
    for r in range(tp):
        with torch.device("meta"):
            model = parallel.tensor_parallelize(llama.Llama(m), parallel.Grid(tp=tp, tp_rank=r), False)
        sharding.mark(model, tp, False)
        (a, b, sharing, _), = [x for x in sharding.tp_pieces(dict(model.named_parameters())[name], r) if x[2].startswith("kv")]
        kv[r] = sharing, sharding.cut(name, full, m, tp, r).reshape(-1)[a:b]
    for r in range(tp):
        for s in range(tp):
            assert (kv[r][0] == kv[s][0]) == torch.equal(kv[r][1], kv[s][1]), (r, s, kv[r][0], kv[s][0])
