"""Cold vs warm start-up with the compile artifact cache: compile-phase seconds and Inductor compiles.

Each start runs in a fresh process (`kiln warmup`), as a real restart would: same model, same fresh cache
directory. "Cold" fills the cache, "warm" loads it. The issue's target is warm <= 25% of cold.

    python -m benchmarks.bench_compile_cache [MODEL] [-O2] [--device cpu] [--repeats 1] [kiln warmup flags]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def start(model: str | None, level: int, device: str, cache_dir: str, extra: list[str],
          inductor_dir: str) -> dict[str, str]:
    cmd = [sys.executable, "-m", "kiln", "warmup", *([model] if model else []), f"-O{level}",
           "--device", device, "--cache-dir", cache_dir, *extra]
    env = {k: v for k, v in os.environ.items() if k != "KILN_DISABLE_COMPILE_CACHE"}
    # a private Inductor/Triton cache: otherwise "cold" would hit Inductor's global cache from earlier runs
    env["TORCHINDUCTOR_CACHE_DIR"], env["TRITON_CACHE_DIR"] = inductor_dir, os.path.join(inductor_dir, "triton")
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("inductor_compiles="))
    return dict(item.split("=", 1) for item in line.split())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=None, help="model dir or preset (default: embedded SmolLM2)")
    parser.add_argument("-O", dest="level", type=int, default=2, choices=[1, 2, 3])
    parser.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=1, help="warm starts to run (the best is reported)")
    args, extra = parser.parse_known_args()  # anything else goes to `kiln warmup` (e.g. --cudagraph-capture-sizes)
    with tempfile.TemporaryDirectory(prefix="kiln-bench-cache-") as cache_dir, \
            tempfile.TemporaryDirectory(prefix="kiln-bench-inductor-") as inductor_dir, \
            tempfile.TemporaryDirectory(prefix="kiln-bench-inductor-empty-") as empty_dir:
        run = (args.model, args.level, args.device, cache_dir, extra)
        cold = start(*run, inductor_dir)
        # a restart on the same host: kiln's cache plus the Inductor cache the cold start left behind
        warms = [start(*run, inductor_dir) for _ in range(args.repeats)]
        # kiln's cache alone (another host sharing only $KILN_CACHE_DIR): on CPU, loading re-builds the C++
        bare = start(*run, empty_dir)
    warm = min(warms, key=lambda w: float(w["compile_phase_s"]))
    cold_s, warm_s = float(cold["compile_phase_s"]), float(warm["compile_phase_s"])
    print(f"model={args.model or 'embedded'} -O{args.level} device={args.device}")
    print(f"{'start':<6} {'compile phase s':>16} {'start-up s':>11} {'inductor compiles':>18} {'cache hits':>11}")
    for name, row in (("cold", cold), ("warm", warm), ("bare", bare)):
        print(f"{name:<6} {float(row['compile_phase_s']):>16.2f} {float(row['startup_s']):>11.2f} "
              f"{row['inductor_compiles']:>18} {row['cache_hits']:>11}")
    print(f"warm/cold compile phase: {warm_s / cold_s:.1%}; bare (empty Inductor cache)/cold: "
          f"{float(bare['compile_phase_s']) / cold_s:.1%}" if cold_s else "cold compile phase was 0 s")


if __name__ == "__main__":
    main()
