# SPDX-License-Identifier: Apache-2.0
"""Configuration: ``config.toml`` (the Mooncake deployment skeleton users copy) and the
``MC_*`` environment variables Mooncake documents, validated up front.

Precedence, lowest first: built-in defaults, the file, ``MC_*`` variables, explicit
``TransferEngine(...)`` arguments. Unknown keys and wrong types are a
:class:`ConfigError` naming the file, the key, the bad value and what is expected, with
the closest known key when the name looks misspelled.

:func:`find_problems` and :meth:`Config.load_lenient` report every problem at once
instead of stopping at the first; ``mooncake-te doctor`` uses them.
"""
from __future__ import annotations

import copy
import difflib
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

try:                                    # Python 3.11+
    import tomllib
except ModuleNotFoundError:             # pragma: no cover - older Pythons
    try:
        import tomli as tomllib         # the same parser, published for 3.7-3.10
    except ModuleNotFoundError:
        tomllib = None

from .errors import ConfigError

# section -> key -> (accepted types, default, allowed values or None)
_STR, _INT, _BOOL, _NUM = (str,), (int,), (bool,), (int, float)

#: The values ``protocol`` may take (the engine's ``protocol=``, ``[transfer_engine]
#: protocol``, the vLLM connector's and the CLI's ``--protocol``): "auto", then each
#: transport's own names, added by :func:`declare_transport` (transports declare them;
#: this module never names one). Read it through :func:`protocols`.
_PROTOCOLS: list = ["auto"]
#: Other projects' protocol names (Mooncake's) -> ours, as transports declare them.
_ALIASES: dict = {}
#: Which transport declared each key and variable (key or variable -> transport name).
_OWNERS: dict = {}
#: Variables that force a protocol when true (MC_FORCE_TCP -> "tcp"), as declared.
_FORCE: dict = {}


SCHEMA: dict[str, dict[str, tuple]] = {
    "metadata": {
        "server_type": (_STR, "p2p", ("p2p", "etcd", "redis", "http")),
        "server_address": (_STR, "", None),
    },
    "transfer_engine": {
        "protocol": (_STR, "auto", _PROTOCOLS),
        "device_names": ((list,), [], None),
        "use_gpu_direct": (_BOOL, True, None),
        "enable_multi_nic": (_BOOL, True, None),
        "topology_aware": (_BOOL, True, None),
        "timeout_ms": (_INT, 30000, None),
        "retry_count": (_INT, 3, None),
        # A transport's own keys (tcp_*, rdma_*, the data port's limits) are declared by
        # the transport (Transport.settings) and added by declare_transport.
        "host": (_STR, "", None),
        "port": (_INT, 0, None),
        "auth_token": (_STR, "", None),
        # The RPC port's limits (docs/security.md, issue #20).
        "rpc_max_connections": (_INT, 256, None),
        "rpc_max_per_peer": (_INT, 64, None),
        "rpc_request_timeout_s": (_NUM, 10.0, None),
        # Observability (docs/observability.md): counters on/off, /metrics port (0: none).
        "metrics": (_BOOL, True, None),
        "metrics_port": (_INT, 0, None),
    },
    "kvcache": {
        "cache_dir": (_STR, "", None),
        "dram_cache_gb": (_NUM, 0, None),
        "ssd_cache_gb": (_NUM, 0, None),
        "eviction_policy": (_STR, "lru", ("lru", "lfu")),
        "block_size": (_INT, 16, None),
        # Share pool blocks through the owner index on engines without an auth_token
        # (docs/kvcache.md, "Sharing between instances"): off, as nothing authenticates.
        "share_without_token": (_BOOL, False, None),
    },
    # mooncake-te conductor (docs/conductor.md): instances, tokenizer, routing priors.
    "conductor": {
        "host": (_STR, "127.0.0.1", None),
        "port": (_INT, 8000, None),
        "prefill": ((list,), [], None),
        "decode": ((list,), [], None),
        "plain": ((list,), [], None),
        "metadata_server": (_STR, "", None),
        "model": (_STR, "", None),
        "tokenizer": (_STR, "", None),
        "dtype": (_STR, "bfloat16", None),
        "kv_cache_dtype": (_STR, "auto", None),
        "block_size": (_INT, 16, None),
        "namespace": (_STR, "", None),
        "api_key": (_STR, "", None),
        "health_interval_s": (_NUM, 2.0, None),
        "connect_timeout_s": (_NUM, 5.0, None),
        "first_byte_timeout_s": (_NUM, 300.0, None),
        "request_timeout_s": (_NUM, 600.0, None),
        "full_kv_usage": (_NUM, 0.98, None),
        "max_inflight": (_INT, 64, None),
        "prior_base_s": (_NUM, 0.010, None),
        "prior_prefill_s_per_token": (_NUM, 5e-5, None),
        "prior_load_dram_s_per_block": (_NUM, 2e-4, None),
        "prior_load_remote_s_per_block": (_NUM, 5e-4, None),
        "prior_load_ssd_s_per_block": (_NUM, 1e-3, None),
        "affinity": (_NUM, 0.0, None),
        "affinity_residuals": (_NUM, 2.0, None),
        "load_bound": (_NUM, 2.0, None),
        "gpu_blocks": (_INT, 0, None),
        "policy": (_STR, "cost", ("cost", "round_robin", "least_loaded")),
        "kv_events": ((list,), [], None),
        "fit_per_instance": (_BOOL, False, None),
    },
    "p2p_store": {
        "metadata_server": (_STR, "p2p", None),
        "metadata_address": (_STR, "", None),
        "decentralized": (_BOOL, True, None),
    },
}

# Numeric bounds: key -> (lowest, highest or None, why). Values outside are a ConfigError.
_BOUNDS: dict[str, tuple] = {
    "rpc_max_connections": (1, None, "a positive number of connections"),
    "rpc_max_per_peer": (1, None, "a positive number of connections"),
    "rpc_request_timeout_s": (0.1, 3600, "seconds between 0.1 and 3600"),
    "timeout_ms": (1, None, "a positive number of milliseconds"),
    "retry_count": (0, 127, "0 to 127 (Mooncake's MC_RETRY_CNT must be < 128)"),
    "port": (0, 65535, "a TCP port, 0 to pick a free one"),
    "metrics_port": (0, 65535, "a TCP port for /metrics, 0 to serve none"),
    "block_size": (1, None, "a positive number of tokens per KV block"),
    "dram_cache_gb": (0, None, "a size in GB, 0 or more"),
    "ssd_cache_gb": (0, None, "a size in GB, 0 or more"),
    "health_interval_s": (0.05, 3600, "seconds between 0.05 and 3600"),
    "connect_timeout_s": (0.01, 3600, "seconds between 0.01 and 3600"),
    "first_byte_timeout_s": (0.01, 86400, "seconds between 0.01 and 86400"),
    "request_timeout_s": (0.01, 86400, "seconds between 0.01 and 86400"),
    "full_kv_usage": (0.0, 1.0, "a fraction of the KV cache between 0 and 1"),
    "max_inflight": (1, None, "a positive number of requests per instance"),
    "prior_base_s": (0, None, "seconds, 0 or more"),
    "prior_prefill_s_per_token": (0, None, "seconds, 0 or more"),
    "prior_load_dram_s_per_block": (0, None, "seconds, 0 or more"),
    "prior_load_remote_s_per_block": (0, None, "seconds, 0 or more"),
    "prior_load_ssd_s_per_block": (0, None, "seconds, 0 or more"),
    "affinity": (0, 100, "a fraction of the best expected TTFT between 0 and 100 "
                         "(0: no prefix affinity)"),
    "affinity_residuals": (0, 100, "a multiple of the fit's median absolute residual "
                                   "between 0 and 100 (0: ties only by affinity)"),
    "load_bound": (0, 100, "a multiple of the mean load between 0 and 100 (0: no bound; "
                           "1.25 lets an instance take a quarter more than its share)"),
    "gpu_blocks": (0, None, "a number of KV blocks, 0 to read it from vLLM's /metrics"),
}

_TYPE_WORDS = {str: "a string", int: "an integer", bool: "true or false",
               float: "a number", list: "a list of strings"}


# MC_* variable -> (section, key, parser). Mooncake's meanings (reference §6).
def _seconds_to_ms(v: str) -> int:
    # MC_TRANSFER_TIMEOUT is in seconds in Mooncake's Python wrapper (fractions too).
    s = float(v)
    if not math.isfinite(s):
        raise ValueError(v)
    ms = s * 1000
    return math.ceil(ms) if ms > 0 else int(ms)     # 0.0001 s is 1 ms, not 0 (refused)


def _bool(v: str) -> bool:
    return v.strip().lower() in ("1", "true", "yes", "on")


def _device_list(v: str) -> list:
    return [d.strip() for d in v.split(",") if d.strip()]


ENV: dict[str, tuple[str, str, Any]] = {
    "MC_TRANSFER_TIMEOUT": ("transfer_engine", "timeout_ms", _seconds_to_ms),
    "MC_TCP_BIND_ADDRESS": ("transfer_engine", "host", str),
    "MC_TE_FILTERS": ("transfer_engine", "device_names", _device_list),
    "MC_RETRY_CNT": ("transfer_engine", "retry_count", int),
    "MC_AUTH_TOKEN": ("transfer_engine", "auth_token", str),
    "MC_KVCACHE_SHARE_WITHOUT_TOKEN": ("kvcache", "share_without_token", lambda v: _bool(v)),
    "MC_METRICS": ("transfer_engine", "metrics", lambda v: _bool(v)),
    "MC_METRICS_PORT": ("transfer_engine", "metrics_port", int),
}

# What a variable takes, where its parser is not the key's type (the key is in other units).
_ENV_EXPECTS = {"MC_TRANSFER_TIMEOUT": "a number of seconds such as 30 or 2.5 (the "
                                       "variable is in seconds; timeout_ms in a file is in "
                                       "milliseconds)"}

@dataclass(frozen=True)
class Setting:
    """One ``[transfer_engine]`` key a transport owns (``Transport.settings``).

    Attributes
    ----------
    key : str
        The key (its transport's prefix: ``tcp_lanes``, ``rdma_mtu``).
    types : tuple
        Accepted Python types (``(int,)``, ``(int, float)``, ...).
    default : object
        The built-in default.
    allowed : tuple, optional
        The only values accepted.
    bounds : tuple, optional
        ``(lowest, highest or None, what it takes)`` for numbers.
    env : tuple
        ``(variable, parser)`` pairs (Mooncake's ``MC_*`` names), applied in this order
        (a later one wins).
    """

    key: str
    types: tuple
    default: Any
    allowed: "tuple | None" = None
    bounds: "tuple | None" = None
    env: tuple = ()


def declare_transport(name: str, protocols=(), settings=(), aliases=None,
                      force_env=None) -> None:
    """Add what transport ``name`` declares: the ``protocol=`` names it introduces, its
    ``[transfer_engine]`` keys (:class:`Setting`), other projects' protocol names for
    ours (``aliases``: Mooncake's name -> ours) and variables that force a protocol
    (``force_env``: variable -> protocol, set when the variable is true). Called by
    ``mooncake_te.transports`` for each transport (built in or registered); a key or
    variable another transport declared is a ValueError."""
    for st in settings:
        owner = _OWNERS.get(st.key)
        if (owner is not None and owner != name) or \
                (owner is None and st.key in SCHEMA["transfer_engine"]):
            raise ValueError(f"transport {name!r} declares [transfer_engine] {st.key}, which "
                             f"{'transport ' + repr(owner) if owner else 'the engine'} "
                             f"already has: give it a key of its own ({name}_...)")
    for st in settings:
        SCHEMA["transfer_engine"][st.key] = (st.types, st.default, st.allowed)
        if st.bounds is not None:
            _BOUNDS[st.key] = st.bounds
        _OWNERS[st.key] = name
        for var, parse in st.env:
            ENV[var] = ("transfer_engine", st.key, parse)
            _OWNERS[var] = name
    for var, proto in (force_env or {}).items():
        ENV[var] = ("transfer_engine", "protocol",
                    lambda v, p=proto: p if _bool(v) else None)
        _FORCE[var] = proto
        _OWNERS[var] = name
    for proto in protocols:
        if proto not in _PROTOCOLS:
            _PROTOCOLS.append(proto)
            _OWNERS[("protocol", proto)] = name
    for theirs, ours in (aliases or {}).items():
        _ALIASES[theirs] = ours


def withdraw_transport(name: str) -> None:
    """Undo :func:`declare_transport` for ``name`` (``transports.unregister``)."""
    for what, owner in list(_OWNERS.items()):
        if owner != name:
            continue
        del _OWNERS[what]
        if isinstance(what, tuple):
            _PROTOCOLS.remove(what[1])
        elif what in ENV:
            del ENV[what]
            _FORCE.pop(what, None)
        else:
            SCHEMA["transfer_engine"].pop(what, None)
            _BOUNDS.pop(what, None)


def protocols() -> tuple:
    """The values ``protocol`` may take: "auto", then each transport's own names."""
    return tuple(_PROTOCOLS)


def protocol_aliases() -> dict:
    """Other projects' protocol names (Mooncake's ``cuda_ipc``, ``nvlink``, ...) -> the
    protocol that carries them here, as the transports declare them."""
    return dict(_ALIASES)


def owner_of(key: str) -> "str | None":
    """The transport that declared ``[transfer_engine]`` key or variable ``key``, or None
    (the engine's own)."""
    return _OWNERS.get(key)


# MC_METADATA_SERVER holds a Mooncake connection string ("etcd://h:2379",
# "redis://h:6379", "http://h:8080/metadata", "P2PHANDSHAKE", or a bare "h:2379", which
# Mooncake reads as etcd: src/transfer_metadata_plugin.cpp); it sets both [metadata] keys.
ENV_METADATA = "MC_METADATA_SERVER"


def split_metadata_url(spec: str) -> tuple[str, str]:
    """``(server_type, server_address)`` for a Mooncake metadata connection string."""
    from .metadata.url import parse
    return parse(spec).config_pair()


@dataclass
class Problem:
    """One thing wrong in a configuration source.

    Attributes
    ----------
    where : str
        The file (or ``$VAR``) it came from.
    section, key : str
        Where in it (``key`` is ``""`` for a whole section).
    value : object
        The offending value (None for an unknown key whose value does not matter).
    message : str
        What is wrong and what is expected.
    suggestion : str or None
        The closest known name, for a misspelling.
    kind : str
        ``"unknown"`` (section or key), ``"type"``, ``"value"`` or ``"syntax"``.
    """

    where: str
    section: str
    key: str
    value: Any
    message: str
    suggestion: "str | None" = None
    kind: str = "value"

    def __str__(self) -> str:
        return self.message


def _closest(name: str, choices) -> "str | None":
    hits = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return hits[0] if hits else None


def _check(section: str, key: str, value, where: str) -> "Problem | None":
    """The problem with one setting, or None."""
    keys = SCHEMA.get(section)
    if keys is None:
        guess = _closest(section, SCHEMA)
        hint = f"; did you mean [{guess}]?" if guess else ""
        return Problem(where, section, "", None,
                       f"{where}: unknown section [{section}]{hint} known sections: "
                       f"{', '.join(f'[{s}]' for s in SCHEMA)}", guess, "unknown")
    if key not in keys:
        guess = _closest(key, keys)
        elsewhere = [s for s, k in SCHEMA.items() if key in k]
        if guess:
            hint = f"; did you mean {guess!r}?"
        elif elsewhere:
            hint = f"; {key!r} belongs in [{elsewhere[0]}]"
        else:
            hint = ""
        return Problem(where, section, key, value,
                       f"{where}: unknown key {key!r} in [{section}]{hint} known keys: "
                       f"{', '.join(keys)}", guess, "unknown")
    types, _, allowed = keys[key]
    # bool is an int subclass: reject True where a number is expected and vice versa.
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if not ok:
        want = " or ".join(_TYPE_WORDS.get(t, t.__name__) for t in types)
        return Problem(where, section, key, value,
                       f"{where}: [{section}] {key} = {value!r} ({type(value).__name__}): "
                       f"expected {want}", None, "type")
    if allowed is not None and value not in allowed:
        guess = _closest(str(value), allowed) if isinstance(value, str) else None
        hint = f"; did you mean {guess!r}?" if guess else ""
        return Problem(where, section, key, value,
                       f"{where}: [{section}] {key} = {value!r}: expected one of "
                       f"{', '.join(map(repr, allowed))}{hint}", guess, "value")
    if isinstance(value, list) and not all(isinstance(x, str) and x for x in value):
        return Problem(where, section, key, value,
                       f"{where}: [{section}] {key} = {value!r}: expected a list of "
                       f"non-empty strings, e.g. [\"mlx5_0\", \"mlx5_1\"]", None, "type")
    if key in _BOUNDS and isinstance(value, (int, float)):
        lo, hi, why = _BOUNDS[key]
        if value < lo or (hi is not None and value > hi):
            return Problem(where, section, key, value,
                           f"{where}: [{section}] {key} = {value!r}: expected {why}",
                           None, "value")
    return None


def find_problems(raw: Mapping, where: str = "<dict>") -> list[Problem]:
    """Every problem in a parsed config (all of them, not just the first)."""
    problems: list[Problem] = []
    for section, values in raw.items():
        if section not in SCHEMA:
            if not isinstance(values, Mapping):
                # A top-level key: probably a setting written above any [section].
                home = [s for s, k in SCHEMA.items() if section in k]
                hint = f"; put it under [{home[0]}]" if home else ""
                problems.append(Problem(where, "", section, values,
                                        f"{where}: {section} = {values!r} is outside any "
                                        f"section{hint}", home[0] if home else None,
                                        "unknown"))
                continue
            problems.append(_check(section, "", None, where))
            continue
        if not isinstance(values, Mapping):
            problems.append(Problem(where, section, "", values,
                                    f"{where}: [{section}] must be a table, got "
                                    f"{values!r}", None, "type"))
            continue
        for key, value in values.items():
            p = _check(section, key, value, where)
            if p is not None:
                problems.append(p)
    return problems


def read_toml(path) -> dict:
    """Parse a TOML file; ConfigError naming the file and the position on failure."""
    path = os.fspath(path)
    if tomllib is None:
        raise ConfigError(f"cannot read {path}: this Python has no tomllib; "
                          f"pip install tomli")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path!r} is a directory") from None
    except PermissionError:
        raise ConfigError(f"config file {path!r} is not readable by this user") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


@dataclass
class Config:
    """Validated settings: ``cfg["section"]["key"]``, ``cfg.get(section, key)`` or the
    ``data`` dict of dicts.

    Attributes
    ----------
    data : dict
        ``{section: {key: value}}`` for every key of :data:`SCHEMA`.
    source : str
        The file it was loaded from (``"<defaults>"`` for none).
    env_applied : dict
        ``{MC_VAR: (section, key)}`` for each environment variable that took effect.
    """

    data: dict = field(default_factory=lambda: {s: {k: copy.deepcopy(v[1]) for k, v in keys.items()}
                                               for s, keys in SCHEMA.items()})
    source: str = "<defaults>"
    env_applied: dict = field(default_factory=dict)

    def get(self, section: str, key: str):
        return self.data[section][key]

    def __getitem__(self, section: str) -> dict:
        return self.data[section]

    @property
    def timeout_s(self) -> float:
        return self.data["transfer_engine"]["timeout_ms"] / 1000.0

    @classmethod
    def load(cls, path: "str | os.PathLike | Config | None" = None,
             env: Mapping[str, str] | None = None) -> "Config":
        """Defaults, then ``path`` (if any), then ``MC_*`` variables from ``env``.

        Raises
        ------
        ConfigError
            Listing every problem found in the file, one per line.
        """
        if isinstance(path, Config):
            cfg = copy.deepcopy(path)
        else:
            cfg = cls()
            if path is not None:
                cfg.merge_file(path)
        cfg.merge_env(os.environ if env is None else env)
        return cfg

    @classmethod
    def load_lenient(cls, path: "str | os.PathLike | None" = None,
                     env: Mapping[str, str] | None = None) -> tuple["Config", list[Problem]]:
        """Like :meth:`load`, but keep going: bad settings keep their defaults and are
        returned as :class:`Problem` objects. A file that cannot be parsed at all is one
        problem of kind ``"syntax"``."""
        cfg = cls()
        problems: list[Problem] = []
        if path is not None:
            where = os.fspath(path)
            try:
                raw = read_toml(where)
            except ConfigError as e:
                return cfg, [Problem(where, "", "", None, str(e), None, "syntax")]
            problems += find_problems(raw, where)
            bad = {(p.section, p.key) for p in problems}
            for section, values in raw.items():
                if section in SCHEMA and isinstance(values, Mapping):
                    for key, value in values.items():
                        if (section, key) not in bad and (section, "") not in bad:
                            cfg.data[section][key] = copy.deepcopy(value)
            cfg.source = where
        try:
            cfg.merge_env(os.environ if env is None else env)
        except ConfigError as e:
            problems.append(Problem("environment", "", "", None, str(e), None, "value"))
        return cfg, problems

    def merge_file(self, path) -> None:
        path = os.fspath(path)
        self.merge(read_toml(path), path)
        self.source = path

    def merge(self, raw: Mapping, where: str = "<dict>") -> None:
        problems = find_problems(raw, where)
        if problems:
            if len(problems) == 1:
                raise ConfigError(problems[0].message)
            raise ConfigError(f"{len(problems)} problems in {where}:\n"
                              + "\n".join(f"  - {p.message}" for p in problems))
        for section, values in raw.items():
            for key, value in values.items():
                self.data[section][key] = copy.deepcopy(value)

    def merge_env(self, env: Mapping[str, str]) -> None:
        forced = [(var, p) for var, p in _FORCE.items() if _bool(env.get(var, ""))]
        if len({p for _, p in forced}) > 1:
            (a, pa), (b, pb) = forced[:2]
            raise ConfigError(f"{a} and {b} are both set; they contradict each other "
                              f"({pa} only vs {pb} only): unset one")
        for var, (section, key, parse) in ENV.items():
            if var not in env or env[var] == "":
                continue
            try:
                value = parse(env[var])
            except ValueError:
                raise ConfigError(f"environment variable {var}={env[var]!r} is not valid for "
                                  f"[{section}] {key}: expected "
                                  f"{_ENV_EXPECTS.get(var) or _TYPE_WORDS.get(SCHEMA[section][key][0][0], 'a value')}"
                                  ) from None
            if value is not None:
                try:
                    self.data[section][key] = validate(section, key, value, f"${var}")
                except ConfigError:
                    if var not in _ENV_EXPECTS:
                        raise
                    # In the variable's own units, not the key's (-1 s, not -1000 ms).
                    raise ConfigError(f"environment variable {var}={env[var]!r} is not "
                                      f"valid for [{section}] {key}: expected "
                                      f"{_ENV_EXPECTS[var]}, above 0") from None
                self.env_applied[var] = (section, key)
        if env.get(ENV_METADATA):
            kind, addr = split_metadata_url(env[ENV_METADATA])
            self.data["metadata"]["server_type"] = validate("metadata", "server_type", kind,
                                                            f"${ENV_METADATA}")
            self.data["metadata"]["server_address"] = addr
            self.env_applied[ENV_METADATA] = ("metadata", "server_type")

    def with_overrides(self, raw: Mapping, where: str = "<dict>") -> "Config":
        """A copy with ``raw`` (``{section: {key: value}}``) merged over it, validated as
        a file's settings are; ``self`` is left as it is. For settings given beside a file
        (the vLLM connector's ``kv_connector_extra_config``), which win over both the file
        and ``MC_*`` variables.

        Raises
        ------
        ConfigError
            An unknown section or key, or a bad value, named with ``where``.
        """
        cfg = copy.deepcopy(self)
        cfg.merge(raw, where)
        return cfg

    def to_dict(self) -> dict:
        return copy.deepcopy(self.data)


def validate(section: str, key: str, value, where: str = "<dict>"):
    """Check one setting against the schema; return it (or raise ConfigError)."""
    p = _check(section, key, value, where)
    if p is not None:
        raise ConfigError(p.message)
    return value
