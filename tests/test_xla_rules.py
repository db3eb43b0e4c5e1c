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
    "integer all_reduce": (lambda g, t: dist.all_reduce(t.int(), group=g["pair"]), "adds in f32"),
    "integer reduce-scatter": (lambda g, t: dist.reduce_scatter_tensor(t[:1].long(), t.long(), group=g["pair"]),
                               "adds in f32"),
    "int64 beyond int32 gathered": (lambda g, t: dist.all_gather_into_tensor(
        torch.empty(4, dtype=torch.long), t.long() << 31, group=g["pair"]), "beyond int32"),
    "integer reduce-scatter, list form": (lambda g, t: dist.reduce_scatter(
        t[:1].long(), [t[:1].long(), t[1:].long()], group=g["pair"]), "adds in f32"),
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


def _run_to_its_end(rank: int, port: int, args: list, precompile: bool, out_dir: str):
    """A rank of a TP=2 or PP=2 run (or its pre-compile pass) under the rules: every collective it issues, and at each graph
    cut (train.sync, the one place a rank launches its lazy graph on XLA) how many had been issued."""
    import json
    import train
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    if precompile:
        os.environ["NEURON_EXTRACT_GRAPHS_ONLY"] = "1"
    torch.set_num_threads(1)
    rules, cuts, sync = xla_rules.install(), [], train.sync
    train.sync = lambda device: (cuts.append(len(rules.log)), sync(device))
    train.main(args)
    with open(os.path.join(out_dir, f"{'pre' if precompile else 'run'}.rank{rank}.json"), "w") as f:
        json.dump({"log": rules.log, "cuts": cuts}, f)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--tp=2"], ["--pp=2", "--parallel.pp_p2p=allgather", "--model.n_layers=2", "--micro_batch=1"]],
                         ids=["tp2", "pp2"])
def test_a_run_ends_with_every_collective_launched_by_every_rank(tmp_path, layout):
    """On XLA a collective is lazy: it runs in the graph a rank launches at its next cut (or a host read of its
    result). The end-of-run export gathered the TP shards (PP: the stages) on every rank, then rank 0 alone read them to the host: its
    graph's all-gathers waited for peers that had exited (a hang as the run ends, the model unsaved), and no pre-compile
    pass had traced them. Now every rank cuts after the gathers, and the pre-compile pass issues them as the run does."""
    import json
    import sysconfig
    import shutil
    import configs
    import data
    from gloo_spawn import free_ports, spawn
    (tmp_path / "corpus").mkdir()
    for name in ("textwrap.py", "string.py", "shlex.py", "fnmatch.py", "glob.py", "bisect.py"):
        shutil.copy(os.path.join(sysconfig.get_paths()["stdlib"], name), tmp_path / "corpus" / name)
    tok = data.build_tokenizer(configs.DataConfig(data=str(tmp_path / "corpus"), cache_dir=str(tmp_path / "c")), 512)
    args = ["--model.n_layers=1", "--model.dim=32", "--model.n_heads=2", "--model.n_kv_heads=2", "--model.ffn_dim=64",
            "--seq_len=32", "--model.max_seq_len=32", "--global_batch=2", "--micro_batch=2", "--model.vocab_size=512",
            "--log.eval_interval=0", "--log.sample_tokens=0", "--log.peak_tflops=1", "--log.tensorboard=",
            "--steps=2", *layout, "--device=cpu", f"--data={tmp_path}/corpus", f"--data.tokenizer={tok.path}",
            f"--data.cache_dir={tmp_path}/c", f"--out_dir={tmp_path}/o"]
    for precompile in (True, False):
        spawn(_run_to_its_end, (free_ports(1)[0], args, precompile, str(tmp_path)), 2, timeout_s=300)
    assert (tmp_path / "o" / "hf" / "config.json").exists()
    for rank in range(2):
        run, pre = (json.loads((tmp_path / f"{k}.rank{rank}.json").read_text()) for k in ("run", "pre"))
        gathers = run["log"][run["cuts"][-2]:]          # the last step's parameter norm, then the export's
        assert len(gathers) >= 7, gathers          # TP=2: the norm, then 6 weights gathered (qkv, o, gate_up, ...)
        assert run["cuts"][-1] == len(run["log"]), f"rank {rank}: {len(run['log']) - run['cuts'][-1]} collectives " \
                                                  f"after the last cut: {run['log'][run['cuts'][-1]:]}"
        assert pre["log"][-len(gathers):] == run["log"][-len(gathers):] and pre["cuts"][-1] == len(pre["log"]), rank


PROJECT_COLLECTIVES = r"""
import model as llama, parallel, reshard, sharding, train
from test_optim import tiny_config, batch
dev, W = torch_xla.device(), dist.group.WORLD
tok, tgt = batch(0)
pos = torch.arange(tok.shape[1]).expand_as(tok)
for sp in (False, True):
    for tied in (False, True):
        cfg = tiny_config("fp32")
        cfg.model.tie_embeddings = tied
        ref = llama.Llama(cfg.model).init_weights(cfg.seed)
        grid = parallel.Grid(tp=1, tp_group=W, dp_group=W)
        with torch.device("meta"):
            m = llama.Llama(cfg.model)
            parallel.tensor_parallelize(m, grid, sp)        # every region operator, over a TP group of one
        m.to_empty(device="cpu")
        parallel.tie_embeddings(m)
        sharding.mark(m, 1, sp)
        m.load_state_dict(ref.state_dict())
        m = parallel.move_model(m, dev)
        loss = m(tok.to(dev), pos.to(dev), None, tgt.to(dev))
        loss.backward()
        torch_xla.sync()
        want = ref(tok, pos, None, tgt)
        want.backward()
        assert abs(float(loss) - float(want)) < 1e-3 * abs(float(want)), (sp, tied, float(loss), float(want))
        for (n, p), q in zip(m.named_parameters(), ref.parameters()):
            assert torch.allclose(parallel.grad_of(p).cpu(), q.grad, atol=1e-5), (sp, tied, n)
        assert float(parallel.param_norm(m, grid)) > 0 and float(parallel.replica_spread(loss, grid)) == 0
class Batches:
    def reset(self):
        self.i = 0
    def __next__(self):
        self.i += 1
        return {"tokens": tok, "positions": pos, "targets": tgt}
assert abs(float(train.evaluate(m, Batches(), 2, grid, dev, cut=torch_xla.sync)) - float(want) / tgt.numel()) < 1e-3
state = reshard.broadcast_state({"w": torch.arange(10.0), "s": 5}, grid, reader=0, device=dev)
assert state["s"] == 5 and torch.equal(state["w"], torch.arange(10.0))
print("ok")
"""


@pytest.mark.slow
def test_the_project_collectives_run_on_the_real_xla_backend_in_a_world_of_one():
    """Multi-process XLA does not run on CPU, but the real xla backend (ProcessGroupXla) does in a world of one, with
    its own checks of every operand (it takes XLA tensors only: that caught ZeRO-1's host masters, test_optim). Every
    TP/SP region operator (tensor_parallelize over a TP group of one rank), plain and tied, forward and backward,
    equals the plain model; the parameter norm, the replicas' spread, the evaluation's all-reduces and the resume's
    broadcast_state run through it too."""
    from conftest import run_in_xla_world_of_one
    run_in_xla_world_of_one(PROJECT_COLLECTIVES)


def _hang_fault(rank: int, ports: list[int], out_dir: str):
    """NANOTRN_FAULT=hang:1:5 at TP=1 x DP=2 under the rules: rank 1 must wait in a barrier no other rank joins."""
    import json
    import time
    import checkpoint
    import configs
    torch.set_num_threads(1)
    xla_rules.install()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=2)
    grid = parallel.Grid(world=2, rank=rank, dp=2, dp_rank=rank, backend="xla", host_group=parallel.new_host_group())
    os.environ["NANOTRN_FAULT"] = "hang:1:5"
    cfg = configs.Config()
    cfg.ckpt.dir = out_dir
    ckpt = checkpoint.Checkpointer(cfg, grid, compile_only=True)      # where train.py's step finds the fault
    if rank == 1:
        t0 = time.monotonic()
        ckpt.faults.maybe_hang(5)
        with open(os.path.join(out_dir, "waited.json"), "w") as f:
            json.dump(time.monotonic() - t0, f)
    else:                       # the others' step collectives (and a watchdog) in life; here the test ends the wait
        time.sleep(3)
        dist.barrier(group=grid.host_group)
    dist.destroy_process_group()


@pytest.mark.slow
def test_the_hang_fault_hangs_on_the_xla_backend(tmp_path):
    """NANOTRN_FAULT=hang:RANK:STEP (docs/checkpoints.md: the watchdog's test on a cluster) waited in dist.barrier() of
    the default group, which on Trainium is the xla backend, whose barrier returns at once (ProcessGroupXla.barrier:
    _ret_work([])): the rank went on and nothing hung. It waits in the host group's (gloo) barrier, as parallel.barrier."""
    import json
    spawn_and_wait(_hang_fault, 1, 2, str(tmp_path), timeout_s=300)
    assert json.loads((tmp_path / "waited.json").read_text()) > 2.0


def _run_recording_shapes(rank: int, port: int, args: list, env: dict, out: str):
    """A rank of a DP=2 run under the rules, writing the (op, mesh, shape, dtype) of every xla collective it issues."""
    import json
    import train
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", **env)
    torch.set_num_threads(1)
    rules, seen = xla_rules.install(), set()
    for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
        def recorded(t, *a, _f=getattr(dist, name), _n=name, **k):
            n = len(rules.log)
            r = _f(t, *a, **k)
            if len(rules.log) > n:                   # checked: an xla collective (not a gloo host group's)
                seen.add(json.dumps([_n, rules.log[-1][1], list(t.shape), str(t.dtype)]))
            return r
        setattr(dist, name, recorded)
    train.main(args)
    with open(os.path.join(out, f"shapes.rank{rank}.json"), "w") as f:
        json.dump(sorted(seen), f)


@pytest.mark.slow
def test_the_precompile_pass_issues_every_collective_shape_of_a_resume_at_dp2(tmp_path):
    """At DP > 1 a resume reads the model (and the optimizer state) once per DP group and broadcasts it
    (reshard.broadcast_state): graphs of the pickled head's length and of each bucket. The pre-compile pass
    (NEURON_EXTRACT_GRAPHS_ONLY) traced a resume's load only as a world of one has it, so on Trainium every resume at
    DP > 1 compiled these graphs as it started. Every collective shape of a resumed DP=2 run must be one the pass
    issued."""
    import json
    import shutil
    import sysconfig
    import configs
    import data
    from gloo_spawn import free_ports, spawn
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("textwrap.py", "string.py", "shlex.py", "fnmatch.py", "glob.py", "bisect.py"):
        shutil.copy(os.path.join(sysconfig.get_paths()["stdlib"], name), corpus / name)
    tok = data.build_tokenizer(configs.DataConfig(data=str(corpus), cache_dir=str(tmp_path / "c")), 512)
    args = ["--model.n_layers=1", "--model.dim=32", "--model.n_heads=2", "--model.n_kv_heads=2", "--model.ffn_dim=64",
            "--seq_len=32", "--model.max_seq_len=32", "--global_batch=2", "--micro_batch=1", "--model.vocab_size=512",
            "--log.eval_interval=0", "--log.sample_tokens=0", "--log.peak_tflops=1", "--log.tensorboard=",
            "--dp=2", "--ckpt.interval=2", "--device=cpu", f"--data={corpus}", f"--data.tokenizer={tok.path}",
            f"--data.cache_dir={tmp_path}/c"]
    runs = {"pre": (["--steps=2", f"--out_dir={tmp_path}/pre"], {"NEURON_EXTRACT_GRAPHS_ONLY": "1"}),
            "run": (["--steps=2", f"--out_dir={tmp_path}/o"], {}),
            "resume": (["--steps=3", f"--out_dir={tmp_path}/o"], {})}
    for name, (extra, env) in runs.items():
        (tmp_path / name).mkdir(exist_ok=True)
        spawn(_run_recording_shapes, (free_ports(1)[0], args + extra, env, str(tmp_path / name)), 2, timeout_s=300)
    assert (tmp_path / "o" / "ckpt" / "step_00000002").is_dir()
    for rank in range(2):
        pre, resume = (set(json.loads((tmp_path / k / f"shapes.rank{rank}.json").read_text())) for k in ("pre", "resume"))
        head = f'[{reshard.HEAD_BYTES // 2}], "torch.float32"'               # the padded head, 16 bits a float
        assert any(head in s for s in resume), resume                       # the resume's broadcasts were seen
        assert resume <= pre, f"rank {rank}: not issued by the pre-compile pass: {sorted(resume - pre)}"
