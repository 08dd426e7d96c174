# SPDX-License-Identifier: Apache-2.0
"""The scheduler side of the connector: decides which requests load KV from a producer,
which blocks receive it, and which finished prefills keep their blocks under a lease.

Protocol (pull: the consumer READs from the producer), as in vLLM's NIXL connector:

- The proxy sends the prefill request with ``kv_transfer_params={"do_remote_decode":
  True}``. When it finishes, :meth:`request_finished` keeps its blocks (a lease) and
  returns the parameters the proxy forwards to the decode instance.
- The decode request carries them (``do_remote_prefill``). :meth:`get_num_new_matched_tokens`
  reports the prompt as loadable asynchronously; :meth:`update_state_after_alloc` pairs
  the local blocks with the producer's; the worker reads them and tells the producer.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

# Request states vLLM frees normally; only a prefill that ran to its (1-token) length
# hands its blocks to a consumer. An aborted one frees them at once.
_HANDOFF_STATES = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")


@dataclass
class LoadSpec:
    """Read ``remote_block_ids`` of ``remote_engine`` into ``local_block_ids``."""

    request_id: str
    local_block_ids: list
    remote_block_ids: list
    remote_engine: str
    remote_request_id: str
    lease_deadline: "float | None" = None    # producer's wall clock (time.time())


@dataclass
class Work:
    """Scheduler -> worker, once per step (vLLM's ``KVConnectorMetadata`` carries it)."""

    loads: list = field(default_factory=list)        # [LoadSpec]
    releases: list = field(default_factory=list)     # [(remote_engine, remote_request_id)]
    leases: list = field(default_factory=list)       # [request_id] on the producer


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SchedulerSide:
    """vLLM-independent logic; ``request`` objects are vLLM ``Request``\\ s (duck-typed:
    ``request_id``, ``prompt_token_ids``, ``kv_transfer_params``, ``status``)."""

    def __init__(self, *, block_size: int, is_producer: bool, is_consumer: bool,
                 engine_name: str, host: str, port: int, lease_s: float = 120.0,
                 clock=time.time):
        self.block_size = int(block_size)
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self.engine_name = engine_name
        self.host, self.port = host, int(port)
        self.lease_s = float(lease_s)
        self._clock = clock
        self._work = Work()

    # -- consumer -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        p = request.kv_transfer_params
        if self.is_consumer and p and p.get("do_remote_prefill"):
            n = min(len(request.prompt_token_ids or ()),
                    int(p.get("remote_num_tokens", 1 << 62))) - num_computed_tokens
            if n > 0:
                return n, True
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        p = request.kv_transfer_params
        if not (self.is_consumer and p and p.get("do_remote_prefill")):
            return
        p["do_remote_prefill"] = False          # load once, even if called again
        engine, rid = p.get("remote_engine"), p.get("remote_request_id")
        if not engine or rid is None:
            return
        if num_external_tokens <= 0:
            # Full local prefix hit: nothing to read, but the producer holds a lease.
            self._work.releases.append((engine, rid))
            return
        all_ids = list(blocks.get_block_ids()[0])
        fresh = list(blocks.get_unhashed_block_ids()) if hasattr(
            blocks, "get_unhashed_block_ids") else all_ids
        skip = len(all_ids) - len(fresh)        # blocks already cached locally
        # Fewer remote blocks than local ones (a different prompt reached the two
        # instances) must not leave blocks unfilled but counted as computed: the worker's
        # plan() refuses unequal counts and the load is reported failed.
        remote = list(p.get("remote_block_ids") or ())[skip:skip + len(fresh)]
        deadline = p.get("remote_lease_deadline")
        self._work.loads.append(LoadSpec(request.request_id, fresh, remote,
                                         engine, rid,
                                         float(deadline) if deadline is not None else None))

    # -- producer -----------------------------------------------------------------------
    def request_finished(self, request, block_ids):
        p = request.kv_transfer_params
        if not p:
            return False, None
        if p.get("do_remote_prefill") and p.get("remote_engine"):
            # A consumer request aborted before its blocks were allocated: the producer
            # still holds a lease; let it go.
            p["do_remote_prefill"] = False
            self._work.releases.append((p["remote_engine"], p.get("remote_request_id")))
            return False, None
        if not (self.is_producer and p.get("do_remote_decode")):
            return False, None
        status = getattr(request.status, "name", str(request.status))
        n_prompt = len(request.prompt_token_ids or ())
        ids = list(block_ids[0] if block_ids and isinstance(block_ids[0], (list, tuple))
                   else block_ids)[:cdiv(n_prompt, self.block_size)]
        if status not in _HANDOFF_STATES or not ids:
            return False, None
        self._work.leases.append(request.request_id)
        return True, {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_engine": self.engine_name,
                      "remote_request_id": request.request_id,
                      "remote_block_ids": ids, "remote_num_tokens": n_prompt,
                      # The worker's lease starts a step later, so this is conservative.
                      "remote_lease_deadline": self._clock() + self.lease_s,
                      "remote_host": self.host, "remote_port": self.port}

    def take_work(self) -> Work:
        w, self._work = self._work, Work()
        return w
