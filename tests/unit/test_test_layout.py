# SPDX-License-Identifier: Apache-2.0
"""tests/unit/ holds tests that need no server (issue 40, item 4): the ones that start
etcd, redis or an HTTP metadata server (tests/servers.py) live beside the code they
serve, in tests/metadata/ or tests/services/."""
from __future__ import annotations

import ast
import pathlib

UNIT = pathlib.Path(__file__).resolve().parent


def test_unit_tests_start_no_servers():
    bad = []
    for p in sorted(UNIT.glob("*.py")):
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.ImportFrom) and n.module == "servers" or \
                    isinstance(n, ast.Import) and any(a.name == "servers" for a in n.names):
                bad.append(f"{p.name}:{n.lineno}")
    assert not bad, ("these unit tests start servers; move them to tests/metadata/ or "
                     "tests/services/: " + ", ".join(bad))
