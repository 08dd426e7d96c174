# SPDX-License-Identifier: Apache-2.0
"""Transfers through the native extensions built with -fsanitize=address,undefined
(tests/native/test_sanitizers.py runs this with libasan preloaded): WRITE and READ at
three block sizes with authentication, a notification, unregister and close."""
import numpy as np

import mooncake_te as mte

a = mte.TransferEngine(host="127.0.0.1", auth_token=b"t")
b = mte.TransferEngine(host="127.0.0.1", auth_token=b"t")
src = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
dst = np.zeros(1 << 20, np.uint8)
ms, md = a.register(src), b.register(dst)
for bs in (4096, 65536, 1 << 20):
    offs = np.arange(0, 1 << 20, bs, dtype=np.uint64)
    a.submit_arrays(mte.WRITE, b.name, ms.address + offs, md.address + offs, bs).wait()
    a.submit_arrays(mte.READ, b.name, ms.address + offs, md.address + offs, bs).wait()
assert (dst == src).all()
a.write(b.name, ms.address, md.address, 100)
a.send_notification(b.name, b"hi")
b.unregister(md)
a.close()
b.close()
print("asan smoke ok")
