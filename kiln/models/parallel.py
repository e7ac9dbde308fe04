"""Tensor-parallel state seen by the model layers (world size 1 unless the runtime sets a group).

Collectives are torch's functional collectives, which Dynamo traces into the graph and CUDA graphs
can capture; with one rank they are skipped entirely.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: object | None = None  # a torch.distributed ProcessGroup when size > 1


_group = TPGroup()


def set_tp_group(group: TPGroup) -> None:
    global _group
    _group = group


def tp_rank() -> int:
    return _group.rank


def tp_size() -> int:
    return _group.size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _group.size == 1:
        return x
    import torch.distributed._functional_collectives as funcol

    return funcol.all_reduce(x, "sum", _group.group)


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    if _group.size == 1:
        return x
    import torch.distributed._functional_collectives as funcol

    gathered = funcol.all_gather_tensor(x.contiguous(), 0, _group.group)  # [size * T, V/size] (2.11-safe API)
    return torch.cat(gathered.chunk(_group.size, dim=0), dim=-1)
