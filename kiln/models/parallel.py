"""Tensor-parallel state seen by the model layers (world size 1 unless the runtime sets a group).

Collectives are torch's functional collectives, which Dynamo traces into the graph and CUDA graphs
can capture; with one rank they are skipped entirely. On an NCCL group whose GPUs can reach each other's
memory, the row-parallel all-reduce is `kiln::all_reduce` instead (kiln/models/allreduce.py): one-shot /
two-shot over symmetric buffers for small messages, NCCL for large ones.
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


_op_group_name: str | None = None  # set: the row-parallel all-reduce is kiln::all_reduce on this group


def set_tp_group(group: TPGroup) -> None:
    """Publish the group to the layers. Collective on CUDA: every rank of an NCCL group builds the
    peer-to-peer all-reduce buffers here (once, before any forward or graph capture)."""
    global _group, _op_group_name
    from kiln.models.allreduce import setup_p2p_all_reduce, teardown_p2p_all_reduce

    teardown_p2p_all_reduce()
    _group, _op_group_name = group, None
    if group.size > 1 and group.group is not None and torch.cuda.is_available():
        import torch.distributed as dist

        if dist.get_backend(group.group) == "nccl" and \
                setup_p2p_all_reduce(group.group, torch.device("cuda", torch.cuda.current_device())) is not None:
            _op_group_name = group.group.group_name


def use_all_reduce_op(enabled: bool) -> None:
    """Route the all-reduce through kiln::all_reduce (True) or torch's functional collective (False) on
    the current group; set_tp_group decides on GPUs, tests use this to run the op's path over gloo."""
    global _op_group_name
    _op_group_name = _group.group.group_name if enabled and _group.group is not None else None  # type: ignore[union-attr]


def tp_rank() -> int:
    return _group.rank


def tp_size() -> int:
    return _group.size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _group.size == 1:
        return x
    if _op_group_name is not None:  # a plain string: Dynamo bakes it into the graph
        import kiln.models.allreduce  # noqa: F401 - registers the op

        return torch.ops.kiln.all_reduce(x, _op_group_name)
    import torch.distributed._functional_collectives as funcol

    return funcol.all_reduce(x, "sum", _group.group)


def argmax_across_ranks(value: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[T] best value and its global id on each rank -> [T] the id of the best value over all ranks (the
    lowest rank on ties), the same on every rank. One all-gather of [T, 2] fp32 (ids below 2^24 are exact)."""
    gathered = _gather_by_rank(torch.stack([value.float(), index.float()], dim=-1))  # [size, T, 2]
    best = gathered[..., 0].argmax(dim=0, keepdim=True)  # [1, T]; argmax takes the first (lowest rank) maximum
    return gathered[..., 1].gather(0, best).squeeze(0).long()


def _gather_by_rank(x: torch.Tensor) -> torch.Tensor:
    """Every rank's x stacked in rank order, [size, *x.shape], by one eager c10d all-gather."""
    import torch.distributed as dist

    gathered = x.new_empty((_group.size * x.shape[0], *x.shape[1:]))  # the layout every backend accepts
    # all_gather_single is torch 2.13's name for all_gather_into_tensor (deprecated there; 2.11 has only it)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(gathered, x.contiguous(), group=_group.group)
    return gathered.view(_group.size, *x.shape)


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """[T, V/size] on each rank -> [T, V], rank-major along the last dim. Runs eagerly every step (the
    vocab-parallel logits), so it calls c10d directly: the functional collective's wrapper and wait cost
    rank 0's host more than the gather itself, and chunk + cat are one transposing copy here."""
    if _group.size == 1:
        return x
    if torch.compiler.is_compiling():  # traced: the functional form (2.11-safe API)
        import torch.distributed._functional_collectives as funcol

        gathered = funcol.all_gather_tensor(x.contiguous(), 0, _group.group)  # [size * T, V/size]
        return torch.cat(gathered.chunk(_group.size, dim=0), dim=-1)
    return _gather_by_rank(x).movedim(0, -2).reshape(*x.shape[:-1], _group.size * x.shape[-1])
