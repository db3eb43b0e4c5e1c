"""Reading a checkpoint back, at the layout that saved it or at any other TP / PP / DP / ZeRO-1
layout: what Checkpointer.load_latest returns, and the full weights `checkpoint.py export` writes.

At the same layout each rank reads only its own files. At another TP degree, every TP shard of a
stage is joined and re-split (sharding.join / cut), the model's and the optimizer moments';
ZeRO-1 flat shards record their index, so they are cut back into per-parameter tensors
(SavedOptim), each read when the optimizer asks for it. What DP replicas share is read by ONE of
them, its writer (which checksummed it just before), and broadcast over the DP group: at 7B on 128
trn1 nodes (TP=8, DP=512), 16 readers of the shared file system, not 4096.
"""
from __future__ import annotations

import functools
import os
import pickle
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ckptdir import CheckpointError
from ckptsave import map_tree
from configs import ModelConfig
import parallel
import sharding
from parallel import Grid


def tag(tp_rank: int, pp_rank: int) -> str:
    """The (tp, pp) position in a file's name: model_<tag>.pt, optim_<tag>.pt."""
    return f"tp{tp_rank:02d}_pp{pp_rank:02d}"


def optim_name(dp_rank: int, tag: str, zero1: bool) -> str:
    """The optimizer file of (dp_rank, tag): one per DP rank with ZeRO-1, else one per (tp, pp)."""
    return f"optim_dp{dp_rank:03d}_{tag}.pt" if zero1 else f"optim_{tag}.pt"


def load_file(path: Path, mmap: bool = False, weights_only: bool = True):
    """Every read of a checkpoint file (tests count them): onto the host. The optimizer's and the rank
    files' state holds Python objects (weights_only=False): our own checksummed files."""
    return torch.load(path, map_location="cpu", mmap=mmap, weights_only=weights_only)


# ----------------------------------------------------------------------------- what a load returns

@dataclass
class Loaded:
    step: int
    path: Path
    meta: dict                 # {"step", "layout", "config", "extra", ...} as saved
    model: dict                # this rank's model state dict, resharded to this run's layout if needed
    optim: dict | None         # this rank's optimizer state, idem (None if load_optim=False or none saved)
    data: object               # this rank's data-loader state, or at another DP degree every saved DP
                               # rank's (a LazyList: each read when indexed), as PackedLoader takes it
    rng: dict | None           # this rank's RNG streams (None at another layout: not comparable)

    @property
    def extra(self) -> dict:
        return self.meta["extra"]


class LazyList(Sequence):
    """n items, each read by read(i) when first indexed."""

    def __init__(self, n: int, read):
        self.n, self.read = n, functools.cache(read)

    def __len__(self):
        return self.n

    def __getitem__(self, i: int):
        if not -self.n <= i < self.n:
            raise IndexError(i)
        return self.read(i % self.n)


# ----------------------------------------------------------------------------- reading at any layout

def read(d: Path, meta: dict, g: Grid, now: dict, m: ModelConfig, load_optim: bool,
         names=None, say=print, device=None, positions: bool = True) -> Loaded:
    """This rank's part of the verified checkpoint d (meta: its meta.json) at layout `now`. On every
    rank alike: the shared parts are broadcast over the DP group on `device`. Host tensors.
    positions=False (--ckpt.reset_data): the data stream starts afresh, its saved positions unused."""
    saved = meta["layout"]
    load = lambda name: load_file(d / name, mmap=True)
    shared = dp_shared(g)
    readers = [writer_dp_rank(kind, g, now["zero1"]) for kind in (0, 1)]     # model, replicated optimizer
    reads = [not shared or g.dp_rank == r for r in readers]
    # The model: this rank's own file at the same TP degree (mmap: only what is copied is read);
    # at another TP degree, every TP shard of the stage, joined and re-split. After a change of
    # PP degree or split every saved stage is looked at (mmap: only the names this rank has are read).
    stages = [g.pp_rank] if same_stages(saved, now) else range(saved["pp"])
    model = {}
    for p in stages if reads[0] else ():
        if saved["tp"] == now["tp"]:
            model.update(load(f"model_{tag(g.tp_rank, p)}.pt"))
        else:
            model.update(reshard([load(f"model_{tag(t, p)}.pt") for t in range(saved["tp"])],
                                 m, g.tp, g.tp_rank, keep=names))
    if names is not None and not same_stages(saved, now):
        model = {k: v for k, v in model.items() if k in names}
    if shared:
        model = broadcast_state(model if reads[0] else None, g, readers[0], device)
    optim = None
    if load_optim and (d / optim_name(0, tag(0, 0), saved["zero1"])).exists():   # was one saved?
        if now["zero1"]:                       # this rank's own shard: read by its owner only
            optim = _read_optim(d, saved, now, g, m)
        else:                                  # the same on every replica: one reads, all receive
            optim = _read_optim(d, saved, now, g, m) if reads[1] else None
            if shared:
                optim = broadcast_state(optim, g, readers[1], device)
    rank_file = lambda r: load_file(d / f"rank{r:05d}.pt", weights_only=False)
    rng, data = None, None
    if saved == now:
        mine = rank_file(g.rank)
        rng, data = mine["rng"], mine["data"]
    elif saved["dp"] == now["dp"]:
        data = rank_file(g.dp_rank * saved["tp"])["data"]      # the rank at (pp 0, this dp, tp 0)
    else:
        # Read on first use: a data loader takes only the saved ranks owning its streams (one or
        # two at any scale), not all DP ranks' files on every rank.
        data = LazyList(saved["dp"], lambda r: rank_file(r * saved["tp"])["data"])
    data = data if positions else None
    if saved != now:
        say(f"{d.name} was saved at layout {saved}, this run is {now}: model"
            f"{' and optimizer' if optim is not None else ''} resharded; RNG streams start from the seed"
            + ("; data loaders take the saved positions of their streams" if isinstance(data, LazyList) else ""))
    return Loaded(meta["step"], d, meta, model, optim, data, rng)


def same_stages(saved: dict, now: dict) -> bool:
    """Each stage holds the layers it held when saved: the same PP degree and split (layout["stages"], absent
    without PP and in PP checkpoints from before it was saved: those are read as another split, from every stage)."""
    return saved["pp"] == now["pp"] and saved.get("stages") == now.get("stages")


def _read_optim(d: Path, saved: dict, now: dict, g: Grid, m: ModelConfig) -> dict:
    load = lambda name: load_file(d / name, weights_only=False)
    same = (same_stages(saved, now) and all(saved[k] == now[k] for k in ("tp", "zero1"))
            and (not now["zero1"] or saved["dp"] == now["dp"]))
    if same:
        return load(optim_name(g.dp_rank, tag(g.tp_rank, g.pp_rank), now["zero1"]))
    # Any other layout: the state is rebuilt per parameter ("<name>.<moment>", shaped as the
    # parameter is on this TP rank), each tensor when the optimizer asks for it. A ZeRO-1 rank
    # asks only for the parameters of its shard, and a saved ZeRO-1 tensor is cut from the one
    # or two saved shards holding it (memory-mapped): at 4096 ranks a rank still reads about
    # its own share, times saved_tp / tp when the TP degree changes.
    stages = [g.pp_rank] if same_stages(saved, now) else range(saved["pp"])
    tps = [g.tp_rank] if saved["tp"] == now["tp"] else range(saved["tp"])
    src = {(t, p): SavedOptim(d, tag(t, p), saved, d.name) for p in stages for t in tps}
    stage = {k: p for (t, p), s in src.items() if t == tps[0] for k in s.index}
    # A tied matrix is saved without PP once, as embed.weight; a last stage's copy of it
    # (pipeline.py: the same gradients, rounded alike) has the embedding's moments.
    alias = {"lm_head" + k[len("embed"):]: k for k in stage if m.tie_embeddings and k.startswith("embed.weight.")
             and "lm_head" + k[len("embed"):] not in stage}
    stage.update({k: stage[v] for k, v in alias.items()})

    def get(key: str) -> torch.Tensor:
        key = alias.get(key, key)
        pieces, name = [src[t, stage[key]][key] for t in tps], key.rsplit(".", 1)[0]
        if saved["tp"] == now["tp"]:
            return pieces[0]
        return sharding.cut(name, sharding.join(name, pieces, m), m, g.tp, g.tp_rank)
    head = src[tps[0], stages[0]].head
    return {**{k: head[k] for k in ("precision", "step", "sr_seed", "lr")}, "layout": {"kind": "full"},
            "state": LazyMap(stage, get)}


# ----------------------------------------------------------------------------- one read, broadcast over DP

BUCKET_BYTES = 64 << 20      # tensors travel packed into buckets of this size (a larger tensor: alone)
HEAD_BYTES = 64 << 10        # the pickled structure travels padded to a multiple of this: one graph shape at any step


def dp_shared(g: Grid) -> bool:
    """Whether what DP replicas hold alike is read by one of them and broadcast (read), as rehearse traces it."""
    return g.dp > 1 and g.dp_group is not None and dist.is_initialized()


def rehearse(model: dict, optim: dict, g: Grid, zero1: bool, device) -> None:
    """The pre-compile pass's stand-in for read()'s broadcasts at DP > 1 (no checkpoint is read there): the model's and
    the replicated optimizer state's, from the same readers, of this run's own state dicts. The buckets and the padded
    head then have a resume's shapes at this layout, so that on Trainium its graphs are compiled before the run."""
    if not dp_shared(g):
        return
    readers = [writer_dp_rank(kind, g, zero1) for kind in (0, 1)]
    broadcast_state(model if g.dp_rank == readers[0] else None, g, readers[0], device)
    if not zero1:
        broadcast_state(optim if g.dp_rank == readers[1] else None, g, readers[1], device)


def writer_dp_rank(kind: int, g: Grid, zero1: bool) -> int:
    """The DP replica that writes file `kind` (0: model, 1: optimizer without ZeRO-1) of g's (tp, pp)
    position and reads it back: file k of the n = kinds x TP x PP goes to replica k * DP // n, evenly
    over the nodes, each rank deciding alone. The writer verifies its crc32 at resume, so the load
    reads it from that node's page cache: the shared file system serves each byte once."""
    kinds = 1 if zero1 else 2
    n = kinds * g.tp * g.pp
    k = kind * g.tp * g.pp + g.pp_rank * g.tp + g.tp_rank
    return k * g.dp // n


def broadcast_state(obj, g: Grid, reader: int, device=None):
    """obj (a state dict) as the DP group's reader (DP rank) holds it, on every rank of the group (obj: None
    elsewhere). The pickled structure, then the tensors' bytes in buckets of BUCKET_BYTES (one XLA graph
    for all full ones), each through _broadcast. Cost per rank: about four times the state's bytes
    (two bytes a float32, a ring all-reduce), whatever the DP degree."""
    device = torch.device(device or "cpu")
    src = g.pp_rank * g.tp * g.dp + reader * g.tp + g.tp_rank      # its global rank
    mine = g.rank == src
    tensors, buckets = [], []

    def strip(o):
        if not isinstance(o, torch.Tensor):
            return o
        t = o.detach().contiguous().cpu()
        n = t.numel() * t.element_size()
        if not buckets or (buckets[-1] and buckets[-1] + n > BUCKET_BYTES):
            buckets.append(0)
        off = buckets[-1]
        buckets[-1] = off + (n + 15) // 16 * 16
        tensors.append((t, len(buckets) - 1, off, n))
        return _TensorRef(t.dtype, tuple(t.shape), len(buckets) - 1, off)

    head = pickle.dumps((map_tree(obj, lambda x, _: strip(x)), buckets)) if mine else b""
    head = _broadcast_bytes(head, src, g, device)
    skeleton, buckets = pickle.loads(head)
    data = []
    for i, size in enumerate(buckets):
        raw = torch.zeros(size, dtype=torch.uint8)
        for t, b, off, n in tensors if mine else ():
            if b == i:
                raw[off:off + n].copy_(t.reshape(-1).view(torch.uint8))
        data.append(_broadcast(raw, src, g, device))

    def build(o):
        if not isinstance(o, _TensorRef):
            return o
        n = int(np.prod(o.shape, dtype=np.int64)) * torch.empty((), dtype=o.dtype).element_size()
        return data[o.bucket][o.offset:o.offset + n].view(o.dtype).view(o.shape)
    return map_tree(skeleton, lambda x, _: build(x))


@dataclass(frozen=True)
class _TensorRef:
    dtype: torch.dtype
    shape: tuple
    bucket: int
    offset: int


def _broadcast(raw: torch.Tensor, src: int, g: Grid, device: torch.device) -> torch.Tensor:
    """raw (host bytes, an even count) from global rank src to g's DP group, back on the host, 16 bits a float32:
    Neuron's collective engine adds in f32 whatever the dtype (no integer datapath: neuronx-cc 2.32's notes, error
    NCC_EVRF061 after), so int32 words above 2^24 came back rounded. An integer below 2^16 plus the other ranks'
    zeros is exact in f32, and never the NaN, -0 or subnormal that bytes viewed as f32 can be. Through
    parallel.broadcast (an all-reduce: xla's own broadcast is wrong on sub-groups)."""
    x = parallel.broadcast(raw.view(torch.int16).float().to(device), src, g.dp_group)
    return x.cpu().to(torch.int16).view(torch.uint8)


def _broadcast_bytes(b: bytes, src: int, g: Grid, device: torch.device) -> bytes:
    n = int(_broadcast(torch.tensor([len(b)]).view(torch.uint8), src, g, device).view(torch.int64))
    raw = torch.zeros(-(-n // HEAD_BYTES) * HEAD_BYTES, dtype=torch.uint8)    # (the step's int varies its length)
    if b:
        raw[:n].copy_(torch.frombuffer(bytearray(b), dtype=torch.uint8))
    return _broadcast(raw, src, g, device)[:n].numpy().tobytes()


class LazyMap(Mapping):
    """The keys of `keys`, each value computed by get(key) when it is read."""

    def __init__(self, keys, get):
        self.keys_, self.get_ = keys, get

    def __getitem__(self, key):
        if key not in self.keys_:
            raise KeyError(key)
        return self.get_(key)

    def __iter__(self):
        return iter(self.keys_)

    def __len__(self):
        return len(self.keys_)


class SavedOptim(Mapping):
    """The optimizer state one (TP rank, stage) saved, "<name>.<moment>" -> tensor shaped like the
    parameter. ZeRO-1: cut from the DP shards, laid end to end in the order of layout["params"],
    each opened (memory-mapped) only when a tensor lies on it."""

    def __init__(self, d: Path, tag: str, saved: dict, where: str):
        self.load = lambda n: load_file(d / n, mmap=True, weights_only=False)
        self.shards, self.tag = {}, tag
        self.head = self.load(optim_name(0, tag, saved["zero1"]))
        lay = self.head.get("layout") if isinstance(self.head, dict) else None
        if not isinstance(lay, dict) or lay.get("kind") not in ("full", "zero1") or (
                lay["kind"] == "zero1" and "params" not in lay):
            raise CheckpointError(f"{where}: the optimizer state was saved in a form that cannot be resharded "
                                  f"(not nanotrn's, or ZeRO-1 shards saved before they recorded their index). "
                                  f"Resume at the saved layout {saved}, or load only the model weights with a "
                                  f"fresh optimizer: Checkpointer.load_latest(load_optim=False)")
        if lay["kind"] == "full":
            self.index = {k: None for k in self.head["state"]}
            return
        self.shards[0], self.size, self.index, off = self.head, -(-lay["numel"] // lay["dp"]), {}, 0
        for name, shape in lay["params"]:
            n = int(np.prod(shape))
            self.index.update({f"{name}.{k}": (k, off, n, shape) for k in self.head["state"]})
            off += n

    def __getitem__(self, key: str) -> torch.Tensor:
        if self.index[key] is None:
            return self.head["state"][key]
        k, off, n, shape = self.index[key]
        S, parts = self.size, []
        for r in range(off // S, (off + n - 1) // S + 1):
            if r not in self.shards:
                self.shards[r] = self.load(optim_name(r, self.tag, True))
            parts.append(self.shards[r]["state"][k][max(off, r * S) - r * S:min(off + n, (r + 1) * S) - r * S])
        return torch.cat(parts).view(shape)

    def __iter__(self):
        return iter(self.index)

    def __len__(self):
        return len(self.index)


def reshard(shards: list[dict], m: ModelConfig, tp: int, tp_rank: int, keep=None) -> dict:
    """TP rank tp_rank's state out of tp, from every TP rank's of another degree (in rank order):
    each tensor joined and re-split as its parameter is (tp=1: full). keep: only these keys."""
    out = {}
    for key in (k for k in shards[0] if keep is None or k in keep):
        full = sharding.join(key, [s[key] for s in shards], m)
        out[key] = sharding.cut(key, full, m, tp, tp_rank).clone()
    return out


def full_model_state(path: str | Path, m: ModelConfig, masters: bool = False) -> dict:
    """The full weights of the checkpoint folder `path`, in one process, whatever layout wrote it. masters (the
    export's): a mixed run's fp32 master copies from its optimizer state, of which the saved bf16 weights are the
    rounding (as train.py's end-of-run export; DeepSpeed's zero_to_fp32.py too reads a bf16 run's weights from the
    optimizer's fp32 copies). Reads 4 bytes a parameter instead of 2, memory-mapped, one tensor at a time."""
    path = Path(path)
    names = sorted(n for n in os.listdir(path) if re.fullmatch(r"model_tp\d+_pp\d+\.pt", n))
    stages: dict[str, list] = {}
    for n in names:
        model = load_file(path / n, mmap=True)
        stages.setdefault(n[-7:], []).append(_masters(path, n[6:-3], model, m) if masters else model)
    full = {}
    for shards in stages.values():
        full.update(reshard(shards, m, 1, 0))
    return full


def _masters(d: Path, tag: str, model: dict, m: ModelConfig) -> dict:
    """model (one (TP rank, stage) file's weights) with each tensor replaced by its fp32 master where the optimizer
    state saved beside it is a mixed run's; unchanged otherwise (or saved without the optimizer)."""
    zero1 = (d / optim_name(0, tag, True)).exists()
    if not zero1 and not (d / optim_name(0, tag, False)).exists():
        return model
    saved = SavedOptim(d, tag, {"zero1": zero1}, d.name)
    if saved.head["precision"] != "mixed":
        return model
    # a matrix tied without PP is one parameter, named embed.weight in the optimizer (a last stage's copy: its own)
    key = lambda k: "embed.weight" if m.tie_embeddings and f"{k}.master" not in saved.index else k
    return {k: saved[f"{key(k)}.master"] for k in model}
