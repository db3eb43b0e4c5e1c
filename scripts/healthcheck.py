"""Pre-flight health check: collective bandwidth over every group kind, and who is slow.

Before training Llama 2 7B on 128 trn1 nodes the AWS team ran a "scrutiny check" of the network,
and ran it again after every hardware failure before restarting. This is ours. It times
all-reduce and all-gather over every group kind the run uses (the TP, DP and PP groups of
parallel.rank_groups, the world) and between pairs of nodes, then names any rank, group or node
far slower than the median. Exit status 1 when it names something, so a job script stops there.

    torchrun --nproc_per_node=32 scripts/healthcheck.py --tp=8     # one trn1 node
    scripts/launch.sh health --preset llama2_7b                    # the run's own layout
    torchrun --nproc_per_node=4 scripts/healthcheck.py --tp=2 --backend=gloo   # anywhere (CPU)

How a slow rank is found. In a collective every member waits for the last one to arrive, so a
rank's own time says little: the late rank looks fast and its partners look slow. So every
timed collective starts right after a barrier, and each rank records the time it spent inside
the collective. The member that arrived last waited for nobody: the shortest time in the group
is the group's transfer time. A rank's lateness is (the longest time in its group) - (its own
time): how long the group waited for it. Both use only durations measured on one host, so no
clocks are compared across nodes.
  - a rank is late when its median lateness exceeds the median rank's by more than
    max(--min-gap-ms, (--factor - 1) x its typical transfer time): it makes collectives
    --factor times slower;
  - a group is slow when its transfer time is over --factor x the median group of its kind;
  - a rank whose TP group and DP group (and PP group) are all slow is the likely bad link;
  - a node is slow when its pairs with both ring neighbours are slow, or all its ranks are late.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import socket
import statistics
import sys
import time
from collections import defaultdict
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configs import ConfigError, check_dir  # noqa: E402  (the repository root, where configs.py and parallel.py live)
import hardware  # noqa: E402
from monitor import quiet_gloo  # noqa: E402
from planner.instances import INSTANCES  # noqa: E402
from parallel import backend_for, launch_env, rank_groups  # noqa: E402

OPS = ("all_reduce", "all_gather")


def group_kinds(world: int, tp: int, pp: int, ranks_per_node: int) -> dict[str, list[list[int]]]:
    """Every group kind to time: the training groups, the world, and node pairs.

    Node pairs: rank j of node a with rank j of node b, for all j at once, so the pair of
    instances moves data over their EFA links at full width. Two rounds, each node paired with
    its ring neighbour on each side; a node whose two pairs are both slow is the bad one.
    Only for an even number of nodes: on XLA every rank must take part in every collective."""
    kinds = {k: v for k, v in rank_groups(world, tp, pp).items() if len(v[0]) > 1}
    kinds["world"] = [list(range(world))]
    n = world // ranks_per_node
    if n >= 2 and n % 2 == 0 and world % ranks_per_node == 0:
        for name, first in (("node_pair_a", 0), ("node_pair_b", 1)):
            if n == 2 and first == 1:
                break                    # two nodes: both rounds are the same pair
            pairs = [((a + first) % n, (a + first + 1) % n) for a in range(0, n, 2)]
            kinds[name] = [[a * ranks_per_node + j, b * ranks_per_node + j]
                           for a, b in pairs for j in range(ranks_per_node)]
    return kinds


# ----------------------------------------------------------------------------- measuring

def resolve(backend: str) -> str:
    """--backend auto: a run's backend (parallel.backend_for) for Trainium's xla device, else CUDA's, else the CPU's
    (never XLA:CPU, which pick_device would take for one process: no collectives between processes)."""
    if backend == "auto":
        return backend_for("xla" if not hardware.xla_on_cpu() else "cuda" if torch.cuda.is_available() else "cpu")
    return backend


def setup(backend: str, timeout_s: float):
    """Init the process group. Returns (backend, device, sync, host_group).

    sync() waits until the device has really finished (XLA is lazy: torch_xla.sync() only
    launches the graph). host_group is a gloo group for barriers and for gathering the
    results: the xla backend's barrier is a no-op."""
    backend = resolve(backend)
    timeout = timedelta(seconds=timeout_s)
    if backend == "xla":          # trn1: NeuronCores, collectives over NeuronLink and EFA
        import torch_xla
        import torch_xla.core.xla_model as xm
        import torch_xla.distributed.xla_backend  # noqa: F401  (registers the "xla" backend)
        dist.init_process_group("xla", init_method="xla://", timeout=timeout)

        def sync():
            torch_xla.sync()
            xm.wait_device_ops()
        return backend, torch_xla.device(), sync, dist.new_group(backend="gloo", timeout=timeout)
    dist.init_process_group(backend, timeout=timeout)
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        return backend, device, torch.cuda.synchronize, dist.new_group(backend="gloo", timeout=timeout)
    return backend, torch.device("cpu"), lambda: None, dist.group.WORLD


def check_args(args) -> None:
    """Every flag and torchrun's environment, before any process group: one line each, not a traceback from
    a division by zero, int('x') or init_process_group (run bare, without torchrun, it has no rendezvous)."""
    least = {"tp": 1, "pp": 1, "reps": 1, "warmup": 0, "ranks_per_node": 0, "min_gap_ms": 0.0}
    bad = [f"--{k.replace('_', '-')} {getattr(args, k)}: give a number >= {v}" for k, v in least.items()
           if not getattr(args, k) >= v]
    bad += [f"--{k.replace('_', '-')} {getattr(args, k)}: give a finite number > {v}" for k, v in
            (("mb", 0), ("timeout_s", 0), ("factor", 1)) if not v < getattr(args, k) < float("inf")]
    if args.inject_delay and not re.fullmatch(r"\d+:\d+(\.\d*)?", args.inject_delay):
        bad.append(f"--inject-delay {args.inject_delay}: give RANK:SECONDS, e.g. 3:0.5")
    if args.json and (os.path.isdir(args.json) or not os.path.isdir(os.path.dirname(os.path.abspath(args.json)))):
        bad.append(f"--json {args.json}: give a file name in an existing directory")
    elif args.json and not os.path.lexists(args.json):      # a folder it can write into (/proc is not), else the report,
        try:                                                # written at the end, fails after every measurement
            check_dir("json", args.json)
        except ConfigError as e:
            bad.append(str(e))
    if not {"WORLD_SIZE", "MASTER_ADDR"} <= set(os.environ):     # (launch_env takes a world of 1 without a rendezvous)
        bad.append("no WORLD_SIZE or MASTER_ADDR: run it under torchrun (scripts/launch.sh health does), which sets "
                   "the rendezvous")
    try:
        world = launch_env()[0]
        per_node = args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if args.tp >= 1 and args.pp >= 1 and (world % (args.tp * args.pp) or world % per_node):
            bad.append(f"world {world} must be a multiple of tp*pp={args.tp * args.pp} and of ranks per node {per_node}")
        if args.inject_delay and not bad and int(args.inject_delay.split(":")[0]) >= world:    # else no rank sleeps
            bad.append(f"--inject-delay {args.inject_delay}: rank {args.inject_delay.split(':')[0]} is not in the "
                       f"world of {world}; give a rank below {world}")
        # As train.py refuses it (hardware.pick_device): each process was a world of its own, timed
        # nothing between them and said "healthy" ("world 1 = 0 node(s) x 2", once per process).
        if args.backend == "xla" and world > 1 and hardware.xla_on_cpu():
            bad.append(f"--backend=xla on XLA:CPU (PJRT_DEVICE={hardware.xla_platform() or 'unset'}) has no "
                       f"collectives between processes: run it on Trainium (PJRT_DEVICE=NEURON), or --backend=gloo")
        backend = resolve(args.backend)
        # Else each rank's traceback at init_process_group (torch-xla: "No module named 'libneuronxla'").
        if backend == "xla" and hardware.xla_platform() == "NEURON" and not importlib.util.find_spec("libneuronxla"):
            bad.append(f"--backend={args.backend}: PJRT_DEVICE=NEURON but this Python has no libneuronxla (the runtime "
                       f"of torch-neuronx): run it in the PyTorch venv of the Neuron DLAMI on Trainium, or give "
                       f"--backend=gloo (launch.sh health: HEALTHCHECK_ARGS=--backend=gloo)")
        if backend == "nccl" and not torch.cuda.is_available():     # else each rank's ValueError traceback
            bad.append("--backend=nccl: no CUDA device is visible here; give --backend=gloo (CPU) or auto")
        elif 0 < args.mb < float("inf"):
            # What a rank holds (measure): the payload, the all-gather's output as large, a chunk of at most half:
            # host memory with gloo, a NeuronCore's (the smallest, trn1's) or a GPU's. Else each rank's traceback.
            local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))        # processes on this host
            have = (min(hw.hbm for hw in INSTANCES.values()) if backend == "xla" else
                    torch.cuda.get_device_properties(0).total_memory if backend == "nccl" else
                    os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // local)
            if 2.5 * args.mb * 2**20 > have:
                bad.append(f"--mb {args.mb:g}: a rank holds {2.5 * args.mb / 2**10:.3g} GiB for it (the payload, the "
                           f"all-gather's output, a chunk) but has {have / 2**30:,.1f} GiB ({backend}); give at most "
                           f"--mb {have / 2.5 / 2**20:,.0f}")
    except ValueError as e:                 # configs.ConfigError
        bad.append(str(e))
    if bad:
        sys.exit(f"healthcheck error: {bad[0]}")


def measure(kinds, backend, device, sync, host_group, nbytes: int, warmup: int, reps: int,
            delay: tuple[int, float] | None) -> list[tuple]:
    """Time every op over every kind; all groups of a kind run at once, as in training.
    Returns records (kind, op, group_index, rep, rank, seconds) of this rank."""
    rank = dist.get_rank()
    records = []
    for kind, groups in kinds.items():
        mine, pg = None, None
        for i, g in enumerate(groups):   # every rank creates every group, in the same order
            opts = {"xla_pg_options": {"mesh": groups}} if backend == "xla" else None
            with quiet_gloo():
                created = dist.new_group(g, pg_options=opts) if opts else dist.new_group(g)
            if rank in g:
                mine, pg = i, created
        n = len(groups[0])
        numel = max(n, nbytes // 4) // n * n
        # zeros: an all-reduce sums in place, and ones grew by the group's size a rep (f32's inf after the 11th
        # at 4096 ranks); the bytes moved, and so the timings, do not depend on the values
        buf = torch.zeros(numel, dtype=torch.float32, device=device)
        out = torch.empty(numel, dtype=torch.float32, device=device)
        chunk = buf[: numel // n].clone()
        for op in OPS:
            for rep in range(-warmup, reps):
                dist.barrier(group=host_group)  # start together; then only lateness differs
                if mine is None:
                    continue
                if delay is not None and delay[0] == rank:
                    time.sleep(delay[1])         # --inject-delay: a late rank, for tests
                t0 = time.perf_counter()
                if op == "all_reduce":
                    dist.all_reduce(buf, group=pg)
                else:
                    dist.all_gather_into_tensor(out, chunk, group=pg)
                sync()
                seconds = time.perf_counter() - t0
                if rep >= 0:
                    records.append((kind, op, mine, rep, rank, seconds))
    return records


# ----------------------------------------------------------------------------- analysis

def _median(xs) -> float:
    return statistics.median(xs) if xs else 0.0


def _reference(xs) -> float:
    """The median, the lower one for an even count: with two groups, one slow group must not
    drag the reference halfway up to itself."""
    return statistics.median_low(xs) if xs else 0.0


def analyze(records, kinds, node_of: list[int], nbytes: int, factor: float, min_gap_s: float) -> dict:
    """Turn everyone's records into bandwidths and verdicts. A pure function of the timings."""
    world = len(node_of)
    times = defaultdict(dict)                    # (kind, op, group, rep) -> {rank: seconds}
    for kind, op, gi, rep, rank, s in records:
        times[(kind, op, gi, rep)][rank] = s
    late = defaultdict(list)                     # rank -> how long its groups waited for it
    typical = defaultdict(list)                  # rank -> transfer times of its groups
    transfer = defaultdict(list)                 # (kind, op, group) -> transfer time per rep
    for (kind, op, gi, _), by_rank in times.items():
        longest, shortest = max(by_rank.values()), min(by_rank.values())
        transfer[(kind, op, gi)].append(shortest)
        for r, s in by_rank.items():
            late[r].append(longest - s)
            typical[r].append(shortest)

    late_med = {r: _median(late[r]) for r in range(world)}
    base = _reference(list(late_med.values()))
    late_ranks = [r for r in range(world)
                  if late_med[r] - base > max(min_gap_s, (factor - 1) * _median(typical[r]))]

    groups, slow = [], set()
    for kind, gs in kinds.items():
        n = len(gs[0])
        for op in OPS:
            t = {gi: _median(transfer[(kind, op, gi)]) for gi in range(len(gs)) if (kind, op, gi) in transfer}
            med = _reference(list(t.values()))
            for gi, s in t.items():
                # bus bandwidth (nccl-tests convention): bytes each link carries per second
                moved = (2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n) * (nbytes // 4 * 4)
                is_slow = len(t) > 1 and s > factor * med and s - med > min_gap_s
                groups.append({"kind": kind, "op": op, "group": gi, "ranks": gs[gi], "ms": 1e3 * s,
                               "busbw_gbps": moved / max(s, 1e-12) / 1e9, "slow": is_slow})
                if is_slow:
                    slow.add((kind, gi))

    # A bad link or device slows every group its rank is in: intersect the training kinds.
    rank_kinds = [k for k in ("tp", "dp", "pp") if k in kinds and len(kinds[k]) > 1]
    suspects = []
    if len(rank_kinds) >= 2:
        for r in range(world):
            if all(any((k, gi) in slow for gi, g in enumerate(kinds[k]) if r in g) for k in rank_kinds):
                suspects.append(r)

    # Node pairs: count, for each neighbour of a node, how many of their groups are slow.
    votes = defaultdict(lambda: defaultdict(list))    # node -> neighbour -> [slow?]
    for k in ("node_pair_a", "node_pair_b"):
        for gi, g in enumerate(kinds.get(k, [])):
            a, b = node_of[g[0]], node_of[g[1]]
            votes[a][b].append((k, gi) in slow)
            votes[b][a].append((k, gi) in slow)
    nodes = sorted(set(node_of))
    slow_nodes = []
    for nd in nodes:
        neighbours = votes[nd]
        pairs_slow = len(neighbours) >= 2 and all(2 * sum(v) > len(v) for v in neighbours.values())
        all_late = len(nodes) > 1 and all(r in late_ranks for r in range(world) if node_of[r] == nd)
        if pairs_slow or all_late:
            slow_nodes.append(nd)

    return {"late_ms": [1e3 * late_med[r] for r in range(world)], "late_ranks": late_ranks,
            "groups": groups, "slow_groups": sorted(slow), "suspect_ranks": suspects,
            "slow_nodes": slow_nodes,
            "healthy": not (late_ranks or slow or suspects or slow_nodes)}


def report_text(rep: dict, hosts: list[str], node_of: list[int], factor: float) -> str:
    lines = [f"{'kind':<12} {'op':<11} {'groups':>6} {'size':>5} {'median ms':>10} "
             f"{'median busbw GB/s':>18} {'min busbw':>10}"]
    by = defaultdict(list)
    for g in rep["groups"]:
        by[(g["kind"], g["op"])].append(g)
    for (kind, op), gs in by.items():
        bw = [g["busbw_gbps"] for g in gs]
        lines.append(f"{kind:<12} {op:<11} {len(gs):>6} {len(gs[0]['ranks']):>5} "
                     f"{_median([g['ms'] for g in gs]):>10.3f} {_median(bw):>18.3f} {min(bw):>10.3f}")
    where = lambda r: f"rank {r} (node {node_of[r]}, {hosts[r]})"  # noqa: E731
    med_late = _median(rep["late_ms"])
    for r in rep["late_ranks"]:
        lines.append(f"SLOW: {where(r)} is late: its groups waited {rep['late_ms'][r]:.1f} ms for it "
                     f"per collective (median rank: {med_late:.1f} ms)")
    for g in rep["groups"]:
        if g["slow"]:
            lines.append(f"SLOW: {g['kind']} group {g['ranks']} {g['op']}: {g['ms']:.2f} ms, "
                         f"{g['busbw_gbps']:.3f} GB/s (over {factor}x the median group)")
    for r in rep["suspect_ranks"]:
        lines.append(f"SLOW: {where(r)}: every group it belongs to is slow (likely its link or device)")
    for nd in rep["slow_nodes"]:
        lines.append(f"SLOW: node {nd} ({hosts[node_of.index(nd)]})")
    lines.append("healthy" if rep["healthy"] else "UNHEALTHY: fix or exclude the named ranks/nodes before training")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel degree of the run (default: %(default)s)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline parallel degree of the run (default: %(default)s)")
    ap.add_argument("--mb", type=float, default=64.0, help="payload per collective, MB (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=2,
                    help="untimed repetitions (XLA compiles here) (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=10, help="timed repetitions per op and kind (default: %(default)s)")
    ap.add_argument("--factor", type=float, default=2.0,
                    help="named when this many times the median (default: %(default)s)")
    ap.add_argument("--min-gap-ms", type=float, default=1.0,
                    help="and at least this much slower (default: %(default)s)")
    ap.add_argument("--backend", default="auto", choices=("auto", "xla", "nccl", "gloo"),
                    help="auto: xla on Trainium, else nccl on a GPU, else gloo (default: %(default)s)")
    ap.add_argument("--ranks-per-node", type=int, default=0,
                    help="0 = LOCAL_WORLD_SIZE (torchrun places ranks in blocks per node) (default: %(default)s)")
    ap.add_argument("--json", default="", help="also write the full report here (rank 0)")
    ap.add_argument("--warn-only", action="store_true", help="exit 0 even when something is slow")
    ap.add_argument("--timeout-s", type=float, default=300.0,
                    help="a dead rank fails the check after this many seconds (default: %(default)s)")
    ap.add_argument("--inject-delay", default="", metavar="RANK:SECONDS",
                    help="testing only: this rank sleeps before each collective")
    args = ap.parse_args(argv)
    check_args(args)

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    with quiet_gloo():          # not gloo's lines for each group on each rank (as train.py)
        backend, device, sync, host_group = setup(args.backend, args.timeout_s)
    world, rank = dist.get_world_size(), dist.get_rank()
    per_node = args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))     # (check_args checked both)
    delay = None
    if args.inject_delay:
        r, s = args.inject_delay.split(":")
        delay = (int(r), float(s))
    nbytes = int(args.mb * 2**20)
    kinds = group_kinds(world, args.tp, args.pp, per_node)
    records = measure(kinds, backend, device, sync, host_group, nbytes, args.warmup, args.reps, delay)

    # Rank 0 gathers everyone's records and judges; the others get its verdict, so all exit alike.
    # At 4096 ranks a rank sends ~120 records (~3 KB pickled); rank 0 alone receives ~12 MB and
    # analyzes them (an all-gather gave that, and the analysis, to each of 4096 ranks: 0.4 GB a node).
    gathered = [None] * world if rank == 0 else None
    dist.gather_object((socket.gethostname(), records), gathered, dst=0, group=host_group)
    healthy = torch.zeros(1, dtype=torch.int32)            # the host group is gloo: a CPU tensor
    if rank == 0:
        hosts = [h for h, _ in gathered]
        all_records = [rec for _, recs in gathered for rec in recs]
        node_of = [r // per_node for r in range(world)]
        rep = analyze(all_records, kinds, node_of, nbytes, args.factor, args.min_gap_ms / 1e3)
        healthy[0] = int(rep["healthy"])
        print(f"healthcheck: {backend}, world {world} = {world // per_node} node(s) x {per_node}, "
              f"tp={args.tp} pp={args.pp}, {args.mb:g} MB per collective, {args.reps} reps")
        print(report_text(rep, hosts, node_of, args.factor), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world": world, "ranks_per_node": per_node, "hosts": hosts,
                           "backend": backend, "tp": args.tp, "pp": args.pp, **rep}, f, indent=1)
    dist.broadcast(healthy, src=0, group=host_group)
    dist.destroy_process_group()
    return 0 if healthy.item() or args.warn_only else 1


if __name__ == "__main__":
    sys.exit(main())
