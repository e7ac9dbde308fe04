#!/usr/bin/env bash
# Builds FlashInfer's JIT modules that a GPU call needs (default: trtllm_comm, the all-reduce + norm kernels of
# kiln/models/flashinfer_norm.py) for the H200 (sm_90a) with this machine's nvcc, into .carry/flashinfer_aot/NAME.so;
# gpu_call.sh installs them as FlashInfer's prebuilt modules. Needs the wheels in .whl/ and a tvm-ffi wheel for this
# machine's Python (TVM_FFI_WHEEL, default: the one in .whl/). From the repository root:
#   bash benchmarks/gpu/flashinfer_aot.sh [MODULE...]       ~6 min on 2 cores
set -euo pipefail
site=$(mktemp -d)
python3 -m pip install -q --no-deps --target "$site" .whl/flashinfer_python-*.whl "${TVM_FFI_WHEEL:-$(ls .whl/apache_tvm_ffi-*.whl)}" \
  nvidia-ml-py
mkdir -p .carry/flashinfer_aot "$site/stubs"
# the link asks for libcuda, which a machine without a driver may lack: an empty stand-in with the driver's soname
# (the modules call no driver function; the device's libcuda.so.1 is what loads)
echo | gcc -x c -shared -Wl,-soname,libcuda.so.1 -o "$site/stubs/libcuda.so" -
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} LIBRARY_PATH="$site/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}"
for module in "${@:-trtllm_comm}"; do
  FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE="$site/ws" PYTHONPATH="$site" python3 - "$module" <<'PY'
import shutil
import sys

import flashinfer.jit.comm as comm

spec = getattr(comm, f"gen_{sys.argv[1]}_module")()
spec.build(verbose=False)
shutil.copy(spec.jit_library_path, f".carry/flashinfer_aot/{sys.argv[1]}.so")
print(f".carry/flashinfer_aot/{sys.argv[1]}.so")
PY
done
rm -rf "$site"
