# SPDX-License-Identifier: Apache-2.0
"""Facts with one home (issue 40, item 3): the protocol list (config.protocols(), filled by
the transports' declarations), the
HTTP metadata protocol's names (metadata/http_protocol.py) and connection strings
(metadata/url.py). Each test checks the behaviour through the callers, then that no
other module keeps a copy."""
from __future__ import annotations

import argparse
import ast
import pathlib

import pytest

from mooncake_te import config, transports
from mooncake_te.cli._parser import metadata_url
from mooncake_te.errors import ConfigError
from mooncake_te.integrations.vllm.settings import parse_extra_config
from mooncake_te.metadata import http_protocol, server
from mooncake_te.metadata.stores import http as http_store

PKG = pathlib.Path(__file__).resolve().parents[2] / "mooncake_te"


def _sources(skip=()):
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG).as_posix()
        if not rel.startswith(tuple(skip)):
            yield rel, p.read_text()


# --- the protocol list -----------------------------------------------------------------
def test_every_protocol_but_auto_names_a_transport():
    known = transports.probe()
    assert config.protocols()[0] == "auto"
    for name in config.protocols()[1:]:
        assert name in known, name
    assert config.SCHEMA["transfer_engine"]["protocol"][2] == list(config.protocols())


def test_the_vllm_connector_takes_the_same_protocols():
    for name in config.protocols():
        assert parse_extra_config({"protocol": name}).protocol == name
    with pytest.raises(ConfigError, match="expected one of auto, tcp, shm, rdma"):
        parse_extra_config({"protocol": "udp"})


def test_the_protocol_list_is_written_nowhere():
    """Transports declare their protocol names (``serves``); no module outside them
    spells the list (config.protocols() is filled by the declarations)."""
    lists = []
    for rel, text in _sources(skip=("transports/",)):
        for n in ast.walk(ast.parse(text)):
            if isinstance(n, (ast.Tuple, ast.List)) and len(n.elts) > 2 and all(
                    isinstance(e, ast.Constant) for e in n.elts):
                vals = [e.value for e in n.elts]
                if vals[:2] == ["auto", "tcp"]:
                    lists.append(f"{rel}:{n.lineno}")
    assert lists == [], lists


# --- HTTP metadata names ---------------------------------------------------------------
def test_client_and_server_share_the_http_names():
    for name in http_protocol.__all__:
        assert getattr(server, name) is getattr(http_protocol, name), name
        assert getattr(http_store, name) is getattr(http_protocol, name), name
    literals = ('"X-Mooncake-TTL"', '"X-Mooncake-Metadata-Server"', '"X-MTE-Auth"',
                '"metadata not found"')
    bad = [f"{rel}: {lit}" for rel, text in _sources() if rel != "metadata/http_protocol.py"
           for lit in literals if lit in text]
    assert not bad, bad


# --- connection strings ----------------------------------------------------------------
@pytest.mark.parametrize("text", ["p2p", "P2PHANDSHAKE", "etcd://127.0.0.1:2379",
                                  "127.0.0.1:2379", "h1:2379,h2:2379", "redis://h:6379/1",
                                  "http://h:8080/metadata", "HTTPS://h/metadata"])
def test_the_cli_accepts_what_the_engine_accepts(text):
    assert metadata_url(text) == text.strip()


@pytest.mark.parametrize("text,hint", [("etdc://h:2379", "did you mean etcd://h:2379"),
                                       ("redis://", None), ("zookeeper", None), ("", None)])
def test_the_cli_refuses_with_the_forms(text, hint):
    with pytest.raises(argparse.ArgumentTypeError, match="use one of p2p, etcd://") as ei:
        metadata_url(text)
    if hint:
        assert hint in str(ei.value)


def test_the_vllm_connector_reads_p2p_through_url_parse():
    assert parse_extra_config({"metadata_server": "P2PHANDSHAKE"}).metadata == "p2p"
    assert parse_extra_config({"metadata_server": " p2p "}).metadata == "p2p"
    assert parse_extra_config({"metadata_server": "etcd://h:2379"}).metadata == \
        "etcd://h:2379"


def test_connection_strings_are_split_only_by_metadata_url():
    # metadata/ itself (url.py, and the etcd backend splitting its endpoint list) is
    # where they belong.
    bad = [f"{rel}:{i}" for rel, text in _sources(skip=("metadata/",))
           for i, line in enumerate(text.splitlines(), 1)
           if 'partition("://")' in line or 'split("://"' in line
           or '"p2phandshake"' in line]
    assert not bad, "parse connection strings with mooncake_te.metadata.url: " + \
        ", ".join(bad)
