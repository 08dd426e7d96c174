# SPDX-License-Identifier: Apache-2.0
"""Type stub of the compiled module ``mooncake_te.transports.tcp._tcp`` (scripts/stubgen.py)."""
from typing import Any


class Peer:
    def __init__(self, *args: Any, **kwargs: Any) -> None: ...
    def transfer_sync(self, op: int, local: int, remote: int, length: int, deadline_ns: int,
                      cell: int = ...) -> Any: ...
    def queued(self) -> int: ...
    def submit(self, batch: Any, op: int, local: Any, remote: Any, lens: Any, first: int, run_inline: Any = ...) -> Any: ...
    def add_notify(self, batch: Any, msg: bytes) -> Any: ...
    def shutdown(self) -> Any: ...
    seen_instance: Any
    cma: Any
    restarted: Any
    server: Any
    host: Any
    port: Any
    lanes: Any
    uds: Any
    key: Any

READ: int

class TcpServer:
    def __init__(self, *args: Any, **kwargs: Any) -> None: ...
    def push_notification(self, sender: str, msg: bytes) -> Any: ...
    def take_notifications(self) -> Any: ...
    def counters(self) -> tuple: ...
    def set_limits(self, max_connections: int, max_per_peer: int, auth_timeout_ms: int,
                   idle_timeout_ms: int) -> None: ...
    auth_failures: Any
    regions: Any
    port: Any
    uds_name: Any

WRITE: int
