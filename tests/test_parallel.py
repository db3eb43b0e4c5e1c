"""Tensor, sequence and data parallelism give the same numbers as one process (issue 4).

One spawn of 4 gloo processes runs every layout (several layouts share one spawn to keep the file
fast on 2 cores):
  first, one world of 4:    TP=2 x DP=2 (SP off / on), TP=4 (SP off / on, the latter with full
                            activation checkpointing; 2 KV heads, so each KV head is replicated on
                            2 ranks: the 70B situation), the communication count, and the
                            world-size normalization counter-example;
  then, two worlds of 2:    TP=2 (SP off / on) on ranks 0-1 while DP=2 runs on ranks 2-3; then
                            ranks 0-1 measure what SP's column-parallel linears save for backward.
Every layout uses 2 microbatches per DP rank (gradient accumulation 2) and trains 3 steps with
train.train_step and torch's AdamW. Each rank writes what it gathered (full-shape logits,
gradients, weights) to a file; the tests compare them, in this process, with a plain
single-process Llama (no parallel.py code in the reference).
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import assert_close, count_collectives, load_full_state_dict, packed_batch, seeded_model  # noqa: E402
from conftest import FixedLoader  # noqa: E402
from gloo_spawn import single_process_reference, spawn_and_wait  # noqa: E402
import xla_rules  # noqa: E402
import configs  # noqa: E402
import model as llama  # noqa: E402
import parallel  # noqa: E402
import sharding  # noqa: E402
import train  # noqa: E402
from configs import ConfigError, ModelConfig, ParallelConfig  # noqa: E402

GLOBAL_BATCH, SEQ, ACCUM, STEPS = 8, 16, 2, 3


def tiny_cfg(tp: int = 1, dp: int = 1, sp: bool = False, tied: bool = False) -> configs.Config:
    cfg = configs.tiny()
    cfg.model = ModelConfig(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                            max_seq_len=SEQ, tie_embeddings=tied)  # vocab 97: padded to 98 (TP=2) and 100 (TP=4)
    cfg.parallel = ParallelConfig(tp=tp, dp=dp, sp=sp)
    cfg.data.seq_len, cfg.data.global_batch = SEQ, GLOBAL_BATCH
    cfg.data.micro_batch = GLOBAL_BATCH // (dp * ACCUM)
    cfg.optim.grad_clip = 0.5                     # below the norms seen here: clipping is active
    cfg.seed = 7
    return cfg


def global_batch(step: int) -> dict:
    return packed_batch(step, GLOBAL_BATCH, SEQ)


def rank_batches(step: int, grid: parallel.Grid) -> list[dict]:
    """This DP rank's microbatches: a contiguous 1/DP of the sequences, split into ACCUM pieces."""
    full = global_batch(step)
    per_rank = GLOBAL_BATCH // grid.dp
    mine = {k: v[grid.dp_rank * per_rank:(grid.dp_rank + 1) * per_rank] for k, v in full.items()}
    return [{k: v.chunk(ACCUM)[m] for k, v in mine.items()} for m in range(ACCUM)]


def forward_backward(model, batches, grid, normalize: str = "global"):
    """The first half of train.train_step, for the tests that look between backward and the update.
    Loss normalization as train.py does it (torchtitan's rule): back-propagate
    local_sum * dp / global_tokens, so reduce_gradients' SUM * 1/dp gives d(total / global_tokens).
    normalize="local_mean" is the common mistake shown in
    test_only_1_over_dp_with_the_global_token_count_gives_the_reference_gradients."""
    local_tokens = sum((b["targets"] != -100).sum(dtype=torch.float32) for b in batches)   # float: as train.py
    global_tokens = parallel.all_reduce(local_tokens.clone(), grid.dp_group)
    scale = grid.dp / global_tokens if normalize == "global" else 1.0 / local_tokens
    total = torch.zeros(())
    for b in batches:
        loss = model(b["tokens"], b["positions"], b["doc_ids"], b["targets"])
        (loss * scale).backward()
        total += loss.detach()
    return total, global_tokens


class RecordingAdamW(torch.optim.AdamW):
    """AdamW that gathers the full-shape gradients (reduced and clipped) at its first step."""
    def __init__(self, model, grid, lr=1e-3):
        super().__init__(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1)
        self.model, self.grid, self.grads = model, grid, None

    def step(self, closure=None):
        if self.grads is None:
            self.grads = parallel.gather_full_state_dict(self.model, self.grid, grads=True)
        return super().step(closure)


# ----------------------------------------------------------------------------- the reference

@pytest.fixture(scope="module")
def reference():
    return single_process_reference(tiny_cfg(), global_batch, STEPS)


@pytest.fixture(scope="module")
def reference_tied():
    return single_process_reference(tiny_cfg(tied=True), global_batch, STEPS)


# ----------------------------------------------------------------------------- the spawned ranks

def run_layout(name: str, cfg, grid: parallel.Grid, out_dir: str):
    """Build, check the init, 3 training steps; write what this rank gathered to full shape. Under
    the xla backend's rules (xla_rules), whose log of the layout's collectives is written too."""
    with xla_rules.recording(name, grid, out_dir):
        _run_layout(name, cfg, grid, out_dir)


def _run_layout(name: str, cfg, grid: parallel.Grid, out_dir: str):
    model = seeded_model(cfg, grid)
    res = {"init": parallel.gather_full_state_dict(model, grid), "loss": [], "norm": []}
    b0 = rank_batches(0, grid)[0]
    with torch.no_grad():
        logits = model(b0["tokens"], b0["positions"], b0["doc_ids"])
    res["logits_local"] = logits
    if grid.tp > 1:
        logits = parallel._all_gather(logits, grid.tp_group, dim=-1)
    res["logits"], res["logit_rows"] = logits, grid.dp_rank * (GLOBAL_BATCH // grid.dp)
    opt = RecordingAdamW(model, grid)
    for step in range(STEPS):
        r = train.train_step(model, opt, rank_batches(step, grid), grid, cfg)
        res["loss"].append(r["loss"])
        res["norm"].append(r["grad_norm"])
    res["grads"], res["params"] = opt.grads, parallel.gather_full_state_dict(model, grid)
    held_out = rank_batches(99, grid)       # train.evaluate: each rank's sums, all-reduced over DP
    res["eval"] = train.evaluate(model, FixedLoader(held_out), len(held_out), grid, torch.device("cpu"))
    if cfg.model.tie_embeddings:       # still one Parameter after the steps; its logits, for the export's check
        parallel.check_tied(model)
        with torch.no_grad():
            logits = model(b0["tokens"], torch.arange(SEQ).expand_as(b0["tokens"]))
        res["logits_trained"] = parallel._all_gather(logits, grid.tp_group, dim=-1) if grid.tp > 1 else logits
    # load_full_state_dict is the inverse: load the reference init into a differently seeded model.
    cfg2 = tiny_cfg(cfg.parallel.tp, cfg.parallel.dp, cfg.parallel.sp, cfg.model.tie_embeddings)
    cfg2.seed = 8
    other = seeded_model(cfg2, grid)
    load_full_state_dict(other, res["init"], grid)
    res["reloaded"] = parallel.gather_full_state_dict(other, grid)
    torch.save(res, os.path.join(out_dir, f"{name}.rank{grid.rank}.pt"))


def count_step_collectives(cfg, grid, bucket_bytes=parallel.BUCKET_BYTES):
    """One step's collectives, as (kind, op) -> [count, bytes]."""
    model = seeded_model(cfg, grid)
    kinds = {id(grid.tp_group): "tp", id(grid.dp_group): "dp"}
    with count_collectives() as log:
        forward_backward(model, rank_batches(0, grid), grid)
        parallel.reduce_gradients(model, grid, bucket_bytes)
        parallel.clip_grad_norm_(model.parameters(), 1.0, grid)
    counts = {}
    for op, group, nbytes in log:
        c = counts.setdefault((kinds[id(group)], op), [0, 0])
        c[0] += 1
        c[1] += nbytes
    return counts


def world_size_normalization(cfg, grid):
    """Gradients three ways from the same backward: right (1/DP), xm.reduce_gradients' 1/world, and
    a per-rank mean loss (each rank divides by its own token count)."""
    model = seeded_model(cfg, grid)
    out = {}
    for how in ("right", "world", "local_mean"):
        model.zero_grad(set_to_none=True)
        forward_backward(model, rank_batches(0, grid), grid, "local_mean" if how == "local_mean" else "global")
        if how == "world":            # what xm.reduce_gradients does: SUM over DP, scaled by 1/world
            parallel.reduce_tp_replicated_gradients(model, grid)
            for p in model.parameters():
                parallel.all_reduce(p.grad.mul_(1.0 / grid.world), grid.dp_group)
        else:
            parallel.reduce_gradients(model, grid)
        out[how] = parallel.gather_full_state_dict(model, grid, grads=True)
    return out


def saved_for_backward(fn, params):
    """Run fn() and list what autograd saves for its backward: (shape, bytes) of every tensor given
    to the saved-tensor pack hook, parameters left out (they are held anyway)."""
    weights, saved = {p.data_ptr() for p in params}, []

    def pack(t):
        if t.data_ptr() not in weights:
            saved.append((tuple(t.shape), t.numel() * t.element_size()))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


class GatherSequence(torch.autograd.Function):
    """Megatron's gather_from_sequence_parallel_region: all-gather the sequence forward,
    reduce-scatter backward (the sum of the ranks' partial input gradients, this rank's shard)."""
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return parallel._all_gather(x, group, dim=parallel.SEQ)

    @staticmethod
    def backward(ctx, grad):
        return parallel._reduce_scatter(grad, ctx.group, dim=parallel.SEQ), None


@contextlib.contextmanager
def gather_then_linear():
    """ColumnParallelLinear's SP forward as it was before _LinearWithSequenceParallel: all-gather,
    then F.linear, which saves the gathered [B, T, in] input. The baseline of the memory tests."""
    fixed = parallel.ColumnParallelLinear.forward
    parallel.ColumnParallelLinear.forward = lambda self, x: F.linear(GatherSequence.apply(x, self.group), self.weight)
    try:
        yield
    finally:
        parallel.ColumnParallelLinear.forward = fixed


def sp_saved_memory(grid):
    """TP=2 with SP: the activations a column-parallel linear, the vocab-parallel head and a whole
    model save for backward, with the fix ("shard") and with all-gather + F.linear ("gathered");
    and both paths' gradients for the same input and weights."""
    cfg = tiny_cfg(tp=2, sp=True)
    g = torch.Generator().manual_seed(grid.tp_rank)
    x = torch.randn(2, SEQ // 2, cfg.model.dim, generator=g)         # this rank's sequence shard
    layers = {"column": parallel.ColumnParallelLinear(cfg.model.dim, 48, grid.tp_group, True),
              "head": parallel.VocabParallelHead(cfg.model.dim, 49, 49, 49 * grid.tp_rank, grid.tp_group, True)}
    for layer in layers.values():
        layer.weight.data.normal_(generator=g)
    model = seeded_model(cfg, grid)
    b0 = rank_batches(0, grid)[0]
    out = {}
    for how in ("shard", "gathered"):
        with gather_then_linear() if how == "gathered" else contextlib.nullcontext():
            for name, layer in layers.items():
                xs = x.clone().requires_grad_()
                layer.weight.grad = None
                y, saved = saved_for_backward(lambda: layer(xs), [layer.weight])
                y.pow(2).sum().backward()
                out[how, name] = {"saved": saved, "x_grad": xs.grad, "w_grad": layer.weight.grad}
            _, saved = saved_for_backward(lambda: model(b0["tokens"], b0["positions"], b0["doc_ids"]),
                                          list(model.parameters()))
            out[how, "model"] = {"saved": saved, "batch": tuple(b0["tokens"].shape)}
    return out


def _worker(rank: int, ports: list[int], out_dir: str):
    torch.set_num_threads(1)
    xla_rules.install()          # every group in its XLA form, every collective checked (xla_rules.py)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]), RANK=str(rank),
                      WORLD_SIZE="4", LOCAL_RANK=str(rank))
    # First, one world of 4.
    cfg = tiny_cfg(tp=2, dp=2)
    grid = parallel.init_distributed(cfg, "cpu")
    assert (grid.tp, grid.dp, grid.tp_rank, grid.dp_rank, grid.backend) == (2, 2, rank % 2, rank // 2, "gloo")
    for sp in (False, True):
        run_layout(f"tp2dp2_sp{int(sp)}", tiny_cfg(tp=2, dp=2, sp=sp), grid, out_dir)
    # Tied embeddings (Llama 3.2): embedding and head share each rank's vocabulary shard.
    run_layout("tp2dp2_sp1_tied", tiny_cfg(tp=2, dp=2, sp=True, tied=True), grid, out_dir)
    comm = {sp: count_step_collectives(tiny_cfg(tp=2, dp=2, sp=sp), grid) for sp in (False, True)}
    comm["small_buckets"] = count_step_collectives(tiny_cfg(tp=2, dp=2), grid, bucket_bytes=1)
    norm = world_size_normalization(tiny_cfg(tp=2, dp=2), grid)
    if rank == 0:
        torch.save({"comm": comm, "norm": norm}, os.path.join(out_dir, "tp2dp2_comm_and_norm.pt"))
    cfg4 = tiny_cfg(tp=4, dp=1)
    grid4 = parallel.new_grid(4, rank, 4, 1, sharding.kv_replicas(cfg4.model, 4), "gloo")
    run_layout("tp4_sp0", tiny_cfg(tp=4, dp=1), grid4, out_dir)
    cfg4 = tiny_cfg(tp=4, dp=1, sp=True)
    cfg4.model.checkpointing = "full"       # the recomputed forward repeats its collectives in backward
    cfg4.model.attention = "explicit"       # against the sdpa reference: the two paths agree under TP too
    run_layout("tp4_sp1_ckpt", cfg4, grid4, out_dir)
    dist.destroy_process_group()

    # Then two independent worlds of 2: TP=2 on ranks 0-1, DP=2 on ranks 2-3.
    os.environ.update(MASTER_PORT=str(ports[1 + rank // 2]), RANK=str(rank % 2), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank % 2))
    if rank < 2:
        grid = parallel.init_distributed(tiny_cfg(tp=2), "cpu")
        for sp in (False, True):
            run_layout(f"tp2_sp{int(sp)}", tiny_cfg(tp=2, sp=sp), grid, out_dir)
        torch.save(sp_saved_memory(grid), os.path.join(out_dir, f"sp_saved.rank{rank}.pt"))
    else:
        grid = parallel.init_distributed(tiny_cfg(dp=2), "cpu")
        run_layout("dp2", tiny_cfg(dp=2), grid, out_dir)
        barrier_over_host_group(grid, out_dir)
    parallel.destroy(grid)


def barrier_over_host_group(grid: parallel.Grid, out_dir: str):
    """parallel.barrier over grid.host_group, the gloo group init_distributed adds on xla (whose own
    barrier returns at once): rank 1 writes a file late; rank 0 must see it right after the barrier."""
    grid.host_group = dist.new_group(backend="gloo")
    late = os.path.join(out_dir, "barrier.late")
    if grid.rank == 1:
        time.sleep(0.5)
        open(late, "w").close()
    parallel.barrier(grid)
    if grid.rank == 0:
        with open(os.path.join(out_dir, "barrier.seen"), "w") as f:
            f.write(str(os.path.exists(late)))


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    return spawn_and_wait(_worker, 3, 4, str(tmp_path_factory.mktemp("parallel")))


LAYOUTS = {  # name -> ranks that wrote a file
    "tp2_sp0": [0, 1], "tp2_sp1": [0, 1], "dp2": [0, 1],
    "tp2dp2_sp0": [0, 1, 2, 3], "tp2dp2_sp1": [0, 1, 2, 3], "tp2dp2_sp1_tied": [0, 1, 2, 3],
    "tp4_sp0": [0, 1, 2, 3], "tp4_sp1_ckpt": [0, 1, 2, 3],
}


def load(spawned, name):
    return [torch.load(os.path.join(spawned, f"{name}.rank{r}.pt")) for r in LAYOUTS[name]]


# ----------------------------------------------------------------------------- layout tests

@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(spawned, reference, reference_tied, name):
    reference = reference_tied if "tied" in name else reference
    for rank, res in enumerate(load(spawned, name)):
        where = f"{name} rank {rank}"
        # Layout-independent init: exactly the single-process weights, and load is its inverse.
        for k, v in reference["init"].items():
            assert torch.equal(res["init"][k], v), f"{where}: init of {k} differs"
            assert torch.equal(res["reloaded"][k], v), f"{where}: load_full_state_dict of {k}"
        # Forward: the gathered logits; the padding columns (vocab 97 -> a TP multiple) are masked
        # with the finite mask value (no infinity on trn1).
        full = res["logits"]
        rows = slice(res["logit_rows"], res["logit_rows"] + full.shape[0])
        assert_close(full[..., :97], reference["logits"][rows], f"{where}: logits")
        assert torch.all(full[..., 97:] == llama.MASK_VALUE), f"{where}: padding logits not masked"
        for step in range(STEPS):
            assert_close(res["loss"][step], reference["loss"][step], f"{where}: loss at step {step}")
            assert_close(res["norm"][step], reference["norm"][step], f"{where}: grad norm at step {step}")
        assert set(res["grads"]) == set(reference["grads"])
        for k, g in reference["grads"].items():
            assert_close(res["grads"][k], g, f"{where}: grad of {k} (step 0, reduced and clipped)")
        for k, p in reference["params"].items():
            assert_close(res["params"][k], p, f"{where}: {k} after {STEPS} AdamW steps")
        assert_close(res["eval"], reference["eval"], f"{where}: evaluation after {STEPS} steps")


@pytest.mark.slow
def test_tied_export_gives_the_trained_logits(spawned, tmp_path):
    """TP=2 x DP=2 with tied embeddings (issue 26): the export of the trained weights (the embedding
    only, as HF writes a tied model), read by transformers, gives the trained model's logits."""
    transformers = pytest.importorskip("transformers")
    import hf
    res = load(spawned, "tp2dp2_sp1_tied")[0]
    assert torch.equal(res["params"]["embed.weight"], res["params"]["lm_head.weight"])
    hf.save_hf(res["params"], tiny_cfg(tied=True).model, str(tmp_path / "hf"))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    with torch.no_grad():
        logits = back(global_batch(0)["tokens"][:res["logits_trained"].shape[0]]).logits
    assert_close(logits, res["logits_trained"][..., :97], "tied TP=2: the export's logits in transformers")


@pytest.mark.slow
def test_layouts_issue_only_xla_collectives(spawned):
    """Every layout above ran under the xla backend's rules (xla_rules.py): groups in their XLA
    form, meshes the verifier accepts, only collectives the xla backend runs. The list is what
    each issues on xla (rank 0, 3 steps, the checks' gathers included)."""
    import json
    for name, ranks in LAYOUTS.items():
        for rank in ranks:
            ops = json.load(open(os.path.join(spawned, f"{name}.xla_ops.rank{rank}.json")))
            if rank == 0:
                print(name, ops)
            assert ops and all(k.split(" over ")[0] in xla_rules.CHECKED for k in ops), (name, ops)


def test_clipping_was_active(reference):
    # Otherwise the grad-norm comparison above would not exercise the clip coefficient.
    assert all(n > tiny_cfg().optim.grad_clip for n in reference["norm"])


@pytest.mark.slow
def test_replicated_kv_heads_are_distinct_shards(spawned):
    """TP=4 with 2 KV heads: ranks 0,1 hold copies of KV head 0, ranks 2,3 of KV head 1."""
    res = load(spawned, "tp4_sp0")
    m = tiny_cfg().model
    w = res[0]["params"]["layers.0.attn.qkv_proj.weight"]
    for r in range(4):
        local = sharding.cut("layers.0.attn.qkv_proj.weight", w, m, 4, r).view(3, m.head_dim, m.dim)
        groups = w.view(2, 4, m.head_dim, m.dim)        # [kv group, (q, q, k, v), hd, dim]
        assert torch.equal(local[0], groups[r // 2, r % 2]) and torch.equal(local[1:], groups[r // 2, 2:])


@pytest.mark.slow
def test_only_1_over_dp_with_the_global_token_count_gives_the_reference_gradients(spawned, reference):
    """TP=2 x DP=2 on 4 ranks. Dividing the DP sum by the world size (xm.reduce_gradients, HLAT's
    divergence) gives gradients TP=2 times too small; dividing each rank's loss by its own token
    count (not the global one) weights the two DP halves wrongly. Only 1/DP + global tokens matches."""
    norm = torch.load(os.path.join(spawned, "tp2dp2_comm_and_norm.pt"))["norm"]
    ref = reference["grads_unclipped"]
    for k, g in ref.items():
        assert_close(norm["right"][k], g, f"right normalization: {k}")
    for k, g in ref.items():   # exactly half of the right gradient: off by a factor TP
        assert_close(norm["world"][k], g / 2, f"1/world normalization: {k}")
        assert (norm["world"][k] - g).abs().max() > 0.49 * g.abs().max()
    worst = max(((norm["local_mean"][k] - g).abs().max() / g.abs().max()).item() for k, g in ref.items())
    assert worst > 0.05, f"per-rank mean loss should differ from the global mean (rel. error {worst:.3g})"


@pytest.mark.slow
def test_communication_matches_formulas(spawned):
    """One step of TP=2 x DP=2: M=2 microbatches of b=2 sequences, T=16, d=64, L=2, fp32.
    act = b*T*d*4 bytes (one [B, T, dim] activation), tok = b*T*4 (one float per token).

    Without SP, per microbatch (TP group):
      all-reduce: forward  1 (embedding) + 2L (o_proj, down_proj: row-parallel outputs)
                  backward 2L (qkv_proj, gate_up_proj: column-parallel inputs) + 1 (lm_head input)
                  loss     2 (max: tok bytes; [sum_exp, target logit]: 2*tok bytes)
      -> M*(4L+4) all-reduces, M*((4L+2)*act + 3*tok) bytes.
    With SP, per microbatch: all-gather 2L+1 forward (column inputs) + 2L+1 backward (row outputs)
      + 2L+1 backward (column inputs again, for the weight gradients: _LinearWithSequenceParallel
      saves only the sequence shard, Megatron's trade of one all-gather for tp times less memory),
      so 6L+3, was 4L+2 when the gathered input was saved; reduce-scatter 2L+1 forward (embedding,
      row outputs) + 2L+1 backward (column inputs); each act bytes; the loss's 2 all-reduces; once
      per step 1 all-reduce of the (2L+1) norm-weight gradients, (2L+1)*d*4 bytes.
    Per step: TP all-reduce of the clip norm (4 bytes); DP: 1 all-reduce of the token count (4
    bytes, float32: Neuron adds in f32) and the gradient buckets: all local parameters, 1 bucket (64 MiB cap), or one
    per parameter with a 1-byte cap. Nothing else: no DP traffic per microbatch."""
    comm = torch.load(os.path.join(spawned, "tp2dp2_comm_and_norm.pt"))["comm"]
    m = tiny_cfg().model
    M, b, T, d, L, tp = ACCUM, GLOBAL_BATCH // (2 * ACCUM), SEQ, m.dim, m.n_layers, 2
    act, tok = b * T * d * 4, b * T * 4
    vp = sharding.padded_vocab(m.vocab_size, tp)
    per_layer = ((m.n_heads + 2 * m.n_kv_heads) * m.head_dim * d + m.n_heads * m.head_dim * d + 3 * d * m.ffn_dim) // tp + 2 * d
    local_params = 2 * vp // tp * d + L * per_layer + d
    n_tensors = 2 + 6 * L + 1                     # embed, lm_head, final norm; 6 per layer
    dp = {("dp", "all_reduce"): [2, 4 + 4 * local_params]}
    assert comm[False] == {("tp", "all_reduce"): [M * (4 * L + 4) + 1, M * ((4 * L + 2) * act + 3 * tok) + 4], **dp}
    assert comm[True] == {("tp", "all_gather"): [M * (6 * L + 3), M * (6 * L + 3) * act],
                          ("tp", "reduce_scatter"): [M * (4 * L + 2), M * (4 * L + 2) * act],
                          ("tp", "all_reduce"): [2 * M + 2, M * 3 * tok + (2 * L + 1) * d * 4 + 4], **dp}
    assert comm["small_buckets"][("dp", "all_reduce")] == [1 + n_tensors, 4 + 4 * local_params]


# ----------------------------------------------------------------------------- SP memory

def sp_saved(spawned):
    return [torch.load(os.path.join(spawned, f"sp_saved.rank{r}.pt")) for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("layer", ["column", "head"])
def test_sp_column_linear_saves_only_the_sequence_shard(spawned, layer):
    """TP=2, SP: a column-parallel linear (and the vocab-parallel lm_head, its subclass) keeps for
    backward its [b, T/2, d] input shard, not the all-gathered [b, T, d] (Megatron, NxD), and its
    gradients equal those of all-gather + F.linear, which kept the gathered input."""
    full = 2 * SEQ * tiny_cfg().model.dim * 4                      # bytes of a [b, T, d] fp32 input
    for rank, res in enumerate(sp_saved(spawned)):
        new, old = res["shard", layer], res["gathered", layer]
        assert [n for _, n in new["saved"]] == [full // 2], f"rank {rank}: saved {new['saved']}"
        assert [n for _, n in old["saved"]] == [full], f"rank {rank}: baseline saved {old['saved']}"
        for k in ("x_grad", "w_grad"):
            assert_close(new[k], old[k], f"rank {rank}: {layer} {k}")


@pytest.mark.slow
def test_sp_model_saves_tp_times_less_per_column_linear(spawned):
    """Whole TP=2 SP model forward: the saved activations shrink by exactly the 2L+1 column-parallel
    inputs (qkv_proj, gate_up_proj per layer, lm_head) times half a [b, T, d] activation; nothing
    else changes."""
    m = tiny_cfg().model
    for rank, res in enumerate(sp_saved(spawned)):
        b, T = res["shard", "model"]["batch"]
        new, old = (sum(n for _, n in res[how, "model"]["saved"]) for how in ("shard", "gathered"))
        print(f"rank {rank}: TP=2 SP model forward saves {new} bytes of activations (was {old})")
        assert old - new == (2 * m.n_layers + 1) * b * (T - T // 2) * m.dim * 4, (rank, old, new)


# ----------------------------------------------------------------------------- pure functions

def test_rank_groups_follow_nxd_layout():
    g = parallel.rank_groups(8, tp=2, pp=2)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert parallel.rank_groups(8, tp=4, pp=1, kv_replicas=2)["kv"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # tied embeddings: each pipeline's first and last stage, not its first two (the same at PP=2 only)
    g = parallel.rank_groups(16, tp=2, pp=4, tied=True)
    assert g["pp"][:2] == [[0, 4, 8, 12], [1, 5, 9, 13]] and "embed" not in parallel.rank_groups(16, 2, 4)
    assert g["embed"] == [[0, 12], [1, 13], [2, 14], [3, 15]]
    # 70B layout: every kind partitions the world.
    g = parallel.rank_groups(256, tp=32, pp=8, kv_replicas=4)
    for kind, groups in g.items():
        assert sorted(r for grp in groups for r in grp) == list(range(256)), kind
    assert len(g["tp"][0]) == 32 and len(g["dp"][0]) == 1 and len(g["pp"][0]) == 8


@pytest.mark.parametrize("tie,dtype", [(False, None), (True, torch.bfloat16)])
def test_build_model_allocates_what_to_empty_allocates_without_empty_like(monkeypatch, tie, dtype):
    """build_model allocates its meta model with torch.empty, not Module.to_empty: to_empty's empty_like of
    a meta tensor ran torch's Python reference, whose stride logic imported sympy (~1 s CPU of every rank's
    start-up). The same parameters and buffers as to_empty's (names, shapes, dtypes, strides, grads), tied."""
    cfg = configs.PRESETS["tiny"]()
    cfg.model.tie_embeddings = tie
    with torch.device("meta"):
        ref = llama.Llama(cfg.model)
    if dtype is not None:
        ref.to(dtype)
    ref.to_empty(device="cpu")
    parallel.tie_embeddings(ref)
    calls = []
    real = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    model = parallel.build_model(cfg, parallel.Grid(), "cpu", dtype=dtype)
    assert calls == []

    def described(m):
        return [(n, t.device, t.shape, t.dtype, t.stride(), t.requires_grad, type(t))
                for n, t in [*m.named_parameters(remove_duplicate=False), *m.named_buffers()]]
    assert described(model) == described(ref)
    assert (model.lm_head.weight is model.embed.weight) == tie


@pytest.mark.parametrize("max_norm", [0.5, 50.0])
def test_clip_grad_norm_is_torchs_above_and_below_the_limit(max_norm):
    # Every layout above clips (test_clipping_was_active), so they never see a norm under the limit,
    # where the gradients must stay as they are, not be scaled up to it.
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.zeros(4, 3)) for _ in range(3)]
    theirs = [torch.nn.Parameter(torch.zeros(4, 3)) for _ in range(3)]
    for a, b in zip(ours, theirs):
        a.grad = torch.randn(4, 3)
        b.grad = a.grad.clone()
    norm = parallel.clip_grad_norm_(ours, max_norm, parallel.Grid())
    assert_close(norm, torch.nn.utils.clip_grad_norm_(theirs, max_norm), "norm")
    for a, b in zip(ours, theirs):
        assert_close(a.grad, b.grad, "clipped gradient")


def test_clipping_bf16_gradients_rounds_each_element_once():
    """The clip coefficient stays fp32 and multiplies each bf16 gradient in fp32 (parallel.scale_to_norm_, ZeRO-1's
    too). Rounded to bf16 first (up to 2^-9), it moved every clipped norm: over 200 gradient scales |clipped norm /
    max_norm - 1| averaged 1.44e-3 (worst 3.57e-3); in fp32 9.2e-5, worst 1.74e-3, the floor of exact clipping rounded
    once (this loop, 2026-11-29). Bounds: 3x the fp32 mean, 1.1x the floor."""
    torch.manual_seed(0)
    base = [torch.randn(64, 64), torch.randn(4096), torch.randn(32, 128)]
    worst, floor, total = 0.0, 0.0, 0.0
    for i in range(200):
        grads = [(b * (1.5 + i * 0.0731) / 100).bfloat16() for b in base]     # norms 1.5x to 16x the limit
        params = [torch.nn.Parameter(g.clone()) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        parallel.clip_grad_norm_(params, 1.0, parallel.Grid())
        ratio = torch.cat([p.grad.double().flatten() for p in params]).norm().item()
        exact = torch.cat([g.double().flatten() for g in grads]).norm()
        rounded_once = torch.cat([(g.double() / (exact + 1e-6)).bfloat16().double().flatten() for g in grads]).norm()
        worst, floor, total = max(worst, abs(ratio - 1)), max(floor, abs(rounded_once.item() - 1)), total + abs(ratio - 1)
    assert total / 200 < 3e-4 and worst <= 1.1 * floor, (total / 200, worst, floor)


def test_clip_at_zero_is_no_clipping():
    """--optim.grad_clip=0 means no clipping (configs.OptimConfig), where torch's clip_grad_norm_(max_norm=0) zeroes
    every gradient: the gradients stay as they are, and the norm is still returned for the log."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(4, 3)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn(4, 3)
    before = [p.grad.clone() for p in params]
    norm = parallel.clip_grad_norm_(params, 0.0, parallel.Grid())
    assert_close(norm, torch.cat([g.reshape(-1) for g in before]).norm(), "norm")
    assert all(torch.equal(p.grad, g) for p, g in zip(params, before))


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("world,change,message", [
    (3, dict(tp=2), "not divisible by tp*pp"),
    (4, dict(tp=2, dp=4), "launch 8 processes or set --dp=2"),
    (8, dict(tp=8), "n_heads 4 is not divisible by tp 8"),
    (4, dict(tp=4, ffn_dim=126), "ffn_dim=126 is not divisible by --tp=4"),
    (2, dict(tp=2, dim=96, n_heads=6, n_kv_heads=3), "n_kv_heads 3 and tp 2"),
    (4, dict(tp=4, sp=True, seq_len=14), "--seq_len=14 over --tp=4"),
])
def test_bad_layout_fails_before_process_groups(monkeypatch, world, change, message):
    cfg = tiny_cfg()
    cfg.data.micro_batch = 1
    for k, v in change.items():
        section = cfg.parallel if k in ("tp", "dp", "sp") else cfg.data if k == "seq_len" else cfg.model
        setattr(section, k, v)
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, cfg.data.seq_len)
    # torchrun's environment but no rendezvous server: any process-group work would hang or fail.
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(ConfigError, match=re.escape(message)):
        parallel.init_distributed(cfg, "cpu")
    assert not dist.is_initialized()


@pytest.mark.slow
def test_barrier_waits_for_every_rank(spawned):
    with open(os.path.join(spawned, "barrier.seen")) as f:
        assert f.read() == "True", "parallel.barrier returned before rank 1 reached it"


def test_world_one_needs_no_process_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    grid = parallel.init_distributed(tiny_cfg(), "cpu")
    assert grid == parallel.Grid() and not dist.is_initialized()
