# SPDX-License-Identifier: Apache-2.0
"""One bench run's resources: the target (a loopback child or a remote segment), the
initiator engine and its buffer, closed in the right order whatever happens."""
from __future__ import annotations

import numpy as np

from .runner import Runner
from .target import LoopbackTarget, TargetControl


class BenchSession:
    """Set up an initiator against a bench target; a context manager.

    Parameters
    ----------
    mode : str
        ``"loopback"`` (start a target child process on ``host``) or ``"initiator"``
        (use the running target ``segment``).
    host : str, optional
        Address of the initiator engine (and of the loopback target).
    segment : str, optional
        The target's segment name (initiator mode).
    buffer_size : int
        Bytes to register on each side (the initiator uses at most what the target has).
    metadata, protocol : str, optional
        Passed to the engines.
    devices, target_devices : str, optional
        RDMA device lists ("rxe0" or "mlx5_0,mlx5_1") of the initiator and of the
        loopback target.
    """

    def __init__(self, mode: str, host: str | None = None, segment: str | None = None,
                 buffer_size: int = 128 << 20, metadata: str | None = None,
                 protocol: str | None = None, devices: str | None = None,
                 target_devices: str | None = None):
        from ..batch import READ
        from ..engine import TransferEngine
        from ..errors import InvalidArgumentError
        self.mode = mode
        self.child = None
        self.engine = None
        try:
            if mode == "loopback":
                self.child = LoopbackTarget(host or "127.0.0.1", buffer_size, metadata,
                                            protocol, devices=target_devices)
                segment = self.child.segment
                host = host or "127.0.0.1"
            elif mode == "initiator":
                if not segment:
                    raise InvalidArgumentError(
                        "initiator mode needs --segment NAME: the name a "
                        "`mooncake-te bench --mode target` printed")
            else:
                raise InvalidArgumentError(f"mode must be 'loopback' or 'initiator', "
                                           f"got {mode!r}")
            self.segment = segment
            self.engine = TransferEngine(host=host, metadata=metadata, protocol=protocol,
                                         devices=devices)
            seg = self.engine.open_segment(segment)
            if not seg.buffers:
                raise InvalidArgumentError(f"segment {segment} published no buffers; is it a "
                                           f"`mooncake-te bench --mode target`?")
            # The target registers one buffer; with several, use the largest writable one.
            buf = max(seg.buffers, key=lambda b: (getattr(b, "access", "rw") == "rw",
                                                  b.length))
            self.remote_address, self.remote_length = buf.address, buf.length
            self.local = np.empty(min(buffer_size, buf.length), dtype=np.uint8)
            self.local.fill(0xA5)         # fault every page in before anything is timed
            region = self.engine.register(self.local)
            # What actually carries bytes to this peer (a same-host peer gets "shm").
            probe = self.engine.submit_arrays(READ, segment, [region.address],
                                              [self.remote_address], 64)
            probe.wait()
            self.transport = probe.transport
            self.runner = Runner(self.engine, segment, self.remote_address,
                                 self.remote_length, self.local,
                                 TargetControl(self.engine, segment))
        except BaseException:
            self.close()
            raise

    def header(self) -> dict:
        """Who measured what: for the report's first line and the JSON."""
        from .. import __version__
        return {"mode": self.mode, "initiator": self.engine.name, "segment": self.segment,
                "transport": self.transport, "remote_buffer": self.remote_length,
                "local_buffer": int(self.local.nbytes), "version": __version__,
                "target_pid": self.child.proc.pid if self.child else None}

    def run(self, cfg, progress=None) -> dict:
        """Run ``cfg``; the results carry :meth:`header` under ``"header"``."""
        results = self.runner.run(cfg, progress)
        return {"header": self.header(), **results}

    def close(self) -> None:
        """Initiator first (nothing is left in flight towards the target), then target."""
        eng, self.engine = self.engine, None
        try:
            if eng is not None:
                eng.close()
        finally:
            child, self.child = self.child, None
            if child is not None:
                child.close()

    def __enter__(self) -> "BenchSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
