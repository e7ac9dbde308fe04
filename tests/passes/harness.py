"""Test harness for kiln's passes: capture a tiny model's graph, split it, and get each piece's post-grad
graph exactly as Inductor hands it to the hook, without generating code (seconds, not minutes).

Numbers are checked by running graphs eagerly on real inputs: the captured graph before/after the
graph-level passes, and each piece's post-grad graph before/after the post-grad passes.

Dynamo and Inductor are imported inside the functions: importing them while pytest collects would
precede tests/attention's conftest, which must decorate its Triton kernels first.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from kiln import Runtime, SamplingParams
from kiln.compiler.ranges import CompileKey
from kiln.compiler.split import SplitGraph, split_at_attention
from kiln.models.forward_context import ForwardContext, set_forward_context
from kiln.passes import PassConfig
from kiln.passes.base import PassEnv
from kiln.passes.context import compiling
from kiln.passes.manager import PassManager
from kiln.runtime.request import Request
from kiln.runtime.scheduler import SchedulerOutput


@dataclass
class Capture:
    runtime: Runtime  # -O0: model, torch attention backend, KV cache
    gm: fx.GraphModule  # Dynamo's graph, as the compiler's backend receives it
    inputs: list[Any]  # its real inputs (parameters, the token count, input_ids, positions)
    context: ForwardContext
    extra: dict[str, Any] = field(default_factory=dict)

    def run(self, gm: fx.GraphModule) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (hidden states, the KV cache it wrote), from a zeroed cache."""
        cache = self.runtime.engine.worker.kv_cache
        cache.zero_()
        # a symbolic size among the inputs (the token count, where the graph reshapes by it) runs as its value
        inputs = [i.node.hint if isinstance(i, torch.SymInt) else i for i in self.inputs]
        with torch.inference_mode(), set_forward_context(self.context):
            out = gm(*inputs)
        return out[0].clone(), cache.clone()


def capture(runtime: Runtime, prompt: list[int]) -> Capture:
    """Trace the -O0 runtime's model on one prefill of `prompt` (its KV blocks allocated for real)."""
    engine = runtime.engine
    req = Request("capture", prompt, SamplingParams(), engine.eos_token_ids, engine.max_model_len)
    assert engine.kv.allocate(req, len(prompt))
    batch = engine.runner.prepare(SchedulerOutput([req], [len(prompt)]))
    n = batch.num_padded_tokens
    context = engine.runner.forward_context(batch.metadata, n)
    ids, pos = engine.runner.input_ids[:n], engine.runner.positions[:n]
    seen: dict[str, Any] = {}

    def backend(gm: fx.GraphModule, inputs: list[Any]) -> Any:
        seen["gm"], seen["inputs"] = gm, list(inputs)
        return gm.forward

    model = engine.model
    torch._dynamo.reset()
    for t in (ids, pos):
        torch._dynamo.mark_dynamic(t, 0)
    with torch.inference_mode(), set_forward_context(context):
        torch.compile(model.forward, backend=backend, fullgraph=True, dynamic=False)(ids, pos)
    torch._dynamo.reset()
    return Capture(runtime, seen["gm"], seen["inputs"], context)


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


def piece_inputs(split: SplitGraph, inputs: list[Any], context: ForwardContext) -> dict[str, list[Any]]:
    """Run the split graph eagerly, recording each compiled piece's real inputs."""
    recorded: dict[str, list[Any]] = {}

    class Recorder(fx.Interpreter):
        def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
            recorded.setdefault(str(target), [a.clone() if isinstance(a, torch.Tensor) else a for a in args])
            return super().call_module(target, args, kwargs)

    with torch.inference_mode(), set_forward_context(context):
        Recorder(split.module).run(*inputs)
    return recorded


class _Stop(Exception):
    pass


def _grab(manager: PassManager | None) -> Any:
    """A post-grad hook that runs the manager between two snapshots, then stops Inductor."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class Grab(CustomGraphPass):
        before: fx.GraphModule | None = None
        after: fx.GraphModule | None = None

        def __call__(self, graph: fx.Graph) -> None:
            root = graph.owning_module or torch.nn.Module()
            self.before = copy_graph_module(fx.GraphModule(root, graph))
            if manager is not None:
                manager(graph)
            self.after = copy_graph_module(fx.GraphModule(root, graph))
            raise _Stop

        def uuid(self) -> str:
            return f"grab-{id(self)}"

    return Grab()


def post_grad(piece: fx.GraphModule, key: CompileKey, manager: PassManager | None,
              name: str = "piece") -> tuple[fx.GraphModule, fx.GraphModule]:
    """(post-grad graph before our passes, after them) for one piece compiled for `key`."""
    import torch._inductor

    from kiln.compiler.fakes import example_inputs, token_symbol

    grab = _grab(manager)
    fake_mode, inputs = example_inputs(piece, key, token_symbol(piece))
    patches = {"post_grad_custom_post_pass": grab, "fx_graph_cache": False}
    with compiling(name, key), torch._guards.tracing(torch._guards.TracingContext(fake_mode)), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        try:
            torch._inductor.standalone_compile(copy.deepcopy(piece), inputs, dynamic_shapes="from_tracing_context",
                                               options={"config_patches": patches})
        except Exception as exc:  # noqa: BLE001 - Inductor may wrap our stop signal
            if grab.after is None:
                raise
            del exc
    assert grab.before is not None and grab.after is not None
    return grab.before, grab.after


def split(gm: fx.GraphModule) -> SplitGraph:
    return split_at_attention(copy_graph_module(gm))


def each_piece_with(gm: fx.GraphModule, key: CompileKey, name: str,
                    after: tuple[str, ...] = ()) -> Iterator[tuple[fx.GraphModule, fx.GraphModule, int, int]]:
    """For each distinct piece of the captured graph, with only pass `name` on (and the passes it runs `after`):
    (post-grad graph before, after, the pass's rewrites there, how many pieces share it)."""
    manager = PassManager(PassConfig.from_names([*after, name]), PassEnv())
    for piece_hash, group in split(gm).distinct().items():
        scope = f"{piece_hash[:12]}_{key}"
        before, after = post_grad(group[0].module, key, manager, scope)
        yield before, after, manager.matches[scope].get(name, 0), len(group)
