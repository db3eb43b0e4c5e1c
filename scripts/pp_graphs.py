"""The pipeline step's graphs on XLA:CPU, in one process: the graph census of train.train_step at PP 2.

On trn1 a pipeline step is PP processes, each tracing its own stage's graphs and exchanging
activations with its neighbours. XLA:CPU runs no collectives between processes (torch-xla's CPU client), so
this runs the stages one after another in ONE process, each exactly as its rank runs it in
train.py: pipeline.build_model, torch-xla's activation checkpointing, optim.build_optimizer,
train.train_step (its pipeline branch) with train.sync as the graph cut after every task, and
train.py's sync after the step. One thing is stood in for, at one seam:

    the point-to-point's all-gather over a two-rank group (pipeline.p2p, pp_p2p="allgather",
    the form NxD uses on XLA and the only one configs.validate allows there), with the creation
    of those groups (pipeline._pair_groups's dist.new_group).

StandInPairs replaces torch.distributed.new_group and all_gather_into_tensor while a stage is
built and trained: the group is a plain object naming its two ranks, and the all-gather writes
this rank's half and, for the peer's half, a fixed device tensor of the message's shape and dtype
(what the neighbour would have sent; its values do not matter to a graph). So each exchange is a
graph of its own, of the same shape, with a concatenation where trn1 has the all-gather. No
process group exists here: any other cross-process call of the step would fail, so there is none
but the ones over groups of degree 1 or absent here. Those are the PP sums of the loss and of the
squared gradient norm (two scalar all-reduces in the reduce/clip/update graph on trn1; a group of
None here, so parallel.all_reduce skips them); the census counts graphs, and tests/test_pipeline.py
lists each layout's collectives on gloo under the xla backend's rules.

Where the cuts are, as NxD's pipeline engine (neuronx-distributed, Release 2.29,
src/neuronx_distributed/pipeline/model.py): NxDPPModel calls self._mark_step() (xm.mark_step) at
the end of every task when the scheduler marks it graph_break (the default, scheduler.py): after
the forward step (_fwd_step_task), the backward step (_bwd_step_task), each receive
(_fwd_preprocess_task: "this mark_step call is important to avoid incorrect HLO graph tracing: if
mark_step is not called, there will be redundant recv CC op"; _bwd_preprocess_task), each send
(_fwd_postprocess_task, _bwd_postprocess_task), the gradient reduction (_reduce_grads_task), and
before and after run_train. pipeline.py cuts after every forward, backward and exchange (a send
and a receive at the same moment are one exchange, one graph), and train.py after the update.

Graphs are named by the task whose cut ended them: token count, forward, backward, the exchange
(what it moves: send activation, recv gradient, ...), reduce/clip/update, resume; each with its
stage, its HLO size, a hash of its HLO (distinct graphs = distinct hashes) and its weight copies
(outputs that are an input transposed: what F.linear's saved W^T made of every forward graph here,
before model.LinearFunction).

    PJRT_DEVICE=CPU python scripts/pp_graphs.py --microbatches=2,4,8 --json=out/pp_graphs.json

tests/test_xla.py (test_pipeline_graph_census) and bench.py xla run it.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TINY = ["--model.n_layers=4", "--model.dim=64", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.ffn_dim=176", "--model.vocab_size=256", "--data.seq_len=32", "--data.micro_batch=2",
        "--optim.warmup_steps=2", "--precision=fp32", "--model.attention=explicit",
        "--parallel.pp=2", "--parallel.pp_p2p=allgather", "--parallel.pp_schedule=1f1b", "--device=xla"]


class Pair:
    """The stand-in for one two-rank group of the all-gather point-to-point."""

    def __init__(self, ranks):
        self.ranks = tuple(ranks)


class StandInPairs:
    """The seam (see the module docstring): torch.distributed.new_group and all_gather_into_tensor,
    replaced while one stage (`rank`) is built and trained in this process."""

    def __init__(self):
        self.rank = None
        self.peer_data: dict = {}      # (numel, dtype) -> the neighbour's message, on the device

    def new_group(self, ranks=None, timeout=None, backend=None, pg_options=None, **kw):
        return Pair(ranks)

    def all_gather_into_tensor(self, out, x, group=None, async_op=False):
        import torch
        assert isinstance(group, Pair) and self.rank in group.ranks, (group, self.rank)
        key = (x.numel(), x.dtype)
        if key not in self.peer_data:          # device data (a transfer), not a graph of its own
            g = torch.Generator().manual_seed(x.numel())
            self.peer_data[key] = torch.randn(x.numel(), generator=g).to(x.dtype).to(x.device)
        halves = [x if r == self.rank else self.peer_data[key] for r in group.ranks]
        out.copy_(torch.cat(halves))

    def __enter__(self):
        import torch.distributed as dist
        self.saved = dist.new_group, dist.all_gather_into_tensor
        dist.new_group, dist.all_gather_into_tensor = self.new_group, self.all_gather_into_tensor
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist
        dist.new_group, dist.all_gather_into_tensor = self.saved


def task_label() -> str:
    """The pipeline task whose cut is running: read from the caller's frames (pipeline.py)."""
    f = sys._getframe(2)
    while f is not None:
        name, local = f.f_code.co_name, f.f_locals
        if os.path.basename(f.f_code.co_filename) == "pipeline.py":
            if name == "p2p":
                to_next = local["peer"] == local["comm"].next
                what = []
                if local["send"] is not None:
                    what.append("send " + ("activation" if to_next else "gradient"))
                if local["recv"]:
                    what.append("recv " + ("gradient" if to_next else "activation"))
                return "p2p " + " + ".join(what)
            if name in ("forward", "backward"):
                return name
        if name == "train_step" and os.path.basename(f.f_code.co_filename) == "train.py":
            return "token count"
        f = f.f_back
    return "other"


def config(cfg_args: list[str], microbatches: int):
    """The run's config, checked: a bad argument is one line (__main__), before torch-xla's import."""
    import configs
    cfg = configs.from_args(cfg_args + [f"--data.global_batch={microbatches * 2}"])
    configs.check_values(cfg)
    return cfg


def run(cfg_args: list[str], microbatches: int, steps: int, resume_steps: int, graph_file: str) -> dict:
    """Each stage: `steps` training steps, then a resume (host copies of its model and optimizer
    state, as a checkpoint holds them, loaded into a freshly built stage, as train.py does) and
    `resume_steps` more. Returns every graph run, labelled, and the compiles per step."""
    import torch
    import torch_xla
    import torch_xla.debug.metrics as met
    import ckptsave
    import model as llama
    import optim
    import parallel
    import pipeline
    import train
    from xla_check import GraphLog, snapshot

    cfg = config(cfg_args, microbatches)
    dev = torch_xla.device()
    log = GraphLog(graph_file)
    log.new()                                     # skip what earlier runs left in the file
    graphs, stand_in = [], StandInPairs()
    state = {"compiles": met.counter_value("UncachedCompile") or 0}

    def collect(stage, step, label):
        compiles = (met.counter_value("UncachedCompile") or 0) - state["compiles"]
        state["compiles"] += compiles
        for g in log.new():
            graphs.append({"stage": stage, "step": step, "label": label, "instructions": g["instructions"],
                           "hash": g["hash"], "weight_copies": g["weight_copies"], "compiled": compiles,
                           "microbatches": microbatches})
            compiles = 0

    def batches(step):
        g = torch.Generator().manual_seed(1000 * microbatches + step)
        T, b = cfg.data.seq_len, cfg.data.micro_batch
        out = []
        for _ in range(microbatches):
            toks = torch.randint(0, cfg.model.vocab_size, (b, T + 1), generator=g)
            out.append({"tokens": toks[:, :-1], "targets": toks[:, 1:],
                        "positions": torch.arange(T).expand(b, T), "doc_ids": torch.zeros(b, T, dtype=torch.long)})
        return [{k: v.to(dev) for k, v in mb.items()} for mb in out]

    per_step, reads = {}, {}
    for s in range(cfg.parallel.pp):
        grid = parallel.Grid(world=cfg.parallel.pp, rank=s, pp=cfg.parallel.pp, pp_rank=s, backend="xla")
        stand_in.rank = s
        with stand_in:
            def build(weights=None):             # train.py's sources: a checkpoint's weights or the seed
                stage = pipeline.build_model(cfg, grid, dev, dtype=optim.param_dtype(cfg.optim.precision))
                if weights is not None:
                    stage.load_state_dict(weights)
                else:
                    parallel.init_weights(stage, cfg, grid)
                stage = parallel.move_model(stage, dev)
                llama.use_xla_checkpointing(stage)
                return stage, optim.build_optimizer(stage, cfg, grid)

            def cut():
                train.sync(dev)
                collect(s, step, task_label())

            stage, opt = build()
            train.sync(dev)
            collect(s, 0, "setup")
            for step in range(1, steps + resume_steps + 1):
                if step == steps + 1:            # the resume: what a checkpoint holds, loaded as train.py loads it
                    model_sd, optim_sd = ckptsave.to_host(stage.state_dict()), ckptsave.to_host(opt.state_dict())
                    collect(s, step - 1, "save")
                    stage, opt = build(model_sd)
                    opt.load_state_dict(optim_sd)
                    train.sync(dev)
                    collect(s, step - 1, "resume")
                before, read = state["compiles"], snapshot()["TransferFromDevice"]
                opt.set_lr(optim.lr_at(step - 1, cfg.optim))
                micro = batches(step)
                train.train_step(stage, opt, micro, grid, cfg, cut=cut)
                train.sync(dev)                  # train.py's sync after the step
                collect(s, step, "reduce/clip/update")
                per_step.setdefault(s, []).append(state["compiles"] - before)
                reads.setdefault(s, []).append(snapshot()["TransferFromDevice"] - read)
    return {"microbatches": microbatches, "graphs": graphs, "compiles_per_step": per_step,
            "host_reads_per_step": reads, "steps": steps, "resume_steps": resume_steps}


def census(graphs: list[dict]) -> dict:
    """{"stage S: label": {"distinct": HLO hashes, "sizes": [instructions], "runs": n, "compiled": n}}."""
    out: dict = {}
    for g in graphs:
        d = out.setdefault(f"stage {g['stage']}: {g['label']}",
                           {"distinct": [], "sizes": [], "runs": 0, "compiled": 0, "weight_copies": 0})
        d["weight_copies"] = max(d["weight_copies"], g["weight_copies"])
        if g["hash"] not in d["distinct"]:
            d["distinct"].append(g["hash"])
            d["sizes"].append(g["instructions"])
        d["runs"] += 1
        d["compiled"] += g["compiled"]
    return out


def table(report: dict) -> list[str]:
    """The census as lines: one per (stage, graph), its distinct graphs (HLO sizes) and its runs
    at each number of microbatches, then the compiles per step of each run."""
    runs = report["runs"]
    ms = [r["microbatches"] for r in runs]
    labels = list(dict.fromkeys(k for r in runs for k in r["census"]))
    out = [f"{'graph (stage: task)':44s} {'distinct graphs (HLO instructions) at ' + '/'.join(map(str, ms)) + ' microbatches':58s} "
           f"runs at {'/'.join(map(str, ms))}"]
    for label in labels:
        cs = [r["census"].get(label, {"sizes": [], "runs": 0}) for r in runs]
        sizes = " / ".join(f"{len(c['sizes'])} ({','.join(map(str, c['sizes']))})" for c in cs)
        out.append(f"{label:44s} {sizes:58s} {'/'.join(str(c['runs']) for c in cs)}")
    for r in runs:
        out.append(f"{r['microbatches']} microbatches: graphs compiled per step ({r['steps']} steps, then "
                   f"{r['resume_steps']} resumed) " + "; ".join(f"stage {s} {v}" for s, v in r["compiles_per_step"].items())
                   + "; host reads per step " + "; ".join(f"stage {s} {v}" for s, v in r["host_reads_per_step"].items()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--microbatches", default="2,4,8",
                    help="one run per number of microbatches per step (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=3, help="training steps of each run (default: %(default)s)")
    ap.add_argument("--resume-steps", type=int, default=2,
                    help="then a resume into a freshly built stage and this many steps more (default: %(default)s)")
    ap.add_argument("--graphs", default="/tmp/pp_graphs.hlo",
                    help="torch-xla writes every graph run here (default: %(default)s)")
    ap.add_argument("--json", default="", help="also write the report here")
    ap.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then train.py arguments replacing the tiny model's")
    args = ap.parse_args()
    if not re.fullmatch(r"[1-9][0-9]*(,[1-9][0-9]*)*", args.microbatches) or args.steps < 1 or args.resume_steps < 0:
        sys.exit(f"error: --microbatches {args.microbatches!r} --steps {args.steps} --resume-steps {args.resume_steps}: "
                 f"give whole numbers >= 1 (comma-separated microbatches), resume steps >= 0")
    from xla_check import check_out_file
    from benchmarks.common import write_json     # strict JSON, as bench.py and xla_check.py write it
    check_out_file("--graphs", args.graphs + ".0")
    if args.json:
        check_out_file("--json", args.json)
    cfg_args = TINY + [a for a in args.train_args if a != "--"]
    counts = [int(x) for x in args.microbatches.split(",")]
    for m in counts:                   # every run's arguments, before torch-xla's import (~10 s)
        config(cfg_args, m)
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    # torch-xla writes every graph it runs (HLO and the Python frames) here, when set before its import.
    os.environ["XLA_SAVE_TENSORS_FILE"], os.environ["XLA_SAVE_TENSORS_FMT"] = args.graphs, "hlo"
    os.makedirs(os.path.dirname(os.path.abspath(args.graphs)), exist_ok=True)
    if os.path.exists(args.graphs + ".0"):
        os.remove(args.graphs + ".0")
    import torch
    import torch_xla
    torch.set_num_threads(1)
    torch_xla.device()                 # before any backward (scripts/xla_check.py says why)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    report = {"args": cfg_args, "runs": []}
    for m in counts:
        r = run(cfg_args, m, args.steps, args.resume_steps, args.graphs + ".0")
        r["census"] = census(r["graphs"])
        report["runs"].append(r)
    print("\n".join(table(report)))
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from configs import ConfigError
    try:
        main()
    except ConfigError as e:            # a bad train.py argument: one line, as train.py says it, not a traceback
        sys.exit(f"error: {e}")
