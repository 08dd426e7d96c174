# SPDX-License-Identifier: Apache-2.0
"""What the TCP transport declares (``mooncake_te.transports`` hands it to
:func:`mooncake_te.config.declare_transport`): its ``protocol=`` names, its
``[transfer_engine]`` keys with Mooncake's ``MC_*`` variables, and ``MC_FORCE_TCP``.
Pure Python: read before the native module is loaded."""
from __future__ import annotations

import os

from ...config import Setting

_INT, _NUM = (int,), (int, float)


def default_tcp_lanes(cpus: "int | None" = None) -> int:
    """TCP lanes per peer when nothing sets them: half the CPUs this process may run on,
    2 to 8. Measured (docs/benchmarks.md, section 6): on 2 CPUs 2 lanes moved 1.02-1.13x
    iperf3's one stream and 4 lanes 0.97-1.00x; on 16 CPUs 8 lanes moved 27 GB/s and 4
    lanes 17."""
    if cpus is None:
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = os.cpu_count() or 2
    return max(2, min(8, cpus // 2))


#: the protocol= values it carries: TCP, and same-host peers over its unix socket
SERVES = ("auto", "tcp", "shm")

SETTINGS = (
    Setting("tcp_lanes", _INT, default_tcp_lanes(),
            bounds=(1, None, "a positive number of TCP lanes per peer"),
            env=(("MC_TCP_LANES_PER_PEER", int), ("MC_TCP_MAX_CONNECTIONS_PER_PEER", int))),
    Setting("tcp_slice_size", _INT, 256 << 10, bounds=(1, None, "a positive number of bytes"),
            env=(("MC_TCP_SLICE_SIZE", int),)),
    # The data port's limits (docs/security.md, issue #20 item 6); 0 connections: from
    # the descriptor limit (transports.tcp.default_max_connections).
    Setting("data_max_connections", _INT, 0,
            bounds=(0, 1 << 20, "a number of connections (0: from the descriptor limit)")),
    Setting("data_max_per_peer", _INT, 128,
            bounds=(1, 1 << 20, "a positive number of connections")),
    Setting("data_auth_timeout_s", _NUM, 10.0,
            bounds=(0.1, 3600, "seconds between 0.1 and 3600")),
    Setting("data_idle_timeout_s", _NUM, 600.0, bounds=(0, 10 ** 6, "seconds, 0 for never")),
)

#: Mooncake's MC_FORCE_TCP: protocol = "tcp" when true
FORCE_ENV = {"MC_FORCE_TCP": "tcp"}
