# SPDX-License-Identifier: Apache-2.0
"""Registering 1,265 small tensors (issue 9 target: under 20 ms), and unregistering them.

1,265 separate numpy arrays, one per KV block buffer, of the sizes an fp16 KV block of
16 tokens takes per layer for 4, 8, 16 and 32 KV heads of dimension 128 (16, 32, 64 and
128 KiB), in rotation: about 76 MB in all. They are allocated once; each round registers
all of them on an engine with no peers (or unregisters all of them), one ``register``
call per tensor, as an integration without a batch call would. NIXL needed a range cache
to get the same count from 2.4 s to 17 ms (vLLM's NIXL connector).
"""
from __future__ import annotations

import numpy as np
import pytest

import mooncake_te as mte

COUNT = 1265
SIZES = [16 << 10, 32 << 10, 64 << 10, 128 << 10]
ROUNDS = 5


@pytest.fixture(scope="module")
def tensors():
    arrs = [np.empty(SIZES[i % len(SIZES)], dtype=np.uint8) for i in range(COUNT)]
    for a in arrs:
        a.fill(0)                   # pages touched: registration, not page faults, is timed
    return arrs


@pytest.fixture()
def fresh_engine():
    with mte.TransferEngine(host="127.0.0.1") as eng:
        yield eng


def _ms(record, benchmark):
    times = record.times(benchmark)
    return (float(np.median(times)) * 1e3, float(min(times)) * 1e3) if times else (0, 0)


def test_register_1265(benchmark, fresh_engine, tensors, record):
    eng = fresh_engine
    regions = []

    def clear():
        for r in regions:
            eng.unregister(r)
        regions.clear()

    def register_all():
        regions.extend(eng.register(a) for a in tensors)

    benchmark.pedantic(register_all, setup=clear, rounds=ROUNDS, warmup_rounds=1)
    clear()
    med, best = _ms(record, benchmark)
    if med:
        record("registration of 1,265 tensors of 16-128 KiB [< 20 ms]",
               f"register x {COUNT} (one call each)",
               f"{med:8.1f} ms median, {best:.1f} ms best, {med / COUNT * 1e3:.1f} µs/tensor")


def test_unregister_1265(benchmark, fresh_engine, tensors, record):
    eng = fresh_engine
    regions = []

    def fill():
        regions.extend(eng.register(a) for a in tensors)

    def unregister_all():
        for r in regions:
            eng.unregister(r)
        regions.clear()

    benchmark.pedantic(unregister_all, setup=fill, rounds=ROUNDS, warmup_rounds=1)
    med, best = _ms(record, benchmark)
    if med:
        record("registration of 1,265 tensors of 16-128 KiB [< 20 ms]",
               f"unregister x {COUNT} (one call each)",
               f"{med:8.1f} ms median, {best:.1f} ms best, {med / COUNT * 1e3:.1f} µs/tensor")
