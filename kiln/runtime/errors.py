"""Errors of the runtime that more than one module raises."""


class EngineDeadError(RuntimeError):
    """The engine cannot continue (e.g. a tensor-parallel worker died); every request fails with it."""
