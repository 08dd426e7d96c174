#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Quick start 1: set up what the demo uses (scripts/setup.sh --demo: a compiler and Python),
# then run the loopback transfer benchmark on the
# embedded defaults (a target engine in a second process, 127.0.0.1).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --demo
exec .venv/bin/mooncake-te bench --host 127.0.0.1 "$@"
