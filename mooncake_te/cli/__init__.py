# SPDX-License-Identifier: Apache-2.0
"""The ``mooncake-te`` command line."""
