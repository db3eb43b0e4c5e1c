"""The xla backend's rules, executable on CPU: what torch-xla's ProcessGroupXla (torch-xla 2.9,
torch_xla/distributed/xla_backend.py) and XLA's HLO verifier accept, checked on every
torch.distributed call a gloo test makes.

gloo accepts anything; the xla backend does not. A distributed test that calls install() in its
worker runs on gloo as before, but:
  - the project's process groups are created in their XLA form: parallel.group_options is made to
    return the mesh it returns on xla ({"xla_pg_options": {"mesh": [...]}}), which is recorded
    here and stripped before gloo sees it;
  - every group's mesh must pass the verifier's rule (CheckReplicaGroups): the groups of one
    collective name every rank of the world exactly once, in groups of equal size. A sub-group
    created without a mesh gets [ranks] on xla (new_xla_process_group), which fails it;
  - broadcast on a sub-group fails: ProcessGroupXla hands the group-local src (torch 2.9's
    opts.rootRank) to xm.collective_broadcast, which compares it with the GLOBAL ordinal (pytorch/xla
    PR #9657, open): a group whose local src is not that global rank gets zeros or another rank's
    tensor, silently. parallel.broadcast is the form that works there;
  - operations the xla backend cannot do fail at once with XlaRuleError: send, recv, isend, irecv,
    batch_isend_irecv (group-local peers taken for global ranks, a sync per op); all_to_all,
    gather, scatter and reduce on a sub-group (all_to_all ignores the mesh, the others run over
    the whole world); all_reduce with an op it has no lowering for (AVG, BXOR, PREMUL_SUM); barrier
    (a no-op on xla: a barrier must use a gloo group); *_object collectives and coalesced ones;
  - an all-reduce or reduce-scatter of integers fails: Neuron's collective engine adds in f32 whatever the
    operand's dtype (no integer datapath): an int32 word above 2^24 comes back rounded (neuronx-cc's 2.32
    release notes: "unsupported ops downcast with a warning", its next default the error NCC_EVRF061);
  - an int64 operand of any collective with a value beyond int32 fails: neuronx-cc runs int64 as int32 on
    trn1 (always) and trn2 (unless --native-int64), so a gathered or broadcast int64 comes back wrapped.
Groups created with backend="gloo" (the host group train.py adds on xla, given to its grid here as
there) are gloo on Trainium too and are not checked. Every checked collective is logged (op, mesh), so a test can list what a
layout issues on xla. Checks run before the real call, on every rank alike, so a violation raises
on all ranks instead of hanging one.
"""
from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist

import parallel


class XlaRuleError(RuntimeError):
    pass


ALLOWED_REDUCE_OPS = {dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX,
                      dist.ReduceOp.BAND, dist.ReduceOp.BOR}      # ProcessGroupXla._get_reduce_type
CHECKED = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
           "broadcast")
NEVER = ("send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier", "all_gather_object",
         "broadcast_object_list", "gather_object", "scatter_object_list", "all_reduce_coalesced")
NOT_ON_SUBGROUPS = ("all_to_all", "all_to_all_single", "gather", "scatter", "reduce")
REDUCING = ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "broadcast")    # xm.collective_broadcast: an all-reduce


def mesh_error(mesh, world: int) -> str | None:
    """The verifier's rule for one collective's replica groups, or None when they pass it."""
    flat = sorted(r for g in mesh for r in g)
    if flat != list(range(world)):
        missing, twice = sorted(set(range(world)) - set(flat)), sorted({r for r in flat if flat.count(r) > 1})
        return f"mesh {mesh} must name each of the {world} ranks once (missing {missing}, repeated {twice})"
    if len({len(g) for g in mesh}) != 1:
        return f"mesh {mesh} has groups of different sizes"
    return None


class Rules:
    def __init__(self):
        self.meshes: dict[int, list[list[int]] | None] = {}   # id(group) -> its mesh; None: a gloo host group
        self.groups: list = []                               # keeps the groups alive (stable ids)
        self.log: list[tuple[str, tuple]] = []               # (op, mesh) of every checked collective
        self.suspended = 0

    def mesh_of(self, group) -> list[list[int]] | None:
        world = dist.get_world_size()
        if group is None or group is dist.group.WORLD:
            return [list(range(world))]
        if id(group) not in self.meshes:
            raise XlaRuleError(f"a collective on a group this test did not create through dist.new_group: {group}")
        return self.meshes[id(group)]

    def check(self, op: str, group, reduce_op=None, tensor=None):
        if self.suspended:
            return
        mesh = self.mesh_of(group)
        if mesh is None:                                     # a gloo group: gloo on Trainium too
            return
        sub = len(mesh) > 1
        if op in NEVER:
            raise XlaRuleError(f"dist.{op} cannot run on the xla backend (torch-xla 2.9): "
                               f"{'send/recv take group-local peers as global ranks and sync per op; use the all-gather pairs (pipeline.py)' if 'send' in op or 'recv' in op else 'not supported there'}")
        if op in NOT_ON_SUBGROUPS and sub:
            raise XlaRuleError(f"dist.{op} on a sub-group: the xla backend runs it over the whole world")
        if op == "broadcast" and len(mesh[0]) < dist.get_world_size():
            raise XlaRuleError("dist.broadcast on a sub-group: the xla backend takes the group-local src for a "
                               "global ordinal (pytorch/xla#9657), other groups get zeros; use parallel.broadcast")
        if reduce_op is not None and reduce_op not in ALLOWED_REDUCE_OPS:
            raise XlaRuleError(f"dist.{op} with {reduce_op}: the xla backend has no such reduction")
        if op in REDUCING and tensor is not None and not tensor.is_floating_point():
            raise XlaRuleError(f"dist.{op} of {tensor.dtype}: Neuron adds in f32 (no integer datapath), values "
                               f"above 2^24 come back rounded; reduce floats (NCC_EVRF061)")
        if (tensor is not None and tensor.dtype == torch.int64 and tensor.numel()
                and not -2**31 <= int(tensor.min()) <= int(tensor.max()) < 2**31):
            raise XlaRuleError(f"dist.{op} of int64 values beyond int32: neuronx-cc runs int64 as int32 (trn1 always, "
                               f"trn2 unless --native-int64: aws-neuron-sdk data-types), they come back wrapped")
        self.log.append((op, tuple(tuple(g) for g in mesh)))

    def new_group(self, original, ranks=None, timeout=None, backend=None, pg_options=None, **kw):
        mesh = None
        if isinstance(pg_options, dict):
            mesh = pg_options.get("xla_pg_options", {}).get("mesh")
            pg_options = None
        kwargs = dict(kw, backend=backend, pg_options=pg_options)
        if timeout is not None:
            kwargs["timeout"] = timeout
        group = original(ranks, **kwargs)
        self.groups.append(group)
        if backend == "gloo":
            self.meshes[id(group)] = None
            return group
        world = dist.get_world_size()
        ranks = sorted(ranks) if ranks is not None else list(range(world))
        # What new_xla_process_group records when no mesh is given.
        if mesh is None:
            mesh = [ranks] if 1 < len(ranks) < world else ([list(range(world))] if len(ranks) == world
                                                           else [[r] for r in range(world)])
        if not self.suspended:
            err = mesh_error(mesh, world)
            if err:
                raise XlaRuleError(f"group {ranks}: {err} (XLA's replica-group verifier rejects it)")
            if ranks not in [sorted(g) for g in mesh]:
                raise XlaRuleError(f"group {ranks} is not one of the groups of its mesh {mesh}")
        self.meshes[id(group)] = mesh
        return group


RULES: Rules | None = None


def install() -> Rules:
    """Enforce the rules in this process (a spawned gloo worker) from now on; idempotent."""
    global RULES
    if RULES is not None:
        return RULES
    rules = RULES = Rules()
    parallel.group_options = lambda backend, mesh: {"xla_pg_options": {"mesh": mesh}}   # the XLA form
    init = parallel.init_distributed

    def as_on_xla(cfg, device):      # train.py's grid: the host's agreements and barriers over gloo, as on XLA
        grid = init(cfg, device)
        grid.host_group = parallel.new_host_group()
        return grid
    parallel.init_distributed = as_on_xla

    def wrap(name):
        original = getattr(dist, name)
        if name == "new_group":
            return lambda *a, **k: rules.new_group(original, *a, **k)

        sig = inspect.signature(original)

        def checked(*args, **kwargs):
            bound = sig.bind(*args, **kwargs).arguments
            group = bound.get("group")
            if name == "batch_isend_irecv":
                group = bound["p2p_op_list"][0].group if bound["p2p_op_list"] else None
            op = bound.get("op") if name in ("all_reduce", "reduce_scatter", "reduce_scatter_tensor") else None
            operand = next((bound[k] for k in ("tensor", "input", "input_tensor", "output") if k in bound), None)
            rules.check(name, group, op, operand)
            return original(*args, **kwargs)
        return checked

    for name in ("new_group",) + CHECKED + NEVER + NOT_ON_SUBGROUPS:
        wrapped = wrap(name)
        setattr(dist, name, wrapped)
        if name in ("isend", "irecv"):        # P2POp accepts only the functions of distributed_c10d
            setattr(dist.distributed_c10d, name, wrapped)
    return rules


@contextlib.contextmanager
def suspended():
    """Run gloo-only code (a layout that uses send/recv on purpose) unchecked."""
    RULES.suspended += 1
    try:
        yield
    finally:
        RULES.suspended -= 1


@contextlib.contextmanager
def recording(name: str, grid, out_dir: str):
    """Write the collectives this rank issues in the block, as {"op over kind": count}, to
    out_dir/name.xla_ops.rank{rank}.json (the layout tests' list of what runs on xla)."""
    import json
    import os
    start = len(RULES.log)
    yield
    names = mesh_names(grid.world, grid.tp, grid.pp)
    with open(os.path.join(out_dir, f"{name}.xla_ops.rank{grid.rank}.json"), "w") as f:
        json.dump(summary(RULES.log[start:], names), f, indent=1, sort_keys=True)


def summary(log, names: dict[tuple, str]) -> dict[str, int]:
    """{"op over kind": count} from a log, kinds named by names (mesh -> name)."""
    out: dict[str, int] = {}
    for op, mesh in log:
        key = f"{op} over {names.get(mesh, f'{len(mesh)} groups of {len(mesh[0])}')}"
        out[key] = out.get(key, 0) + 1
    return out


def mesh_names(world: int, tp: int, pp: int) -> dict[tuple, str]:
    """mesh -> kind, for the project's group kinds and the pipeline's pair meshes."""
    import pipeline
    names = {(tuple(range(world)),): "world"}
    for kv in [k for k in range(2, tp) if tp % k == 0]:
        names[tuple(tuple(g) for g in parallel.rank_groups(world, tp, pp, kv)["kv"])] = "kv"
    for kind, lists in parallel.rank_groups(world, tp, pp).items():
        names[tuple(tuple(g) for g in lists)] = kind
    if pp > 1:
        for parity, mesh in enumerate(pipeline.pair_meshes(world, tp, pp)):
            names[tuple(tuple(g) for g in mesh)] = f"pp pairs (mesh {parity})"
    return names
