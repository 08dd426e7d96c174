# SPDX-License-Identifier: Apache-2.0
"""The command line that runs one of our modules in a child process."""
from __future__ import annotations

import os
import sys

# The folder that holds the mooncake_te package this process imported (site-packages, or
# a source checkout).
_HOME = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_m(module: str) -> list[str]:
    """``python -m module``, except that the child imports the mooncake_te its parent runs.

    ``-m`` puts the current directory first on ``sys.path``; run from a source checkout
    next to a non-editable install, the child would import the unbuilt checkout ("No
    module named mooncake_te.core._regions"). Instead the child's first path entry is the
    parent's package home (``python -I`` would also drop PYTHONPATH and the user's
    environment). Append the module's own arguments.
    """
    code = ("import runpy, sys; sys.path[0] = {!r}; "
            "runpy.run_module({!r}, run_name='__main__', alter_sys=True)").format(_HOME, module)
    return [sys.executable, "-c", code]
