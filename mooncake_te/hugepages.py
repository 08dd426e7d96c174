# SPDX-License-Identifier: Apache-2.0
"""Back a freshly allocated host buffer with transparent huge pages (2 MiB on x86-64).

Why: a same-host transfer (``process_vm_readv/writev``, the shm route) pins and copies
the destination page by page, and the copying thread walks the source's page tables.
On 4 KiB pages that costs a quarter to a third more CPU per byte than on 2 MiB pages
(benchmarks/pd_load.py), and a P/D load competes for that CPU with the model's own
threads. numpy already asks for huge pages for its large arrays; a KV cache that vLLM
allocates with ``torch.zeros`` is written (zeroed) at allocation, so it sits on 4 KiB
pages that ``madvise(MADV_HUGEPAGE)`` alone no longer changes, and ``MADV_COLLAPSE``
copies them at ~0.2 GiB/s (4 s per GiB on the 2-core test VM).

How: the buffer must still be all zeros (nothing stored yet) and nobody else may touch
it meanwhile: vLLM hands the connector its KV cache before the first forward pass. For
each 2 MiB-aligned stretch that holds only zeros, the range is marked ``MADV_HUGEPAGE``
and its 4 KiB pages are given back (``MADV_DONTNEED``: private anonymous memory reads as
zeros afterwards, so the contents do not change); touching it again (the caller's
prefault) maps 2 MiB pages. A stretch with any non-zero byte is left as it is. Only
private anonymous mappings are changed (``/proc/self/maps``): never a file, shared
memory, or memory another process maps. Nothing here is needed for correctness; where
the kernel has THP off (``never``) or refuses, the buffer stays on small pages and the
result says why.
"""
from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass

import numpy as np

_MADV_DONTNEED = 4
_MADV_HUGEPAGE = 14
_THP = "/sys/kernel/mm/transparent_hugepage"


@dataclass
class HugePageResult:
    """What :func:`back_with_hugepages` did: ``eligible`` bytes (the 2 MiB-aligned part),
    ``remapped`` bytes given back to be refilled with huge pages, and ``reason`` when
    nothing was done."""
    length: int
    eligible: int = 0
    remapped: int = 0
    reason: str = ""


def thp_mode() -> str:
    """The kernel's transparent huge page mode: ``always``, ``madvise``, ``never``, or
    ``unavailable`` (no THP, not Linux)."""
    try:
        with open(os.path.join(_THP, "enabled")) as f:
            text = f.read()
    except OSError:
        return "unavailable"
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return "unavailable"


def huge_page_size() -> int:
    """The PMD huge page size in bytes (2 MiB on x86-64); 0 without THP."""
    try:
        with open(os.path.join(_THP, "hpage_pmd_size")) as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


def _private_anonymous(lo: int, hi: int) -> bool:
    """Whether [lo, hi) lies entirely in private anonymous read-write mappings."""
    covered = lo
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                a, b = (int(x, 16) for x in parts[0].split("-"))
                if b <= covered or a >= hi:
                    continue
                path = parts[5].strip() if len(parts) > 5 else ""
                if a > covered or parts[1][:2] != "rw" or parts[1][3] != "p" or path:
                    return False
                covered = b
                if covered >= hi:
                    return True
    except (OSError, ValueError, IndexError):
        return False
    return covered >= hi


def back_with_hugepages(view: np.ndarray) -> HugePageResult:
    """Give the all-zero 2 MiB-aligned stretches of ``view`` (a flat uint8 host buffer
    nobody else is using) back to the kernel to be refilled with huge pages on the next
    touch. The caller touches them afterwards (a prefault), or the first writer does."""
    n = int(view.nbytes)
    res = HugePageResult(length=n)
    mode = thp_mode()
    hp = huge_page_size()
    if not sys.platform.startswith("linux") or mode in ("never", "unavailable") or hp <= 0:
        res.reason = f"transparent huge pages are {mode}"
        return res
    base = int(view.ctypes.data)
    lo = (base + hp - 1) // hp * hp
    hi = (base + n) // hp * hp
    if hi <= lo:
        res.reason = "smaller than one huge page"
        return res
    res.eligible = hi - lo
    if not _private_anonymous(lo, hi):
        res.reason = "not private anonymous memory"
        return res
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if libc.madvise(lo, hi - lo, _MADV_HUGEPAGE) != 0:
        res.reason = f"madvise(MADV_HUGEPAGE): {os.strerror(ctypes.get_errno())}"
        return res
    # Zero stretches, merged into runs: one MADV_DONTNEED per run.
    words = np.frombuffer(view, dtype=np.uint8, count=hi - lo, offset=lo - base)
    written = np.asarray(words.view(np.uint64).reshape(-1, hp // 8).any(axis=1))
    zero = [not w for w in written.tolist()]
    i, count = 0, len(zero)
    while i < count:
        if not zero[i]:
            i += 1
            continue
        j = i
        while j < count and zero[j]:
            j += 1
        if libc.madvise(lo + i * hp, (j - i) * hp, _MADV_DONTNEED) == 0:
            res.remapped += (j - i) * hp
        i = j
    if not res.remapped:
        res.reason = "no all-zero huge page stretch (memory already written)"
    return res


def anon_huge_bytes(ranges) -> int:
    """About how many bytes of ``ranges`` (``[(address, length)]``) the kernel backs with
    anonymous huge pages: for each mapping they overlap (``/proc/self/smaps``), its
    ``AnonHugePages`` capped at the overlap (exact when a mapping lies inside the ranges,
    which is the case for a KV cache); 0 if unknown."""
    spans = sorted((a, a + n) for a, n in ranges if n > 0)
    total, overlap = 0, 0
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    a, b = (int(x, 16) for x in head.split("-"))
                    overlap = sum(max(0, min(b, hi) - max(a, lo)) for lo, hi in spans)
                elif overlap and head == "AnonHugePages:":
                    total += min(int(line.split()[1]) << 10, overlap)
    except (OSError, ValueError):
        return 0
    return total
