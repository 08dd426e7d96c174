# SPDX-License-Identifier: Apache-2.0
"""Where manifests and holder lists live.

With a metadata store (etcd, redis, http) they are keys beside the engines'
descriptors, under the same prefix (``MC_METADATA_CLUSTER_ID`` applies):

* ``mooncake/[<cluster>/]p2p_store/objects/<name>``: the manifest (JSON);
* ``mooncake/[<cluster>/]p2p_store/holders/<name>``: ``{"object_id", "holders": [...]}``;
* ``mooncake/[<cluster>/]p2p_store/index``: ``{"names": [...]}``, for ``list()``.

They are the object directory's area ``p2p_store``
(:class:`mooncake_te.objdir.ObjectDirectory`, shared with the KV cache's owner index).
With the engines' ``auth_token`` each holder entry carries ``mac``, the object
directory's record MAC (:mod:`mooncake_te.objdir.record_mac`, label
:data:`HOLDER_LABEL`) over the object's name and id and the entry's fields; getters skip
an entry without a valid one, so whoever can write the metadata store cannot announce
holders. Entries written by older versions carry a MAC of their own (32 hex digits) and
are skipped as unauthenticated (docs/p2p_store.md says what to do).

The stores offer no compare-and-swap, so two getters adding themselves at the same
moment can lose one update. Three things make that harmless: every change is read back
after a random pause and redone if it was lost
(:meth:`~mooncake_te.objdir.ObjectDirectory.update`); every holder re-checks its own
entry each refresh period; and holders gossip (a getter names itself in each chunk request, and getters
ask holders for the holders they know). A holder that died stays listed until someone
notices its engine's segment has expired from the store (the engines' keys carry a
TTL) and prunes it; until then getters skip it at the first refused connection.

With ``metadata="p2p"`` there is no store: the publisher's store is the directory, and
getters are given its address (``seeds=``). It answers manifest and holder requests
from what it holds and what it has been told.
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod

from ..errors import MetadataError
from ..metadata import KeyValueBackend, ram_key
from ..objdir import ObjectDirectory, record_key, record_mac, record_mac_ok
from .control import ControlClient
from .errors import ObjectExistsError
from .manifest import HolderRef, Manifest

log = logging.getLogger("mooncake_te.p2p_store")

#: entries of an object's holder list in a metadata store
MAX_HOLDERS = 256
#: the name list's key in the directory's area
INDEX = "index"
#: the label of the holder entries' MAC key (:func:`mooncake_te.objdir.record_key`)
HOLDER_LABEL = "p2p_store/holders"


def _holder_fields(name: str, object_id: str, ref: HolderRef) -> tuple:
    """What a holder entry's MAC covers: the object (name, id) and the entry."""
    return name, object_id, ref.name, ref.address, ref.segment, ref.instance


class Directory(ABC):
    """Manifests and holder lists, wherever they live."""

    kind = "?"
    #: auth_token for other stores' control ports (set by the store from its engine)
    token: bytes | None = None

    @abstractmethod
    def publish(self, manifest: Manifest) -> None:
        """Make ``manifest`` findable; ObjectExistsError if a live publisher has the name."""

    @abstractmethod
    def withdraw(self, manifest: Manifest) -> None:
        """Remove the object (its publisher calls this)."""

    @abstractmethod
    def manifest(self, name: str) -> Manifest | None: ...

    def manifests(self, names) -> list:
        """:meth:`manifest` of each name (a store answers all in one round trip)."""
        return [self.manifest(n) for n in names]

    @abstractmethod
    def holders(self, name: str, object_id: str) -> list[HolderRef]: ...

    @abstractmethod
    def add_holder(self, manifest: Manifest, ref: HolderRef) -> None: ...

    @abstractmethod
    def remove_holder(self, manifest: Manifest, ref: HolderRef) -> None: ...

    @abstractmethod
    def names(self) -> list[str]: ...

    def holder_gone(self, manifest: Manifest, ref: HolderRef) -> None:
        """A getter could not reach ``ref``: prune it if it is really gone."""

    def describe(self) -> str:
        return self.kind

    def close(self) -> None:
        pass


def _alive(ref: HolderRef, timeout: float = 1.0, token: bytes | None = None) -> bool:
    """Does the store ``ref`` names still run (same instance)?"""
    c = ControlClient(ref.address, timeout, token)
    try:
        reply = c.call({"op": "hello"})
        return reply.get("ref", {}).get("instance") == ref.instance
    except MetadataError:
        return False
    finally:
        c.close()


class StoreDirectory(Directory):
    """Manifests and holder lists in a metadata store (etcd, redis, http).

    Parameters
    ----------
    backend : KeyValueBackend
        An open store; closed by :meth:`close` only if ``owned``.
    """

    def __init__(self, backend: KeyValueBackend, owned: bool = False):
        self.backend = backend
        self.kind = backend.kind
        self._owned = owned
        self.dir = ObjectDirectory(backend, "p2p_store")
        #: holder entries refused for their MAC (with a token)
        self.rejected = 0

    def _holder_key(self) -> "bytes | None":
        """The holder entries' MAC key (None without a token: entries carry no MAC)."""
        return record_key(self.token, HOLDER_LABEL)

    def _entry(self, key: "bytes | None", manifest: Manifest, ref: HolderRef) -> dict:
        """``ref``'s entry in ``manifest``'s holder list, with its MAC under ``key``."""
        entry = ref.to_json()
        if key is not None:
            entry["mac"] = record_mac(key, *_holder_fields(manifest.name,
                                                           manifest.object_id, ref))
        return entry

    def describe(self) -> str:
        return f"the {self.kind} metadata store {getattr(self.backend, 'address', '')}".rstrip()

    def _hkey(self, name: str) -> str:
        """The store key of ``name``'s holder list."""
        return self.dir.key(f"holders/{name}")

    # -- Directory -----------------------------------------------------------------------
    def publish(self, manifest: Manifest) -> None:
        old = self.manifest(manifest.name)
        if old is not None and old.origin.key != manifest.origin.key:
            if _alive(old.origin, token=self.token):
                raise ObjectExistsError(
                    f"an object named {manifest.name!r} is already published by "
                    f"{old.origin.name} ({old.origin.address}) in {self.describe()}; "
                    f"unregister it there first or pick another name")
            log.warning("replacing object %r: its publisher %s no longer runs",
                        manifest.name, old.origin.address)
        self.dir.put(f"objects/{manifest.name}", manifest.encode())
        origin = self._entry(self._holder_key(), manifest, manifest.origin)
        self.dir.put_json(f"holders/{manifest.name}",
                          {"object_id": manifest.object_id, "holders": [origin]})
        self.dir.update(INDEX, lambda d: _with_name(d, manifest.name, True), {"names": []})

    def withdraw(self, manifest: Manifest) -> None:
        cur = self.manifest(manifest.name)
        if cur is not None and cur.object_id != manifest.object_id:
            return      # already replaced by someone else's object: not ours to delete
        self.dir.delete_many([f"objects/{manifest.name}", f"holders/{manifest.name}"])
        self.dir.update(INDEX, lambda d: _with_name(d, manifest.name, False), {"names": []})

    def manifest(self, name: str) -> Manifest | None:
        raw = self.dir.get(f"objects/{name}")
        return None if raw is None else Manifest.decode(raw)

    def manifests(self, names) -> list:
        raws = self.dir.get_many([f"objects/{n}" for n in names], hint=False)
        return [None if raw is None else Manifest.decode(raw) for raw in raws]

    def holders(self, name: str, object_id: str) -> list[HolderRef]:
        d = self.dir.get_json(f"holders/{name}", {})
        if not isinstance(d, dict) or d.get("object_id") != object_id:
            return []
        key = self._holder_key()
        out = []
        for h in list(d.get("holders", ()))[-MAX_HOLDERS:]:
            try:
                ref = HolderRef.from_json(h)
            except (KeyError, TypeError, ValueError):
                continue
            # With a token, an entry counts only with its MAC (issue #35 item 8): anyone
            # who can write to the metadata store cannot announce holders.
            if key is not None and not record_mac_ok(
                    key, h.get("mac"), *_holder_fields(name, object_id, ref)):
                self._refused(name, ref, h.get("mac"))
                continue
            out.append(ref)
        return out

    def _refused(self, name: str, ref: HolderRef, tag) -> None:
        self.rejected += 1
        if self.rejected in (1, 10, 100) or self.rejected % 1000 == 0:
            older = isinstance(tag, str) and len(tag) == 32
            log.warning("holder %s (%s) of %r has no valid MAC; ignored (%d so far): %s",
                        ref.name, ref.address, name, self.rejected,
                        "written by a P2P store of an older version (its holder MAC "
                        "predates the object directory's scheme), ignored until that "
                        "store runs this version (docs/p2p_store.md)" if older
                        else "written without this cluster's auth_token, or altered")

    def _change_holders(self, manifest: Manifest, ref: HolderRef, add: bool) -> None:
        key = self._holder_key()

        def change(d):
            if d.get("object_id") != manifest.object_id:
                if not add:
                    return d
                d = {"object_id": manifest.object_id, "holders": []}
            hs = [h for h in d.get("holders", ()) if isinstance(h, dict) and (
                h.get("address") != ref.address or h.get("instance") != ref.instance)]
            if add:
                hs.append(self._entry(key, manifest, ref))
            # Bounded: the oldest entries go first (live holders re-add themselves each
            # refresh period); the publisher's own entry stays first.
            if len(hs) > MAX_HOLDERS:
                hs = hs[:1] + hs[len(hs) - MAX_HOLDERS + 1:]
            return {"object_id": manifest.object_id, "holders": hs}
        self.dir.update(f"holders/{manifest.name}", change, {})

    def add_holder(self, manifest: Manifest, ref: HolderRef) -> None:
        self._change_holders(manifest, ref, True)

    def remove_holder(self, manifest: Manifest, ref: HolderRef) -> None:
        self._change_holders(manifest, ref, False)

    def holder_gone(self, manifest: Manifest, ref: HolderRef) -> None:
        # The engine's descriptor carries a TTL in every store: once it is gone the
        # holder's process is gone (or cut off), and the entry can go too.
        try:
            if self.backend.get(ram_key(ref.segment, getattr(self.backend, "cluster_id", None))) \
                    is None:
                self.remove_holder(manifest, ref)
                log.info("pruned holder %s of %r: its engine left the metadata store",
                         ref.name, manifest.name)
        except MetadataError as e:
            log.debug("could not prune %s: %s", ref.name, e)

    def names(self) -> list[str]:
        return list(self.dir.get_json(INDEX, {"names": []}).get("names", ()))

    def close(self) -> None:
        if self._owned:
            self.backend.close()


def _with_name(d: dict, name: str, present: bool) -> dict:
    names = [n for n in d.get("names", ()) if n != name]
    if present:
        names.append(name)
    return {"names": sorted(names)}


class SeedDirectory(Directory):
    """No metadata store: ask the seed stores (publishers) given by address.

    Parameters
    ----------
    seeds : list of str
        ``host:port`` control addresses of stores that publish or hold the objects
        (:attr:`P2PStore.address`).
    """

    kind = "p2p"

    def __init__(self, seeds, timeout: float = 3.0):
        self.seeds = list(seeds or ())
        self._timeout = timeout
        self._clients: dict[str, ControlClient] = {}

    def describe(self) -> str:
        return f"the seed stores {', '.join(self.seeds)}" if self.seeds else \
            "this store (metadata='p2p' and no seeds given)"

    def _ask(self, request: dict):
        """Yield each seed's reply; MetadataError if none answered at all."""
        errors = []
        answered = False
        for s in self.seeds:
            c = self._clients.get(s)
            if c is None:
                c = self._clients[s] = ControlClient(s, self._timeout, self.token)
            try:
                reply = c.call(request)
            except MetadataError as e:
                errors.append(str(e))
                continue
            answered = True
            yield reply
        if self.seeds and not answered:
            raise MetadataError("no seed store answered: " + "; ".join(errors))

    def publish(self, manifest: Manifest) -> None:
        pass    # the publisher's own store answers for it

    def withdraw(self, manifest: Manifest) -> None:
        pass

    def manifest(self, name: str) -> Manifest | None:
        for reply in self._ask({"op": "manifest", "name": name}):
            if reply.get("ok"):
                return Manifest.from_json(reply["manifest"])
        return None

    def holders(self, name: str, object_id: str) -> list[HolderRef]:
        out = {}
        for reply in self._ask({"op": "holders", "name": name, "object_id": object_id}):
            for h in list(reply.get("holders", ()) if reply.get("ok") else ())[:MAX_HOLDERS]:
                try:
                    ref = HolderRef.from_json(h)
                except (KeyError, TypeError, ValueError):
                    continue
                out[ref.key] = ref
        return list(out.values())

    def add_holder(self, manifest: Manifest, ref: HolderRef) -> None:
        self._tell("announce", manifest, ref)

    def remove_holder(self, manifest: Manifest, ref: HolderRef) -> None:
        self._tell("withdraw", manifest, ref)

    def _tell(self, op: str, manifest: Manifest, ref: HolderRef) -> None:
        try:
            for _ in self._ask({"op": op, "name": manifest.name, "object_id": manifest.object_id,
                                "holder": ref.to_json()}):
                pass
        except MetadataError as e:
            log.debug("could not %s to the seeds: %s", op, e)

    def names(self) -> list[str]:
        names = set()
        for reply in self._ask({"op": "list"}):
            names.update(m["name"] for m in reply.get("objects", ()))
        return sorted(names)

    def close(self) -> None:
        for c in self._clients.values():
            c.close()
