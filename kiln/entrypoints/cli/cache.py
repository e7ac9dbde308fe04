"""`kiln warmup` (pay the cold compile ahead of time) and `kiln cache ls | verify | clear`."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from kiln.cache.store import (
    ARTIFACT_SUFFIX,
    FACTORS,
    PEAK_DIR,
    READY,
    TOKENIZER_DIR,
    cache_root,
    compile_root,
    verify_file,
)
from kiln.entrypoints.cli.main import add_runtime_args, runtime_kwargs


def add_parser(subparsers: Any) -> None:
    warm = subparsers.add_parser("warmup", help="compile (or load) every range/size for a model and exit")
    add_runtime_args(warm)
    warm.add_argument("--cache-dir", default=None, help="cache root (default $KILN_CACHE_DIR or ~/.cache/kiln)")
    warm.set_defaults(func=run_warmup)

    cache = subparsers.add_parser("cache", help="inspect or clear the compile artifact cache")
    cache.add_argument("--cache-dir", default=None, help="cache root (default $KILN_CACHE_DIR or ~/.cache/kiln)")
    actions = cache.add_subparsers(dest="action", required=True)
    actions.add_parser("ls", help="keys with size, date and a few factors").set_defaults(func=run_ls)
    actions.add_parser("verify", help="checksum every artifact").set_defaults(func=run_verify)
    clear = actions.add_parser("clear", help="delete every key, or one")
    clear.add_argument("key", nargs="?", default=None, help="a key or unique key prefix")
    clear.set_defaults(func=run_clear)


def _use_cache_dir(args: argparse.Namespace) -> None:
    # the environment, not a config field: the runtime and any TP worker processes it spawns all see it
    if getattr(args, "cache_dir", None):
        os.environ["KILN_CACHE_DIR"] = str(Path(args.cache_dir).expanduser().resolve())


def run_warmup(args: argparse.Namespace) -> int:
    from kiln import Runtime

    _use_cache_dir(args)
    start = time.perf_counter()
    runtime = Runtime(args.model, **runtime_kwargs(args))
    runtime.finish_background_compiles()  # those artifacts reach the cache too
    stats = runtime.compile_stats
    print(f"kiln warmup: {stats.summary()}")
    print(f"inductor_compiles={stats.inductor_compiles} cache_hits={stats.cache_hits} "
          f"cache_saves={stats.cache_saves} cache_recovered={stats.cache_recovered} "
          f"compile_phase_s={stats.warmup_seconds:.2f} startup_s={time.perf_counter() - start:.2f} "
          f"key={stats.cache_key or '-'}")
    return 0


def _keys(args: argparse.Namespace) -> list[Path]:
    _use_cache_dir(args)
    root = compile_root()
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run_ls(args: argparse.Namespace) -> int:
    keys = _keys(args)
    if not keys:
        print(f"no compile cache entries under {compile_root()}")
    for key_dir in keys:
        try:
            factors = json.loads((key_dir / FACTORS).read_text())
        except (OSError, ValueError):
            factors = {}
        factors = _mapping(factors)
        ranks = sorted(key_dir.glob("rank_*"))
        ready = all((r / READY).is_file() for r in ranks) and bool(ranks)
        date = time.strftime("%Y-%m-%d %H:%M", time.localtime(key_dir.stat().st_mtime))
        model, env = _mapping(factors.get("model")), _mapping(factors.get("environment"))
        print(f"{key_dir.name}  {_size(key_dir) / 2**20:8.1f} MiB  {date}  {'ready' if ready else 'partial'}  "
              f"{model.get('architecture', '?')} L{model.get('num_layers', '?')} h{model.get('hidden_size', '?')} "
              f"{factors.get('dtype', '?')} -O{_mapping(factors.get('compilation')).get('level', '?')} "
              f"{env.get('device', '?')} torch {env.get('torch', '?')}  ranks={len(ranks)}")
    return 0


def _mapping(value: object) -> dict:
    """A part of a key's factors file as a dict; anything else (a file edited or cut short) shows as '?'."""
    return value if isinstance(value, dict) else {}


def run_verify(args: argparse.Namespace) -> int:
    bad = checked = 0
    for key_dir in _keys(args):
        for path in sorted(key_dir.rglob(f"*{ARTIFACT_SUFFIX}")):
            checked += 1
            reason = verify_file(path)
            if reason is not None:
                bad += 1
                print(f"BAD {path.relative_to(key_dir.parent)}: {reason}")
    print(f"verified {checked} artifact(s): {checked - bad} ok, {bad} bad")
    return 1 if bad else 0


def run_clear(args: argparse.Namespace) -> int:
    keys = _keys(args)
    if args.key is not None:
        if not args.key:
            raise ValueError("an empty key prefix; give none to clear every entry")
        keys = [k for k in keys if k.name.startswith(args.key)]
        if len(keys) != 1:
            raise ValueError(f"key prefix {args.key!r} matches {len(keys)} entries")
    for key_dir in keys:
        shutil.rmtree(key_dir, ignore_errors=True)
    for remembered in (cache_root() / PEAK_DIR, cache_root() / TOKENIZER_DIR):  # they go with everything
        if not args.key and remembered.is_dir():
            shutil.rmtree(remembered, ignore_errors=True)
    print(f"removed {len(keys)} cache entr{'y' if len(keys) == 1 else 'ies'}")
    return 0
