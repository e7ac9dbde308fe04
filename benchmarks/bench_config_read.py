"""`Runtime(<HF directory>)` constructor time with and without transformers on the critical path, in fresh
processes, interleaved (docs/startup.md, "Config without transformers").

Writes a tiny checkpoint (a preset's random weights, config.json written by transformers) plus a byte-level
BPE tokenizer of Llama-3's size once, then alternates fresh processes of a baseline kiln source tree
(`--before`, e.g. `git archive <commit> | tar -x -C /tmp/kiln-before`) and this tree, each building
`Runtime(dir, level=--level (0), device=...)`. Each child reports the constructor's wall time, the start-up summary
line, the config read's seconds, and which thread first imported transformers and from where. A last pair
of children times `import transformers` on its own (after `import torch`, as in kiln): AutoConfig's and
AutoTokenizer's first access.

    python -m benchmarks.bench_config_read --before /tmp/kiln-before --rounds 3 --json /tmp/config_read.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def child_runtime(spec: dict[str, Any]) -> dict[str, Any]:
    import threading
    import traceback

    origin: dict[str, Any] = {}

    class Watch:  # records the first import of transformers: the thread and the kiln frame that asked
        def find_spec(self, name, path=None, target=None):
            if name == "transformers" and not origin:
                frames = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_stack()
                          if "/kiln/" in f.filename]
                origin.update(thread=threading.current_thread().name, kiln_frames=frames[-3:])
            return None

    sys.meta_path.insert(0, Watch())
    start = time.perf_counter()
    from kiln import Runtime

    imported = time.perf_counter()
    rt = Runtime(spec["checkpoint"], level=spec["level"], device=spec["device"])
    built = time.perf_counter()
    return {"import_kiln_s": imported - start, "constructor_s": built - imported,
            "summary": rt.startup_times.summary(), "phases": rt.startup_times.as_dict(),
            "config_s": rt.engine.loaded.config_seconds, "config_type": type(rt.engine.loaded.hf_config).__name__,
            "transformers_first_import": origin, "has_tokenizer": rt.tokenizer is not None}


def child_import(spec: dict[str, Any]) -> dict[str, Any]:
    import torch  # noqa: F401  (kiln imports it first; transformers' own cost is what is left)

    start = time.perf_counter()
    import transformers

    imported = time.perf_counter()
    transformers.AutoConfig  # noqa: B018  (the lazy module loads the auto classes on first access)
    config = time.perf_counter()
    transformers.AutoTokenizer  # noqa: B018
    tokenizer = time.perf_counter()
    return {"import_s": imported - start, "auto_config_s": config - imported,
            "auto_tokenizer_s": tokenizer - config, "total_s": tokenizer - start}


def write_checkpoint(directory: Path, preset: str, tokenizer_vocab: int) -> Path:
    import torch

    from benchmarks.synthetic_tokenizer import write_bpe_tokenizer
    from kiln.models.loader.random_checkpoint import write_random_checkpoint

    if (directory / "tokenizer.json").is_file():
        return directory
    path = write_random_checkpoint(preset, directory, dtype=torch.float32)
    write_bpe_tokenizer(path, tokenizer_vocab)
    return path


def run_child(kind: str, src: Path, spec: dict[str, Any]) -> dict[str, Any]:
    """This file run by path in a fresh interpreter, with only `src` on the path: its kiln is the one timed."""
    env = {**os.environ, "PYTHONPATH": str(src), "KILN_DISABLE_COMPILE_CACHE": "1"}
    out = subprocess.run([sys.executable, __file__, "--child", kind, json.dumps(spec)], cwd="/", env=env,
                         capture_output=True, text=True, timeout=600, check=False)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": f"exit {out.returncode}", "log_tail": (out.stdout + out.stderr)[-2000:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="a kiln source tree to compare against (the baseline)")
    parser.add_argument("--preset", default="tiny-llama")
    parser.add_argument("--tokenizer-vocab", type=int, default=128256, help="BPE tokenizer size (Llama-3's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--level", type=int, default=0, help="Runtime level (1+: compiles overlap the tokenizer)")
    parser.add_argument("--workdir", default="/tmp/kiln-bench-config-read")
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    checkpoint = write_checkpoint(Path(args.workdir) / args.preset, args.preset, args.tokenizer_vocab)
    spec = {"checkpoint": str(checkpoint), "device": args.device, "level": args.level}
    trees = {"before": Path(args.before).resolve(), "after": ROOT}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for round_ in range(args.rounds):
        for name, src in trees.items():
            result = run_child("runtime", src, spec)
            runs[name].append(result)
            print(f"round {round_ + 1} {name}: {result.get('constructor_s', result.get('error'))} "
                  f"{result.get('summary', '')}", flush=True)
    imports = [run_child("import", ROOT, spec) for _ in range(args.rounds)]
    report = {"runs": runs, "import_transformers": imports, "checkpoint": str(checkpoint)}
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"\n| tree | constructor s (median of {args.rounds}) | config s | tokenizer phase s | "
          "first transformers import |")
    print("|---|---|---|---|---|")
    base = None
    for name, results in runs.items():
        ok = [r for r in results if "constructor_s" in r]
        if not ok:
            print(f"| {name} | failed | | | |")
            continue
        ctor = statistics.median(r["constructor_s"] for r in ok)
        base = base or ctor
        origin = ok[-1]["transformers_first_import"]
        print(f"| {name} | {ctor:.2f} ({ctor / base:.2f}x) | {statistics.median(r['config_s'] for r in ok):.2f} | "
              f"{statistics.median(r['phases']['tokenizer'] for r in ok):.2f} | "
              f"{origin.get('thread')}: {' <- '.join(reversed(origin.get('kiln_frames', [])))} |")
    ok = [r for r in imports if "total_s" in r]
    if ok:
        print(f"\nimport transformers after torch (median of {len(ok)}): import "
              f"{statistics.median(r['import_s'] for r in ok):.2f} s, AutoConfig "
              f"{statistics.median(r['auto_config_s'] for r in ok):.2f} s, AutoTokenizer "
              f"{statistics.median(r['auto_tokenizer_s'] for r in ok):.2f} s")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        kind, child_spec = sys.argv[2], json.loads(sys.argv[3])
        print("RESULT", json.dumps((child_runtime if kind == "runtime" else child_import)(child_spec)))
    else:
        main()
