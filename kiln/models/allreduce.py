"""The tensor-parallel all-reduce on GPUs: NCCL, or one-shot / two-shot over peer-to-peer buffers.

Decode all-reduces are small (8-64 KB per layer at batch 1-8 on Llama shapes), so their latency, not
bandwidth, is what TP decode pays ~2 x layers times per step. NCCL's ring/tree protocols have a fixed
cost per call even when replayed from a CUDA graph; a one-shot all-reduce over buffers every rank can
read through NVLink (torch symmetric memory: each rank copies its input into its own buffer, one
barrier, each rank sums all buffers) is one kernel. Two-shot (reduce-scatter + all-gather over the same
buffers) moves less data per rank and suits middle sizes. The choice is made per call from the message
size (`AllReducePolicy`); under CUDA graphs it is made once, at capture, for that size.

Multicast (NVLS / multimem) is never used: it can take a shared host's GPUs down. Only the P2P ops
(`symm_mem.one_shot_all_reduce_copy`, `symm_mem.two_shot_all_reduce_`) are called, and
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 is set before any symmetric allocation.

`kiln::all_reduce` is a custom op (with a fake implementation) so Dynamo traces it into the compiled
pieces as one opaque node, Inductor calls it as an extern kernel and CUDA graphs capture it. On CPU, or
without symmetric memory, the op runs torch's functional all-reduce (gloo or NCCL), exactly the
collective the model traced before.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass

import torch

logger = logging.getLogger("kiln")

MODES = ("auto", "nccl", "one_shot", "two_shot")
FUSED_NORM_KERNELS = ("kiln", "flashinfer")


@dataclass(frozen=True)
class AllReducePolicy:
    """Which all-reduce serves a message of n bytes. `auto`: one-shot up to `one_shot_max_bytes`, then
    two-shot up to `two_shot_max_bytes`, NCCL above. Where the all-reduce feeds a residual add + RMSNorm
    (the allreduce_rmsnorm pass), messages up to `fused_norm_max_bytes` take the one-kernel form instead
    (kiln/models/p2p_norm.py), whatever the plain all-reduce would have been.

    Thresholds from benchmarks/bench_tp.py on 2 H200s (NVLink, torch 2.11, bf16, per call replayed from a
    CUDA graph): NCCL 11.3 / 11.9 / 12.3 / 14.9 / 19.0 us at 8 / 32 / 128 / 512 / 1024 KB, one-shot
    6.8 / 6.9 / 8.0 / 11.1 / 14.8, two-shot 8.8 / 9.7 / 9.9 / 10.5 / 13.2; every sum equal to NCCL's. The one
    kernel for all-reduce + add + RMSNorm against kiln's all-reduce then the add + norm (2 H200s, 2026-12-04,
    `bench_tp.py --parts allreduce`): 5.1 / 5.4 / 6.9 / 9.0 us against 8.8 / 9.0 / 12.9 / 16.2 at 8 / 64 / 512 /
    1024 KB, hence its bound of 1 MB (Llama-3-8B at batch 64, 70B at 64 over two ranks). `fused_norm_kernel`:
    kiln's kernel or FlashInfer's (kiln/models/flashinfer_norm.py) for that one kernel."""

    mode: str = "auto"
    one_shot_max_bytes: int = 256 << 10
    two_shot_max_bytes: int = 1 << 20
    fused_norm_max_bytes: int = 1 << 20
    fused_norm_kernel: str = "kiln"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"KILN_TP_ALLREDUCE must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.fused_norm_kernel not in FUSED_NORM_KERNELS:
            raise ValueError(f"KILN_TP_FUSED_NORM must be one of {', '.join(FUSED_NORM_KERNELS)}, "
                             f"got {self.fused_norm_kernel!r}")
        if min(self.one_shot_max_bytes, self.two_shot_max_bytes, self.fused_norm_max_bytes) < 0:
            raise ValueError("all-reduce byte thresholds must be >= 0")

    @classmethod
    def from_env(cls) -> AllReducePolicy:
        """KILN_TP_ALLREDUCE (auto|nccl|one_shot|two_shot), KILN_TP_ONE_SHOT_MAX_BYTES,
        KILN_TP_TWO_SHOT_MAX_BYTES, KILN_TP_FUSED_NORM_MAX_BYTES, KILN_TP_FUSED_NORM (kiln|flashinfer)."""
        default = cls()
        return cls(os.environ.get("KILN_TP_ALLREDUCE", default.mode),
                   int(os.environ.get("KILN_TP_ONE_SHOT_MAX_BYTES", default.one_shot_max_bytes)),
                   int(os.environ.get("KILN_TP_TWO_SHOT_MAX_BYTES", default.two_shot_max_bytes)),
                   int(os.environ.get("KILN_TP_FUSED_NORM_MAX_BYTES", default.fused_norm_max_bytes)),
                   os.environ.get("KILN_TP_FUSED_NORM", default.fused_norm_kernel))

    @property
    def buffer_bytes(self) -> int:
        """The symmetric buffer each rank needs (0: NCCL only)."""
        if self.mode == "nccl":
            return 0
        if self.mode in ("one_shot", "two_shot"):
            return max(self.one_shot_max_bytes, self.two_shot_max_bytes, 1 << 20)
        return max(self.one_shot_max_bytes, self.two_shot_max_bytes)

    def choose(self, nbytes: int) -> str:
        if self.mode != "auto":
            return self.mode if nbytes <= self.buffer_bytes else "nccl"
        if nbytes <= self.one_shot_max_bytes:
            return "one_shot"
        if nbytes <= self.two_shot_max_bytes:
            return "two_shot"
        return "nccl"


class P2PAllReduce:
    """One process group's symmetric buffer (every rank can load/store every other rank's) and the
    all-reduce over it. Built collectively on every rank of the group, outside any graph capture."""

    def __init__(self, group: torch.distributed.ProcessGroup, policy: AllReducePolicy, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"  # never build multicast objects
        self.policy = policy
        self.group_name = group.group_name
        with warnings.catch_warnings():  # deprecated (no longer needed) on newer torch; needed on 2.11
            warnings.simplefilter("ignore")
            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                symm_mem.enable_symm_mem_for_group(self.group_name)
        # after the bytes torch's kernels use, two halves of the largest fused message each for the fused add +
        # norm kernel (p2p_norm.py), which alternates between them and no other kernel touches
        self.norm_half_bytes = policy.fused_norm_max_bytes if policy.mode in ("auto", "one_shot") else 0
        self.buffer = symm_mem.empty(policy.buffer_bytes + 2 * self.norm_half_bytes, dtype=torch.uint8,
                                     device=device)
        self.handle = symm_mem.rendezvous(self.buffer, self.group_name)
        # its flags: the upper half of the signal pad; torch's kernels use the lower (one flag per block and
        # rank, at most 32 blocks)
        slots = getattr(self.handle, "signal_pad_size", 2048) // 4
        self.norm_first_slot = slots // 2
        self.norm_max_rows = (slots - self.norm_first_slot) // self.handle.world_size
        self.norm_epochs = torch.zeros(self.norm_max_rows, dtype=torch.int32, device=device)  # calls per row
        self.flashinfer_norm = flashinfer_norm(group, policy, device) if self.norm_half_bytes else None

    def view(self, like: torch.Tensor) -> torch.Tensor:
        """The start of this rank's buffer as a tensor shaped like `like`."""
        nbytes = like.numel() * like.element_size()
        return self.buffer[:nbytes].view(like.dtype).view(like.shape)

    def kind_for(self, x: torch.Tensor) -> str:
        nbytes = x.numel() * x.element_size()
        # the P2P kernels need 4-byte aligned sizes (vectorised loads) and bf16/fp32
        if x.dtype not in (torch.bfloat16, torch.float32) or nbytes % 16 or nbytes > self.buffer.numel():
            return "nccl"
        return self.policy.choose(nbytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x, self.kind_for(x))

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rms_norm(all_reduce(x) + residual), all_reduce(x) + residual) in one kernel (p2p_norm.py) for a
        [T, N] message of at most `norm_half_bytes` and `norm_max_rows` rows; None elsewhere (two steps then)."""
        if (x.dim() != 2 or residual.shape != x.shape or residual.dtype != x.dtype or x.shape[1] % 16
                or self.kind_for(x) == "nccl" or x.shape[0] > self.norm_max_rows
                or x.numel() * x.element_size() > self.norm_half_bytes):
            return None
        if self.flashinfer_norm is not None:
            fused = self.flashinfer_norm(x, residual, weight, eps)
            if fused is not None:
                return fused
        from kiln.models.p2p_norm import p2p_add_rms_norm

        return p2p_add_rms_norm(x, residual, weight, eps, self.handle, self.norm_epochs, self.norm_first_slot,
                                self.policy.buffer_bytes, self.norm_half_bytes)

    def run(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        """The all-reduce of one kind (benchmarks call each directly)."""
        if kind == "one_shot":  # copy in + barrier + sum of every rank's buffer, one kernel
            return torch.ops.symm_mem.one_shot_all_reduce_copy(self.view(x), x.contiguous(), "sum", self.group_name)
        if kind == "two_shot":
            buf = self.view(x)
            buf.copy_(x)
            torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", self.group_name)
            return buf.clone()
        return nccl_all_reduce(x, self.group_name)


def flashinfer_norm(group: torch.distributed.ProcessGroup, policy: AllReducePolicy, device: torch.device):
    """Collective: FlashInfer's fused kernel for the group when the policy asks for it and every rank can import
    FlashInfer's communication module, else None (kiln's kernel serves)."""
    if policy.fused_norm_kernel != "flashinfer":
        return None
    try:
        import flashinfer.comm  # noqa: F401
        importable = True
    except Exception as exc:  # noqa: BLE001 - not installed, or its import fails: kiln's kernel still works
        logger.warning("KILN_TP_FUSED_NORM=flashinfer: FlashInfer's communication module cannot be imported (%s); "
                       "using kiln's kernel", exc)
        importable = False
    if not all_ranks_agree(importable, group, device):
        return None
    from kiln.models.flashinfer_norm import FlashInferAddRMSNorm

    return FlashInferAddRMSNorm(group, policy.fused_norm_max_bytes)


def nccl_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """torch's functional all-reduce, run eagerly (NCCL on GPU, gloo on CPU)."""
    out = torch.ops._c10d_functional.all_reduce.default(x.contiguous(), "sum", group_name)
    return torch.ops._c10d_functional.wait_tensor.default(out)


_communicators: dict[str, P2PAllReduce] = {}


# group names this process has built symmetric memory for. torch 2.11 registers a group name once per process
# and keeps the first group's store under it; a re-created group gets the same name ("0" for WORLD after
# destroy_process_group), so a second tensor-parallel runtime in one process would rendezvous through the
# dead group's store and hang (seen on the H200: a TP=2 test after another in the same pytest process).
_registered: set[str] = set()


def setup_p2p_all_reduce(group: torch.distributed.ProcessGroup, device: torch.device,
                         policy: AllReducePolicy | None = None) -> P2PAllReduce | None:
    """Collective: build the group's P2P all-reduce when it can serve (CUDA, NCCL group, symmetric memory
    with P2P), else None and the model keeps NCCL. Every rank must call it at the same point; the ranks
    agree first, so one rank that cannot (its process already used the group's name) moves all to NCCL."""
    policy = policy or AllReducePolicy.from_env()
    if device.type != "cuda" or policy.buffer_bytes == 0 or not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy"):
        return None
    fresh = group.group_name not in _registered
    if not all_ranks_agree(fresh, group, device):
        logger.warning("tensor-parallel all-reduce: NCCL (a rank's process built symmetric memory for process "
                       "group %r before, and torch cannot register the name again)", group.group_name)
        return None
    _registered.add(group.group_name)
    try:
        comm = P2PAllReduce(group, policy, device)
    except Exception as exc:  # noqa: BLE001 - no P2P, old driver, ...: NCCL still works
        logger.warning("symmetric-memory all-reduce unavailable (%s); using NCCL", exc)
        return None
    _communicators[comm.group_name] = comm
    logger.info("tensor-parallel all-reduce: %s", policy)
    return comm


def all_ranks_agree(ok: bool, group: torch.distributed.ProcessGroup, device: torch.device) -> bool:
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)
    return bool(flag.item())


def teardown_p2p_all_reduce() -> None:
    _communicators.clear()


def communicator(group_name: str) -> P2PAllReduce | None:
    """The group's P2P all-reduce, if this process built one (CUDA, NCCL group, symmetric memory)."""
    return _communicators.get(group_name)


def all_reduce_impl(x: torch.Tensor, group_name: str) -> torch.Tensor:
    comm = _communicators.get(group_name)
    if comm is not None and x.is_cuda:
        return comm(x)
    return nccl_all_reduce(x, group_name)


@torch.library.custom_op("kiln::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum of x over the group's ranks (a new tensor)."""
    return all_reduce_impl(x, group_name)


@all_reduce.register_fake
def _all_reduce_fake(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)
