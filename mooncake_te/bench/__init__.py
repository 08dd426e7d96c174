# SPDX-License-Identifier: Apache-2.0
"""Measurement code behind ``mooncake-te bench``, usable on its own.

- :mod:`.runner`: the timed loops (batches through ``submit_arrays``, synchronous
  single requests) and :class:`BenchConfig`;
- :mod:`.target`: the target side, in this process or a loopback child, and the control
  messages ``--verify`` uses;
- :mod:`.stats`: sizes, rates and latency summaries;
- :mod:`.pattern`: the fill pattern ``--verify`` checks byte for byte;
- :mod:`.report`: tables, JSON, CSV, plot, progress bar.

Examples
--------
>>> from mooncake_te.bench import BenchConfig, LoopbackTarget, Runner   # doctest: +SKIP
"""
from __future__ import annotations

from .runner import BenchConfig, DEFAULT_BLOCK_SIZES, Progress, Runner, VerifyError, auto_batch
from .target import BenchTarget, LoopbackTarget, TargetControl

__all__ = ["BenchConfig", "DEFAULT_BLOCK_SIZES", "Progress", "Runner", "VerifyError",
           "auto_batch", "BenchTarget", "LoopbackTarget", "TargetControl"]
