# SPDX-License-Identifier: Apache-2.0
"""Building a conductor from ``config.toml``'s ``[conductor]`` and the command line (the
command line wins)."""
from __future__ import annotations

import os

from ..config import Config
from ..errors import ConfigError
from .cluster import Cluster, static_root
from .cost import Priors
from .registry import InstanceRecord
from .server import Conductor, Settings

ENV_API_KEY = "MTE_CONDUCTOR_API_KEY"


def build(cfg: Config, tokenizer=None, env=None) -> Conductor:
    """A :class:`Conductor` for ``cfg['conductor']`` (not started). ``tokenizer``: an
    object with ``__call__`` / ``apply_chat_template`` (default: loaded from
    ``tokenizer`` or ``model``)."""
    env = os.environ if env is None else env
    c = cfg["conductor"]
    priors = Priors(base_s=c["prior_base_s"], prefill_s_per_token=c["prior_prefill_s_per_token"],
                    load_s_per_block={"gpu": 0.0, "dram": c["prior_load_dram_s_per_block"],
                                      "ssd": c["prior_load_ssd_s_per_block"],
                                      "remote": c["prior_load_remote_s_per_block"]},
                    full_kv_usage=c["full_kv_usage"], max_inflight=c["max_inflight"],
                    fit_per_instance=c["fit_per_instance"], affinity=c["affinity"],
                    affinity_residuals=c["affinity_residuals"],
                    load_bound=c["load_bound"])
    store = None
    if c["metadata_server"]:
        from ..metadata.base import KeyValueBackend
        spec = c["metadata_server"]
        store = _open_store(spec)
        if not isinstance(store, KeyValueBackend):
            raise ConfigError(f"[conductor] metadata_server = {spec!r}: the conductor needs a "
                              f"store (etcd://, redis:// or http://) to find instances and "
                              f"the pools' owner index")
    root = b""
    if c["model"]:
        root = static_root(c["model"], c["dtype"], c["kv_cache_dtype"], c["block_size"])
    cluster = Cluster(priors, store=store, default_root=root,
                      default_namespace=c["namespace"], gpu_blocks=c["gpu_blocks"])
    for role in ("prefill", "decode", "plain"):
        for url in c[role]:
            try:
                cluster.add(InstanceRecord(url=url, role=role, model=c["model"],
                                           block_size=c["block_size"]), static=True)
            except ValueError as e:
                raise ConfigError(f"[conductor] {role}: {e}") from None
    from .events import parse_kv_events
    for spec in c["kv_events"]:
        try:
            url, pub, rep = parse_kv_events(spec)
        except ValueError as e:
            raise ConfigError(f"[conductor] kv_events: {e}") from None
        recs = [r for r in cluster.records.values() if r.url == url]
        if not recs:
            raise ConfigError(f"[conductor] kv_events {spec!r}: no instance {url} is "
                              f"configured (give it with --prefill or --plain first)")
        for r in recs:
            r.kv_events, r.kv_events_replay = pub, rep
    if not cluster.records and store is None:
        raise ConfigError("the conductor has no instances: give --prefill/--decode/--plain "
                          "URLs (or [conductor] prefill/decode/plain), or --metadata where "
                          "instances announce themselves (kv_connector_extra_config.api_url)")
    roles = {r.role for r in cluster.records.values()}
    if "decode" in roles and "prefill" not in roles and store is None:
        raise ConfigError("decode instances need at least one prefill instance (--prefill)")
    s = Settings(host=c["host"], port=c["port"],
                 api_key=c["api_key"] or env.get(ENV_API_KEY, ""),
                 tokenizer=c["tokenizer"] or c["model"],
                 health_interval_s=c["health_interval_s"],
                 discovery_interval_s=c["health_interval_s"],
                 connect_timeout_s=c["connect_timeout_s"],
                 first_byte_timeout_s=c["first_byte_timeout_s"],
                 request_timeout_s=c["request_timeout_s"], policy=c["policy"])
    if tokenizer is not None:
        s.tokenizer = ""
    return Conductor(cluster, s, tokenizer=tokenizer, discovery_store=store)


def _open_store(spec: str):
    from ..metadata import open_backend
    return open_backend(spec)
