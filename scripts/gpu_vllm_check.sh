#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Real vLLM on a GPU with no network (the lent H200): our connector (P/D and the pool)
# against vLLM alone, vLLM's OffloadingConnector and vLLM's MooncakeConnector on our engine.
#
# Here (a machine with PyPI):
#   scripts/gpu_vllm_check.sh stage
#       downloads the wheels of scripts/gpu_vllm/wheels.txt for CPython 3.12 (vLLM 0.26.0,
#       the newest release built for torch 2.11 / CUDA 13), drops from the vLLM wheel what a
#       Llama on Hopper never loads, and splits one tar of them into .gpuvllm/chunks/x?? of
#       46 MiB (a device call carries 64 MiB at most). Prints the device calls to make.
# On the device, in back-to-back calls (its /tmp lives only while the machine stays warm):
#   scripts/gpu_vllm_check.sh install .gpuvllm/chunks/xaa          (carry that chunk)
#   scripts/gpu_vllm_check.sh install .gpuvllm/chunks/xac finish   (the last one)
#   scripts/gpu_vllm_check.sh run [PART...]
#       builds the project, runs the GPU tests, then the parts asked for (default: all):
#       tests, fullhit (full-prefix hits, 2k-16k tokens), trace (a Mooncake trace replayed
#       through vLLM alone, vLLM's OffloadingConnector and the pool), pd (P/D over CUDA IPC,
#       forced TCP, and vLLM's MooncakeConnector on our engine), fullhit8b.
#       Results: $OUT/gpu-vllm-<part>.{txt,json} (copy them to benchmarks/results/).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
G=$ROOT/.gpuvllm
SITE=/tmp/gv-site
cmd=${1:-}
shift || true

stage() {
    local py=${PYTHON:-python3} chunk=${CHUNK:-46M}
    local exc; exc=$(git rev-parse --git-path info/exclude)
    grep -qx '/.gpuvllm/' "$exc" 2>/dev/null || echo '/.gpuvllm/' >>"$exc"
    mkdir -p "$G/wheels"
    if [ ! -f "$G/wheels/.done" ]; then
        echo "stage: downloading $(grep -vc '^#' scripts/gpu_vllm/wheels.txt) wheels for cp312"
        grep -v '^#' scripts/gpu_vllm/wheels.txt | grep . | xargs "$py" -m pip download -q \
            --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
            --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
            --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
            --platform manylinux1_x86_64 -d "$G/wheels" 2>&1 | grep -v "is ignored" || true
        "$py" - "$G"/wheels/vllm-0.26.0-*.whl <<'EOF'
# Rewrite the vLLM wheel without the parts a Llama on Hopper never loads (vLLM wraps
# these imports): FA2 kernels (Hopper runs FA3), the MoE kernels, the Rust frontend, and
# DeepGEMM builds for other Pythons; RECORD loses their lines so pip installs the rest.
import os, sys, zipfile
path = sys.argv[1]
drop = ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/_moe_C_stable_libtorch.abi3.so",
        "vllm/vllm-rs")
drop_prefix = tuple(f"vllm/third_party/deep_gemm/_C.cpython-3{v}-" for v in (10, 11, 13, 14))
gone = lambda n: n in drop or n.startswith(drop_prefix)   # noqa: E731
tmp = path + ".tmp"
with zipfile.ZipFile(path) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
    for info in zin.infolist():
        if gone(info.filename):
            continue
        data = zin.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            data = b"".join(l for l in data.splitlines(True)
                            if not gone(l.split(b",")[0].decode()))
        zout.writestr(info, data)
before = os.path.getsize(path)
os.replace(tmp, path)
print(f"stage: vLLM wheel {before / 2**20:.0f} -> {os.path.getsize(path) / 2**20:.0f} MiB")
EOF
        touch "$G/wheels/.done"
    fi
    rm -rf "$G/chunks"
    mkdir -p "$G/chunks"
    (cd "$G" && tar -cf all.tar wheels/*.whl && sha256sum all.tar | cut -d' ' -f1 >all.tar.sha256)
    (cd "$G/chunks" && split -b "$chunk" ../all.tar) && rm -f "$G/all.tar"
    ls -l "$G/chunks"
    local last; last=$(ls "$G/chunks" | tail -1)
    echo "stage: done. Device calls, back to back (each carries one chunk + all.tar.sha256):"
    for c in "$G"/chunks/*; do
        c=$(basename "$c")
        echo "  carry=[\".gpuvllm/chunks/$c\", \".gpuvllm/all.tar.sha256\"]" \
             "command: scripts/gpu_vllm_check.sh install .gpuvllm/chunks/$c" \
             "$([ "$c" = "$last" ] && echo "finish && scripts/gpu_vllm_check.sh run")"
    done
}

install() {
    local part=$1 fin=${2:-} t0; t0=$(date +%s)
    mkdir -p /tmp/gv
    local name; name=$(basename "$part")
    if grep -qx "$name" /tmp/gv/parts 2>/dev/null; then
        echo "install: $name already appended"
    else
        cat "$part" >>/tmp/gv/all.tar.part && echo "$name" >>/tmp/gv/parts
        echo "install: appended $name; parts so far: $(tr '\n' ' ' </tmp/gv/parts)"
    fi
    [ "$fin" = finish ] || return 0
    local want got; want=$(cat "$G/all.tar.sha256"); got=$(sha256sum /tmp/gv/all.tar.part | cut -d' ' -f1)
    if [ "$want" != "$got" ]; then
        echo "install: sha256 of the parts $(tr '\n' ' ' </tmp/gv/parts) is $got, want $want:" \
             "a chunk is missing or the machine was given back between calls (start again)"
        exit 3
    fi
    rm -rf /tmp/gv/x && mkdir -p /tmp/gv/x && tar -xf /tmp/gv/all.tar.part -C /tmp/gv/x
    rm -f /tmp/gv/all.tar.part
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$SITE" /tmp/gv/x/wheels/*.whl 2>&1 | grep -v "as the 'root' user" || true
    PYTHONPATH=$SITE python3 -c 'import vllm; print("install: vllm", vllm.__version__)'
    echo "install: finished in $(( $(date +%s) - t0 )) s"
}

run() {
    local out=${OUT:-$ROOT/gpu_out}
    mkdir -p "$out"
    # The device machines' rules (no NVLink multicast), unbuffered logs; flashinfer is not
    # carried, so vLLM's sampler must not ask for it.
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1
    export VLLM_HOST_IP=127.0.0.1 PYTHONPATH=$ROOT:$SITE
    [ -d "$SITE/vllm" ] || { echo "run: no vLLM in $SITE: run the install calls first"; exit 3; }
    if [ ! -f "$ROOT/.gpuvllm-built" ]; then
        python3 setup.py build_ext --inplace -j 16 -q >"$out/build.log" 2>&1 \
            || { tail -30 "$out/build.log"; exit 1; }
        touch "$ROOT/.gpuvllm-built"
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/machine.txt"
    python3 -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' \
        2>/dev/null | tee -a "$out/machine.txt"
    local parts=("$@"); [ ${#parts[@]} -gt 0 ] || parts=(tests fullhit trace pd)
    for p in "${parts[@]}"; do
        local t0; t0=$(date +%s)
        local b=(python3 benchmarks/vllm_ttft.py --python python3 --work "/tmp/gv/work-$p"
                 --model-dir "/tmp/gv/model-$([ "$p" = fullhit8b ] && echo 8b || echo 1b)")
        echo "=== run: $p" | tee -a "$out/progress.txt"
        case $p in
        tests)
            python3 -m pytest -q -rs -p no:cacheprovider --timeout 300 \
                tests/integrations/test_vllm_gpu.py tests/transports/test_gpu.py 2>&1 \
                | tail -15 | tee "$out/gpu-vllm-tests.txt" ;;
        fullhit)
            "${b[@]}" --gpu 1b --modes fullhit --requests 2 --start 0 --dram-mb 8192 \
                --ssd-mb 8192 --instance-gpu-util 0.14 --json "$out/gpu-vllm-fullhit.json" \
                2>&1 | tee "$out/gpu-vllm-fullhit.txt" ;;
        fullhit8b)
            "${b[@]}" --gpu 8b --modes fullhit --requests 2 --start 0 --dram-mb 16384 \
                --ssd-mb 16384 --instance-gpu-util 0.25 --fullhit-lengths 4096,16384 \
                --json "$out/gpu-vllm-fullhit8b.json" 2>&1 | tee "$out/gpu-vllm-fullhit8b.txt" ;;
        trace)
            # Each hash id of the trace is 256 tokens (Mooncake's are 512), at most 48 a
            # request: prompts of 0.25-12k tokens; vLLM's own cache (1 GiB = 32k tokens of
            # this model) is smaller than the requests' KV, the pool's DRAM (and vLLM's
            # OffloadingConnector's CPU memory) 4 GiB.
            "${b[@]}" --gpu 1b --modes vllm,nocache,offload,dram,ssd,nohit --requests 60 \
                --tokens-per-hash 256 --max-blocks 48 --kv-mb 1024 --dram-mb 4096 \
                --small-dram-mb 1024 --ssd-mb 8192 --instance-gpu-util 0.14 \
                --json "$out/gpu-vllm-trace.json" 2>&1 | tee "$out/gpu-vllm-trace.txt" ;;
        pd)
            "${b[@]}" --gpu 1b --modes pd,pd-tcp,pd-mc --requests 40 --tokens-per-hash 256 \
                --max-blocks 64 --kv-mb 2048 --instance-gpu-util 0.14 \
                --json "$out/gpu-vllm-pd.json" 2>&1 | tee "$out/gpu-vllm-pd.txt" ;;
        *) echo "run: unknown part $p (tests, fullhit, fullhit8b, trace, pd)"; exit 2 ;;
        esac
        echo "=== run: $p took $(( $(date +%s) - t0 )) s" | tee -a "$out/progress.txt"
    done
}

case $cmd in
stage) stage "$@" ;;
install) install "$@" ;;
run) run "$@" ;;
*) sed -n '3,22p' "$0"; exit 2 ;;
esac
