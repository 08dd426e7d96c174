# SPDX-License-Identifier: Apache-2.0
"""The package's layering, checked on the source with ast (docs/architecture.md):

    tools -> services/integrations -> facade -> transports -> core

A module imports only from its own layer or the layers below it, and no module of one
transport imports another transport (they share only ``transports.base`` and the core).
Imports inside functions count too: a lazy import is still a dependency.
"""
from __future__ import annotations

import ast
import pathlib
import re

import pytest

PKG = pathlib.Path(__file__).resolve().parents[2] / "mooncake_te"

CORE, TRANSPORTS, FACADE, SERVICES, TOOLS = range(5)
NAMES = ("core", "transports", "facade", "services/integrations", "tools")

# Top-level names of mooncake_te and their layer. A new top-level module or folder must
# be placed here (the test fails until it is), which is the point: say where it belongs.
LAYER = {
    # core: the native core and the plain libraries every transport may use
    "core": CORE, "errors": CORE, "batch": CORE, "memory": CORE, "cuda": CORE,
    "config": CORE, "metadata": CORE, "addresses": CORE, "units": CORE, "topology": CORE, "nvmeof_admin": CORE,
    "nvmeof": CORE,
    "transports": TRANSPORTS,
    # the facade: TransferEngine and the modules it is made of
    "": FACADE, "engine": FACADE, "routing": FACADE, "regions": FACADE,
    "segments": FACADE, "submit": FACADE, "auth": FACADE, "netif": FACADE,
    "prepared": FACADE,
    "kvcache": SERVICES, "p2p_store": SERVICES, "objdir": SERVICES, "integrations": SERVICES,
    "compat": SERVICES, "conductor": SERVICES,
    "cli": TOOLS, "bench": TOOLS, "doctor": TOOLS, "lab": TOOLS, "__main__": TOOLS,
    "_spawn": TOOLS, "arguments": CORE, "metrics": CORE, "hugepages": CORE,
}

# Known exceptions, each with the reason and who removes it. Keep this empty.
ALLOWED: dict = {}


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        yield ".".join(parts), is_pkg, path


def _exists(dotted: str) -> bool:
    p = PKG.parent.joinpath(*dotted.split("."))
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists() or \
        any(p.parent.glob(p.name + ".*.so")) or p.with_suffix(".pyx").exists()


def _imports(module: str, is_pkg: bool, path: pathlib.Path):
    """Every mooncake_te module ``module`` imports (resolved), with its line."""
    tree = ast.parse(path.read_text(), str(path))
    pkg = module if is_pkg else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "mooncake_te":
                    yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - node.level + 1]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.split(".")[0] != "mooncake_te":
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                yield (sub if a.name != "*" and _exists(sub) else base), node.lineno


def _layer(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else ""
    assert top in LAYER, (f"{module}: top-level name {top!r} has no layer; add it to LAYER "
                          f"in {__file__} (and to docs/architecture.md)")
    return LAYER[top]


def _transport(module: str) -> str | None:
    """The transport a module belongs to (``tcp`` for mooncake_te.transports.tcp._tcp),
    ``""`` for the shared modules of transports/, None outside transports/."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1] != "transports":
        return None
    if len(parts) == 2 or parts[2] == "base":
        return ""
    return parts[2]


EDGES = [(m, target, line) for m, is_pkg, path in _modules()
         for target, line in _imports(m, is_pkg, path)]


def test_the_walk_sees_the_package():
    mods = {m for m, _, _ in _modules()}
    assert {"mooncake_te.engine", "mooncake_te.transports.tcp",
            "mooncake_te.transports.base"} <= mods
    assert any(t == "mooncake_te.transports.base" for m, t, _ in EDGES
               if m == "mooncake_te.transports.tcp")


@pytest.mark.parametrize("layer", range(5), ids=NAMES)
def test_no_upward_imports(layer):
    bad = []
    for m, target, line in EDGES:
        if _layer(m) != layer or (m, target) in ALLOWED:
            continue
        if _layer(target) > layer:
            bad.append(f"{m}:{line} imports {target} ({NAMES[_layer(target)]})")
    assert not bad, f"{NAMES[layer]} must not import upward:\n" + "\n".join(bad)


def test_no_transport_imports_another():
    bad = []
    for m, target, line in EDGES:
        mine, theirs = _transport(m), _transport(target)
        if not mine or theirs is None:
            continue          # outside transports/, or the shared modules of transports/
        if theirs != mine and not (theirs == "" and target.endswith(".base")):
            bad.append(f"{m}:{line} imports {target}")
    assert not bad, "transports import one another:\n" + "\n".join(bad)


def test_allowed_exceptions_are_still_needed():
    seen = {(m, t) for m, t, _ in EDGES}
    stale = [k for k in ALLOWED if k not in seen]
    assert not stale, f"remove these from ALLOWED, they no longer happen: {stale}"


def _cycles(edges) -> list:
    """Strongly connected components of more than one module (Tarjan's algorithm, by
    hand: a few dozen lines, no dependency for one check). A package's ``__init__``
    re-exporting its own submodules is not a cycle of design: edges from a package to
    a module inside it are left out."""
    graph: dict = {}
    for src, dst, _ in edges:
        if dst.startswith(src + "."):
            continue
        graph.setdefault(src, set()).add(dst)
    index: dict = {}
    low: dict = {}
    stack: list = []
    on: set = set()
    out: list = []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in list(graph):
        if v not in index:
            visit(v)
    return out


# Cycles kept on purpose, each with its reason; the test below fails when one goes away.
# Keep this empty: the last one (compat.store <-> compat.dummy) was removed by structure
# (issue 40): the dummy side (compat.dummy_client) imports no store, the store builds
# DummyStore from it, and the real client (compat.dummy) imports the store.
CYCLES_ALLOWED: set = set()


def test_no_import_cycles():
    """No two modules import each other, directly or around a loop, lazy imports included
    (a cycle hidden in a function is still one: neither module can be read alone)."""
    cycles = [c for c in _cycles(EDGES) if tuple(c) not in CYCLES_ALLOWED]
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_allowed_cycles_are_still_cycles():
    found = {tuple(c) for c in _cycles(EDGES)}
    assert not (CYCLES_ALLOWED - found), f"remove from CYCLES_ALLOWED: {CYCLES_ALLOWED - found}"


def test_the_cycle_check_finds_a_cycle():
    assert _cycles([("a.x", "a.y", 1), ("a.y", "a.z", 2), ("a.z", "a.x", 3)]) == [
        ["a.x", "a.y", "a.z"]]
    assert _cycles([("a", "a.b", 1), ("a.b", "a", 2)]) == []


# --- Cython cimports, C includes, transport names as strings (issue 40, item 4) --------
SRC = PKG.parent / "src"
CIMPORT = re.compile(r"^[ \t]*(?:from\s+(mooncake_te[\w.]*)\s+cimport\b|cimport\s+(mooncake_te[\w.]*))",
                     re.M)
EXTERN = re.compile(r'^[ \t]*cdef\s+extern\s+from\s+"([^"]+)"', re.M)
INCLUDE = re.compile(r'^[ \t]*#[ \t]*include\s+"([^"]+)"', re.M)


def _cython_files():
    for path in sorted(list(PKG.rglob("*.pyx")) + list(PKG.rglob("*.pxd"))):
        rel = path.relative_to(PKG.parent).with_suffix("")
        yield ".".join(rel.parts), path


def _cimports():
    """(module, cimported module, line) of every .pyx/.pxd of the package."""
    out = []
    for module, path in _cython_files():
        text = path.read_text()
        for m in CIMPORT.finditer(text):
            out.append((module, m.group(1) or m.group(2), text.count("\n", 0, m.start()) + 1))
    return out


def _externs():
    """(module, header, line) of every ``cdef extern from "<dir>/<header>"``."""
    out = []
    for module, path in _cython_files():
        text = path.read_text()
        for m in EXTERN.finditer(text):
            out.append((module, m.group(1), text.count("\n", 0, m.start()) + 1))
    return out


def _includes():
    """(source dir under src/, included file resolved under src/ or None, file, line)."""
    out = []
    for path in sorted(SRC.rglob("*.[ch]")) + sorted(SRC.rglob("*.cu")):
        text = path.read_text()
        for m in INCLUDE.finditer(text):
            target = (path.parent / m.group(1)).resolve()
            if not target.exists():
                target = (SRC / m.group(1)).resolve()
            rel = target.relative_to(SRC.resolve()) if target.exists() else None
            out.append((path.relative_to(SRC).parts[0], rel, path.relative_to(SRC),
                        text.count("\n", 0, m.start()) + 1))
    return out


def test_the_cython_and_c_walks_see_the_sources():
    assert ("mooncake_te.transports.tcp._tcp", "mooncake_te.core._core", 16) in \
        [(m, t, n) for m, t, n in _cimports()]
    assert any(h == "tcp/tcp.h" for _, h, _ in _externs())
    assert any(d == "tcp" and str(t) == "core/api.h" for d, t, _, _ in _includes())


def test_no_upward_or_cross_transport_cimports():
    bad = []
    for m, target, line in _cimports():
        if _layer(target) > _layer(m):
            bad.append(f"{m}:{line} cimports {target} ({NAMES[_layer(target)]})")
        mine, theirs = _transport(m), _transport(target)
        if mine and theirs is not None and theirs not in ("", mine):
            bad.append(f"{m}:{line} cimports {target} (another transport)")
    assert not bad, "\n".join(bad)


def test_a_transport_declares_only_its_own_and_the_cores_headers():
    bad = []
    for m, header, line in _externs():
        top = header.split("/")[0] if "/" in header else None
        mine = _transport(m)
        if top is None or top not in {p.name for p in SRC.iterdir()}:
            continue                                     # a system header
        if mine is None:
            ok = top == "core"
        else:
            ok = top in ("core", mine)
        if not ok:
            bad.append(f"{m}:{line} declares {header}")
    assert not bad, "\n".join(bad)


def test_c_sources_include_only_their_own_dir_and_the_core_api():
    """src/core includes only src/core; a transport's C code includes its own dir and,
    of the core, only core/api.h (the function table), never another transport."""
    bad = []
    for src_dir, target, path, line in _includes():
        if target is None:
            bad.append(f"src/{path}:{line} includes a file that does not exist")
            continue
        top = target.parts[0]
        if top == src_dir:
            continue
        if src_dir != "core" and src_dir != "cuda" and str(target) == "core/api.h":
            continue
        bad.append(f"src/{path}:{line} includes src/{target}")
    assert not bad, "\n".join(bad)


def test_the_include_check_can_fail(tmp_path, monkeypatch):
    bad = SRC / "tcp" / "_layering_probe.c"
    bad.write_text('#include "../rdma/rdma.h"\n')
    try:
        hits = [(d, str(t)) for d, t, p, _ in _includes() if p.name == bad.name]
        assert hits == [("tcp", "rdma/rdma.h")]
        with pytest.raises(AssertionError, match="includes src/rdma/rdma.h"):
            test_c_sources_include_only_their_own_dir_and_the_core_api()
    finally:
        bad.unlink()


# Transport names that code outside transports/ must not spell: every layer learns what a
# transport does from its declarations (capabilities, serves, settings), never from its
# name (issue 40, item e).
TRANSPORT_NAMES = {"tcp", "shm", "rdma", "nvmeof", "cuda_ipc", "cuda_dma"}
# Modules outside transports/ that may spell one, and why. Keep it short.
NAME_ALLOWED = {
    # storage segments publish which transport serves them (a descriptor field)
    "mooncake_te.metadata.storage",
    # NVMe-oF fabric transports (nvmet's "tcp"/"rdma" trtype), not ours
    "mooncake_te.nvmeof_admin.host", "mooncake_te.nvmeof_admin.segment",
    "mooncake_te.nvmeof_admin.target", "mooncake_te.cli.nvmeof",
    # the `nvmeof` command's name (cli/nvmeof.py)
    "mooncake_te.cli.main",
    # Mooncake's API takes and returns its protocol names ("tcp", "rdma") as strings
    "mooncake_te.compat.engine", "mooncake_te.compat.mooncake_config",
    "mooncake_te.compat.store",
    # mooncake_client's --protocol flag (Mooncake's names)
    "mooncake_te.compat.dummy",
    # checks of the RDMA devices and the RDMA transport's settings: about it by design
    "mooncake_te.doctor.checks",
    # the lab builds a Soft-RoCE and NVMe-oF fabric for the rdma and nvmeof suites
    "mooncake_te.lab.guest", "mooncake_te.lab.host", "mooncake_te.lab.selftest",
    "mooncake_te.lab.stage2",
}
ALL_LAYERS = (CORE, FACADE, SERVICES, TOOLS)


def _docstrings(tree) -> set:
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and n.body and isinstance(n.body[0], ast.Expr) \
                and isinstance(n.body[0].value, ast.Constant):
            out.add(id(n.body[0].value))
    return out


def _names_as_strings(layers=ALL_LAYERS):
    out = []
    for m, _, path in _modules():
        if _transport(m) is not None or _layer(m) not in layers:
            continue
        tree = ast.parse(path.read_text())
        docs = _docstrings(tree)
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) \
                    and n.value in TRANSPORT_NAMES and id(n) not in docs:
                out.append((m, n.lineno, n.value))
    return out


def test_no_module_outside_transports_names_one():
    bad = [f"{m}:{line} names {v!r}" for m, line, v in _names_as_strings()
           if m not in NAME_ALLOWED]
    assert not bad, ("code outside transports/ reads capabilities, not transport names "
                     "(or add the module to NAME_ALLOWED with the reason):\n" + "\n".join(bad))


def test_allowed_transport_names_are_still_needed():
    seen = {m for m, _, _ in _names_as_strings()}
    assert not (NAME_ALLOWED - seen), f"remove from NAME_ALLOWED: {NAME_ALLOWED - seen}"


def test_kvcache_and_p2p_store_share_only_the_object_directory():
    """The KV cache's owner index and the P2P store are two users of one object directory
    (``mooncake_te.objdir``, issue 40): neither imports the other, and both import it."""
    bad, uses = [], set()
    for m, target, line in EDGES:
        src, dst = (m.split(".") + [""])[1], (target.split(".") + [""])[1]
        if {src, dst} == {"kvcache", "p2p_store"}:
            bad.append(f"{m}:{line} imports {target}")
        if dst == "objdir" and src in ("kvcache", "p2p_store"):
            uses.add(src)
    assert not bad, "kvcache and p2p_store import each other:\n" + "\n".join(bad)
    assert uses == {"kvcache", "p2p_store"}, f"only {sorted(uses)} use mooncake_te.objdir"
