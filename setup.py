# SPDX-License-Identifier: Apache-2.0
"""Builds the native extensions; metadata lives in pyproject.toml.

Each native feature is probed; the build prints one line saying what it built. A
feature forced on (MTE_WITH_<X>=1) and not found is an error; forced off (=0) skips it.

- core, tcp: always.
- rdma: when ``infiniband/verbs.h`` (Debian: libibverbs-dev) is there. Without it the
  package still builds and imports; ``mooncake-te version`` says rdma is unavailable
  and why.
"""
import os
import sys
import sysconfig

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

CFLAGS = ["-O2", "-std=gnu11", "-Wall", "-Wno-unused-function", "-pthread"]
INCLUDE = ["src", numpy.get_include()]


# Wheels ship stripped modules (-s drops the static symbol table; the exported PyInit_*
# stay); MTE_NO_STRIP=1 keeps symbols for gdb and perf.
STRIP = [] if os.environ.get("MTE_NO_STRIP") == "1" else ["-s"]


def ext(name, pyx, sources, libraries=()):
    return Extension(name, [pyx] + sources, include_dirs=INCLUDE, extra_compile_args=CFLAGS,
                     extra_link_args=["-pthread", "-ldl"] + STRIP, libraries=list(libraries),
                     define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")])


def _header_dirs():
    dirs = [d for d in os.environ.get("CPATH", "").split(":") if d]
    dirs += ["/usr/local/include", "/usr/include"]
    multiarch = sysconfig.get_config_var("MULTIARCH")
    if multiarch:
        dirs.append(f"/usr/include/{multiarch}")
    return dirs


def have_header(rel):
    return any(os.path.exists(os.path.join(d, rel)) for d in _header_dirs())


def wanted(feature, found):
    force = os.environ.get(f"MTE_WITH_{feature.upper()}")
    if force == "0":
        return False
    if force == "1" and not found:
        sys.exit(f"MTE_WITH_{feature.upper()}=1 but its headers are missing")
    return found


extensions = [
    ext("mooncake_te.core._regions", "mooncake_te/core/_regions.pyx", ["src/core/regions.c"]),
    ext("mooncake_te.transports.tcp._tcp", "mooncake_te/transports/tcp/_tcp.pyx",
        ["src/tcp/tcp.c", "src/core/regions.c", "src/core/hmac_sha256.c",
         "src/core/gpu.c"]),
    # NVMe-oF data path: plain POSIX I/O and threads, so it builds wherever tcp does.
    ext("mooncake_te.transports.nvmeof._nvmeof", "mooncake_te/transports/nvmeof/_nvmeof.pyx",
        ["src/nvmeof/nvmeof.c", "src/core/regions.c"]),
]
built = ["core", "tcp (GPU staging: libcuda loaded at run time)", "nvmeof"]
skipped = []
if wanted("rdma", have_header("infiniband/verbs.h")):
    extensions.append(ext("mooncake_te.transports.rdma._verbs",
                          "mooncake_te/transports/rdma/_verbs.pyx",
                          ["src/rdma/rdma.c", "src/core/regions.c"], libraries=["ibverbs"]))
    built.append("rdma")
else:
    skipped.append("rdma (no infiniband/verbs.h: apt-get install libibverbs-dev)")
print(f"mooncake_te native build: {', '.join(built)}"
      + (f"; skipped: {', '.join(skipped)}" if skipped else ""), file=sys.stderr)

setup(ext_modules=cythonize(extensions, language_level=3,
                            compiler_directives={"embedsignature": True}))
