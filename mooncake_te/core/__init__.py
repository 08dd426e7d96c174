# SPDX-License-Identifier: Apache-2.0
"""What every transport shares: the native core (``_core``: the region table, the
engine-wide batch, the clock, GPU staging, socket I/O; src/core/) and this host's
identity. Transports depend on this package, never on each other."""
from ._core import (ACC_READ, ACC_WRITE, OP_READ, OP_WRITE, NativeBatch,  # noqa: F401
                    PreparedTable, cuda_driver,
                    Regions, gather_blocks, now_ns, ST_PENDING, ST_COMPLETED, ST_FAILED, ST_TIMEOUT,
                    ST_CANCELED)
from .host import HOST_ID, host_id  # noqa: F401
