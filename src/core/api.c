/* SPDX-License-Identifier: Apache-2.0 */
/* The core's function table (api.h), published by mooncake_te.core._core. */
#include "api.h"

const mte_core_api_t mte_core_table = {
    .version = MTE_CORE_API_VERSION,
    .size = sizeof(mte_core_api_t),
#define MTE_CORE_INIT(f) .f = f,
    MTE_CORE_FUNCTIONS(MTE_CORE_INIT)
#undef MTE_CORE_INIT
};
