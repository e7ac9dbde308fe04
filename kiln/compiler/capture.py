"""`CompiledForward`: the model's forward, captured once by Dynamo, then called without Dynamo.

The first call goes through `torch.compile(fullgraph=True)` with the token dim marked dynamic; the
backend compiles everything. From then on, calls build the graph's inputs themselves (parameters resolved
once from Dynamo's source expressions, the token tensors per call) and call the split graph directly: no
guard evaluation, no frame interception, and no possibility of a silent recompile. That is safe because
the backend has checked that the graph holds for every token count, and the mapping is verified against
the trace's own inputs and output before it is trusted; if anything does not match, calls keep going
through Dynamo (still counted: a retrace would show up in the stats).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kiln.compiler import saved_capture
from kiln.compiler.backend import Capture, KilnBackend
from kiln.compiler.dump import DebugDump
from kiln.compiler.piecewise import generated_forward
from kiln.compiler.stats import CompileStats

logger = logging.getLogger("kiln.compiler")

DirectFn = Callable[..., torch.Tensor]


class CompiledForward:
    def __init__(self, model: nn.Module, backend: KilnBackend, dump: DebugDump | None = None) -> None:
        self.model = model
        self.backend = backend
        self.dump = dump
        self._fn = _private_forward(model)
        self._argnames = [p for p in inspect.signature(self._fn).parameters]
        self._dynamo_forward = torch.compile(self._fn, backend=backend, fullgraph=True, dynamic=False)
        self._direct: DirectFn | None = None
        self.background: Any = None  # BackgroundCompiles, when compiles run after start-up (background.py)

    @property
    def stats(self) -> CompileStats:
        return self.backend.stats

    @property
    def capture(self) -> Capture | None:
        return self.backend.capture

    @property
    def bypasses_dynamo(self) -> bool:
        return self._direct is not None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        direct = self._direct
        if direct is not None:
            return direct(input_ids, positions)
        if self.backend.capture is None and self._direct_from_cache((input_ids, positions)):
            return self._direct(input_ids, positions)
        return self._call_dynamo(input_ids, positions)

    def _direct_from_cache(self, args: tuple[torch.Tensor, ...]) -> bool:
        """A warm start: the split graph an earlier start saved beside its artifacts, checked against this
        model, replaces the Dynamo trace. False (trace as usual) when there is none or it does not fit."""
        store = self.backend.compiler.store
        load_capture = getattr(store, "load_capture", None)
        if load_capture is None or self.dump is not None:  # dumps need the trace itself
            return False
        blob = load_capture()
        if blob is None:
            return False
        hits_before = getattr(store, "hits", 0)
        try:
            capture = self.backend.restore(saved_capture.load(blob))
            infos = capture.inputs
            self._direct = _direct_caller(capture, self.model, self._fn, self._argnames, args,
                                          lambda i, value: saved_capture.matches(infos[i], value))
        except Exception as exc:  # noqa: BLE001 - any doubt means: trace with Dynamo as usual
            logger.warning("not using the cached captured graph (%s); tracing with Dynamo", exc)
            self.backend.capture = None
            self.backend.stats.capture_loaded = False
            self.backend.stats.pieces.clear()
            if hasattr(store, "hits"):
                store.hits = hits_before  # the trace loads them again: count what is used once
            return False
        return True

    def _call_dynamo(self, *args: torch.Tensor) -> torch.Tensor:
        first = self.backend.capture is None
        if first:
            for t in args:
                if t.shape[0] >= 2:  # size 1 would be specialised anyway; the backend then rejects it
                    torch._dynamo.mark_dynamic(t, 0)
        self.backend.trace_started = time.perf_counter()
        dump = self.dump.dynamo() if first and self.dump is not None else contextlib.nullcontext()
        with dump:
            out = self._dynamo_forward(*args)
        if first and self.backend.capture is not None:
            self._direct = self._make_direct(self.backend.capture, args, out)
        return out

    def _make_direct(self, capture: Capture, args: tuple[torch.Tensor, ...], out: Any) -> DirectFn | None:
        outputs = capture.outputs
        expected = capture.example_inputs

        def traced(i: int, value: Any) -> bool:
            want = expected[i]
            return value is want if isinstance(want, torch.Tensor) else value == want

        try:
            if not (isinstance(outputs, (tuple, list)) and len(outputs) == 1 and outputs[0] is out):
                raise _Mismatch("the forward's result is not the graph's single output")
            return _direct_caller(capture, self.model, self._fn, self._argnames, args, traced)
        except _Mismatch as exc:
            logger.warning("calling the compiled graph directly is not possible (%s); calls keep going "
                           "through Dynamo's guards", exc)
            return None
        finally:
            capture.example_inputs, capture.outputs = [], None  # do not pin the trace's tensors


class _Mismatch(Exception):
    pass


def _private_forward(model: nn.Module) -> Callable[..., Any]:
    """model.forward on a private copy of its code object.

    Dynamo keeps its compiled entries on the code object, so every engine compiling the same model class
    would otherwise share (and eventually exhaust) one recompile budget and one cache.
    """
    func = type(model).forward
    fresh = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
                               func.__closure__)
    fresh.__kwdefaults__ = func.__kwdefaults__
    fresh.__qualname__ = func.__qualname__
    return types.MethodType(fresh, model)


def _direct_caller(capture: Capture, model: nn.Module, fn: Callable[..., Any], argnames: list[str],
                   args: tuple[torch.Tensor, ...], fits: Callable[[int, Any], bool]) -> DirectFn:
    """Graph inputs from their sources: model attributes resolved once, token tensors per call; `fits(i,
    value)` must accept every value this call gives (the traced input itself, or its recorded shape)."""
    scope: dict[str, Any] = {"G": fn.__globals__}
    with contextlib.suppress(Exception):  # helpers that some torch versions use inside source names
        from torch._dynamo.guards import CLOSURE_VARS

        scope.update(CLOSURE_VARS)
    frame = {"self": model, **dict(zip(argnames, args))}
    template: list[Any] = [None] * len(capture.sources)
    per_call: list[tuple[int, Callable[[dict[str, Any]], Any]]] = []
    for i, source in enumerate(capture.sources):
        if source is None:
            raise _Mismatch(f"graph input {i} has no source")
        try:
            if any(f"L[{name!r}]" in source for name in argnames):
                getter = eval(f"lambda L: {source}", dict(scope))  # noqa: S307 - Dynamo's own expression
                value = getter(frame)
                per_call.append((i, getter))
            else:
                value = template[i] = eval(source, {**scope, "L": frame})  # noqa: S307
        except Exception as exc:  # noqa: BLE001 - any failure means: do not bypass
            raise _Mismatch(f"cannot evaluate {source}: {exc}") from exc
        if not fits(i, value):
            raise _Mismatch(f"{source} does not evaluate to the traced input {i}")
    forward = generated_forward(capture.split.module)

    def direct(*call_args: torch.Tensor) -> torch.Tensor:
        local = dict(zip(argnames, call_args))
        graph_args = template.copy()
        for i, getter in per_call:
            graph_args[i] = getter(local)
        return forward(*graph_args)[0]

    return direct
