"""allreduce_rmsnorm under tensor parallelism (2 ranks over gloo on CPU).

The pattern test compiles a block built from the model's own TP layers (o_proj -> all-reduce -> add ->
RMSNorm -> MLP -> down_proj -> all-reduce -> add -> RMSNorm: one decoder layer's worth) with Inductor on
each rank, counts the rewrites and compares the compiled result with the eager, unfused block. The
runtime test runs the whole model at TP=2 -O2 with the pass and compares greedy tokens with TP=1.
"""

from __future__ import annotations

import os
import socket
import traceback

import pytest
import torch
import torch.multiprocessing as tmp

from kiln import Runtime, SamplingParams
from kiln.passes import pass_manager_of
from tests.conftest import random_prompts
from tests.passes.conftest import NUM_LAYERS

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

HIDDEN, INTERMEDIATE, TOKENS = 64, 128, 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _block():
    from torch import nn

    from kiln.models.layers import MergedColumnParallelLinear, RMSNorm, RowParallelLinear, SiluAndMul

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.o_proj = RowParallelLinear(HIDDEN, HIDDEN)
            self.post_norm = RMSNorm(HIDDEN, 1e-5)
            self.gate_up = MergedColumnParallelLinear(HIDDEN, [INTERMEDIATE] * 2, ["gate", "up"])
            self.act = SiluAndMul()
            self.down = RowParallelLinear(INTERMEDIATE, HIDDEN)
            self.next_norm = RMSNorm(HIDDEN, 1e-5)

        def forward(self, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h, residual = self.post_norm(self.o_proj(attn), residual)
            h = self.down(self.act(self.gate_up(h)))
            return self.next_norm(h, residual)

    return Block()


def _pattern_rank(rank: int, port: int, results: dict, through_op: bool) -> None:
    import torch.distributed as dist
    from torch._inductor.custom_graph_pass import CustomGraphPass

    from kiln.models.parallel import TPGroup, set_tp_group, use_all_reduce_op
    from kiln.passes import PassConfig
    from kiln.passes.base import PassEnv
    from kiln.passes.manager import PassManager
    from kiln.passes.ops import all_reduce_add_rms_norm, rms_norm_ref

    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        set_tp_group(TPGroup(rank, 2, dist.group.WORLD))
        use_all_reduce_op(through_op)  # kiln::all_reduce (as on GPUs) or the functional collective
        torch.manual_seed(0)  # the same full weights on both ranks; each keeps its shard
        block = _block()
        full = {"o_proj": torch.randn(HIDDEN, HIDDEN) / 8, "gate": torch.randn(INTERMEDIATE, HIDDEN) / 8,
                "up": torch.randn(INTERMEDIATE, HIDDEN) / 8, "down": torch.randn(HIDDEN, INTERMEDIATE) / 8}
        block.o_proj.weight_loader(block.o_proj.weight, full["o_proj"])
        block.gate_up.weight_loader(block.gate_up.weight, full["gate"], "gate")
        block.gate_up.weight_loader(block.gate_up.weight, full["up"], "up")
        block.down.weight_loader(block.down.weight, full["down"])
        for norm in (block.post_norm, block.next_norm):
            norm.weight.data.copy_(torch.rand(HIDDEN) + 0.5)
        attn = torch.randn(TOKENS, HIDDEN // 2) + rank  # this rank's half of the attention heads
        residual = torch.randn(TOKENS, HIDDEN)

        # the fused op alone against all-reduce + the reference add + norm
        partial = torch.randn(TOKENS, HIDDEN) * (rank + 1)
        reduced = partial.clone()
        dist.all_reduce(reduced)
        normed, summed = all_reduce_add_rms_norm(partial, residual, block.post_norm.weight, 1e-5,
                                                 dist.group.WORLD.group_name)
        torch.testing.assert_close(summed, reduced + residual, atol=0, rtol=0)
        torch.testing.assert_close(normed, rms_norm_ref(reduced + residual, block.post_norm.weight, 1e-5))

        manager = PassManager(PassConfig.from_names(["allreduce_rmsnorm"]), PassEnv())

        class Hook(CustomGraphPass):
            def __call__(self, graph) -> None:
                manager(graph)

            def uuid(self) -> str:
                return manager.uuid()

        with torch.inference_mode():
            expected = block(attn, residual)
            torch._dynamo.reset()
            compiled = torch.compile(block, fullgraph=True, dynamic=False,
                                     options={"post_grad_custom_post_pass": Hook(), "fx_graph_cache": False})
            got = compiled(attn, residual)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
        results[rank] = manager.total("allreduce_rmsnorm")
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - report to the parent
        results[rank] = traceback.format_exc()
        raise


@pytest.mark.parametrize("through_op", [False, True], ids=["functional", "kiln_op"])
def test_pattern_matches_twice_per_layer_and_keeps_numbers(through_op: bool) -> None:
    with tmp.Manager() as mgr:
        results = mgr.dict()
        tmp.spawn(_pattern_rank, args=(_free_port(), results, through_op), nprocs=2)
        assert dict(results) == {0: 2, 1: 2}


def test_a_pass_manager_registers_the_fused_ops_before_any_pass_runs() -> None:
    """An artifact restored from the compile cache calls the fused op although no pass ran in this process."""
    import subprocess
    import sys

    code = ("from kiln.passes import PassConfig; from kiln.passes.manager import PassManager; import torch; "
            "PassManager(PassConfig.from_names(['allreduce_rmsnorm'])); torch.ops.kiln.all_reduce_add_rms_norm.default")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 0, done.stderr[-2000:]


GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = random_prompts([5, 17, 40, 3, 26], 256, seed=21)


@pytest.mark.slow
def test_tp2_with_the_pass_matches_tp1(tmp_path) -> None:
    reference = [o.outputs[0].token_ids for o in Runtime("tiny-qwen3", level=0, device="cpu").generate(PROMPTS, GREEDY)]
    # the dump turns Inductor's cache off, so every piece runs the post-grad pass (and counts)
    runtime = Runtime("tiny-qwen3", level=2, compile_sizes=(), device="cpu", tensor_parallel_size=2,
                      max_num_batched_tokens=64, passes=("allreduce_rmsnorm",), debug_dump_path=str(tmp_path))
    try:
        assert [o.outputs[0].token_ids for o in runtime.generate(PROMPTS, GREEDY)] == reference
        compiled = runtime.engine.worker.compiled
        manager = pass_manager_of(compiled)
        total = 0
        for piece_hash, group in compiled.capture.split.distinct().items():
            scopes = [s for s in manager.matches if s.startswith(piece_hash[:12])]
            assert len(scopes) == 1
            total += manager.matches[scopes[0]].get("allreduce_rmsnorm", 0) * len(group)
        assert total == 2 * NUM_LAYERS  # after o_proj and after down_proj, in every layer
    finally:
        runtime.engine.shutdown()
