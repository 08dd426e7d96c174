# SPDX-License-Identifier: Apache-2.0
"""Native pieces shared by every transport (the region table)."""
