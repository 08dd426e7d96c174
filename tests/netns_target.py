# SPDX-License-Identifier: Apache-2.0
"""A target engine for network-namespace tests: run with `ip netns exec NS python
netns_target.py HOST [TOKEN]`; prints {"name", "address"} as JSON and serves until its
stdin closes."""
import json
import sys

import numpy as np

import mooncake_te as mte

eng = mte.TransferEngine(host=sys.argv[1], auth_token=(sys.argv[2] if len(sys.argv) > 2 else None))
buf = np.zeros(4 << 20, np.uint8)
r = eng.register(buf)
print(json.dumps({"name": eng.name, "address": r.address}), flush=True)
sys.stdin.read()
eng.close()
