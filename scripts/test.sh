#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Quick start 2: set everything up, then run the whole test suite. CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# -rs: every skip and its reason in the summary at the end.
exec .venv/bin/python -m pytest -q -rs "$@"
