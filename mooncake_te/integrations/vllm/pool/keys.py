# SPDX-License-Identifier: Apache-2.0
"""Pool keys: a block's key is chained over its tokens and every token before it, from a
root that names the model and the block size."""
from __future__ import annotations

import numpy as np

from ....kvcache import as_key, prefix_hashes

KEY_SCHEME = "mte-vllm-kv/1"          # bump when the key derivation changes


def namespace_root(model: str, block_size: int, extra: str = "") -> bytes:
    """The parent key of a sequence's first block: equal for every process and machine
    serving ``model`` with ``block_size`` tokens per block (``extra``: a LoRA adapter or
    anything else that changes the KV of the same tokens)."""
    return as_key(f"{KEY_SCHEME}|{model}|block {int(block_size)}|{extra}")


def block_keys(token_ids, block_size: int, root: bytes, start: int = 0,
               stop: "int | None" = None) -> list:
    """Keys of the full blocks ``start .. stop-1`` of ``token_ids`` (all full blocks when
    ``stop`` is None). Key ``i`` names block ``i`` and every block before it."""
    n = len(token_ids) // block_size
    stop = n if stop is None else max(0, min(int(stop), n))
    if stop <= start:
        return []
    keys = prefix_hashes(np.asarray(token_ids[:stop * block_size], dtype=np.int64),
                         block_size, parent=root)
    return keys[start:stop]


