# SPDX-License-Identifier: Apache-2.0
"""``mooncake-te conductor``: a KV-cache-aware router in front of vLLM instances running
MooncakeTEConnector (docs/conductor.md).

By job: :mod:`.registry` (instance records in the metadata store; the connector writes
them), :mod:`.cost` (the routing model, data in and decisions out), :mod:`.cluster`
(instances, their state, where a prompt's blocks are), :mod:`.metrics` (counters; vLLM's
gauges read), :mod:`.server` (the aiohttp front), :mod:`.config` (command line and
``[conductor]``). Importing this package imports neither aiohttp nor transformers.
"""
from __future__ import annotations

from .cluster import Cluster, GpuShadow, static_root
from .cost import (Estimate, InstanceState, Priors, Sample, expected_ttft, prefix_by_tier,
                   refit)
from .registry import InstanceRecord, list_instances, publish_instance, role_of

__all__ = ["Cluster", "GpuShadow", "static_root", "Estimate", "InstanceState", "Priors",
           "Sample", "expected_ttft", "prefix_by_tier", "refit", "InstanceRecord", "list_instances",
           "publish_instance", "role_of"]
