# SPDX-License-Identifier: Apache-2.0
"""The fake sysfs machines of tests/data/sysfs/machines.py, loaded once for the tests
that read them (topology discovery, the doctor)."""
from __future__ import annotations

import importlib.util
import os

HERE = os.path.dirname(os.path.abspath(__file__))   # tests/


def _load_machines():
    spec = importlib.util.spec_from_file_location(
        "sysfs_machines", os.path.join(HERE, "data", "sysfs", "machines.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


machines = _load_machines()
