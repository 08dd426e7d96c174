# SPDX-License-Identifier: Apache-2.0
"""``mooncake_te.nvmeof``: the name docs/api.md gives the NVMe-oF target/host admin API,
kept for callers. The code lives in :mod:`mooncake_te.nvmeof_admin` (the data path is
:mod:`mooncake_te.transports.nvmeof`)."""
from __future__ import annotations

import sys

from .nvmeof_admin import *  # noqa: F401,F403
from .nvmeof_admin import __all__, host, segment, target  # noqa: F401

# ``import mooncake_te.nvmeof.host`` keeps working too.
for _m in (host, segment, target):
    sys.modules[f"{__name__}.{_m.__name__.rpartition('.')[2]}"] = _m
del _m
