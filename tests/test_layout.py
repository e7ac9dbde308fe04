"""The house: packages import downward only (docs/architecture.md).

    entrypoints (cli, server, bench) -> runtime -> compiler -> passes -> models -> config
                                                 \\-> cache -> config
                                      runtime -> attention -> models (the paged-attention backends)

Every `import` in every module is read with `ast`, including those inside functions and under
TYPE_CHECKING: a lazy import upward is still a cycle in the design.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import kiln

ROOT = Path(kiln.__file__).parent

# higher imports lower; equal ranks may not import each other
RANK = {"entrypoints": 6, "runtime": 5, "compiler": 4, "passes": 3, "cache": 2, "models": 2, "attention": 3,
        "config": 1}
# kiln.config validates pass names against a leaf module that holds only those names (no torch, no imports)
EXCEPTIONS = {("config", "kiln.passes.config")}


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "kiln" else None


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute kiln module) for every import in the file; `from kiln import X` resolves X."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "kiln":  # the lazy top-level names (Runtime, SamplingParams, ...)
                found += [(node.lineno, kiln._LAZY.get(alias.name, "kiln")) for alias in node.names]
            else:
                found.append((node.lineno, node.module))
    return [(line, m) for line, m in found if m == "kiln" or m.startswith("kiln.")]


def layer_violations(root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        source = package_of("kiln." + ".".join(path.relative_to(root).with_suffix("").parts))
        if source not in RANK:  # kiln/__init__.py and kiln/__main__.py sit above everything
            continue
        for line, module in imported_modules(path):
            target = package_of(module)
            if target is None or target == source or (source, module) in EXCEPTIONS:
                continue
            if target not in RANK or RANK[target] >= RANK[source]:
                bad.append(f"{path.relative_to(root.parent)}:{line} ({source}) imports {module} ({target})")
    return bad


def test_every_package_is_ranked() -> None:
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    packages |= {p.stem for p in ROOT.glob("*.py") if p.stem not in ("__init__", "__main__")}
    assert packages == set(RANK), "a new package needs a place in the house (RANK and docs/architecture.md)"


def test_imports_run_downward_only() -> None:
    assert layer_violations() == []


def test_the_checker_sees_an_upward_import(tmp_path: Path) -> None:
    """The rule can fail: a runtime module importing the server (even lazily, in a function) is caught."""
    fake_root = tmp_path / "kiln"
    (fake_root / "runtime").mkdir(parents=True)
    (fake_root / "runtime" / "bad.py").write_text(
        "def f():\n    from kiln.entrypoints.server.app import build_app\n    from kiln import Runtime\n")
    (fake_root / "compiler").mkdir()
    (fake_root / "compiler" / "bad.py").write_text("from kiln import SamplingParams\n")
    bad = layer_violations(fake_root)
    assert any("runtime/bad.py:2" in b and "kiln.entrypoints.server.app" in b for b in bad), bad
    assert any("compiler/bad.py:1" in b and "kiln.runtime.sampling_params" in b for b in bad), bad
    assert not any("runtime/bad.py:3" in b for b in bad), bad  # runtime may use its own Runtime


def test_readme_and_docs_stand_alone() -> None:
    """No path outside the repository (users have only the repository); every docs/*.md named exists."""
    repo = ROOT.parent
    pages = [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]
    outside, missing = [], []
    for page in pages:
        text = page.read_text()
        for token in re.findall(r"[\w./-]*(?:\.\./|shared/)[\w./-]*", text):
            outside.append(f"{page.name}: {token}")
        for name in re.findall(r"docs/([\w-]+\.md)", text):
            if not (repo / "docs" / name).is_file():
                missing.append(f"{page.name}: docs/{name}")
    assert outside == [] and missing == []
    assert "docs/architecture.md" in (repo / "README.md").read_text()
