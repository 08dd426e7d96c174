#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Write the ``.pyi`` stub of each compiled module from the signatures Cython embeds in
its docstrings (setup.py compiles with ``embedsignature``).

Run it after adding or renaming a ``.pyx`` (the packaging test wants one stub per built
module), then review the result: argument types come from the C declarations, return
types are ``Any``. Usage::

    .venv/bin/python scripts/stubgen.py            # every compiled module of the package
    .venv/bin/python scripts/stubgen.py mooncake_te.core._core
"""
from __future__ import annotations

import glob
import importlib
import inspect
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
C_TYPES = {"bint": "bool", "double": "float", "float": "float", "bytes": "bytes", "str": "str",
           "list": "list", "dict": "dict", "tuple": "tuple", "object": "object"}
INT = re.compile(r"^(unsigned|signed|int|long|short|size_t|ssize_t|Py_ssize_t|u?int\d+_t|"
                 r"uintptr_t)$")


def _split(params: str) -> list:
    depth, cur, out = 0, "", []
    for ch in params:
        depth += ch in "([" and 1 or ch in ")]" and -1 or 0
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [p.strip() for p in out + [cur] if p.strip()]


def _param(p: str) -> str:
    default = ""
    if "=" in p:
        p, default = p.split("=", 1)[0].strip(), " = ..."
    star = "**" if p.startswith("**") else "*" if p.startswith("*") else ""
    words = p.lstrip("*").replace("*", " ").split()
    name, ctype = words[-1], " ".join(w for w in words[:-1] if w != "const")
    if not ctype or name == "self":
        return star + name + default
    last = ctype.split()[-1]
    typ = "Any" if "[" in ctype else "int" if INT.match(last) else C_TYPES.get(last, "Any")
    return f"{star}{name}: {typ}{default}"


def _def(obj, name: str, method: bool) -> str:
    doc = (obj.__doc__ or "").strip().split("\n")[0]
    m = re.match(r"[\w.]*?\w+\((.*)\)", doc)
    params = [_param(p) for p in _split(m.group(1))] if m else ["*args: Any", "**kwargs: Any"]
    if method and params[:1] != ["self"]:
        params.insert(0, "self")
    ret = "None" if name == "__init__" else "Any"
    return f"def {name}({', '.join(params)}) -> {ret}: ..."


def stub(modname: str) -> str:
    mod = importlib.import_module(modname)
    out = ["# SPDX-License-Identifier: Apache-2.0",
           f'"""Type stub of the compiled module ``{modname}`` (scripts/stubgen.py)."""',
           "from typing import Any", ""]
    for name, v in sorted(vars(mod).items()):
        if name.startswith("__") or inspect.ismodule(v):
            continue
        if isinstance(v, (int, float, str, bytes)) and not isinstance(v, bool):
            out.append(f"{name}: {type(v).__name__}")
        elif inspect.isclass(v) and v.__module__ == modname:
            body = [] if "__init__" in vars(v) else \
                ["def __init__(self, *args: Any, **kwargs: Any) -> None: ..."]
            for an, av in vars(v).items():
                if an.startswith("__") and an not in ("__init__", "__enter__", "__exit__",
                                                      "__len__"):
                    continue
                kind = type(av).__name__
                if kind in ("getset_descriptor", "member_descriptor", "property"):
                    body.append(f"{an}: Any")
                elif callable(av):
                    body.append(_def(av, an, True))
            out += ["", f"class {name}:"] + [f"    {b}" for b in body] + [""]
        elif callable(v) and getattr(v, "__module__", None) == modname:
            out += ["", _def(v, name, False)]
    return "\n".join(out).rstrip() + "\n"


def main(argv: list) -> int:
    sys.path.insert(0, ROOT)
    mods = argv or sorted(
        os.path.relpath(p, ROOT).split(".", 1)[0].replace(os.sep, ".")
        for p in glob.glob(os.path.join(ROOT, "mooncake_te", "**", "*.so"), recursive=True))
    for m in mods:
        path = os.path.join(ROOT, *m.split(".")) + ".pyi"
        with open(path, "w") as f:
            f.write(stub(m))
        print(f"wrote {os.path.relpath(path, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
