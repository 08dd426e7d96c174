# SPDX-License-Identifier: Apache-2.0
"""mooncake_te.hugepages: only all-zero stretches of private anonymous memory are handed
back, contents never change, and the refusals say why."""
from __future__ import annotations

import mmap

import numpy as np
import pytest

from mooncake_te import hugepages as hp

THP = hp.thp_mode() in ("always", "madvise") and hp.huge_page_size() > 0
needs_thp = pytest.mark.skipif(not THP, reason=f"transparent huge pages are {hp.thp_mode()}")


def _anon(nbytes: int) -> np.ndarray:
    """A private anonymous mapping of its own (not numpy's allocator, which may already
    ask for huge pages), written so it sits on small pages like torch.zeros' memory."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    a = np.frombuffer(m, dtype=np.uint8)
    a[::4096] = 0                                # touch every page
    return a


@needs_thp
def test_zero_buffer_is_refilled_with_huge_pages():
    size = hp.huge_page_size()
    a = _anon(8 * size)
    r = hp.back_with_hugepages(a)
    assert r.reason == "" and r.remapped == r.eligible and r.eligible >= 6 * size
    a[::4096] = a[::4096]                        # the caller's prefault
    a[-1] = 7
    assert not a[:-1].any() and a[-1] == 7
    # Best effort by the kernel (it may lack a free 2 MiB page), but on an idle test
    # machine the refill gets at least some.
    assert hp.anon_huge_bytes([(int(a.ctypes.data), a.nbytes)]) > 0


@needs_thp
def test_written_stretches_are_kept():
    size = hp.huge_page_size()
    a = _anon(8 * size)
    base = int(a.ctypes.data)
    first = (-base) % size                       # first huge page boundary inside
    marks = [first + 2 * size + 5, first + 5 * size + size - 1, 3]
    for i, off in enumerate(marks):
        a[off] = i + 1
    before = a.copy()
    r = hp.back_with_hugepages(a)
    assert 0 < r.remapped <= r.eligible - 2 * size
    assert np.array_equal(a, before)             # nothing written was dropped


@needs_thp
def test_file_and_shared_memory_are_refused():
    size = hp.huge_page_size()
    shared = mmap.mmap(-1, 4 * size, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    r = hp.back_with_hugepages(np.frombuffer(shared, dtype=np.uint8))
    assert r.remapped == 0 and r.reason == "not private anonymous memory"


def test_small_buffer_and_no_thp(monkeypatch):
    r = hp.back_with_hugepages(np.zeros(4096, np.uint8))
    assert r.remapped == 0 and r.reason
    monkeypatch.setattr(hp, "thp_mode", lambda: "never")
    r = hp.back_with_hugepages(_anon(4 << 20))
    assert r.remapped == 0 and r.reason == "transparent huge pages are never"
