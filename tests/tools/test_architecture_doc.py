# SPDX-License-Identifier: Apache-2.0
"""docs/architecture.md's "where each kind of change goes" list is checked (issue 40,
item 4): every path it names exists, and for each kind of extension a new one that
skips a registration step fails here."""
from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = ROOT / "mooncake_te"
DOC = ROOT / "docs" / "architecture.md"


def _rows() -> list:
    text = DOC.read_text()
    m = re.search(r"<!-- where-each-change-goes -->\n(.*?)<!-- /where-each-change-goes -->",
                  text, re.S)
    assert m, "docs/architecture.md lost its where-each-change-goes table"
    rows = [r for r in m.group(1).splitlines() if r.startswith("|") and "---" not in r]
    return [[c.strip() for c in r.strip("|").split("|")] for r in rows[1:]]


def _paths(change: str, files: str) -> list:
    example = dict(re.findall(r"`(<\w+>)` = `([^`]+)`", change))
    out = []
    for token in re.findall(r"`([^`]+)`", files):
        if "/" not in token and not token.endswith((".py", ".h", ".c", ".md")):
            continue                              # a name (probe, COMMANDS), not a path
        for ph, value in example.items():
            token = token.replace(ph, value)
        out.append(token)
    return out


def test_the_list_names_every_kind():
    kinds = [r[0].split(" (")[0] for r in _rows()]
    assert kinds == ["Transport", "KV cache tier", "Metadata backend", "CLI command",
                     "Status code", "Top-level module"]


def test_every_path_in_the_list_exists():
    missing = []
    for change, files in _rows():
        paths = _paths(change, files)
        assert paths, change
        for p in paths:
            assert "<" not in p, f"{change}: {p} has a placeholder without an example"
            if not (ROOT / p).exists():
                missing.append(f"{change}: {p}")
    assert not missing, "docs/architecture.md names paths that do not exist:\n" + \
        "\n".join(missing)


def test_the_path_check_can_fail():
    assert _paths("Thing (`<name>` = `nope`)", "`mooncake_te/<name>.py`; `COMMANDS`") == \
        ["mooncake_te/nope.py"]
    assert not (ROOT / "mooncake_te/nope.py").exists()


# --- each kind: a new one that forgets a registration step fails ---------------------
def _literal(path: pathlib.Path, name: str):
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, (ast.Assign, ast.AnnAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            if any(getattr(t, "id", None) == name for t in targets):
                return ast.literal_eval(n.value)
    raise AssertionError(f"{path}: no {name}")


def test_every_transport_package_is_probed_and_in_the_contract_suite():
    from mooncake_te.transports import _BUILTIN
    contract = (ROOT / "tests" / "transports" / "test_contract.py").read_text()
    for d in sorted((PKG / "transports").iterdir()):
        if not (d / "__init__.py").exists():
            continue
        assert d.name in _BUILTIN, f"transports/{d.name}: add it to probe() (_BUILTIN)"
        assert f'"{d.name}"' in contract, \
            f"transports/{d.name}: add it to the side fixture of tests/transports/test_contract.py"


def test_every_kv_tier_module_is_registered():
    builtin = _literal(PKG / "kvcache" / "tiers.py", "_BUILTIN")
    for p in sorted((PKG / "kvcache").glob("*.py")):
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.ClassDef) and any(getattr(b, "id", "") == "Tier"
                                                   for b in n.bases) and p.name != "tiers.py":
                assert f"mooncake_te.kvcache.{p.stem}:{n.name}" in builtin, \
                    f"kvcache/{p.name}: {n.name} is a Tier; add it to tiers._BUILTIN"


def test_every_metadata_store_has_a_scheme_and_an_opener():
    from mooncake_te.metadata.url import STORE_SCHEMES
    opener = (PKG / "metadata" / "stores" / "__init__.py").read_text()
    for p in sorted((PKG / "metadata" / "stores").glob("[!_]*.py")):
        assert p.stem in STORE_SCHEMES, f"metadata/stores/{p.name}: add its scheme to url.py"
        assert f"from .{p.stem} import" in opener, \
            f"metadata/stores/{p.name}: open it in stores.open_store"


def test_every_cli_module_is_a_command():
    commands = _literal(PKG / "cli" / "main.py", "COMMANDS")
    for p in sorted((PKG / "cli").glob("[!_]*.py")):
        if p.stem == "main":
            continue
        assert p.stem in commands.values(), f"cli/{p.name}: register it in cli/main.py"


def test_a_transport_touches_its_package_and_at_most_three_registration_points():
    """Issue 40's "done when": adding a transport touches its own package plus at most
    three registration points. The fake transport shows it with one
    (tests/transports/test_fake_settings.py); this counts the built-in route."""
    change, files = next(r for r in _rows() if r[0].startswith("Transport"))
    name = dict(re.findall(r"`(<\w+>)` = `([^`]+)`", change))["<name>"]
    own = (f"mooncake_te/transports/{name}/", f"src/{name}/")
    outside = [p for p in _paths(change, files) if not p.startswith(own)]
    assert len(outside) <= 3, outside
    assert (PKG / "transports" / name / "settings.py").exists()
    # the configuration learns each transport's keys from its settings.py, not its own list
    for d in sorted((PKG / "transports").iterdir()):
        if (d / "__init__.py").exists():
            assert (d / "settings.py").exists(), \
                f"transports/{d.name}: declare SERVES (and its keys) in settings.py"
