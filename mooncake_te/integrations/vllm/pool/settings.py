# SPDX-License-Identifier: Apache-2.0
"""``[kvcache]`` as the connector's pool reads it (:class:`PoolSettings`)."""
from __future__ import annotations

from dataclasses import dataclass

from ....errors import ConfigError

_GIB = 1 << 30


@dataclass
class PoolSettings:
    """``[kvcache]`` as the connector uses it. ``dram_cache_gb = 0`` (the default): no pool.

    Attributes
    ----------
    block_size_set : bool
        ``block_size`` was given explicitly (in the file or the extra config): it must then
        equal vLLM's block size.
    """

    dram_bytes: int = 0
    ssd_bytes: int = 0
    cache_dir: str = ""
    policy: str = "lru"
    block_size: int = 16
    block_size_set: bool = False
    save_queue_bytes: int = 256 << 20
    gpu_staging_bytes: int = 64 << 20      # GPU KV caches: the copier's staging buffer
    remote: bool = True
    share_without_token: bool = False      # [kvcache] share_without_token (docs/kvcache.md)
    persist_on_exit: bool = True
    log_interval_s: float = 10.0
    source: str = "<defaults>"

    @property
    def enabled(self) -> bool:
        return self.dram_bytes > 0

    def check(self, vllm_block_size: int) -> None:
        """Refuse what cannot work, before any memory is registered.

        Raises
        ------
        ConfigError
            ``block_size`` differs from vLLM's (both values named), or ``cache_dir`` cannot
            be written.
        """
        if not self.enabled:
            return
        if self.block_size_set and self.block_size != int(vllm_block_size):
            raise ConfigError(
                f"KVCache block size mismatch: [kvcache] block_size = {self.block_size} "
                f"({self.source}) but vLLM runs with block_size = {vllm_block_size}; a pool "
                f"block is one vLLM block, so set [kvcache] block_size = {vllm_block_size} "
                f"(or start vLLM with --block-size {self.block_size})")
        if self.ssd_bytes > 0:
            if not self.cache_dir:
                raise ConfigError(f"[kvcache] ssd_cache_gb = {self.ssd_bytes / _GIB:g} needs "
                                  f"cache_dir, a directory on a local SSD ({self.source})")
            from ....kvcache.ssd import _writable_dir
            _writable_dir(self.cache_dir)


_EXTRA_KEYS = ("cache_dir", "dram_cache_gb", "ssd_cache_gb", "eviction_policy", "block_size",
               "save_queue_mb", "gpu_staging_mb", "remote", "persist_on_exit",
               "log_interval_s", "share_without_token")


def pool_settings(config, config_path: "str | None", extra: "dict | None") -> PoolSettings:
    """``[kvcache]`` of the connector's ``config.toml`` (``mooncake_config_path``),
    overridden key by key by ``kv_connector_extra_config["kvcache"]`` (a table with the
    same keys, plus ``save_queue_mb``, ``gpu_staging_mb``, ``remote``, ``persist_on_exit``,
    ``log_interval_s``)."""
    from ....config import read_toml, validate
    k = dict(config["kvcache"])
    src = config_path or "<defaults>"
    explicit = set()
    if config_path:
        raw = read_toml(config_path).get("kvcache") or {}
        explicit |= set(raw)
    s = PoolSettings()
    extra = dict(extra or {})
    for key, v in extra.items():
        if key not in _EXTRA_KEYS:
            raise ConfigError(f"kv_connector_extra_config.kvcache has an unknown key {key!r} "
                              f"(known: {', '.join(_EXTRA_KEYS)})")
    for key in ("cache_dir", "dram_cache_gb", "ssd_cache_gb", "eviction_policy", "block_size"):
        if key in extra:
            k[key] = validate("kvcache", key, extra[key], "kv_connector_extra_config.kvcache")
            explicit.add(key)
            src = "kv_connector_extra_config.kvcache" if not config_path else \
                f"{config_path} + kv_connector_extra_config.kvcache"
    s.dram_bytes = int(float(k["dram_cache_gb"]) * _GIB)
    s.ssd_bytes = int(float(k["ssd_cache_gb"]) * _GIB)
    s.cache_dir = str(k["cache_dir"] or "")
    s.policy = str(k["eviction_policy"])
    s.block_size = int(k["block_size"])
    s.block_size_set = "block_size" in explicit
    s.source = src
    s.share_without_token = bool(k.get("share_without_token", False))
    if "save_queue_mb" in extra:
        v = extra["save_queue_mb"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ConfigError(f"kv_connector_extra_config.kvcache.save_queue_mb = {v!r}: "
                              f"expected MiB >= 0 (bytes of blocks waiting to be stored)")
        s.save_queue_bytes = int(v * (1 << 20))
    if "gpu_staging_mb" in extra:
        v = extra["gpu_staging_mb"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 1 <= v <= 4096:
            raise ConfigError(f"kv_connector_extra_config.kvcache.gpu_staging_mb = {v!r}: "
                              f"expected MiB from 1 to 4096 (GPU memory the pool's copier "
                              f"stages block images in, for a KV cache on the GPU)")
        s.gpu_staging_bytes = int(v * (1 << 20))
    for key in ("remote", "persist_on_exit", "share_without_token"):
        if key in extra:
            if not isinstance(extra[key], bool):
                raise ConfigError(f"kv_connector_extra_config.kvcache.{key} = {extra[key]!r}:"
                                  f" expected true or false")
            setattr(s, key, extra[key])
    if "log_interval_s" in extra:
        v = extra["log_interval_s"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ConfigError(f"kv_connector_extra_config.kvcache.log_interval_s = {v!r}: "
                              f"expected seconds >= 0 (0: never)")
        s.log_interval_s = float(v)
    return s


