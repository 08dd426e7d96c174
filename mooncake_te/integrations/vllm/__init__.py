# SPDX-License-Identifier: Apache-2.0
"""vLLM V1 KV-transfer connector on mooncake_te.

Load it in vLLM with no patch::

    --kv-transfer-config '{"kv_connector": "MooncakeTEConnector",
                           "kv_connector_module_path": "mooncake_te.integrations.vllm",
                           "kv_role": "kv_producer"}'

The connector class is imported lazily (vLLM's factory does ``getattr(module, name)``),
so the vLLM-free parts (``layout``, ``handshake``, ``settings``, ``leases``) import
without vLLM installed. See ``docs/vllm.md``.
"""
from __future__ import annotations

__all__ = ["MooncakeTEConnector", "MooncakeConnector"]


def __getattr__(name: str):
    # MooncakeConnector: the name vLLM's own Mooncake deployment files use, so a copied
    # kv_transfer_config only needs kv_connector_module_path added.
    if name in ("MooncakeTEConnector", "MooncakeConnector"):
        from .connector import MooncakeTEConnector
        return MooncakeTEConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
