# SPDX-License-Identifier: Apache-2.0
"""The HTTP metadata protocol's names, shared by the client (``stores/http.py``) and our
server (``server.py``): one definition each, so the two cannot drift apart."""
from __future__ import annotations

#: request header carrying the TTL we ask for, and the reply header confirming it
TTL_HEADER = "X-Mooncake-TTL"
#: reply header by which our server marks its own answers (a 404 from it means "no key")
SERVER_HEADER = "X-Mooncake-Metadata-Server"
#: the body Mooncake's servers send for a missing key
NOT_FOUND_TEXT = "metadata not found"
#: request signature and reply MAC (mooncake_te.metadata.server: sign_request/sign_reply)
AUTH_HEADER = "X-MTE-Auth"
#: most keys one ``POST /metadata/batch`` may ask for
MAX_BATCH = 4096

__all__ = ["TTL_HEADER", "SERVER_HEADER", "NOT_FOUND_TEXT", "AUTH_HEADER", "MAX_BATCH"]
