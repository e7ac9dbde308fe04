"""kiln's own graph passes: a pass manager and one file per pass (docs/passes.md).

The compiler builds one `PassManager` per compiled model (`build_pass_manager`) and installs it through
kiln/compiler/pass_hook.py: graph-level passes run on the captured graph before the split, post-grad
passes inside Inductor for each piece and range/size. Importing this package is cheap; the passes and
their ops load when a manager is built.
"""

from __future__ import annotations

from typing import Any

from kiln.passes.config import ALL_PASSES, LEVEL_DEFAULTS, PassConfig
from kiln.passes.context import CompileScope, compiling, current_scope

__all__ = ["ALL_PASSES", "LEVEL_DEFAULTS", "CompileScope", "PassConfig", "build_pass_manager", "compiling",
           "current_scope", "pass_manager_of"]


def build_pass_manager(config: Any, attention_backend: Any = None, pass_config: PassConfig | None = None) -> Any:
    """The PassManager for a resolved CompilationConfig (or an explicit PassConfig), given the attention
    backend (class or instance) the compiled model will run with."""
    from kiln.passes.base import PassEnv
    from kiln.passes.manager import PassManager

    env = PassEnv(cache_only_attention=bool(getattr(attention_backend, "supports_cache_only", False)),
                  rope_in_attention=bool(getattr(attention_backend, "supports_rope", False)))
    passes = pass_config if pass_config is not None else PassConfig.from_compilation(config)
    return PassManager(passes, env, getattr(config, "debug_dump_path", None))


def pass_manager_of(compiled: Any) -> Any:
    """The PassManager a CompiledForward was built with (None without passes): for tests and stats."""
    hook = getattr(getattr(getattr(compiled, "backend", None), "compiler", None), "config_patches", {}).get(
        "post_grad_custom_post_pass")
    from kiln.passes.manager import PassManager

    return next((p for p in getattr(hook, "passes", []) if isinstance(p, PassManager)), None)
