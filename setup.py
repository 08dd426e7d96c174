# SPDX-License-Identifier: Apache-2.0
"""Builds the native extensions; metadata lives in pyproject.toml.

Each native feature is probed; the build prints one line saying what it built. A
feature forced on (MTE_WITH_<X>=1) and not found is an error; forced off (=0) skips it.

- core, tcp, nvmeof: always.
- rdma: when ``infiniband/verbs.h`` (Debian: libibverbs-dev) is there. Without it the
  package still builds and imports; ``mooncake-te version`` says rdma is unavailable
  and why.

The native core (src/core/: region table, engine-wide batch, clock, socket I/O, GPU
staging) is compiled once, into ``mooncake_te.core._core``. The transports' extensions
call it through a table of function pointers that ``_core`` publishes as a PyCapsule and
each transport fetches at import (src/core/api.h, src/core/import.c; NumPy's C API works
the same way). We chose that over a private shared library (libmte_core.so) because it
needs nothing beyond ordinary setuptools Extensions: a shared library would need a build
step setuptools lacks (build_clib makes static archives), an $ORIGIN rpath on every
extension, and auditwheel/delocate care in wheels; with the capsule, editable installs,
wheels and sdists work unchanged.
"""
import glob
import os
import sys
import sysconfig

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

CFLAGS = ["-O2", "-std=gnu11", "-Wall", "-Wno-unused-function", "-pthread",
          "-Werror=implicit-function-declaration"]
INCLUDE = ["src", numpy.get_include()]


# Wheels ship stripped modules (-s drops the static symbol table; the exported PyInit_*
# stay); MTE_NO_STRIP=1 keeps symbols for gdb and perf.
STRIP = [] if os.environ.get("MTE_NO_STRIP") == "1" else ["-s"]


def ext(name, pyx, sources, libraries=(), core=False):
    """A transport's extension links src/core/import.c (the core's table), never core code;
    the core's own extension (core=True) is built with MTE_CORE_BUILD."""
    macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
    if core:
        macros.append(("MTE_CORE_BUILD", "1"))
    else:
        sources = sources + ["src/core/import.c"]
    return Extension(name, [pyx] + sources, include_dirs=INCLUDE, extra_compile_args=CFLAGS,
                     extra_link_args=["-pthread", "-ldl"] + STRIP, libraries=list(libraries),
                     define_macros=macros)


CORE = ["src/core/" + f for f in ("api.c", "batch.c", "clock.c", "metrics.c", "regions.c", "sockio.c",
                                  "gpu.c", "stage.c", "hmac_sha256.c", "prep.c")]


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
    ext("mooncake_te.core._core", "mooncake_te/core/_core.pyx", CORE, core=True),
    ext("mooncake_te.transports.tcp._tcp", "mooncake_te/transports/tcp/_tcp.pyx",
        ["src/tcp/wire.c", "src/tcp/client.c", "src/tcp/server.c"]),
    # NVMe-oF data path: plain POSIX I/O and threads, so it builds wherever tcp does.
    ext("mooncake_te.transports.nvmeof._nvmeof", "mooncake_te/transports/nvmeof/_nvmeof.pyx",
        ["src/nvmeof/nvmeof.c"]),
]
built = ["core", "tcp", "nvmeof"]   # GPU staging is in core; libcuda is loaded at run time
skipped = []
if wanted("rdma", have_header("infiniband/verbs.h")):
    extensions.append(ext("mooncake_te.transports.rdma._verbs",
                          "mooncake_te/transports/rdma/_verbs.pyx",
                          sorted(glob.glob("src/rdma/*.c")), libraries=["ibverbs"]))
    built.append("rdma")
else:
    skipped.append("rdma (no infiniband/verbs.h: apt-get install libibverbs-dev)")
print(f"mooncake_te native build: {', '.join(built)}"
      + (f"; skipped: {', '.join(skipped)}" if skipped else ""), file=sys.stderr)

setup(ext_modules=cythonize(extensions, language_level=3,
                            compiler_directives={"embedsignature": True}))
