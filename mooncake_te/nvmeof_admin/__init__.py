# SPDX-License-Identifier: Apache-2.0
"""NVMe over Fabrics: make targets (the kernel's nvmet, through configfs) and connect
hosts to them (``/dev/nvme-fabrics``), so an engine can publish a namespace as a storage
segment (``TransferEngine.register_storage``) and peers move bytes between their memory
and it with ordinary transfers. See ``docs/nvmeof.md``."""
from __future__ import annotations

from .host import (Connection, Controller, HostError, connect, disconnect, find_namespace,
                   host_nqn, list_connections, namespaces)
from .target import (Namespace, Port, Target, TargetError, create_target, delete_target,
                     get_target, list_targets)

__all__ = ["Connection", "Controller", "HostError", "connect", "disconnect", "find_namespace",
           "host_nqn", "list_connections", "namespaces", "Namespace", "Port", "Target",
           "TargetError", "create_target", "delete_target", "get_target", "list_targets"]
