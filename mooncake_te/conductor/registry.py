# SPDX-License-Identifier: Apache-2.0
"""Where the conductor finds its instances: one record per vLLM instance in the metadata
store, next to the engines' segment descriptors,

    ``mooncake/[<cluster>/]conductor/instances/<engine name>`` ->
    ``{"url", "role", "engine", "model", "block_size", "root", "namespace", "remote",
    "kv_events", "kv_events_replay"}``

written by :class:`~mooncake_te.integrations.vllm.MooncakeTEConnector` when its
``kv_connector_extra_config`` has ``api_url`` (and a metadata store), withdrawn when it
shuts down. ``root`` is the hex of the pool's key root (:func:`..integrations.vllm.pool.
namespace_root`) and ``namespace`` the pool's index namespace, so the conductor computes a
prompt's block keys and asks the owner index exactly as that instance's connector does;
``remote`` is false when the instance does not read other instances' pools
(``kvcache.remote: false``), so their blocks are no hit for it.
``kv_events`` / ``kv_events_replay``: vLLM's KV events publisher and replay endpoints
(``--kv-events-config``) as the instance configured them (a wildcard host stands for the
host of ``url``), empty when it publishes none.

Nothing here imports aiohttp or vLLM: the connector imports this module.
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass

from ..metadata.base import KeyValueBackend, key_prefix

log = logging.getLogger("mooncake_te.conductor")

ROLES = ("prefill", "decode", "plain")


def instances_prefix(cluster_id: "str | None" = None) -> str:
    return key_prefix(cluster_id) + "conductor/instances/"


def role_of(is_producer: bool, is_consumer: bool) -> str:
    """The conductor's role for a connector's ``kv_role``: producer only -> prefill,
    consumer only -> decode, both -> plain (prefix hits from the pool, no P/D)."""
    if is_producer and not is_consumer:
        return "prefill"
    if is_consumer and not is_producer:
        return "decode"
    return "plain"


@dataclass
class InstanceRecord:
    """One vLLM instance as the conductor sees it."""

    url: str                       # http://host:port of its OpenAI server
    role: str = "plain"            # prefill | decode | plain
    engine: str = ""               # its transfer engine's segment name (owner in the index)
    model: str = ""
    block_size: int = 16
    root: str = ""                 # hex of the pool key root ("" : computed by the conductor)
    namespace: str = ""            # the pool's owner-index namespace ("" : no pool)
    remote: bool = True            # reads other instances' pools (kvcache.remote)
    pool_blocks: int = 0           # its pool's capacity in blocks, DRAM + SSD (0: none)
    kv_events: str = ""            # vLLM's KV events PUB endpoint ("" : none)
    kv_events_replay: str = ""     # its replay (ROUTER) endpoint ("" : none)

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"instance {self.url}: role {self.role!r} is not one of "
                             f"{', '.join(ROLES)}")
        if not str(self.url).startswith(("http://", "https://")):
            raise ValueError(f"instance URL {self.url!r}: expected http://host:port")
        self.url = str(self.url).rstrip("/")
        self.block_size = int(self.block_size)
        self.remote = bool(self.remote)

    @property
    def name(self) -> str:
        return self.engine or self.url

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "InstanceRecord":
        d = json.loads(raw)
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def kv_events_of(vllm_config) -> dict:
    """vLLM's KV events endpoints (``--kv-events-config`` with the zmq publisher) as the
    conductor's record fields, empty when the instance publishes none."""
    c = getattr(vllm_config, "kv_events_config", None)
    if c is None or not getattr(c, "enable_kv_cache_events", False) \
            or getattr(c, "publisher", "") != "zmq":
        return {}
    return {"kv_events": str(c.endpoint or ""), "kv_events_replay": str(c.replay_endpoint or "")}


def publish_instance(store, rec: InstanceRecord) -> "str | None":
    """Write ``rec`` under the instances directory; the key, or None when ``store`` is not
    a key-value store (p2p metadata: the conductor then needs the instance configured)."""
    if not isinstance(store, KeyValueBackend):
        return None
    key = instances_prefix(store.cluster_id) + rec.name
    store.put(key, rec.encode())
    return key


def withdraw_instance(store, key: "str | None") -> None:
    if key and isinstance(store, KeyValueBackend):
        try:
            store.delete(key)
        except Exception as e:            # shutting down: the conductor's health check copes
            log.warning("conductor record %s not withdrawn: %s", key, e)


def list_instances(store) -> dict:
    """``{engine name: InstanceRecord}`` of every record in ``store`` (one listing and one
    batch read). Malformed records are skipped with a warning."""
    prefix = instances_prefix(store.cluster_id)
    keys = store.keys(prefix)
    out = {}
    for key, raw in zip(keys, store.get_many(keys) if keys else []):
        if not raw:
            continue
        try:
            rec = InstanceRecord.decode(raw)
        except (ValueError, TypeError, KeyError) as e:
            log.warning("conductor: skipping the malformed instance record %s: %s", key, e)
            continue
        out[rec.name] = rec
    return out
