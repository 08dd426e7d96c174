# SPDX-License-Identifier: Apache-2.0
import sys

from .cli.main import main

sys.exit(main())
