"""The pass manager: runs the configured passes in order, at both places a pass can run.

`run_graph_passes(gm)` runs on the captured graph before the split; calling the manager itself is the
post-grad hook Inductor runs once per piece and compile range/size (installed through
kiln/compiler/pass_hook.py). Its uuid names the passes, their code and configuration, plus which passes
are active for the compile in progress, so Inductor's own cache never hands back an artifact built with
a different set of rewrites.
"""

from __future__ import annotations

import hashlib
import logging
from collections import defaultdict
from pathlib import Path

from torch import fx

from kiln.passes.base import KilnPass, PassEnv
from kiln.passes.config import ALL_PASSES, PassConfig
from kiln.passes.context import current_scope

logger = logging.getLogger("kiln.passes")

MANAGER_VERSION = 1  # bump when the manager changes how it runs passes
GRAPH_SCOPE = "graph"  # stats/dump name for the pre-split graph


def pass_classes() -> dict[str, type[KilnPass]]:
    from kiln.passes.add_rmsnorm import AddRMSNormPass
    from kiln.passes.allreduce_rmsnorm import AllReduceRMSNormPass
    from kiln.passes.gate_up_silu_mul import GateUpSiluMulPass
    from kiln.passes.gemm_add_rmsnorm import GemmAddRMSNormPass
    from kiln.passes.noop import NoOpEliminationPass
    from kiln.passes.qk_norm_rope import QKNormRopePass
    from kiln.passes.qkv_rope import QKVRopePass
    from kiln.passes.rmsnorm_gemm import RMSNormGemmPass
    from kiln.passes.rope_kv import RopeKVCachePass
    from kiln.passes.silu_mul import SiluMulPass
    from kiln.passes.silu_mul_quant import SiluMulQuantPass

    classes = [NoOpEliminationPass, RopeKVCachePass, QKNormRopePass, QKVRopePass, AllReduceRMSNormPass,
               GemmAddRMSNormPass, AddRMSNormPass, SiluMulQuantPass, GateUpSiluMulPass, RMSNormGemmPass,
               SiluMulPass]
    return {cls.name: cls for cls in classes}


class PassManager:
    def __init__(self, config: PassConfig, env: PassEnv | None = None, dump_dir: str | Path | None = None) -> None:
        self.config = config
        self.env = env or PassEnv()
        classes = pass_classes()
        self.passes: list[KilnPass] = [classes[name](config, self.env) for name in ALL_PASSES if getattr(config, name)]
        if self.passes:
            # Register the ops rewritten graphs call now, not when a pass first matches: an artifact restored
            # from the compile cache runs no pass, yet calls them (seen on the H200: an 8B TP=2 restore failed
            # with "no attribute all_reduce_add_rms_norm").
            import kiln.passes.ops  # noqa: F401
        self._dump_arg = dump_dir
        self.dump_dir = Path(dump_dir).expanduser().resolve() / "passes" if dump_dir else None
        # scope name ("graph" or "<piece>_<key>") -> pass name -> rewrites; tests and stats read it
        self.matches: dict[str, dict[str, int]] = defaultdict(dict)

    def __reduce__(self) -> tuple:
        """Pickles as its configuration: a compile worker process rebuilds the same passes (same uuid)."""
        return PassManager, (self.config, self.env, self._dump_arg)

    def __bool__(self) -> bool:
        return bool(self.passes)

    # -- the two places passes run --------------------------------------------------------------------
    def run_graph_passes(self, gm: fx.GraphModule) -> fx.GraphModule:
        """Before the split: rewrites in place (and returns) the captured graph."""
        changed = False
        for i, graph_pass in enumerate(self.passes):
            before = self._text(gm.graph) if self.dump_dir else None
            count = graph_pass.apply_graph(gm)
            self._record(GRAPH_SCOPE, i, graph_pass, count, before, gm.graph)
            changed |= count > 0
        if changed:
            gm.graph.lint()
            gm.recompile()
        return gm

    def __call__(self, graph: fx.Graph) -> None:
        """Inductor's post-grad custom pass: every pass that suits the compile in progress, in order."""
        scope = current_scope()
        name = scope.name if scope else f"unscoped_{id(graph):x}"
        for i, graph_pass in enumerate(self.passes):
            if not graph_pass.applies_to(scope):
                continue
            before = self._text(graph) if self.dump_dir else None
            count = graph_pass.apply_post_grad(graph)
            self._record(name, i, graph_pass, count, before, graph)
            if count:
                graph.lint()

    # -- identity -------------------------------------------------------------------------------------
    def uuid(self) -> str:
        parts = [f"kiln-passes-v{MANAGER_VERSION}", repr(self.config), repr(self.env)]
        parts += [f"{p.name}:{p.uuid()}" for p in self.passes]
        scope = current_scope()
        if scope is not None:  # Inductor asks while compiling: gated passes make artifacts differ by key
            parts.append("active:" + ",".join(p.name for p in self.passes if p.applies_to(scope)))
        return hashlib.sha256("|".join(parts).encode()).hexdigest()

    # -- stats and dumps ------------------------------------------------------------------------------
    def total(self, pass_name: str, scope_prefix: str = "") -> int:
        """Rewrites by one pass, summed over scopes whose name starts with `scope_prefix`."""
        return sum(counts.get(pass_name, 0) for scope, counts in self.matches.items() if scope.startswith(scope_prefix))

    def summary(self) -> str:
        totals = {p.name: self.total(p.name) for p in self.passes}
        return ", ".join(f"{n}: {c}" for n, c in totals.items()) or "no passes"

    def _record(self, scope: str, index: int, graph_pass: KilnPass, count: int, before: str | None,
                graph: fx.Graph) -> None:
        counts = self.matches[scope]
        counts[graph_pass.name] = counts.get(graph_pass.name, 0) + count
        if count:
            logger.debug("pass %s rewrote %d place(s) in %s", graph_pass.name, count, scope)
        if self.dump_dir is not None and before is not None:
            folder = self.dump_dir / scope
            folder.mkdir(parents=True, exist_ok=True)
            stem = f"{index:02d}_{graph_pass.name}"
            (folder / f"{stem}.before.txt").write_text(before)
            (folder / f"{stem}.after.txt").write_text(f"# {count} rewrite(s)\n" + self._text(graph))

    @staticmethod
    def _text(graph: fx.Graph) -> str:
        return str(graph)
