"""Pipeline parallelism gives the same numbers as one process (issue 5).

One spawn of 8 gloo processes runs every layout, in three rounds (worlds are torn down and
re-created between rounds, so several small layouts share one spawn and the file stays fast):
  first, one world of 8:  PP=2 x TP=2 x DP=2, 1F1B, with "send" (SP off) and "allgather" (SP on);
  then two worlds of 4:   ranks 0-3: PP=2 x TP=2 (send, SP off; allgather, SP on), then PP=4 1F1B
                          (allgather, 8 microbatches); ranks 4-7: PP=2 x DP=2 (send; allgather),
                          then PP=4 GPipe (send, 8 microbatches);
  last, four worlds of 2: PP=2 with 1F1B / GPipe x send / allgather (4 microbatches; GPipe + send
                          with full activation checkpointing, GPipe + allgather with uneven stages,
                          pp_cuts=1).
Each layout runs 3 AdamW steps (clipping active) and writes what it gathered to full shape
(initial weights, step-0 gradients after reduction and clipping, final weights) plus its loss,
grad norm, live-activation peak (the schedule's list, and autograd's saved tensors), step 0's order
of tasks, message counts and one step's collectives. The tests compare
them, in this process, with a plain single-process Llama on the same global batches. The grad
norm is compared before clipping: a uniform gradient scale error (picotron's grad_acc-times-larger
PP gradients) would survive clipping in the gradients themselves, not in the norm.
"""
from __future__ import annotations

import os
import re
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import assert_close, count_collectives, load_full_state_dict, packed_batch, seeded_model  # noqa: E402
from conftest import FixedLoader  # noqa: E402
from gloo_spawn import single_process_reference, spawn_and_wait  # noqa: E402
import xla_rules  # noqa: E402
import configs  # noqa: E402
import model as llama  # noqa: E402
import parallel  # noqa: E402
import pipeline  # noqa: E402
import train  # noqa: E402
from configs import ConfigError, ModelConfig, ParallelConfig  # noqa: E402

GLOBAL_BATCH, SEQ, STEPS = 8, 16, 3


def tiny_cfg(pp=2, tp=1, dp=1, sp=False, schedule="1f1b", p2p="send", micro_batch=2, cuts="",
             tied=False) -> configs.Config:
    cfg = configs.tiny()
    cfg.model = ModelConfig(vocab_size=97, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64,
                            max_seq_len=SEQ, tie_embeddings=tied)
    cfg.parallel = ParallelConfig(tp=tp, pp=pp, dp=dp, sp=sp, pp_schedule=schedule, pp_p2p=p2p, pp_cuts=cuts)
    cfg.data.seq_len, cfg.data.global_batch, cfg.data.micro_batch = SEQ, GLOBAL_BATCH, micro_batch
    cfg.optim.grad_clip = 0.5                     # below the norms seen here: clipping is active
    cfg.seed = 7
    return cfg


def global_batch(step: int) -> dict:
    return packed_batch(step, GLOBAL_BATCH, SEQ)


def rank_batches(step: int, grid: parallel.Grid, cfg) -> list[dict]:
    """This DP rank's microbatches (the same on every stage and TP rank of its pipeline)."""
    full = global_batch(step)
    per_rank = GLOBAL_BATCH // grid.dp
    mine = {k: v[grid.dp_rank * per_rank:(grid.dp_rank + 1) * per_rank] for k, v in full.items()}
    m = per_rank // cfg.data.micro_batch
    return [{k: v.chunk(m)[i] for k, v in mine.items()} for i in range(m)]


class RecordingAdamW(torch.optim.AdamW):
    """torch's AdamW that gathers the whole model's gradients (reduced and clipped) at its first step."""
    def __init__(self, model, grid):
        super().__init__(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1)
        self.model, self.grid, self.grads = model, grid, None
        self.step_count = 0         # Adam's t: optim.guarded_step advances it on a skipped step

    def step(self, closure=None):
        if self.grads is None:
            self.grads = pipeline.gather_full_state_dict(self.model, self.grid, grads=True)
        return super().step(closure)


class SavedBy:
    """A tensor autograd saved in microbatch i's forward for its backward, counted while alive (freed by
    that backward): peak is how many microbatches' activations a stage held at once, counted by autograd
    itself rather than by the schedule's own list."""
    alive: dict = {}
    peak = 0

    def __init__(self, t: torch.Tensor, i: int):
        self.t, self.i = t, i
        SavedBy.alive[i] = SavedBy.alive.get(i, 0) + 1
        SavedBy.peak = max(SavedBy.peak, sum(n > 0 for n in SavedBy.alive.values()))

    def __del__(self):
        SavedBy.alive[self.i] -= 1


# ----------------------------------------------------------------------------- the reference

@pytest.fixture(scope="module")
def reference():
    return single_process_reference(tiny_cfg(pp=1), global_batch, STEPS)


@pytest.fixture(scope="module")
def reference_tied():
    """Tied embeddings (Llama 3.2): one matrix, used by the first stage and the last."""
    return single_process_reference(tiny_cfg(pp=1, tied=True), global_batch, STEPS)


# ----------------------------------------------------------------------------- the spawned ranks

def run_layout(name: str, cfg, grid: parallel.Grid, out_dir: str):
    """Under the xla backend's rules (xla_rules), except "send", gloo's point-to-point, which the xla
    backend cannot run (configs.validate refuses it there)."""
    if cfg.parallel.pp_p2p == "send":
        with xla_rules.suspended():
            return _run_layout(name, cfg, grid, out_dir)
    with xla_rules.recording(name, grid, out_dir):
        return _run_layout(name, cfg, grid, out_dir)


def _run_layout(name: str, cfg, grid: parallel.Grid, out_dir: str):
    model = seeded_model(cfg, grid, build=pipeline.build_model)
    res = {"init": pipeline.gather_full_state_dict(model, grid), "loss": [], "norm": [], "max_live": [],
           "pp_rank": grid.pp_rank, "pp": grid.pp}
    opt = RecordingAdamW(model, grid)
    for step in range(STEPS):
        batches = rank_batches(step, grid, cfg)
        if step == 0:      # the order of this stage's tasks ("F" or "B", microbatch), and what autograd saved
            res["order"], real_tasks = [], (pipeline._Microbatches.forward, pipeline._Microbatches.backward)
            SavedBy.alive, SavedBy.peak = {}, 0

            def forward(mb, x):
                res["order"].append(("F", mb.next_fwd))
                with torch.autograd.graph.saved_tensors_hooks(lambda t, i=mb.next_fwd: SavedBy(t, i), lambda s: s.t):
                    return real_tasks[0](mb, x)
            pipeline._Microbatches.forward = forward
            pipeline._Microbatches.backward = lambda mb, dy: (res["order"].append(("B", mb.next_fwd - len(mb.live)))
                                                              or real_tasks[1](mb, dy))
            try:
                r = train.train_step(model, opt, batches, grid, cfg)
            finally:
                pipeline._Microbatches.forward, pipeline._Microbatches.backward = real_tasks
            res["saved_peak"] = SavedBy.peak
        elif step == STEPS - 1:          # one step's collectives, and its point-to-point messages
            messages, real_p2p = [0, 0], pipeline.p2p

            def counted(comm, send, peer, recv):       # what p2p exchanges: nothing past either end
                messages[0] += peer is not None and send is not None
                messages[1] += peer is not None and recv
                return real_p2p(comm, send, peer, recv)
            pipeline.p2p = counted
            try:
                with count_collectives() as log:
                    r = train.train_step(model, opt, batches, grid, cfg)
            finally:
                pipeline.p2p = real_p2p
            kinds = {id(grid.tp_group): "tp", id(grid.dp_group): "dp", id(grid.pp_group): "pp",
                     id(grid.embed_group): "embed"}
            res["collectives"] = sorted((kinds[id(g)], op) for op, g, _ in log if id(g) in kinds)
            res["messages"] = tuple(messages)
        else:
            r = train.train_step(model, opt, batches, grid, cfg)
        res["loss"].append(r["loss"])
        res["norm"].append(r["grad_norm"])
        res["max_live"].append(r["max_live"])
        res["microbatches"], res["bubble"], res["idle"] = len(batches), r["bubble"], r["idle"]
    # The non-finite guard sees the step's loss and norm; returning False skips the update.
    seen = []
    r = train.train_step(model, opt, rank_batches(STEPS, grid, cfg), grid, cfg,
                            guard=lambda loss, norm: seen.append((loss, norm)) or False)
    assert r["skipped"] and len(seen) == 1 and seen[0][0] is r["loss"]
    res["grads"], res["params"] = opt.grads, pipeline.gather_full_state_dict(model, grid)
    res["eval"] = pipeline.evaluate(model, FixedLoader(rank_batches(99, grid, cfg)), len(batches), grid,
                                    torch.device("cpu"))
    if cfg.model.tie_embeddings:      # one document per row, for the export's check in transformers
        plain = [dict(b, doc_ids=torch.zeros_like(b["doc_ids"]), positions=torch.arange(SEQ).expand_as(b["tokens"]))
                 for b in rank_batches(99, grid, cfg)]
        res["eval_plain"] = pipeline.evaluate(model, FixedLoader(plain), len(plain), grid, torch.device("cpu"))
    # A stage loads its TP shard of full weights (load_full_state_dict on the stage's own
    # names): the inverse of the gather. Load the initial weights into another seed.
    cfg2 = tiny_cfg(grid.pp, grid.tp, grid.dp, cfg.parallel.sp, cfg.parallel.pp_schedule, cfg.parallel.pp_p2p,
                    cfg.data.micro_batch, cfg.parallel.pp_cuts, cfg.model.tie_embeddings)
    cfg2.seed = 8
    other = seeded_model(cfg2, grid, build=pipeline.build_model)
    load_full_state_dict(other, {k: v for k, v in res["init"].items() if k in other.state_dict()}, grid)
    res["reloaded"] = pipeline.gather_full_state_dict(other, grid)
    torch.save(res, os.path.join(out_dir, f"{name}.rank{grid.rank}.pt"))


def _init(ports, port_index, rank, world, cfg) -> parallel.Grid:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[port_index]), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    return parallel.init_distributed(cfg, "cpu")


def _worker(rank: int, ports: list[int], out_dir: str):
    torch.set_num_threads(1)
    xla_rules.install()          # every group in its XLA form, every collective checked (xla_rules.py)
    # First, one world of 8, PP=2 x TP=2 x DP=2.
    grid = _init(ports, 0, rank, 8, tiny_cfg(pp=2, tp=2, dp=2))
    assert (grid.pp_rank, grid.dp_rank, grid.tp_rank) == (rank // 4, rank // 2 % 2, rank % 2)
    run_layout("pp2tp2dp2_send", tiny_cfg(pp=2, tp=2, dp=2, p2p="send"), grid, out_dir)
    run_layout("pp2tp2dp2_allgather_sp", tiny_cfg(pp=2, tp=2, dp=2, sp=True, p2p="allgather"), grid, out_dir)
    parallel.destroy(grid)

    # Then two worlds of 4.
    half, r = rank // 4, rank % 4
    if half == 0:
        grid = _init(ports, 1, r, 4, tiny_cfg(pp=2, tp=2))
        run_layout("pp2tp2_send", tiny_cfg(pp=2, tp=2, p2p="send"), grid, out_dir)
        run_layout("pp2tp2_allgather_sp", tiny_cfg(pp=2, tp=2, sp=True, p2p="allgather"), grid, out_dir)
        cfg4 = tiny_cfg(pp=4, p2p="allgather", micro_batch=1)
        cfg_tied = tiny_cfg(pp=2, tp=2, tied=True, p2p="allgather")     # as XLA needs (no send/recv)
    else:
        grid = _init(ports, 2, r, 4, tiny_cfg(pp=2, dp=2))
        run_layout("pp2dp2_send", tiny_cfg(pp=2, dp=2, p2p="send"), grid, out_dir)
        run_layout("pp2dp2_allgather", tiny_cfg(pp=2, dp=2, p2p="allgather"), grid, out_dir)
        cfg4 = tiny_cfg(pp=4, schedule="gpipe", p2p="send", micro_batch=1)
        cfg_tied = tiny_cfg(pp=2, dp=2, tied=True, p2p="allgather")
    grid4 = parallel.new_grid(4, r, 1, 4, 1, "gloo")        # PP=4 in the same world
    run_layout(f"pp4_{cfg4.parallel.pp_schedule}", cfg4, grid4, out_dir)
    p = cfg_tied.parallel       # tied embeddings: the embedding group joins the first and last stage
    grid_tied = parallel.new_grid(4, r, p.tp, p.pp, 1, "gloo", tied=True)
    run_layout(f"pp2tp{p.tp}dp{4 // p.tp // p.pp}_allgather_tied", cfg_tied, grid_tied, out_dir)
    parallel.destroy(grid)

    # Last, four worlds of 2, PP=2: each schedule with each point-to-point.
    schedule, p2p = [("1f1b", "send"), ("1f1b", "allgather"), ("gpipe", "send"), ("gpipe", "allgather")][rank // 2]
    cfg = tiny_cfg(pp=2, schedule=schedule, p2p=p2p, cuts="1" if rank // 2 == 3 else "")
    if rank // 2 == 2:
        cfg.model.checkpointing = "full"         # the stage's own forward recomputes blocks too
    grid = _init(ports, 3 + rank // 2, rank % 2, 2, cfg)
    run_layout(f"pp2_{schedule}_{p2p}", cfg, grid, out_dir)
    parallel.destroy(grid)


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    return spawn_and_wait(_worker, 7, 8, str(tmp_path_factory.mktemp("pipeline")))


LAYOUTS = {  # name -> number of ranks that wrote a file
    "pp2tp2dp2_send": 8, "pp2tp2dp2_allgather_sp": 8,
    "pp2tp2_send": 4, "pp2tp2_allgather_sp": 4, "pp2dp2_send": 4, "pp2dp2_allgather": 4,
    "pp4_1f1b": 4, "pp4_gpipe": 4, "pp2tp2dp1_allgather_tied": 4, "pp2tp1dp2_allgather_tied": 4,
    "pp2_1f1b_send": 2, "pp2_1f1b_allgather": 2, "pp2_gpipe_send": 2, "pp2_gpipe_allgather": 2,
}


@pytest.mark.slow
def test_layouts_issue_only_xla_collectives(spawned):
    """Every "allgather" layout above ran under the xla backend's rules (xla_rules.py): its groups
    in their XLA form with meshes the verifier accepts, no send/recv. Its point-to-point is the
    all-gather over neighbour pairs; the list is what it issues on xla."""
    import json
    seen = 0
    for name, n in LAYOUTS.items():
        for rank in range(n):
            path = os.path.join(spawned, f"{name}.xla_ops.rank{rank}.json")
            if not ("allgather" in name or name == "pp4_1f1b"):
                assert not os.path.exists(path)          # gloo's send/recv: refused on xla, run unchecked
                continue
            ops = json.load(open(path))
            if rank == 0:
                print(name, ops)
            assert any(k.startswith("all_gather_into_tensor over pp pairs") for k in ops), (name, ops)
            seen += 1
    assert seen == 8 + 4 + 4 + 4 + 2 + 2 + 4 + 4


def load(spawned, name):
    return [torch.load(os.path.join(spawned, f"{name}.rank{r}.pt")) for r in range(LAYOUTS[name])]


# ----------------------------------------------------------------------------- layout tests

@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(spawned, reference, reference_tied, name):
    reference = reference_tied if "tied" in name else reference
    for rank, res in enumerate(load(spawned, name)):
        where = f"{name} rank {rank}"
        for k, v in reference["init"].items():       # layout-independent init, and load inverts gather
            assert torch.equal(res["init"][k], v), f"{where}: init of {k} differs"
            assert torch.equal(res["reloaded"][k], v), f"{where}: load_full_state_dict of {k}"
        for step in range(STEPS):                    # the loss is valid on every rank, not only the last stage
            assert_close(res["loss"][step], reference["loss"][step], f"{where}: loss at step {step}")
            assert_close(res["norm"][step], reference["norm"][step], f"{where}: grad norm at step {step}")
        assert set(res["grads"]) == set(reference["grads"])
        for k, g in reference["grads"].items():
            assert_close(res["grads"][k], g, f"{where}: grad of {k} (step 0, reduced and clipped)")
        for k, p in reference["params"].items():
            assert_close(res["params"][k], p, f"{where}: {k} after {STEPS} AdamW steps (and a skipped one)")
        assert_close(res["eval"], reference["eval"], f"{where}: pipeline.evaluate")


def test_clipping_was_active(reference):
    assert all(n > tiny_cfg().optim.grad_clip for n in reference["norm"])


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in LAYOUTS if "tied" in n])
def test_tied_copies_stay_equal_and_export(spawned, name, tmp_path):
    """Tied embeddings over two stages (issue 26): the first stage's embedding and the last
    stage's copy in its head take the same summed gradient and the same update, so after the steps
    they are bit-for-bit equal; the export (the embedding only, as HF writes a tied model) read by
    transformers gives the pipeline's own loss on held-out batches."""
    transformers = pytest.importorskip("transformers")
    import hf
    res = load(spawned, name)[0]
    params = res["params"]
    assert torch.equal(params["embed.weight"], params["lm_head.weight"]), f"{name}: the tied copies parted"
    cfg = tiny_cfg(pp=1, tied=True)
    hf.save_hf(params, cfg.model, str(tmp_path / "hf"))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    b = global_batch(99)
    with torch.no_grad():
        logits = back(b["tokens"]).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["targets"].flatten(), ignore_index=-100)
    assert_close(loss, res["eval_plain"], f"{name}: the export's loss in transformers")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pp2_1f1b_send", "pp2_gpipe_allgather", "pp4_1f1b", "pp4_gpipe"])
def test_1f1b_keeps_at_most_pp_minus_stage_microbatches_alive_gpipe_all(spawned, name):
    """1F1B: stage s holds at most PP - s microbatches (<= PP) whatever m; GPipe holds all m. Counted twice:
    the schedule's list of microbatches in flight, and the microbatches whose saved activations autograd
    still holds (a graph kept past its backward shows in the second only)."""
    for res in load(spawned, name):
        pp, s, m = res["pp"], res["pp_rank"], res["microbatches"]
        assert m > pp                                 # otherwise the two schedules could not differ
        want = pp - s if "1f1b" in name else m
        assert res["max_live"] == [want] * STEPS, f"{name} stage {s}: live activations {res['max_live']}"
        assert res["saved_peak"] == want, f"{name} stage {s}: microbatches with saved activations {res['saved_peak']}"


def one_f_one_b_order(pp: int, s: int, m: int) -> list[tuple[str, int]]:
    """Stage s's tasks under 1F1B as Megatron-LM runs them (megatron/core/pipeline_parallel/schedules.py,
    forward_backward_pipelining_without_interleaving) and NxD (pipeline/scheduler.py, Train1F1BSchedule):
    min(pp - s - 1, m) warm-up forwards, then one forward and one backward in turn, then the last backwards."""
    w = min(pp - s - 1, m)
    steady = [task for i in range(m - w) for task in (("F", w + i), ("B", i))]
    return [("F", i) for i in range(w)] + steady + [("B", i) for i in range(m - w, m)]


def test_the_1f1b_order_is_nxds_table():
    """The table in NxD's Train1F1BSchedule docstring (PP4, 6 microbatches), row by row."""
    nxd = ["F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5", "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5",
           "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5", "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"]
    assert [" ".join(f"{k}{i}" for k, i in one_f_one_b_order(4, s, 6)) for s in range(4)] == nxd


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_stage_runs_its_tasks_in_its_schedules_order(spawned, name):
    """What each stage ran at step 0, in order: 1F1B's order (above), or GPipe's (every forward, then
    every backward, oldest first)."""
    for res in load(spawned, name):
        pp, s, m = res["pp"], res["pp_rank"], res["microbatches"]
        gpipe = [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
        want = gpipe if "gpipe" in name else one_f_one_b_order(pp, s, m)
        assert [tuple(t) for t in res["order"]] == want, f"{name} stage {s}: {res['order']}"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_communication_per_step(spawned, name):
    """Per step, whatever the number of microbatches m: DP all-reduces the token count, the gradients
    (one bucket) and the loss: 3, so gradients are reduced once, not per microbatch; PP all-reduces
    the clip norm and the loss: 2. Point-to-point: m activations forward over each link, m gradients
    back, nothing else (no shape messages)."""
    for res in load(spawned, name):
        got = [c for c in res["collectives"] if c[0] != "tp"]
        dp = [("dp", "all_reduce")] * 3 if "dp2" in name else []
        tied = [("embed", "all_reduce")] if "tied" in name and res["pp_rank"] in (0, res["pp"] - 1) else []
        assert got == sorted(dp + tied + [("pp", "all_reduce")] * 2), f"{name}: {got}"
        links = (res["pp_rank"] > 0) + (res["pp_rank"] < res["pp"] - 1)
        assert res["messages"] == (links * res["microbatches"],) * 2


@pytest.mark.slow
def test_1f1b_bubble_is_pp_minus_1_over_m_plus_pp_minus_1_and_idle_is_measured(spawned):
    for res in load(spawned, "pp4_1f1b"):
        assert res["bubble"] == pytest.approx(3 / (8 + 3))
        assert 0.0 < res["idle"] < 1.0


# ----------------------------------------------------------------------------- stages and bad input

def test_stage_bounds_and_names():
    assert pipeline.stage_bounds(tiny_cfg(pp=2)) == [(0, 2), (2, 4)]
    assert pipeline.stage_bounds(tiny_cfg(pp=4)) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    cfg = tiny_cfg(pp=3, cuts="1,3")
    cfg.model.n_layers = 5
    bounds = pipeline.stage_bounds(cfg)
    assert bounds == [(0, 1), (1, 3), (3, 5)]
    stages = {pipeline.stage_of(n, bounds) for n, _ in llama.Llama(cfg.model).named_parameters()
              if n.startswith("layers.2.")}
    assert stages == {1}
    assert pipeline.stage_of("embed.weight", bounds) == 0 and pipeline.stage_of("lm_head.weight", bounds) == 2


@pytest.mark.parametrize("world,change,message", [
    (3, dict(pp=3), "n_layers 4 is not divisible by pp 3; change pp or give explicit stage boundaries"),
    (2, dict(pp=2, micro_batch=8), "pipeline of 2 stages needs at least 2 microbatches per step, got 1"),
    (2, dict(pp=2, cuts="0"), "pp_cuts '0' must be 1 increasing layer indices"),
    (4, dict(pp=4, micro_batch=4), "pipeline of 4 stages needs at least 4 microbatches per step, got 2"),
])
def test_bad_pipeline_layout_fails_before_process_groups(monkeypatch, world, change, message):
    cfg = tiny_cfg(**change)
    # torchrun's environment but no rendezvous server: any process-group work would hang or fail.
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(ConfigError, match=re.escape(message)):
        parallel.init_distributed(cfg, "cpu")                # the path train.py takes
    assert not dist.is_initialized()


def test_train_py_rejects_bad_pipeline_before_any_work(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(ConfigError, match="n_layers 4 is not divisible by pp 3"):
        train.main(["--pp=3", "--model.n_layers=4", "--device=cpu"])
    assert not dist.is_initialized()


def test_train_step_rejects_too_few_microbatches():
    grid = parallel.Grid(world=2, pp=2)               # no process groups: an error must come first
    with pytest.raises(ConfigError, match="needs at least 2 microbatches per step, got 1"):
        train.train_step(None, None, rank_batches(0, grid, tiny_cfg(micro_batch=8)), grid, tiny_cfg())


def test_the_step_tells_the_fused_loss_its_scale():
    """In bf16 the fused loss rounds its gradients once only when it is told the scale the step
    multiplies its loss by (model.LinearCrossEntropy, grad_scale). train.forward_backward and the
    pipeline's last stage (one stage here, in process) both tell it: their gradients equal those of
    model(..., grad_scale=scale) * scale bit for bit, which differ from a loss scaled after it rounded."""
    cfg = tiny_cfg(pp=1)
    batches = rank_batches(0, parallel.Grid(), cfg)
    scale = 1 / sum((b["targets"] != -100).sum() for b in batches)

    def grads(run):
        model = llama.Llama(cfg.model).init_weights(cfg.seed).to(torch.bfloat16)
        run(model)
        return [p.grad for p in model.parameters()]

    def told(model, grad_scale=scale):
        for b in batches:
            (model(b["tokens"], b["positions"], b["doc_ids"], b["targets"], grad_scale) * scale).backward()

    def pipelined(model):
        stage = pipeline.PipelineStage(model, [(0, cfg.model.n_layers)], 0)
        mb = pipeline._Microbatches(stage, batches, scale, parallel.Grid(), pipeline.no_cut)
        for _ in batches:
            mb.forward(None)
            mb.backward(None)

    ref = grads(told)
    assert not all(torch.equal(a, b) for a, b in zip(ref, grads(lambda m: told(m, None))))
    for run in (lambda m: train.forward_backward(m, batches, scale, pipeline.no_cut), pipelined):
        assert all(torch.equal(a, b) for a, b in zip(ref, grads(run)))


def _tied_sync_worker(rank: int, world: int, store_file: str):
    """PP=2 tied, bf16_sr: train.train_step's steps, the last stage's copy nudged one bf16 ulp after each update,
    standing in for Trainium's rounding (each NeuronCore rounds from its own generator); then a mixed step's masters."""
    import optim
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    try:
        grid = parallel.new_grid(2, rank, 1, 2, 1, "gloo", tied=True)
        cfg = tiny_cfg(pp=2, tied=True)
        cfg.optim.precision = "bf16_sr"
        guarded = optim.guarded_step
        for software in (False, True):         # Trainium's hardware rounding; CPU's software rounding
            model = seeded_model(cfg, grid, build=pipeline.build_model, dtype=torch.bfloat16)
            opt = optim.build_optimizer(model, cfg, grid, software_sr=software)
            copy = model.embed.weight if model.first else model.lm_head.weight
            updated = []                        # the first stage's embedding as its update left it

            def nudged(o, verdict):
                out = guarded(o, verdict)
                if not model.first:
                    copy.data.copy_(torch.nextafter(copy.data, torch.tensor(float("inf"), dtype=copy.dtype)))
                updated[:] = [copy.data.clone()]
                return out
            optim.guarded_step = nudged
            try:
                for step in range(2):
                    train.train_step(model, opt, rank_batches(step, grid, cfg), grid, cfg)
            finally:
                optim.guarded_step = guarded
            both = [torch.empty_like(copy.data) for _ in range(2)]
            dist.all_gather(both, copy.data.contiguous())
            first = [torch.empty_like(copy.data) for _ in range(2)]
            dist.all_gather(first, updated[0].contiguous())
            assert torch.equal(both[0], first[0])           # the first stage's weights are its update's, kept
            # hardware rounding: the first stage's weights again after every step; software: the stages round
            # alike (AdamW._sr_key), so no sync is paid for, and the nudge stays
            assert torch.equal(both[0], both[1]) == (not software), software
        # mixed: the whole model's fp32 masters gathered over the stages (train.py's export), each the weight the
        # bf16 param rounds; the receiving stages' buffers are fp32 too
        cfg.optim.precision = "mixed"
        model = seeded_model(cfg, grid, build=pipeline.build_model, dtype=torch.bfloat16)
        opt = optim.build_optimizer(model, cfg, grid)
        train.train_step(model, opt, rank_batches(0, grid, cfg), grid, cfg)
        weights = pipeline.gather_full_state_dict(model, grid)
        masters = pipeline.gather_full_state_dict(model, grid, masters=opt.masters())
        assert weights.keys() == masters.keys() == llama.param_shapes(cfg.model).keys()
        assert all(t.dtype == torch.float32 and torch.equal(t.bfloat16(), weights[k]) for k, t in masters.items())
        assert not all(torch.equal(t, weights[k].float()) for k, t in masters.items())
    finally:
        dist.destroy_process_group()


def _tied_zero1_sr_worker(rank: int, world: int, store_file: str):
    """PP=2 x DP=2 tied, ZeRO-1, software bf16_sr: the stages' DP shards cut the embedding and its copy at other
    points, so their slots draw other streams (AdamW._sr_key keys a slot by where it starts): copies rounded apart."""
    import optim
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    try:
        grid = parallel.new_grid(4, rank, 1, 2, 1, "gloo", tied=True)
        cfg = tiny_cfg(pp=2, dp=2, tied=True)
        cfg.parallel.zero1, cfg.optim.precision = True, "bf16_sr"
        cfg.model.vocab_size = 1000     # an embedding over half of each stage: both stages' DP shards cut it, apart
        model = seeded_model(cfg, grid, build=pipeline.build_model, dtype=torch.bfloat16)
        opt = optim.build_optimizer(model, cfg, grid, software_sr=True)
        assert opt.zero1 and opt.use_sr
        copy = model.embed.weight if model.first else model.lm_head.weight
        for step in range(3):
            train.train_step(model, opt, rank_batches(step, grid, cfg), grid, cfg)
        every = [torch.empty_like(copy.data) for _ in range(4)]
        dist.all_gather(every, copy.data.contiguous())
        assert all(torch.equal(every[r], every[r + 2]) for r in range(2))      # stage 0's rank r, stage 1's r + 2
        # and the DP replicas hold one embedding: each pair's sync comes from its own first-stage rank (rank % 2
        # here), not from a rank outside the pair, whose broadcast would leave both of the pair's copies zeros
        assert torch.equal(every[0], every[1]) and every[0].abs().sum() > 0
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_tied_embeddings_copies_stay_one_under_zero1_and_software_stochastic_rounding(tmp_path):
    from gloo_spawn import spawn
    spawn(_tied_zero1_sr_worker, (4, str(tmp_path / "store")), nprocs=4)


@pytest.mark.slow
def test_a_tied_embeddings_copies_stay_one_under_hardware_stochastic_rounding(tmp_path):
    """Under hardware bf16_sr (Trainium) the two stages round their copies of a tied embedding each with its own
    core's generator: they drifted apart for good. pipeline.sync_tied_embedding gives the last stage the first's."""
    from gloo_spawn import spawn
    spawn(_tied_sync_worker, (2, str(tmp_path / "store")), nprocs=2)
