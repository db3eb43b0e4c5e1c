"""The model of the xla backend (tests/xla_rules.py) fails what the xla backend cannot run, and the
project's meshes pass it. The layout tests (test_parallel.py, test_pipeline.py, test_optim.py's
ZeRO-1) run under these rules; this file shows the rules can fail.
"""
import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gloo_spawn import spawn_and_wait  # noqa: E402
import parallel  # noqa: E402
import pipeline  # noqa: E402
import reshard  # noqa: E402
import xla_rules  # noqa: E402


@pytest.mark.parametrize("world,tp,pp", [(2, 1, 2), (8, 2, 2), (8, 1, 4), (16, 2, 4), (256, 32, 8)])
def test_project_meshes_pass_the_verifier_rule(world, tp, pp):
    for kind, mesh in parallel.rank_groups(world, tp, pp, kv_replicas=2).items():
        assert xla_rules.mesh_error(mesh, world) is None, kind
    for mesh in pipeline.pair_meshes(world, tp, pp):
        assert xla_rules.mesh_error(mesh, world) is None, mesh


def test_pair_meshes_are_nxds():
    """NxD's get_pipeline_model_parallel_sr_group: [r_i, r_(i+1)%pp] for i of one parity."""
    assert pipeline.pair_meshes(4, 1, 4) == [[[0, 1], [2, 3]], [[1, 2], [3, 0]]]
    assert pipeline.pair_meshes(4, 1, 2) == [[[0, 2], [1, 3]], [[2, 0], [3, 1]]]


def test_verifier_rule_rejects_bad_meshes():
    # the pairs without the wrap-around (the odd round misses stages 0 and pp-1)
    assert "missing [0, 3]" in xla_rules.mesh_error([[1, 2]], 4)
    # odd pp: a rank in two pairs of one mesh
    assert "repeated [0]" in xla_rules.mesh_error([[0, 1], [2, 0]], 3)
    assert "different sizes" in xla_rules.mesh_error([[0, 1, 2], [3]], 4)
    assert xla_rules.mesh_error([[0, 1, 2, 3]], 4) is None


VIOLATIONS = {
    # name -> (what to run on every rank, the error it must raise)
    "isend": (lambda g, t: dist.isend(t, 1 - dist.get_rank() % 2, group=g["pair"]).wait(), "cannot run on the xla"),
    "batch_isend_irecv": (lambda g, t: dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, t, (dist.get_rank() + 2) % 4)]), "cannot run on the xla"),
    "all_to_all on a sub-group": (lambda g, t: dist.all_to_all([t.clone(), t.clone()], [t, t], group=g["pair"]),
                                  "on a sub-group"),
    "reduce on a sub-group": (lambda g, t: dist.reduce(t, 0, group=g["pair"]), "on a sub-group"),
    "gather on a sub-group": (lambda g, t: dist.gather(t, None, group=g["pair"]), "on a sub-group"),
    "AVG": (lambda g, t: dist.all_reduce(t, op=dist.ReduceOp.AVG, group=g["pair"]), "no such reduction"),
    "broadcast on a sub-group": (lambda g, t: dist.broadcast(t, 2 * (dist.get_rank() // 2) + 1, group=g["pair"]),
                                 "group-local src"),
    "barrier": (lambda g, t: dist.barrier(), "cannot run on the xla"),
    "sub-group without mesh": (lambda g, t: dist.new_group([0, 1]), "must name each of the 4 ranks once"),
    "odd pairs without wrap-around": (lambda g, t: dist.new_group(
        [1, 2], pg_options={"xla_pg_options": {"mesh": [[1, 2]]}}), "missing \\[0, 3\\]"),
    "group not in its mesh": (lambda g, t: dist.new_group(
        [0, 2], pg_options={"xla_pg_options": {"mesh": [[0, 1], [2, 3]]}}), "not one of the groups"),
}


def _worker(rank: int, ports: list[int], out_dir: str):
    import re
    torch.set_num_threads(1)
    rules = xla_rules.install()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=4)
    mesh = [[0, 1], [2, 3]]
    groups = {"pair": [dist.new_group(r, pg_options={"xla_pg_options": {"mesh": mesh}}) for r in mesh][rank // 2]}
    t = torch.ones(2)
    dist.all_reduce(t, group=groups["pair"])                    # allowed: checked, logged, run
    assert t.tolist() == [2.0, 2.0] and rules.log[:1] == [("all_reduce", ((0, 1), (2, 3)))]
    # parallel.broadcast from each pair's second rank (group-local 1: on xla, dist.broadcast took global
    # rank 1 for the root, so pair [2, 3] got zeros), as the resume's one read per DP group and the
    # pipeline's full state dict use it: under the rules, each pair holds its source's tensor.
    src = 2 * (rank // 2) + 1
    got = parallel.broadcast(torch.full((3,), 10.0 + rank) if rank == src else torch.full((3,), float("nan")),
                             src, groups["pair"])
    assert got.tolist() == [10.0 + src] * 3, (rank, got)    # NaN garbage on the others: not NaN x 0
    # The resume's one read per DP group at TP=2 x DP=2 (DP groups [0, 2], [1, 3]), read by DP rank 1.
    dp = [dist.new_group(r, pg_options={"xla_pg_options": {"mesh": [[0, 2], [1, 3]]}}) for r in ([0, 2], [1, 3])]
    grid = parallel.Grid(world=4, rank=rank, tp=2, dp=2, tp_rank=rank % 2, dp_rank=rank // 2, dp_group=dp[rank % 2])
    state = reshard.broadcast_state({"w": torch.arange(5.0) + rank} if rank >= 2 else None, grid, reader=1)
    assert torch.equal(state["w"], torch.arange(5.0) + 2 + rank % 2), (rank, state)
    caught = {}
    for name, (fn, message) in VIOLATIONS.items():
        try:
            fn(groups, torch.ones(2))
            caught[name] = "no error"
        except xla_rules.XlaRuleError as e:
            caught[name] = "ok" if re.search(message, str(e)) else f"wrong error: {e}"
    with xla_rules.suspended():                                  # gloo-only code, unchecked
        dist.barrier()
    torch.save(caught, os.path.join(out_dir, f"caught.rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_rules_fail_what_the_xla_backend_cannot_run(tmp_path):
    spawn_and_wait(_worker, 1, 4, str(tmp_path), timeout_s=300)
    for rank in range(4):
        caught = torch.load(tmp_path / f"caught.rank{rank}.pt")
        assert caught == {name: "ok" for name in VIOLATIONS}, (rank, caught)
