#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# On a machine with a CUDA GPU (and CuPy; PyTorch for the torch cases): build the native
# extensions with this machine's Python, run the GPU tests, a few CPU transfer tests (the
# build works), the GPU benchmark and `mooncake-te topology`. Logs and the benchmark's
# JSON go to $OUT (default ./gpu_out). Exit status: the GPU tests'.
#
#   scripts/gpu_check.sh            # PYTHON=... to pick the interpreter
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
# Never NVLink multicast on shared hosts (the device machines' rule), and unbuffered logs.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi -L 2>&1 | tee "$OUT/machine.log"
"$PY" -c 'import sys, cupy, numpy; print(sys.version.split()[0], "cupy", cupy.__version__,
          "numpy", numpy.__version__)' 2>&1 | tee -a "$OUT/machine.log"
if ! "$PY" setup.py build_ext --inplace -q >"$OUT/build.log" 2>&1; then
    tail -40 "$OUT/build.log"
    exit 1
fi
grep "native build" "$OUT/build.log"
"$PY" -m pytest -q -rs -p no:cacheprovider --timeout 120 tests/transports/test_gpu.py \
    tests/integrations/test_vllm_gpu.py 2>&1 \
    | tee "$OUT/tests.log"
rc=${PIPESTATUS[0]}
"$PY" -m pytest -q -p no:cacheprovider --timeout 120 tests/transports/test_transfer.py 2>&1 | tail -3 \
    | tee "$OUT/tests_cpu.log"
timeout 240 "$PY" benchmarks/gpu_bench.py --json "$OUT/gpu_bench.json" 2>&1 | tee "$OUT/bench.log"
timeout 240 "$PY" benchmarks/gpu_kv.py --json "$OUT/gpu_kv.json" 2>&1 | tee "$OUT/gpu_kv.log"
"$PY" -m mooncake_te topology 2>&1 | head -40 | tee "$OUT/topology.log"
exit "$rc"
