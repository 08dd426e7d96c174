# SPDX-License-Identifier: Apache-2.0
# For transport modules: fetch the core's function table once, at import (src/core/api.h).
# Every transport .pyx runs `mte_core_import()` at module level before using the core.
cdef extern from "core/api.h":
    int mte_core_import() except -1
