# SPDX-License-Identifier: Apache-2.0
"""``kv_connector_extra_config`` for :class:`MooncakeTEConnector`, validated up front.

The keys of Mooncake's own vLLM deployment files are accepted under their names
(``mooncake_config_path``, ``transfer_engine_protocol`` / ``mooncake_protocol``,
``device_names`` / ``device_name``, ``metadata_server``, ``use_gpu_direct``,
``enable_multi_nic``), and so are Mooncake's GPU protocol names (the transports declare
them: ``config.protocol_aliases()``),
so a copied ``kv_transfer_config`` works once ``kv_connector`` and
``kv_connector_module_path`` name this connector. Unknown keys and bad values are a :class:`~mooncake_te.ConfigError`
naming the key, the value and what is expected. ``docs/vllm.md`` lists every key.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field

from ...config import Config, protocol_aliases, protocols
from ...metadata.url import parse as parse_metadata_url
from ...errors import ConfigError

# [transfer_engine] booleans the extra config may set; they win over the file and MC_*.
ENGINE_SWITCHES = ("use_gpu_direct", "enable_multi_nic")
# canonical key -> accepted spellings (the first is ours; the rest are Mooncake's and
# vLLM's MooncakeConnector's names for the same thing)
ALIASES = {
    "mooncake_config_path": ("mooncake_config_path",),
    "metadata_server": ("metadata_server", "metadata"),
    "protocol": ("protocol", "transfer_engine_protocol", "mooncake_protocol"),
    "device_names": ("device_names", "device_name"),
    "auth_token": ("auth_token",),
    "host": ("host", "local_hostname"),
    "lease_s": ("lease_s",),
    "transfer_timeout_s": ("transfer_timeout_s",),
    "handshake_timeout_s": ("handshake_timeout_s",),
    "idle_wait_s": ("idle_wait_s",),
    "enforce_handshake_compat": ("enforce_handshake_compat",),
    "hugepages": ("hugepages",),
    "prepared_loads": ("prepared_loads",),
    "api_url": ("api_url",),
    "kvcache": ("kvcache",),
    "use_gpu_direct": ("use_gpu_direct",),
    "enable_multi_nic": ("enable_multi_nic",),
}
_KNOWN = {alias: key for key, names in ALIASES.items() for alias in names}


@dataclass
class ConnectorSettings:
    """What the connector takes from ``kv_connector_extra_config``.

    ``None`` means "not set here": the engine then takes the value from
    ``mooncake_config_path`` (our ``config.toml``), then ``MC_*`` variables, then its
    defaults. ``use_gpu_direct`` and ``enable_multi_nic``, when set, are already merged
    into ``config`` (``[transfer_engine]``), the configuration the engine is built with.
    """

    config: Config = field(default_factory=Config.load)
    config_path: "str | None" = None
    metadata: "str | None" = None
    protocol: "str | None" = None
    devices: "list | None" = None
    auth_token: "str | None" = None
    host: "str | None" = None
    lease_s: float = 120.0
    transfer_timeout_s: "float | None" = None
    handshake_timeout_s: float = 5.0
    idle_wait_s: float = 0.005                 # longest wait of a step without a forward pass
    enforce_handshake_compat: bool = True
    hugepages: bool = True                     # host KV cache onto 2 MiB pages (hugepages.py)
    prepared_loads: bool = True                # P/D loads by block id (worker._prepare_loads)
    use_gpu_direct: "bool | None" = None        # [transfer_engine] override
    enable_multi_nic: "bool | None" = None      # [transfer_engine] override
    api_url: "str | None" = None               # where clients reach this vllm serve
    pool: "object | None" = None                # pool.PoolSettings ([kvcache])
    pool_lookup_address: str = ""              # set by the connector (engine id, rank)

    @property
    def token(self) -> "bytes | None":
        """The auth token the worker's engine uses (``auth_token`` here, else
        ``[transfer_engine] auth_token`` / ``MC_AUTH_TOKEN``), None without one."""
        from ...auth import check_token
        return check_token(self.auth_token or self.config["transfer_engine"]["auth_token"])

    @property
    def timeout_s(self) -> float:
        return self.transfer_timeout_s or self.config.timeout_s


def _suggest(key: str) -> str:
    hit = difflib.get_close_matches(key, list(_KNOWN), n=1, cutoff=0.6)
    return f"; did you mean {hit[0]!r}?" if hit else ""


def _number(key, v, low=0.0):
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ConfigError(f"kv_connector_extra_config.{key} = {v!r}: expected a number of "
                          f"seconds")
    try:
        f = float(v)
    except ValueError:
        raise ConfigError(f"kv_connector_extra_config.{key} = {v!r}: expected a number of "
                          f"seconds") from None
    if not f > low:
        raise ConfigError(f"kv_connector_extra_config.{key} = {v!r}: must be > {low:g}")
    return f


def parse_extra_config(extra, env=None) -> ConnectorSettings:
    """Validate ``kv_connector_extra_config`` (a dict; ``None`` means empty).

    ``mooncake_config_path`` falls back to ``MOONCAKE_CONFIG_PATH`` in ``env`` (as in
    Mooncake's vLLM integration); the file is loaded and checked here.

    Raises
    ------
    ConfigError
        An unknown key (with the closest known one), two spellings of one key with
        different values, a value of the wrong type, or a bad ``config.toml``.
    """
    env = os.environ if env is None else env
    if extra is not None and not isinstance(extra, dict):
        raise ConfigError(f"kv_connector_extra_config must be a mapping, got {extra!r}")
    extra = dict(extra or {})
    vals: dict = {}
    for k, v in extra.items():
        key = _KNOWN.get(k)
        if key is None:
            raise ConfigError(f"kv_connector_extra_config has an unknown key {k!r}"
                              f"{_suggest(k)} (known: {', '.join(sorted(_KNOWN))})")
        if key in vals and vals[key][1] != v:
            raise ConfigError(f"kv_connector_extra_config sets {key!r} twice with different "
                              f"values: {vals[key][0]}={vals[key][1]!r}, {k}={v!r}")
        vals[key] = (k, v)
    get = {k: v for k, (_, v) in vals.items()}
    s = ConnectorSettings()

    path = get.get("mooncake_config_path") or env.get("MOONCAKE_CONFIG_PATH") or None
    if path is not None:
        if not isinstance(path, str):
            raise ConfigError(f"kv_connector_extra_config.mooncake_config_path = {path!r}: "
                              f"expected a path to a config.toml")
        if not os.path.exists(path):
            raise ConfigError(f"kv_connector_extra_config.mooncake_config_path: {path!r} does "
                              f"not exist (it names mooncake_te's config.toml)")
        s.config_path = path
        s.config = Config.load(path, env=env)

    md = get.get("metadata_server")
    if md is not None:
        if not isinstance(md, str) or not md:
            raise ConfigError(f"kv_connector_extra_config.metadata_server = {md!r}: expected "
                              f"'P2PHANDSHAKE' or a URL (etcd://h:2379, redis://h:6379, "
                              f"http://h:8080/metadata)")
        s.metadata = "p2p" if parse_metadata_url(md).is_p2p else md

    proto = get.get("protocol")
    if proto is not None:
        name = proto.strip().lower() if isinstance(proto, str) else ""
        aliases = protocol_aliases()
        name = aliases.get(name, name)
        if name not in protocols():
            raise ConfigError(f"kv_connector_extra_config.{vals['protocol'][0]} = {proto!r}: "
                              f"expected one of {', '.join(protocols())} (or Mooncake's "
                              f"{', '.join(aliases)}); mooncake_te has no transport "
                              f"for it, use rdma or auto")
        s.protocol = name

    dev = get.get("device_names")
    if dev is not None:
        if isinstance(dev, str):
            dev = [d.strip() for d in dev.split(",") if d.strip()]
        if not isinstance(dev, (list, tuple)) or not all(isinstance(d, str) for d in dev):
            raise ConfigError(f"kv_connector_extra_config.device_names = {dev!r}: expected a "
                              f"list of RDMA device names or a comma-separated string")
        s.devices = list(dev)

    tok = get.get("auth_token")
    if tok is not None:
        if not isinstance(tok, str) or not tok:
            raise ConfigError("kv_connector_extra_config.auth_token: expected a non-empty "
                              "string")
        s.auth_token = tok

    host = get.get("host")
    if host is not None:
        if not isinstance(host, str) or not host:
            raise ConfigError(f"kv_connector_extra_config.host = {host!r}: expected the "
                              f"address peers reach this instance at")
        s.host = host

    if "lease_s" in get:
        s.lease_s = _number("lease_s", get["lease_s"])
    if "transfer_timeout_s" in get:
        s.transfer_timeout_s = _number("transfer_timeout_s", get["transfer_timeout_s"])
    if "handshake_timeout_s" in get:
        s.handshake_timeout_s = _number("handshake_timeout_s", get["handshake_timeout_s"])
    if "idle_wait_s" in get:
        s.idle_wait_s = _number("idle_wait_s", get["idle_wait_s"])
        if s.idle_wait_s > 1.0:
            raise ConfigError(f"kv_connector_extra_config.idle_wait_s = {s.idle_wait_s:g}: "
                              f"at most 1 second (vLLM admits no new request while a step "
                              f"waits)")
    if "enforce_handshake_compat" in get:
        v = get["enforce_handshake_compat"]
        if not isinstance(v, bool):
            raise ConfigError(f"kv_connector_extra_config.enforce_handshake_compat = {v!r}: "
                              f"expected true or false")
        s.enforce_handshake_compat = v
    if "hugepages" in get:
        v = get["hugepages"]
        if not isinstance(v, bool):
            raise ConfigError(f"kv_connector_extra_config.hugepages = {v!r}: expected true or "
                              f"false")
        s.hugepages = v
    if "prepared_loads" in get:
        v = get["prepared_loads"]
        if not isinstance(v, bool):
            raise ConfigError(f"kv_connector_extra_config.prepared_loads = {v!r}: expected "
                              f"true or false")
        s.prepared_loads = v
    if "api_url" in get:
        v = get["api_url"]
        if not isinstance(v, str) or not v.startswith(("http://", "https://")):
            raise ConfigError(f"kv_connector_extra_config.api_url = {v!r}: expected the URL "
                              f"clients reach this vLLM server at, e.g. "
                              f"\"http://10.0.0.1:8100\" (the conductor finds it there)")
        s.api_url = v.rstrip("/")
    over = {}
    for key in ENGINE_SWITCHES:
        if key in get:
            v = get[key]
            if not isinstance(v, bool):
                raise ConfigError(f"kv_connector_extra_config.{key} = {v!r} "
                                  f"({type(v).__name__}): expected true or false (it sets "
                                  f"[transfer_engine] {key})")
            setattr(s, key, v)
            over[key] = v
    if over:
        s.config = s.config.with_overrides({"transfer_engine": over},
                                           "kv_connector_extra_config")
    kv = get.get("kvcache")
    if kv is not None and not isinstance(kv, dict):
        raise ConfigError(f"kv_connector_extra_config.kvcache = {kv!r}: expected a table of "
                          f"[kvcache] keys (cache_dir, dram_cache_gb, ssd_cache_gb, "
                          f"eviction_policy, block_size)")
    from .pool import pool_settings
    s.pool = pool_settings(s.config, s.config_path, kv)
    return s
