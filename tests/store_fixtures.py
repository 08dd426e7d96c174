# SPDX-License-Identifier: Apache-2.0
"""Fixtures of the store drop-in's tests: each test module runs once under each metadata
server that holds the index (etcd, redis, ours), with engines bound to loopback. Import
both names into a test module to use them."""
import pytest

from servers import EtcdServer, HttpMetadataServer, RedisServer, _serve


@pytest.fixture(autouse=True)
def _loopback(monkeypatch):
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")


@pytest.fixture(scope="module", params=["etcd", "redis", "http"])
def index_url(request):
    cls = {"etcd": EtcdServer, "redis": RedisServer, "http": HttpMetadataServer}[request.param]
    yield from (srv.url for srv in _serve(cls))
