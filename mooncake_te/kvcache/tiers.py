# SPDX-License-Identifier: Apache-2.0
"""The KV cache's tiers: one small interface, a registry, and DRAM as the hub.

Every block a :class:`~.store.KVCache` serves passes through its DRAM pool, the *hub*: a
block found in another tier is first read into a hub slot (checked), then copied out or
read by peers from there; a block the hub evicts is written from its slot to the tier
below (demotion). A tier therefore only moves blocks between itself and hub slots::

                        lookup / read_into (get-into)
        +-----------+  <---------------------------  +------------------------+
        | DRAM hub  |                                | ssd     (local)        |
        | (slots)   |  --------------------------->  | remote  (peers' hubs)  |
        +-----------+   write_from (put-from: demote) | ...     (registered)   |
                                                      +------------------------+

The registry (:func:`registered`) is the ordered list of tier classes: the hub first,
then ``ssd`` and ``remote``, then any tier registered with :func:`register`. The cache
walks it for lookups, reads, stats and counters, and its order is the order in which a
prefix is looked for (and in which per-tier counts are reported everywhere: the vLLM
pool's lookup reply, its counters and hit-rate line, the Prometheus metrics). Adding a
tier (say an object store) is its own module with a :class:`Tier` subclass and one
line in :data:`_BUILTIN` (or a :func:`register` call from the code that provides it).

Two kinds of tier:

* **local** (``local = True``): membership is a cheap in-process question
  (:meth:`Tier.holds`), asked key by key under the cache's lock, and a tier may take the
  hub's demotions (:meth:`Tier.accept` + :meth:`Tier.write_from`). ``ssd``.
* **not local**: asked once for a whole prefix or batch (:meth:`Tier.lookup_prefix`,
  :meth:`Tier.locate`), outside the lock, and only when the caller passes
  ``remote=True``. ``remote``: other instances' hubs, found through the owner index.
"""
from __future__ import annotations

import importlib

#: The hub's name; it is always the first tier.
HUB = "dram"


class Tier:
    """One tier of a :class:`~.store.KVCache`. Subclasses set :attr:`name` and
    :attr:`local` and implement what their kind needs (see the module docstring); the
    defaults describe a tier that holds nothing.

    Items passed to :meth:`read_into` are ``(key, handle, length, view, addr)``: the
    ``handle`` :meth:`locate` returned (None for a local tier), the payload length, and
    the hub slot to fill as a writable memoryview and as an address (a tier that reads
    with the transfer engine needs the latter). The slot must receive a whole record
    (:mod:`.record`: header, then payload) whose key, length and checksum the tier has
    checked; the result is one bool per item, False where it could not (the cache then
    frees the slot and counts :attr:`failed_counter`).
    """

    name: str = ""
    #: Where the blocks are, in words (metric help texts): "the pool's SSD tier".
    description: str = ""
    #: Membership is asked key by key under the cache's lock (see module docstring).
    local: bool = True
    #: The tier keeps blocks on a disk; its :meth:`stats` then has ``disk_bytes`` (what
    #: the vLLM pool reports as the tier's bytes).
    disk: bool = False
    #: The counter a failed :meth:`read_into` item bumps.
    failed_counter: str = ""
    #: Blocks this tier serves were authenticated (or are this cache's own). False: the
    #: hub serves them but never publishes them to the owner index as its own (the
    #: remote tier when sharing without a token; issue 35).
    verified: bool = True
    #: The tier takes the hub's demotions (:meth:`accept`, :meth:`write_from`); the
    #: first local tier that does gets them (without one, an evicted block is dropped).
    demotions: bool = False
    #: An owner index (:class:`~.index.OwnerIndex`) the tier finds peers' blocks in:
    #: the hub then publishes its own blocks there, so peers find them too.
    owner_index = None

    # --- opening -----------------------------------------------------------------------
    @classmethod
    def open(cls, cache, args: dict) -> "Tier | None":
        """The tier for ``cache``, or None where ``args`` (the cache's constructor
        arguments, plus ``tiers={name: {...}}``'s entry for this tier) do not ask for
        it. Called in registry order, after the hub's pool exists."""
        return None

    @classmethod
    def blank_stats(cls) -> dict:
        """:meth:`stats` of a tier that is not open (so every registered tier reports the
        same keys whether configured or not)."""
        return {}

    # --- queries -----------------------------------------------------------------------
    def holds(self, key: bytes) -> bool:
        return False

    def length(self, key: bytes) -> "int | None":
        """Payload bytes of ``key`` held here (local tiers)."""
        return None

    def lookup_prefix(self, keys) -> int:
        """How many of ``keys``, from the first, this tier holds."""
        n = 0
        for k in keys:
            if not self.holds(k):
                break
            n += 1
        return n

    def locate(self, keys) -> list:
        """For each key ``(length, handle)`` or None (tiers that are not local: one
        query for the batch)."""
        return [(n, None) if n is not None else None for n in map(self.length, keys)]

    def keys(self) -> list:
        return []

    def __len__(self) -> int:
        return len(self.keys())

    # --- eviction order (local tiers) ----------------------------------------------------
    def touch(self, key: bytes) -> None:
        """``key`` was asked for (its recency or frequency)."""

    def frequency(self, key: bytes) -> int:
        return 1

    # --- data movement ---------------------------------------------------------------------
    def read_into(self, items) -> list:
        """Get-into: bring blocks into hub slots (see the class docstring)."""
        return [False] * len(items)

    def accept(self, key: bytes, length: int, seq: int, pinned=(), freq: int = 1):
        """Make room for a demoted block: ``(handle, evicted keys)``, handle None when
        the tier cannot take it (then the block is dropped). Local tiers only."""
        return None, []

    def write_from(self, items) -> None:
        """Put-from: ``items`` is ``[(handle from accept, record image view)]`` taken
        out of the hub's slots (page-aligned, a multiple of 4 KiB)."""

    def remove(self, key: bytes) -> None:
        """Forget ``key`` (evict it without writing it anywhere)."""

    # --- accounting and lifetime -----------------------------------------------------------
    def stats(self) -> dict:
        """Occupancy as ``{"blocks", "bytes", "capacity_blocks", "capacity_bytes", ...}``;
        the cache reports each key prefixed with the tier's name (``ssd_blocks``)."""
        return {}

    def close(self) -> None:
        pass


class DRAMHub(Tier):
    """The hub as a tier: a view of the :class:`~.store.KVCache`'s slot pool (its key
    -> slot map). The cache moves blocks in and out of it; this class answers the
    questions every tier answers."""

    name = HUB
    description = "the pool's DRAM tier"
    local = True

    def __init__(self, cache):
        self._cache = cache

    @classmethod
    def open(cls, cache, args: dict) -> "DRAMHub":
        return cls(cache)

    @classmethod
    def blank_stats(cls) -> dict:
        return dict.fromkeys(("blocks", "bytes", "capacity_blocks", "capacity_bytes"), 0)

    def holds(self, key: bytes) -> bool:
        return key in self._cache._dram

    def length(self, key: bytes) -> "int | None":
        ent = self._cache._dram.get(key)
        return None if ent is None else ent[1]

    def keys(self) -> list:
        return list(self._cache._dram)

    def __len__(self) -> int:
        return len(self._cache._dram)

    def stats(self) -> dict:
        c = self._cache
        return {"blocks": len(c._dram), "bytes": sum(n for _, n in c._dram.values()),
                "capacity_blocks": c.dram_slots, "capacity_bytes": c.dram_slots * c.slot_size}


# --- the registry ------------------------------------------------------------------------
# The built-in tiers after the hub, in lookup order, as "module:Class" (imported on first
# use, so a tier's module may import this one).
_BUILTIN = ("mooncake_te.kvcache.ssd:SSDTier", "mooncake_te.kvcache.remote:RemoteTier")
_registry: "list[type[Tier]] | None" = None
_extra: list = []


def _load(spec: str) -> type:
    mod, _, cls = spec.partition(":")
    return getattr(importlib.import_module(mod), cls)


def registered() -> tuple:
    """The tier classes, hub first, in lookup order."""
    global _registry
    if _registry is None:
        _registry = [DRAMHub] + [_load(s) for s in _BUILTIN]
    return tuple(_registry + _extra)


def names() -> tuple:
    """The registered tiers' names, hub first (``("dram", "ssd", "remote")``)."""
    return tuple(t.name for t in registered())


def local_names() -> tuple:
    return tuple(t.name for t in registered() if t.local)


def register(cls: type) -> type:
    """Add a tier class after the registered ones (usable as a class decorator). Caches
    created afterwards open it; counters, replies and metrics name it from then on.

    Raises
    ------
    ValueError
        The name is empty, taken, or not a word (it becomes part of counter and metric
        names: ``hit_<name>``, ``served_<name>_bytes``).
    """
    name = getattr(cls, "name", "")
    if not name or not name.isidentifier() or not name.islower():
        raise ValueError(f"a tier name must be a lower-case identifier, got {name!r}")
    if name in names():
        raise ValueError(f"a tier named {name!r} is registered already")
    _extra.append(cls)
    return cls


def unregister(name: str) -> None:
    """Remove a tier added with :func:`register` (tests)."""
    _extra[:] = [t for t in _extra if t.name != name]
