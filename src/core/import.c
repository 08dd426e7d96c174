/* SPDX-License-Identifier: Apache-2.0 */
/* Linked into every transport extension module: fetches the core's table (api.h). */
#include <Python.h>

#include "api.h"

const mte_core_api_t *mte_core;

int mte_core_import(void)
{
    if (mte_core)
        return 0;
    const mte_core_api_t *t = PyCapsule_Import("mooncake_te.core._core._C_API", 0);
    if (!t)
        return -1;
    if (t->version != MTE_CORE_API_VERSION || t->size < sizeof(*t)) {
        PyErr_Format(PyExc_ImportError,
                     "mooncake_te.core._core has native API version %u (size %u), this module "
                     "needs version %u: rebuild the package (pip install -e . or setup.py "
                     "build_ext --inplace)", t->version, t->size, MTE_CORE_API_VERSION);
        return -1;
    }
    mte_core = t;
    return 0;
}
