# SPDX-License-Identifier: Apache-2.0
"""A pytest plugin (``-p without_extras``) that makes the optional extras' client
libraries unimportable, as on a machine where ``pip install mooncake-te[dev]`` ran
without ``[redis,etcd,http]``; ``tests/tools/test_optional_extras.py`` runs tests under it."""
from __future__ import annotations

import importlib.abc
import sys

BLOCKED = {"redis", "hiredis", "etcd3gw", "aiohttp", "requests"}


class _Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


for _m in list(sys.modules):
    if _m.split(".")[0] in BLOCKED:
        del sys.modules[_m]
sys.meta_path.insert(0, _Missing())
