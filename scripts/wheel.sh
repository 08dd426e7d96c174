#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds a wheel of this checkout into dist/ (mooncake_te is not on PyPI): install it on a
# machine with the same Python and architecture with `pip install dist/mooncake_te-*.whl`.
# Needs a C compiler and the Python headers. Usage: scripts/wheel.sh [PYTHON]
# (default: .venv/bin/python where scripts/setup.sh made it, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-${PYTHON:-}}
if [[ -z $PY ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
mkdir -p dist
if "$PY" -c "import build" 2>/dev/null; then
    "$PY" -m build --wheel --outdir dist .
else
    # pip alone: it fetches the build requirements (setuptools, Cython, numpy) itself.
    "$PY" -m pip wheel --no-deps --wheel-dir dist .
fi
echo "wheel.sh: built $(ls -t dist/*.whl | head -1); install it with: pip install <that file>"
