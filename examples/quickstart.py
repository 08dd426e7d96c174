# SPDX-License-Identifier: Apache-2.0
"""The README's tour, runnable: python examples/quickstart.py"""
import numpy as np
import mooncake_te as mte

with mte.TransferEngine(host="127.0.0.1") as prefill, \
     mte.TransferEngine(host="127.0.0.1") as decode:
    kv = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)
    src = prefill.register(kv)                         # peers may read and write it
    dst = decode.register(np.zeros_like(kv))

    seg = prefill.open_segment(decode.name)            # "127.0.0.1:<port>"
    remote = seg.buffers[0].address                    # what decode published

    # One blocking transfer: returns once decode's memory holds the bytes.
    prefill.write(decode.name, src.address, remote, 1 << 20)

    # Many descriptors at once: numpy arrays, with a notification after the data.
    blocks = np.arange(256, dtype=np.uint64) * 65536
    batch = prefill.submit_arrays(mte.WRITE, decode.name, src.address + blocks,
                                  remote + blocks, 65536, notify=b"req-42 done")
    batch.wait(timeout=10)                             # raises on the first failure
    print(batch.transport, batch.status()[0])          # shm TransferStatus('completed', 65536)
    print(decode.notifications())                      # [Notification(sender=..., message=b'req-42 done')]

    # READ pulls remote bytes into local memory.
    back = np.zeros(4096, np.uint8)
    r = prefill.register(back)
    prefill.read(decode.name, r.address, remote, 4096)
    assert (back == kv[:4096]).all()

    # Bad input gets a typed error that says what to do.
    try:
        prefill.write(decode.name, src.address, remote + (64 << 20) - 8, 4096)
    except mte.AddressNotRegisteredError as e:
        print(e)          # ... is not inside a region it registered; check the address ...
