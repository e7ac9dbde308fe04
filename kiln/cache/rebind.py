"""Replace a function in every loaded module that bound it by name.

`from m import f` copies the binding, so replacing `m.f` alone misses every module that imported it that way
(which modules do differs between torch and Triton versions). Both replacements in kiln/cache use this: Triton's
`triton_key` (triton_key.py) and Inductor's `write_atomic` (inductor_writes.py).
"""

from __future__ import annotations

import sys


def rebind(name: str, original: object, replacement: object) -> int:
    """Point every module-level `name` that is `original` at `replacement`; returns how many were.

    A module imported afterwards binds the replacement, from a module replaced here. Namespaces are read through
    `__dict__`, so no module `__getattr__` runs (and sys.modules may hold objects that are not modules)."""
    count = 0
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict) and namespace.get(name) is original:
            setattr(module, name, replacement)
            count += 1
    return count
