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


# Modules whose tests do not carry their name, and where they are. The engine's parts
# (split out of engine.py by job) are exercised through the engine's public API, as
# users reach them: naming a test file after each internal part would test the split,
# not the behaviour.
ENGINE_TESTS = ["unit/test_engine_api.py", "transports/test_transfer.py",
                "transports/test_fake_routing.py"]
TESTS_OF = {
    "batch": ["unit/test_status_codes.py"] + ENGINE_TESTS,
    "errors": ["unit/test_status_codes.py"],
    "regions": ENGINE_TESTS,
    "routing": ENGINE_TESTS + ["transports/test_sync_route.py"],
    "segments": ENGINE_TESTS + ["transports/test_identity.py"],
    "submit": ENGINE_TESTS,
    "nvmeof_admin": ["fabric/test_nvmeof.py"],
    "integrations": ["integrations/test_vllm_connector.py"],
}
TESTS = UNIT.parent


def _modules() -> list:
    pkg = TESTS.parent / "mooncake_te"
    return sorted({p.stem if p.is_file() else p.name for p in pkg.iterdir()
                   if (p.suffix == ".py" or (p / "__init__.py").exists())
                   and not p.name.startswith("_")})


def test_every_module_has_tests_a_reader_can_find():
    """From a module's path to its tests (issue 40): ``mooncake_te/<name>.py`` or
    ``mooncake_te/<name>/`` is tested in ``tests/<layer>/test_<name>*.py`` or
    ``tests/<name>/``, or in the
    files :data:`TESTS_OF` names (each of which must exist and name the module)."""
    missing, stale = [], []
    for name in _modules():
        if name in TESTS_OF:
            for rel in TESTS_OF[name]:
                f = TESTS / rel
                if not f.exists():
                    stale.append(f"{name}: {rel} does not exist")
            continue
        if not (TESTS / name).is_dir() and not list(TESTS.glob(f"*/test_{name}*.py")):
            missing.append(name)
    assert not missing, (f"no tests/<layer>/test_<name>*.py for {missing}: name a test "
                         "file after the module, or list where its tests are in TESTS_OF")
    assert not stale, stale
    assert not set(TESTS_OF) - set(_modules()), "TESTS_OF names a module that is gone"


def test_named_test_files_mention_their_module():
    """A file listed in :data:`TESTS_OF` for a module exercises it: it imports the module
    or, for the engine's parts, the engine."""
    bad = []
    for name, files in TESTS_OF.items():
        for rel in files:
            text = (TESTS / rel).read_text()
            engine = rel in ENGINE_TESTS and ("TransferEngine" in text or "mte." in text)
            if not engine and name not in text:
                bad.append(f"{rel} does not mention {name}")
    assert not bad, bad
