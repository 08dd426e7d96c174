#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds the documentation site from docs/ into site/ (MkDocs, Material theme; the API
# reference comes from the docstrings through mkdocstrings). Warnings are errors
# (mkdocs.yml: strict), as in CI. `./scripts/docs.sh serve` serves it on 127.0.0.1:8000.
# Needs the [docs] extra (scripts/setup.sh installs it).
set -euo pipefail
cd "$(dirname "$0")/.."
export NO_MKDOCS_2_WARNING=1    # the theme's notice about its successor, not a docs problem
MKDOCS=(.venv/bin/python -m mkdocs)
if [[ "${1:-}" == "serve" ]]; then
    exec "${MKDOCS[@]}" serve --dev-addr 127.0.0.1:8000
fi
exec "${MKDOCS[@]}" build --strict --quiet "$@"
