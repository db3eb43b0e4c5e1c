"""Reading a checkpoint back, at the layout that saved it or at any other TP / PP / DP / ZeRO-1
layout: what checkpoint.Checkpointer.load_latest returns once it has found the newest complete,
valid checkpoint, and the full weights `python checkpoint.py export` writes out. checkpoint.py
writes the files (its docstring draws them on disk); this module only reads them.

At the same layout each rank reads back only its own files. At another TP degree, all TP shards
of a stage are read and re-split with parallel.unshard_tensors / shard_tensor, for the model and
for the optimizer moments (which, without ZeRO-1, have their parameters' layout). ZeRO-1 flat
shards record their index (parameter names and shapes), so they are cut back into per-parameter
tensors (SavedOptim), each read when the optimizer asks for it (LazyMap).
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from configs import ModelConfig
from parallel import Grid, shard_tensor, unshard_tensors


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked (another model, another layout, a failed save)."""


def optim_name(dp_rank: int, tag: str, zero1: bool) -> str:
    """The optimizer file of (dp_rank, tag): one per DP rank with ZeRO-1, else one per (tp, pp)."""
    return f"optim_dp{dp_rank:03d}_{tag}.pt" if zero1 else f"optim_{tag}.pt"


# ----------------------------------------------------------------------------- what a load returns

@dataclass
class Loaded:
    step: int
    path: Path
    meta: dict                 # {"step", "layout", "config", "extra", ...} as saved
    model: dict                # this rank's model state dict, resharded to this run's layout if needed
    optim: dict | None         # this rank's optimizer state, idem (None if load_optim=False or none saved)
    data: object               # this rank's data-loader state (None if the DP degree changed)
    rng: dict | None           # this rank's RNG streams (None at another layout: not comparable)
    data_states: Sequence | None   # every saved DP rank's loader state (read when indexed), at another DP degree

    @property
    def extra(self) -> dict:
        return self.meta["extra"]


class LazyList(Sequence):
    """n items, each read by read(i) when first indexed."""

    def __init__(self, n: int, read):
        self.n, self.read, self.got = n, read, {}

    def __len__(self):
        return self.n

    def __getitem__(self, i: int):
        if not -self.n <= i < self.n:
            raise IndexError(i)
        if i % self.n not in self.got:
            self.got[i % self.n] = self.read(i % self.n)
        return self.got[i % self.n]

    def __eq__(self, other):
        return list(self) == list(other)


# ----------------------------------------------------------------------------- reading at any layout

def read(d: Path, meta: dict, g: Grid, now: dict, m: ModelConfig, load_optim: bool,
         names=None, say=print) -> Loaded:
    """This rank's part of the complete, verified checkpoint d (meta: its meta.json), saved at
    layout meta["layout"] and read back at layout `now` (Checkpointer.layout) on rank g."""
    saved = meta["layout"]
    load = lambda name: torch.load(d / name, map_location="cpu", mmap=True, weights_only=True)
    tag = lambda t, p: f"tp{t:02d}_pp{p:02d}"
    # The model: this rank's own file at the same TP degree (mmap: only what is copied is read);
    # at another TP degree, every TP shard of the stage, joined and re-split. After a change of
    # PP degree every saved stage is looked at (mmap: only the names this rank has are read).
    stages = [g.pp_rank] if saved["pp"] == now["pp"] else range(saved["pp"])
    model = {}
    for p in stages:
        if saved["tp"] == now["tp"]:
            model.update(load(f"model_{tag(g.tp_rank, p)}.pt"))
        else:
            model.update(reshard([load(f"model_{tag(t, p)}.pt") for t in range(saved["tp"])],
                                 m, g.tp, g.tp_rank, keep=names))
    if names is not None and saved["pp"] != now["pp"]:
        model = {k: v for k, v in model.items() if k in names}
    optim = None
    if load_optim and (d / optim_name(0, tag(0, 0), saved["zero1"])).exists():   # was one saved?
        optim = _read_optim(d, saved, now, g, m)
    rank_file = lambda r: torch.load(d / f"rank{r:05d}.pt", map_location="cpu", weights_only=False)
    rng, data, data_states = None, None, None
    if saved == now:
        mine = rank_file(g.rank)
        rng, data = mine["rng"], mine["data"]
    elif saved["dp"] == now["dp"]:
        data = rank_file(g.dp_rank * saved["tp"])["data"]      # the rank at (pp 0, this dp, tp 0)
    else:
        # Read on first use: a data loader takes only the saved ranks owning its streams (one or
        # two at any scale), not all DP ranks' files on every rank.
        data_states = LazyList(saved["dp"], lambda r: rank_file(r * saved["tp"])["data"])
    if saved != now:
        say(f"{d.name} was saved at layout {saved}, this run is {now}: model"
            f"{' and optimizer' if optim is not None else ''} resharded; RNG streams start from "
            f"the seed" + ("" if data is not None else "; data loaders take the saved positions of their streams"))
    return Loaded(meta["step"], d, meta, model, optim, data, rng, data_states)


def _read_optim(d: Path, saved: dict, now: dict, g: Grid, m: ModelConfig) -> dict:
    # Our own checksummed files; the optimizer's state may hold Python objects: weights_only=False.
    load = lambda name: torch.load(d / name, map_location="cpu", weights_only=False)
    tag = f"tp{g.tp_rank:02d}_pp{g.pp_rank:02d}"
    same = all(saved[k] == now[k] for k in ("tp", "pp", "zero1")) and (not now["zero1"] or saved["dp"] == now["dp"])
    if same:
        return load(optim_name(g.dp_rank, tag, now["zero1"]))
    # Any other layout: the state is rebuilt per parameter ("<name>.<moment>", shaped as the
    # parameter is on this TP rank), each tensor when the optimizer asks for it. A ZeRO-1 rank
    # asks only for the parameters of its shard, and a saved ZeRO-1 tensor is cut from the one
    # or two saved shards holding it (memory-mapped): at 4096 ranks a rank still reads about
    # its own share, times saved_tp / tp when the TP degree changes.
    stages = [g.pp_rank] if saved["pp"] == now["pp"] else range(saved["pp"])
    tps = [g.tp_rank] if saved["tp"] == now["tp"] else range(saved["tp"])
    src = {(t, p): SavedOptim(d, f"tp{t:02d}_pp{p:02d}", saved, d.name) for p in stages for t in tps}
    stage = {k: p for (t, p), s in src.items() if t == tps[0] for k in s.index}

    def get(key: str) -> torch.Tensor:
        pieces, name = [src[t, stage[key]][key] for t in tps], key.rsplit(".", 1)[0]
        if saved["tp"] == now["tp"]:
            return pieces[0]
        return shard_tensor(name, unshard_tensors(name, pieces, m), m, g.tp, g.tp_rank)
    head = src[tps[0], stages[0]].head
    return {**{k: head[k] for k in ("precision", "step", "sr_seed", "lr")}, "layout": {"kind": "full"},
            "state": LazyMap(stage, get)}


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
    """The optimizer state one (TP rank, stage) saved, per parameter: "<name>.<moment>" -> tensor
    shaped like the parameter. Unsharded: its file's state. ZeRO-1: cut from the DP shards, which
    are laid end to end in the order of layout["params"]; a shard file is opened (memory-mapped)
    only when a tensor lies on it."""

    def __init__(self, d: Path, tag: str, saved: dict, where: str):
        self.load = lambda n: torch.load(d / n, map_location="cpu", weights_only=False, mmap=True)
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
    """The state of TP rank tp_rank out of tp, from the states of every TP rank of another TP
    degree (in rank order): each tensor is joined to full shape and re-split as its parameter is.
    tp=1 gives the full tensors.
    keep: only these keys (None: all)."""
    out = {}
    for key in (k for k in shards[0] if keep is None or k in keep):
        full = unshard_tensors(key, [s[key] for s in shards], m)
        out[key] = shard_tensor(key, full, m, tp, tp_rank).clone()
    return out


def full_model_state(path: str | Path, m: ModelConfig) -> dict:
    """Full (unsharded) weights of the checkpoint directory `path`, in one process, whatever the
    layout that wrote it."""
    path = Path(path)
    names = sorted(n for n in os.listdir(path) if re.fullmatch(r"model_tp\d+_pp\d+\.pt", n))
    stages: dict[str, list] = {}
    for n in names:
        stages.setdefault(n[-7:], []).append(torch.load(path / n, map_location="cpu", mmap=True, weights_only=True))
    full = {}
    for shards in stages.values():
        full.update(reshard(shards, m, 1, 0))
    return full
