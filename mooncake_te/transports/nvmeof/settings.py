# SPDX-License-Identifier: Apache-2.0
"""What the NVMe-oF storage transport declares (``mooncake_te.transports`` hands it to
:func:`mooncake_te.config.declare_transport`): it carries storage segments whatever
protocol carries memory, and has no keys of its own."""
from __future__ import annotations

SERVES = ("*",)
