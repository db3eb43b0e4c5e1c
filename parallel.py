"""Tensor, sequence, pipeline and data parallelism on torch.distributed.

(Skeleton: the rank grid and the single-process paths. Tensor/sequence/data parallel layers and
gradient reduction are filled in by the parallel.py issue.)
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


def rank_groups(world: int, tp: int, pp: int) -> dict[str, list[list[int]]]:
    """All groups of each kind, as plain lists of global ranks, from ONE layout:
    ranks = arange(world).reshape(PP, DP, TP), as in NxD. TP is contiguous (one trn1 instance,
    NeuronLink), PP outermost. The same lists create gloo/nccl groups and the XLA mesh."""
    dp = world // (tp * pp)
    grid = torch.arange(world).reshape(pp, dp, tp)
    return {
        "tp": grid.reshape(pp * dp, tp).tolist(),
        "dp": grid.permute(0, 2, 1).reshape(pp * tp, dp).tolist(),
        "pp": grid.permute(1, 2, 0).reshape(dp * tp, pp).tolist(),
    }


@dataclass
class Grid:
    """Where this rank sits: its coordinates and its process groups (None when single-process)."""
    world: int = 1
    rank: int = 0
    tp: int = 1
    pp: int = 1
    dp: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    tp_group: object = None
    dp_group: object = None
    pp_group: object = None
    backend: str = ""

    @property
    def is_main(self) -> bool:
        return self.rank == 0
