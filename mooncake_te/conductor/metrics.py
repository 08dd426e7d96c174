# SPDX-License-Identifier: Apache-2.0
"""The conductor's counters, in Prometheus' text format on ``GET /metrics``
(names documented in docs/observability.md)."""
from __future__ import annotations

from collections import defaultdict

_HELP = {
    "mooncake_te_conductor_requests_total":
        ("counter", "requests routed, by instance and role (prefill, decode, plain)"),
    "mooncake_te_conductor_retries_total":
        ("counter", "requests sent again elsewhere after an instance failed before its "
                    "first byte"),
    "mooncake_te_conductor_failures_total":
        ("counter", "instance failures before the first byte (connection, timeout, 5xx)"),
    "mooncake_te_conductor_errors_total":
        ("counter", "requests answered with an error, by HTTP status"),
    "mooncake_te_conductor_client_disconnects_total":
        ("counter", "clients that left before the answer ended (upstream cancelled)"),
    "mooncake_te_conductor_dropped_kv_transfer_params_total":
        ("counter", "client requests whose own kv_transfer_params were dropped"),
    "mooncake_te_conductor_hit_tokens_total":
        ("counter", "prompt tokens expected reusable at routing, by tier (gpu, dram, ssd, remote)"),
    "mooncake_te_conductor_prompt_tokens_total": ("counter", "prompt tokens routed"),
    "mooncake_te_conductor_cached_tokens_total":
        ("counter", "cached prompt tokens vLLM reported (usage.prompt_tokens_details)"),
    "mooncake_te_conductor_ttft_expected_seconds_total":
        ("counter", "sum of expected TTFT of the requests measured, by instance"),
    "mooncake_te_conductor_ttft_measured_seconds_total":
        ("counter", "sum of measured TTFT (first byte from the instance), by instance"),
    "mooncake_te_conductor_ttft_samples_total":
        ("counter", "requests whose TTFT was measured, by instance"),
    "mooncake_te_conductor_route_seconds_total":
        ("counter", "time spent deciding (tokenize, keys, index, ranking)"),
    "mooncake_te_conductor_instance_healthy": ("gauge", "1 when the last health check passed"),
    "mooncake_te_conductor_instance_inflight":
        ("gauge", "requests routed to the instance and not yet answered"),
    "mooncake_te_conductor_instance_prefill_seconds_per_token":
        ("gauge", "the per-token prefill time in use (measured, else the prior)"),
    "mooncake_te_conductor_instance_wait_seconds_per_request":
        ("gauge", "what one request ahead adds to a TTFT there (measured, else the prior)"),
    "mooncake_te_conductor_instance_fit_residual_seconds":
        ("gauge", "the fit's median absolute residual: estimates closer than "
                  "affinity_residuals times this are ties, won by the prefix holder"),
    "mooncake_te_conductor_instance_shared_seconds_per_token":
        ("gauge", "what one uncached token in flight on another instance adds to a TTFT "
                  "there: about 0 where instances have compute of their own (measured)"),
    "mooncake_te_conductor_instance_gpu_blocks":
        ("gauge", "blocks in the instance's GPU prefix cache, from its KV events"),
    "mooncake_te_conductor_instance_kv_events_complete":
        ("gauge", "1 when every KV event batch since the instance started was applied"),
    "mooncake_te_conductor_instance_kv_events_batches":
        ("gauge", "KV event batches applied"),
    "mooncake_te_conductor_instance_kv_events_gaps":
        ("gauge", "sequence gaps seen on the KV events stream (filled from replay)"),
    "mooncake_te_conductor_instance_kv_events_restarts":
        ("gauge", "times the KV events stream restarted (the instance restarted)"),
}


class Counters:
    def __init__(self):
        self.c: dict = defaultdict(float)          # (name, labels tuple) -> value

    def inc(self, name: str, value: float = 1.0, **labels) -> None:
        self.c[(name, tuple(sorted(labels.items())))] += value

    def get(self, name: str, **labels) -> float:
        return self.c.get((name, tuple(sorted(labels.items()))), 0.0)

    def total(self, name: str) -> float:
        return sum(v for (n, _), v in self.c.items() if n == name)

    def exposition(self, gauges: "list | None" = None) -> bytes:
        """Text format: every counter, then ``gauges`` (``(name, labels, value)``)."""
        rows: dict = defaultdict(list)
        for (name, labels), v in self.c.items():
            rows[name].append((dict(labels), v))
        for name, labels, v in gauges or ():
            rows[name].append((labels, v))
        out = []
        for name in sorted(rows):
            kind, doc = _HELP.get(name, ("untyped", ""))
            out.append(f"# HELP {name} {doc}\n# TYPE {name} {kind}\n")
            for labels, v in rows[name]:
                lab = ",".join(f'{k}="{_esc(str(x))}"' for k, x in sorted(labels.items()))
                out.append(f"{name}{{{lab}}} {v:.9g}\n" if lab else f"{name} {v:.9g}\n")
        return "".join(out).encode()


def _esc(s: str) -> str:
    return s.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


def parse_vllm_metrics(text: str) -> dict:
    """The few vLLM gauges the conductor routes by, summed over label sets:
    ``running``, ``waiting``, ``kv_usage`` (0..1) and ``num_gpu_blocks`` (from
    ``vllm:cache_config_info``), each only when present."""
    out: dict = {}
    names = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
             "vllm:kv_cache_usage_perc": "kv_usage", "vllm:gpu_cache_usage_perc": "kv_usage"}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name, _, rest = line.partition("{")
        if not rest:
            name, _, val = line.partition(" ")
            labels = ""
        else:
            labels, _, val = rest.rpartition("}")
        name = name.strip()
        if name in names:
            try:
                out[names[name]] = out.get(names[name], 0.0) + float(val.split()[0])
            except (ValueError, IndexError):
                pass
        elif name == "vllm:cache_config_info":
            for part in labels.split(","):
                k, _, v = part.partition("=")
                if k.strip() == "num_gpu_blocks":
                    try:
                        out["num_gpu_blocks"] = int(v.strip().strip('"'))
                    except ValueError:
                        pass
    return out
