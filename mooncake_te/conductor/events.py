# SPDX-License-Identifier: Apache-2.0
"""vLLM's KV events: each instance's GPU prefix cache as vLLM itself reports it.

``vllm serve ... --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'`` makes vLLM publish, on
a ZeroMQ PUB socket, one message per engine step with cache changes: three frames,
``topic``, an 8-byte big-endian sequence number (0, 1, 2, ... from the publisher's start)
and a msgpack payload ``[ts, [event, ...], data_parallel_rank?]``. An event is a map whose
``type`` is

- ``BlockStored``: ``block_hashes`` (vLLM's hashes, bytes or ints), ``parent_block_hash``
  (the hash of the block before the first, None at a sequence's start), ``token_ids`` (the
  blocks' tokens), ``block_size``, and optionally ``lora_name``, ``extra_keys`` (cache
  salt, multimodal inputs), ``medium`` (``GPU``, ``CPU``...), ``group_idx``;
- ``BlockRemoved``: ``block_hashes`` evicted;
- ``AllBlocksCleared``: the whole prefix cache reset.

The ROUTER socket at ``replay_endpoint`` answers a request (an empty frame and the first
wanted sequence number, 8 bytes big-endian) with every buffered message from there
(``[b"", topic, seq, payload]`` each), then ``[b"", b"", -1 as 8 signed bytes, b""]``.

vLLM's hashes are not ours: :class:`GpuBlocks` maps each stored block to the pool key the
connector would give it (:func:`~..integrations.vllm.pool.keys.block_keys` over the
event's tokens, chained from its parent's key, or from the instance's key root when the
parent is None), so the router's questions ("which of this prompt's keys does instance
``i`` hold?") are answered in its own keys. Blocks whose KV depends on more than their
tokens (a LoRA adapter, a cache salt, multimodal inputs), of another block size or KV
cache group, or stored in a medium other than the GPU are not counted (``skipped``).

Sequence numbers keep the view honest: a gap (messages the SUB socket dropped, or missed
before it connected) is filled from the replay endpoint; a sequence number that goes back
means the publisher restarted (vLLM restarted: its cache is empty) and the view is reset
and refilled from sequence 0. A view that cannot be filled (no replay endpoint, or the
replay buffer no longer holds the gap) is marked not ``complete``; the router then also
counts what it sent there itself (docs/conductor.md, *KV events*).

:class:`GpuBlocks` is data only (tested on hand-made batches); :class:`Subscriber` is its
ZeroMQ side, which needs ``pyzmq`` and ``msgpack`` (or ``msgspec``): ``pip install
'mooncake-te[conductor]'``.
"""
from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlsplit

from ..integrations.vllm.pool.keys import block_keys

log = logging.getLogger("mooncake_te.conductor")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
GPU_MEDIA = (None, "GPU", "gpu")


def _missing(what: str) -> RuntimeError:
    return RuntimeError(f"the conductor reads vLLM's KV events with {what}: pip install "
                        f"'mooncake-te[conductor]' (or pip install pyzmq msgpack), or drop "
                        f"the instances' kv_events endpoints")


def decoder():
    """A function ``bytes -> object`` decoding msgpack (``msgpack``, else ``msgspec``)."""
    try:
        import msgpack
        return lambda b: msgpack.unpackb(b, raw=False, strict_map_key=False)
    except ImportError:
        pass
    try:
        import msgspec
        return msgspec.msgpack.Decoder().decode
    except ImportError:
        raise _missing("msgpack (or msgspec)") from None


def connect_endpoint(endpoint: str, instance_url: str = "") -> str:
    """The address to connect to for a publisher configured with ``endpoint``: vLLM binds
    ``tcp://*:5557`` (all addresses); the conductor connects to the instance's host."""
    e = str(endpoint).strip()
    if not e.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"KV events endpoint {endpoint!r}: expected tcp://host:port (or "
                         f"ipc://path), as in vLLM's --kv-events-config")
    if e.startswith("tcp://"):
        hostport = e[len("tcp://"):]
        host, sep, port = hostport.rpartition(":")
        if not sep or not port.isdigit() or int(port) == 0:
            raise ValueError(f"KV events endpoint {endpoint!r}: needs a fixed port "
                             f"(tcp://host:port); port 0 is only known inside vLLM")
        if host in ("*", "0.0.0.0", "[::]", "::", ""):
            h = urlsplit(instance_url).hostname if instance_url else None
            if not h:
                raise ValueError(f"KV events endpoint {endpoint!r} binds every address: "
                                 f"give the instance's URL so its host can be used")
            host = f"[{h}]" if ":" in h else h
        e = f"tcp://{host}:{port}"
    return e


class GpuBlocks:
    """One instance's GPU prefix cache in pool keys, kept from its KV event batches."""

    def __init__(self, root: bytes, block_size: int):
        self.root = root
        self.block_size = int(block_size)
        self.keys: set = set()
        self.by_hash: dict = {}          # vLLM block hash -> our key
        self.last_seq = -1               # last sequence number applied
        self.complete = False            # every batch since the publisher started applied
        self.batches = 0
        self.gaps = 0
        self.restarts = 0
        self.skipped = 0                 # events about blocks we cannot key (see module)
        self.orphans = 0                 # stored blocks whose parent we never saw

    def __contains__(self, key) -> bool:
        return key in self.keys

    def __len__(self) -> int:
        return len(self.keys)

    def clear(self) -> None:
        self.keys.clear()
        self.by_hash.clear()

    def reset(self) -> None:
        """Forget everything (the publisher restarted): refill from sequence 0."""
        self.clear()
        self.last_seq = -1
        self.complete = False

    def apply(self, seq: int, batch) -> None:
        """Apply one decoded batch ``[ts, events, dp_rank?]`` numbered ``seq``. The caller
        orders batches; this records ``last_seq`` and whether the history is whole."""
        if seq == 0:
            self.reset()
            self.complete = True
        elif seq != self.last_seq + 1:
            self.complete = False
        self.last_seq = seq
        self.batches += 1
        events = batch[1] if isinstance(batch, (list, tuple)) and len(batch) > 1 else []
        for ev in events or []:
            self.apply_event(ev)

    def apply_event(self, ev) -> None:
        if not isinstance(ev, dict):
            self.skipped += 1
            return
        kind = ev.get("type")
        if kind == "AllBlocksCleared":
            self.clear()
        elif kind == "BlockRemoved":
            if ev.get("medium") not in GPU_MEDIA or (ev.get("group_idx") or 0) != 0:
                return
            for h in ev.get("block_hashes") or []:
                k = self.by_hash.pop(_h(h), None)
                if k is not None:
                    self.keys.discard(k)
        elif kind == "BlockStored":
            self._stored(ev)
        else:
            self.skipped += 1

    def _stored(self, ev: dict) -> None:
        hashes = [_h(h) for h in ev.get("block_hashes") or []]
        toks = ev.get("token_ids") or []
        bs = int(ev.get("block_size") or 0)
        extra = ev.get("extra_keys") or []
        if (ev.get("medium") not in GPU_MEDIA or (ev.get("group_idx") or 0) != 0
                or ev.get("lora_name") or ev.get("lora_id")
                or any(x is not None for x in extra)
                or bs != self.block_size or len(toks) != bs * len(hashes) or not hashes):
            self.skipped += 1
            return
        parent = ev.get("parent_block_hash")
        pkey: "bytes | None"
        if parent is None:
            pkey = self.root
        else:
            pkey = self.by_hash.get(_h(parent))
            if pkey is None:            # its parent evicted or never seen: cannot chain
                self.orphans += 1
                return
        for h, k in zip(hashes, block_keys(toks, bs, pkey)):
            self.by_hash[h] = k
            self.keys.add(k)


def _h(h):
    """A vLLM block hash as a dict key (bytes or int; msgpack may give lists of ints)."""
    return bytes(h) if isinstance(h, (bytearray, memoryview, list)) else h


class Subscriber:
    """Keeps one :class:`GpuBlocks` up to date from an instance's publisher (an asyncio
    task: :meth:`run`). ``endpoint`` / ``replay``: addresses to connect to (see
    :func:`connect_endpoint`); ``topic``: vLLM's ``topic`` (default empty: all)."""

    REPLAY_TIMEOUT_S = 2.0

    def __init__(self, name: str, view: GpuBlocks, endpoint: str, replay: str = "",
                 topic: str = ""):
        try:
            import zmq  # noqa: F401
            import zmq.asyncio  # noqa: F401
        except ImportError:
            raise _missing("pyzmq") from None
        self.name = name
        self.view = view
        self.endpoint = endpoint
        self.replay = replay
        self.topic = topic.encode()
        self.decode = decoder()
        self.last_sub_seq = -1          # the SUB socket's last number (monotonic per life)
        self.errors = 0
        self._want_reset = False

    def restarted(self) -> None:
        """The instance came back after being down: its cache is new (refill from 0 on
        the next pass)."""
        self._want_reset = True

    async def run(self) -> None:
        import zmq
        import zmq.asyncio
        ctx = zmq.asyncio.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        try:
            await self._catch_up(0)               # whatever vLLM did before we connected
            while True:
                if self._want_reset:
                    self._want_reset = False
                    self._reset()
                    await self._catch_up(0)
                if not await sub.poll(500):
                    continue
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.errors += 1
                    continue
                seq = int.from_bytes(frames[1], "big")
                if seq <= self.last_sub_seq:      # numbers went back: a new publisher
                    log.info("conductor: %s's KV events restarted (seq %d after %d): its "
                             "GPU cache view is reset", self.name, seq, self.last_sub_seq)
                    self._reset()
                self.last_sub_seq = seq
                v = self.view
                if seq <= v.last_seq:             # already applied from a replay
                    continue
                if seq > v.last_seq + 1:
                    v.gaps += 1
                    await self._catch_up(v.last_seq + 1, stop=seq)
                self._apply(seq, frames[2])
        finally:
            sub.close(0)

    def _reset(self) -> None:
        self.view.restarts += 1
        self.view.reset()
        self.last_sub_seq = -1

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = self.decode(payload)
        except Exception as e:
            self.errors += 1
            if self.errors in (1, 10, 100) or self.errors % 1000 == 0:
                log.warning("conductor: undecodable KV event batch from %s (%d so far): %s",
                            self.name, self.errors, e)
            self.view.complete = False
            self.view.last_seq = seq
            return
        self.view.apply(seq, batch)

    async def _catch_up(self, start: int, stop: "int | None" = None) -> None:
        """Apply the replay endpoint's batches ``start .. stop-1`` (all from ``start``
        when ``stop`` is None). Without a replay endpoint, or when it does not answer,
        the view stays as it is (``complete`` False from the next batch's number)."""
        if not self.replay:
            return
        import zmq
        import zmq.asyncio
        ctx = zmq.asyncio.Context.instance()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.replay)
        try:
            await s.send_multipart([b"", int(start).to_bytes(8, "big")])
            while True:
                if not await s.poll(int(self.REPLAY_TIMEOUT_S * 1000)):
                    log.info("conductor: %s's KV events replay endpoint did not answer",
                             self.name)
                    return
                f = await s.recv_multipart()
                if len(f) != 4 or f[2] == END_SEQ or len(f[2]) != 8:
                    if start == 0 and self.view.last_seq < 0 and f[2:3] == [END_SEQ]:
                        self.view.complete = True     # nothing published yet: all known
                    return
                seq = int.from_bytes(f[2], "big")
                if stop is not None and seq >= stop:
                    continue
                if seq <= self.view.last_seq:
                    continue
                if seq != self.view.last_seq + 1 and seq != 0:
                    # The buffer no longer holds what we missed.
                    self.view.complete = False
                self._apply(seq, f[3])
        finally:
            s.close(0)


def parse_kv_events(spec: str) -> tuple:
    """``URL=ENDPOINT[,REPLAY]`` (``--kv-events``) -> ``(url, endpoint, replay)``."""
    url, sep, eps = str(spec).partition("=")
    if not sep or not url.startswith(("http://", "https://")) or not eps:
        raise ValueError(f"--kv-events {spec!r}: expected INSTANCE_URL=ENDPOINT[,REPLAY], "
                         f"e.g. http://127.0.0.1:8100=tcp://127.0.0.1:5557,"
                         f"tcp://127.0.0.1:5558 (vLLM's --kv-events-config endpoint and "
                         f"replay_endpoint)")
    pub, _, rep = eps.partition(",")
    return url.rstrip("/"), pub.strip(), rep.strip()
