# SPDX-License-Identifier: Apache-2.0
"""Type stub of the compiled module ``mooncake_te.transports.nvmeof._nvmeof`` (scripts/stubgen.py)."""
from typing import Any


class Device:
    def __init__(self, *args: Any, **kwargs: Any) -> None: ...
    def submit(self, batch: Any, op: int, local: Any, offs: Any, lens: Any, first: int) -> Any: ...
    def transfer(self, op: int, local: int, off: int, length: int, deadline_ns: int) -> Any: ...
    def close(self, wait_ms: int = ...) -> Any: ...
    size: Any
    block: Any
    memalign: Any
    direct: Any
    path: Any
    regions: Any
    ident: Any

OUT_OF_RANGE: int
STORAGE_BASE: int
