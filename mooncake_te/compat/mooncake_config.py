# SPDX-License-Identifier: Apache-2.0
"""``mooncake.mooncake_config`` on mooncake_te: ``MooncakeConfig``, the JSON config a
Mooncake Store user passes through ``MOONCAKE_CONFIG_PATH``, and the environment
fallbacks (``mooncake-wheel/mooncake/mooncake_config.py`` in kvcache-ai/Mooncake).

Fields: ``local_hostname``, ``metadata_server``, ``master_server_address``,
``global_segment_size``, ``local_buffer_size`` (bytes, or strings such as ``"4GB"``),
``protocol``, ``device_name``, and the optional ``enable_ssd_offload``,
``ssd_offload_path``, ``tenant_id``. :meth:`MooncakeConfig.setup_args` gives the dict
:meth:`mooncake_te.compat.store.MooncakeDistributedStore.setup` takes.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from .. import errors as E
from .store import _parse_size

#: Mooncake's defaults: a 3.125 GiB segment and a 1 GiB local buffer.
DEFAULT_GLOBAL_SEGMENT_SIZE = 3355443200
DEFAULT_LOCAL_BUFFER_SIZE = 1073741824


@dataclass
class MooncakeConfig:
    local_hostname: str
    metadata_server: str
    global_segment_size: int
    local_buffer_size: int
    protocol: str
    device_name: str
    master_server_address: str
    enable_ssd_offload: bool = False
    ssd_offload_path: str = ""
    tenant_id: str = "default"

    @staticmethod
    def from_file(file_path: str) -> "MooncakeConfig":
        """Read the JSON config at ``file_path``.

        Raises
        ------
        ConfigError
            The file is missing, not JSON, or lacks ``metadata_server`` or
            ``master_server_address``.
        """
        try:
            with open(file_path) as f:
                cfg = json.load(f)
        except (OSError, ValueError) as e:
            raise E.ConfigError(f"Mooncake config {file_path}: {e}") from None
        if not isinstance(cfg, dict):
            raise E.ConfigError(f"Mooncake config {file_path}: not a JSON object")
        missing = [k for k in ("metadata_server", "master_server_address") if not cfg.get(k)]
        if missing:
            raise E.ConfigError(f"Mooncake config {file_path} lacks {', '.join(missing)}")
        return MooncakeConfig(
            local_hostname=str(cfg.get("local_hostname", "localhost")),
            metadata_server=str(cfg["metadata_server"]),
            global_segment_size=_parse_size(cfg.get("global_segment_size",
                                                    DEFAULT_GLOBAL_SEGMENT_SIZE)),
            local_buffer_size=_parse_size(cfg.get("local_buffer_size",
                                                  DEFAULT_LOCAL_BUFFER_SIZE)),
            protocol=str(cfg.get("protocol", "tcp")),
            device_name=str(cfg.get("device_name", "")),
            master_server_address=str(cfg["master_server_address"]),
            enable_ssd_offload=bool(cfg.get("enable_ssd_offload", False)),
            ssd_offload_path=str(cfg.get("ssd_offload_path", "")),
            tenant_id=str(cfg.get("tenant_id", "default")))

    @staticmethod
    def load_from_env() -> "MooncakeConfig":
        """The file ``MOONCAKE_CONFIG_PATH`` names, else the ``MOONCAKE_*`` variables
        (``MOONCAKE_MASTER`` needed; ``MOONCAKE_TE_META_DATA_SERVER``,
        ``MOONCAKE_LOCAL_HOSTNAME``, ``MOONCAKE_PROTOCOL``, ``MOONCAKE_DEVICE``,
        ``MOONCAKE_GLOBAL_SEGMENT_SIZE``, ``MOONCAKE_LOCAL_BUFFER_SIZE`` optional)."""
        path = os.getenv("MOONCAKE_CONFIG_PATH")
        if path:
            return MooncakeConfig.from_file(path)
        master = os.getenv("MOONCAKE_MASTER")
        if not master:
            raise E.ConfigError("neither MOONCAKE_CONFIG_PATH nor MOONCAKE_MASTER is set")
        return MooncakeConfig(
            local_hostname=os.getenv("MOONCAKE_LOCAL_HOSTNAME", "localhost"),
            metadata_server=os.getenv("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE"),
            global_segment_size=_parse_size(os.getenv("MOONCAKE_GLOBAL_SEGMENT_SIZE",
                                                      DEFAULT_GLOBAL_SEGMENT_SIZE)),
            local_buffer_size=_parse_size(os.getenv("MOONCAKE_LOCAL_BUFFER_SIZE",
                                                    DEFAULT_LOCAL_BUFFER_SIZE)),
            protocol=os.getenv("MOONCAKE_PROTOCOL", "tcp"),
            device_name=os.getenv("MOONCAKE_DEVICE", ""),
            master_server_address=master)

    def setup_args(self) -> dict:
        """The dict form of ``MooncakeDistributedStore.setup``'s arguments."""
        d = asdict(self)
        d["rdma_devices"] = d.pop("device_name")
        return d
