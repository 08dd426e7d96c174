# SPDX-License-Identifier: Apache-2.0
"""Adapters that plug mooncake_te into serving frameworks. Each is imported only on
request (``import mooncake_te`` never imports a framework)."""
