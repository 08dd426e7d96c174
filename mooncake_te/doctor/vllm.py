# SPDX-License-Identifier: Apache-2.0
"""Reading the vLLM side of a deployment for the doctor.

Accepted files (JSON, or YAML when PyYAML is installed):

- a ``vllm serve --config`` file: engine arguments as keys, dashes or underscores
  (``block-size: 16``, ``kv-transfer-config: '{"kv_connector": ...}'``);
- a dumped ``VllmConfig``: ``{"cache_config": {"block_size": 16}, "kv_transfer_config":
  {...}}``;
- a bare ``--kv-transfer-config`` JSON: ``{"kv_connector": "MooncakeConnector",
  "kv_role": "kv_producer"}``.

Field names are those of vLLM's ``vllm/config/kv_transfer.py`` (``KVTransferConfig``)
and ``vllm/config/cache.py`` (``CacheConfig``).
"""
from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, field

from ..errors import ConfigError

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
# KVTransferConfig fields (vLLM 0.11-0.13); a closed set, so anything else is a typo.
KV_TRANSFER_KEYS = (
    "kv_connector", "engine_id", "kv_buffer_device", "kv_buffer_size", "kv_role", "kv_rank",
    "kv_parallel_size", "kv_ip", "kv_port", "kv_connector_extra_config",
    "kv_connector_module_path", "enable_permute_local_kv", "kv_load_failure_policy",
)
# CacheConfig fields that have been stable across releases. The class grows often, so an
# unknown key is only reported when it is a near miss of one of these.
CACHE_KEYS = (
    "block_size", "gpu_memory_utilization", "swap_space", "cache_dtype",
    "is_attention_free", "num_gpu_blocks_override", "sliding_window",
    "enable_prefix_caching", "prefix_caching_hash_algo", "cpu_offload_gb",
    "calculate_kv_scales", "kv_sharing_fast_prefill", "mamba_page_size_padded",
    "mamba_block_size", "mamba_cache_dtype", "mamba_ssm_cache_dtype",
    "kv_cache_memory_bytes", "kv_offloading_size", "kv_offloading_backend",
)
# Engine arguments whose misspelling matters to a KV-transfer deployment; other keys are
# vLLM's business and change between releases.
ENGINE_KEYS = (
    "block_size", "kv_transfer_config", "cache_config", "kv_cache_dtype",
    "disaggregation_mode", "enable_prefix_caching", "gpu_memory_utilization",
    "prefill_decode_disaggregation",
)
DISAGG_ROLES = ("prefill", "decode")
OUR_MODULE = "mooncake_te.integrations.vllm"
OUR_CLASS = "MooncakeTEConnector"


@dataclass
class VllmSettings:
    """What the doctor needs from a vLLM config file."""

    path: str
    block_size: "int | None" = None
    block_size_key: str = ""                  # where it was found, for messages
    kv_transfer: "dict | None" = None
    kv_transfer_key: str = ""
    role: "str | None" = None                 # "prefill" | "decode", if the file says
    role_key: str = ""
    unknown: list = field(default_factory=list)   # [(where, key, suggestion or None)]

    @property
    def kv_role(self) -> "str | None":
        return (self.kv_transfer or {}).get("kv_role")

    @property
    def extra_config(self) -> dict:
        extra = (self.kv_transfer or {}).get("kv_connector_extra_config")
        return extra if isinstance(extra, dict) else {}

    @property
    def uses_mooncake_te(self) -> bool:
        """The file selects our connector (mooncake_te.integrations.vllm)."""
        kv = self.kv_transfer or {}
        return (str(kv.get("kv_connector_module_path") or "").startswith(OUR_MODULE)
                or kv.get("kv_connector") == OUR_CLASS)

    @property
    def mooncake_config_path(self) -> "str | None":
        """``kv_connector_extra_config.mooncake_config_path``, as given, or resolved next
        to the vLLM file when it does not exist relative to the working directory."""
        p = self.extra_config.get("mooncake_config_path")
        if not isinstance(p, str) or not p:
            return None
        if os.path.isabs(p) or os.path.exists(p):
            return p
        beside = os.path.join(os.path.dirname(os.path.abspath(self.path)), p)
        return beside if os.path.exists(beside) else p


def _norm(d: dict) -> dict:
    return {str(k).replace("-", "_"): v for k, v in d.items()}


def _load_file(path: str):
    try:
        with open(path, "r") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"vLLM config file {path!r} does not exist") from None
    except OSError as e:
        raise ConfigError(f"vLLM config file {path!r} cannot be read: {e.strerror}") from None
    try:
        return json.loads(text)
    except ValueError as e:
        json_error = e
    try:
        import yaml
    except ImportError:
        raise ConfigError(f"{path}: not valid JSON ({json_error}); YAML files need PyYAML "
                          f"(pip install 'pyyaml>=6', or '.[yaml]' in a mooncake_te clone)") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: neither valid JSON nor valid YAML: {e}") from None


def _near(key: str, known) -> "str | None":
    # 0.85: "blok_size" and "kv_transfer_cfg" are caught; real vLLM arguments that merely
    # share words with these ("data_parallel_size_local") are not.
    hits = difflib.get_close_matches(key, list(known), n=1, cutoff=0.85)
    return hits[0] if hits else None


def load_vllm_config(path: "str | os.PathLike") -> VllmSettings:
    """Parse a vLLM config file (see the module docstring for accepted shapes).

    Raises
    ------
    ConfigError
        The file is missing, unparsable, or not a mapping; a kv_transfer_config given
        as a string is not JSON.
    """
    path = os.fspath(path)
    raw = _load_file(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of vLLM settings, got "
                          f"{type(raw).__name__}")
    top = _norm(raw)
    s = VllmSettings(path=path)

    kv: object
    if "kv_connector" in top or "kv_role" in top:
        kv, s.kv_transfer_key = raw, "kv_transfer_config"
        top = {}
    else:
        kv = top.get("kv_transfer_config")
        s.kv_transfer_key = "kv_transfer_config"
        if isinstance(kv, str):             # the CLI form, kept as a JSON string in YAML
            try:
                kv = json.loads(kv)
            except ValueError as e:
                raise ConfigError(f"{path}: kv_transfer_config is a string but not JSON: "
                                  f"{e}") from None
    if kv is not None and not isinstance(kv, dict):
        raise ConfigError(f"{path}: kv_transfer_config must be a mapping, got {kv!r}")
    s.kv_transfer = dict(kv) if kv is not None else None

    cache = top.get("cache_config")
    if isinstance(cache, dict) and cache.get("block_size") is not None:
        s.block_size, s.block_size_key = cache["block_size"], "cache_config.block_size"
    if top.get("block_size") is not None:
        s.block_size, s.block_size_key = top["block_size"], "block_size"

    extra = (s.kv_transfer or {}).get("kv_connector_extra_config") or {}
    # Deployment settings files nest the role: {"prefill_decode_disaggregation":
    # {"role": "decode"}}.
    pdd = top.get("prefill_decode_disaggregation")
    for where, d in (("", top), ("prefill_decode_disaggregation.", pdd),
                     ("kv_connector_extra_config.", extra)):
        for k in ("disaggregation_mode", "role"):
            v = d.get(k) if isinstance(d, dict) else None
            if isinstance(v, str) and v.lower() in DISAGG_ROLES:
                s.role, s.role_key = v.lower(), where + k

    # Misspellings: every unknown kv_transfer_config key; near misses elsewhere.
    for k in (s.kv_transfer or {}):
        if k not in KV_TRANSFER_KEYS:
            s.unknown.append((s.kv_transfer_key, k, _near(k, KV_TRANSFER_KEYS)
                              or _loose(k, KV_TRANSFER_KEYS)))
    if isinstance(cache, dict):
        for k in cache:
            if k not in CACHE_KEYS and _near(k, CACHE_KEYS):
                s.unknown.append(("cache_config", k, _near(k, CACHE_KEYS)))
    for k in top:
        if k not in ENGINE_KEYS and _near(k, ENGINE_KEYS):
            s.unknown.append(("the top level", k, _near(k, ENGINE_KEYS)))
    return s


def _loose(key: str, known) -> "str | None":
    hits = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return hits[0] if hits else None
