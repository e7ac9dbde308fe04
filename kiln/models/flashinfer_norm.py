"""FlashInfer's all-reduce + residual add + RMSNorm (TensorRT-LLM's one-shot Lamport kernel), one call a row-parallel
projection, as the alternative to kiln's own kernel (kiln/models/p2p_norm.py) behind kiln::all_reduce_add_rms_norm.

Why a second kernel: kiln's pulls each peer's row through NVLink after a flag barrier, two dependent trips over the
link a call; the Lamport protocol has every rank push its rows into every peer's buffer and the reader poll its
own memory until no element is the sentinel (negative zero), so a call waits on one trip and no flag. Which of the
two serves is `AllReducePolicy.fused_norm_kernel` (KILN_TP_FUSED_NORM), chosen by an A/B on two GPUs.

The workspace lives in torch symmetric memory on the tensor-parallel group (no multicast, the same peer-to-peer
mappings kiln's all-reduce uses), built collectively once per group, sized for `max_bytes` a message. The kernel
sums in fp32 and rounds once, where kiln's kernel and the unfused graph round the sum before the residual add, so
its results may differ from them in the last bit.
"""

from __future__ import annotations

import torch

_VEC_ELEMENTS = 8  # the kernel's vector width in 16-bit elements: the hidden size must be a multiple


class FlashInferAddRMSNorm:
    """One group's workspace and the fused call. Build on every rank of the group at the same point."""

    def __init__(self, group: torch.distributed.ProcessGroup, max_bytes: int) -> None:
        from flashinfer.comm import trtllm_ar

        self.rank, self.world = group.rank(), group.size()
        self.max_elements = max_bytes // 2
        rows = max(1, self.max_elements // 1024)  # the workspace is sized by rows x hidden only: any split will do
        self._handles, self.workspace, _ = trtllm_ar.trtllm_create_ipc_workspace_for_all_reduce_fusion(
            self.rank, self.world, rows, 1024, group=group, create_metadata=True, use_symm_dev_mem=False)
        self._module = trtllm_ar.get_trtllm_comm_module()
        self._pattern = trtllm_ar.AllReduceFusionPattern.kARResidualRMSNorm

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rms_norm(all_reduce(x) + residual), all_reduce(x) + residual), or None for a call the kernel cannot
        take (dtype, shape, size)."""
        if (x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16) or residual.shape != x.shape
                or residual.dtype != x.dtype or weight.dtype != x.dtype or x.shape[1] % _VEC_ELEMENTS
                or not 0 < x.numel() <= self.max_elements):
            return None
        x, residual = x.contiguous(), residual.contiguous()
        normed, summed = torch.empty_like(x), torch.empty_like(x)
        self._module.trtllm_allreduce_fusion(
            allreduce_in=x, world_size=self.world, world_rank=self.rank, token_num=x.shape[0],
            hidden_dim=x.shape[1], workspace_ptrs=self.workspace, launch_with_pdl=True, use_oneshot=True,
            trigger_completion_at_end=True, fp32_acc=True, pattern_code=self._pattern, allreduce_out=None,
            residual_in=residual, residual_out=summed, norm_out=normed, quant_out=None, scale_out=None,
            rms_gamma=weight.contiguous(), rms_eps=float(eps), scale_factor=None, layout_code=None)
        return normed, summed
