# SPDX-License-Identifier: Apache-2.0
"""src/core/span.h: the one address -> entry lookup of the native tree (issue 40, item c).
The region table and the RDMA transport's key tables use it; no C file keeps a binary
search of its own."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"

PROGRAM = r"""
#include <stdio.h>
#include "core/span.h"
typedef struct { uint64_t len, pad, addr; } ent_t;   /* fields not first: offsets matter */
int main(void) {
    ent_t v[3] = {{.addr = 100, .len = 10}, {.addr = 200, .len = 50},
                  {.addr = 0xffffffffffff0000ull, .len = 0x100}};
    ent_t *p[3] = {&v[0], &v[1], &v[2]};
    struct { uint64_t a, l; } q[] = {{99, 1}, {100, 10}, {100, 11}, {105, 0}, {110, 1},
                                     {200, 50}, {249, 1}, {250, 1}, {0xffffffffffff0080ull, 0x80},
                                     {0xffffffffffff0080ull, 0x81},
                                     {0xffffffffffff0080ull, 0xffffffffffffffffull}, {0, 0}};
    for (size_t k = 0; k < sizeof(q) / sizeof(q[0]); k++)
        printf("%td %td %td\n", MTE_SPAN_FIND(v, 3, direct, ent_t, q[k].a, q[k].l),
               MTE_SPAN_FIND(p, 3, indirect, ent_t, q[k].a, q[k].l),
               MTE_SPAN_LAST_LE(v, 3, direct, ent_t, q[k].a));
    printf("%td\n", MTE_SPAN_FIND(v, 0, direct, ent_t, 100, 1));
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_span_find(tmp_path):
    c = tmp_path / "span.c"
    c.write_text(PROGRAM)
    exe = tmp_path / "span"
    subprocess.run(["cc", "-O2", "-Wall", "-Werror", f"-I{SRC}", str(c), "-o", str(exe)],
                   check=True, timeout=120)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True,
                         timeout=30).stdout.split("\n")
    rows = [tuple(map(int, line.split())) for line in out if line.strip()]
    assert rows == [(-1, -1, -1), (0, 0, 0), (-1, -1, 0), (0, 0, 0), (-1, -1, 0),
                    (1, 1, 1), (1, 1, 1), (-1, -1, 1), (2, 2, 2), (-1, -1, 2),
                    (-1, -1, 2), (-1, -1, -1), (-1,)]


def test_no_other_binary_search_over_addresses():
    loops = re.compile(r"while \(lo <=? hi\)")
    bad = [str(p.relative_to(ROOT)) for p in SRC.rglob("*.[ch]")
           if p.name != "span.h" and loops.search(p.read_text())]
    assert not bad, f"look addresses up with core/span.h (MTE_SPAN_FIND): {bad}"
