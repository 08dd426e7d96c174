# SPDX-License-Identifier: Apache-2.0
"""Builds the native extensions; metadata lives in pyproject.toml.

Each native feature is probed; the build prints one line saying what it built. A
feature forced on (MTE_WITH_<X>=1) and not found is an error.
"""
import os
import sys

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

CFLAGS = ["-O2", "-std=gnu11", "-Wall", "-Wno-unused-function", "-pthread"]
INCLUDE = ["src", numpy.get_include()]


def ext(name, pyx, sources):
    return Extension(name, [pyx] + sources, include_dirs=INCLUDE, extra_compile_args=CFLAGS,
                     extra_link_args=["-pthread", "-ldl"],
                     define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")])


extensions = [
    ext("mooncake_te.core._regions", "mooncake_te/core/_regions.pyx", ["src/core/regions.c"]),
    ext("mooncake_te.transports.tcp._tcp", "mooncake_te/transports/tcp/_tcp.pyx",
        ["src/tcp/tcp.c", "src/core/regions.c", "src/core/hmac_sha256.c",
         "src/core/gpu.c"]),
]
built = ["core", "tcp (GPU staging: libcuda loaded at run time)"]
print(f"mooncake_te native build: {', '.join(built)}", file=sys.stderr)

setup(ext_modules=cythonize(extensions, language_level=3,
                            compiler_directives={"embedsignature": True}))
