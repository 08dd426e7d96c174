# SPDX-License-Identifier: Apache-2.0
"""Real metadata servers for tests: redis-server, etcd and ``mooncake-te metadata-server``.

Each is started from its real binary (Debian packages ``redis-server`` and
``etcd-server``; our own server through ``python -m mooncake_te``) on a free 127.0.0.1
port, waited for until it answers, and stopped (SIGTERM, then SIGKILL) afterwards. The
classes also expose ``kill()`` (SIGKILL) and ``start()`` again on the same port and data
directory, for restart tests. Nothing is mocked.

Use the fixtures from any test module with ``tests/`` on ``sys.path``::

    from servers import redis_server, etcd_server, http_metadata_server

A missing binary skips the test with the install command, except under ``CI=true``,
where it fails: CI installs the packages, so a skip there would hide a broken setup.
"""
from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import weakref

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START_TIMEOUT = 20.0


def _ephemeral_range() -> tuple:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A port nobody listens on right now, below the kernel's ephemeral range: a port
    that bind(0) returned could be handed to the next process's bind(0) or outgoing
    connection (vLLM's gloo and zmq sockets do that) before our server binds it, which
    failed a vLLM test once ('Address already in use'). Ports outside the range are only
    taken by an explicit bind."""
    import random
    lo, _ = _ephemeral_range()
    first = max(1024, lo - 12000)
    for _ in range(200):
        port = random.randrange(first, lo)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:                 # a crowded range: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _missing(binary: str, package: str):
    msg = f"{binary} not found; install it with: apt-get install -y {package}"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(msg)
    pytest.skip(msg)


#: the Python client library each metadata backend needs in the test process, and the
#: extra that installs it
CLIENTS = {"etcd": ("etcd3gw", "etcd"), "redis": ("redis", "redis"),
           "http": ("requests", "http")}


def require_client(scheme: str) -> None:
    """Skip the test, with the install command, when the client library of the
    ``scheme`` backend (an optional extra) is missing: the test is about that backend,
    and erroring there says nothing about the code under test."""
    module, extra = CLIENTS[scheme]
    pytest.importorskip(module, reason=f"the {scheme} metadata backend needs the Python "
                                       f"module {module!r}: pip install mooncake-te[{extra}]")


_RUNNING: "weakref.WeakSet[_Server]" = weakref.WeakSet()


@atexit.register
def _kill_leftovers() -> None:
    # Servers run in their own session (so a test's SIGKILL hits only them); if the test
    # process dies without teardown, do not leave them running on the CI machine.
    for srv in list(_RUNNING):
        if srv.proc is not None and srv.proc.poll() is None:
            srv.proc.kill()


class _Server:
    """A server process on 127.0.0.1 with start/stop/kill and a readiness probe."""

    name = "?"
    #: the word the matching backend's errors use for it
    label = "?"

    def kind_word(self) -> str:
        return self.label

    #: (module, extra) pairs this server's tests need in the test process: the client
    #: library of the matching backend. A missing one skips the test with the install
    #: command (pytest.importorskip), instead of erroring deep inside the backend.
    extras: tuple = ()

    def __init__(self, workdir: str | None = None):
        for module, extra in self.extras:
            pytest.importorskip(module, reason=f"{self.label} tests need the Python module "
                                               f"{module!r}: pip install mooncake-te[{extra}]")
        self.host = "127.0.0.1"
        self.port = 0
        self._own_dir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix=f"mte-{self.name}-")
        self.proc: subprocess.Popen | None = None
        self.log_path = os.path.join(self.workdir, f"{self.name}.log")

    # subclasses
    def command(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def env(self) -> dict | None:
        return None

    def _pick_ports(self) -> None:
        self.port = free_port()

    def start(self, timeout: float = START_TIMEOUT):
        """Start (again, on the same port and data directory when restarted)."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        fresh = not self.port
        for attempt in range(3):
            if fresh or attempt:
                self._pick_ports()
            log = open(self.log_path, "ab")
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=self.workdir,
                                         env=self.env(), start_new_session=True)
            log.close()
            _RUNNING.add(self)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break           # exited: port taken, bad flag, ... (see the log)
                if self.ready():
                    return self
                time.sleep(0.05)
            self.stop()
            if not fresh:
                break           # a restart must keep its port; do not hop
        raise RuntimeError(f"{self.name} did not start on {self.host}:{self.port}; "
                           f"log {self.log_path}:\n{self.log_tail()}")

    def log_tail(self, n: int = 2000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL, as a crash: no shutdown code runs."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<{type(self).__name__} {self.url}>"


def _tcp_ping(host: str, port: int, payload: bytes, expect: bytes) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5) as s:
            s.sendall(payload)
            return s.recv(64).startswith(expect)
    except OSError:
        return False


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=0.5) as r:
            return r.status == 200
    except Exception:
        return False


class RedisServer(_Server):
    """``redis-server`` without persistence (a restart comes back empty)."""

    name = "redis"
    label = "redis"
    binary = "redis-server"
    extras = (("redis", "redis"),)

    def __init__(self, workdir: str | None = None, password: str | None = None):
        super().__init__(workdir)
        self.password = password

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}"

    def command(self):
        return [self.binary, "--bind", self.host, "--port", str(self.port), "--save", "",
                "--appendonly", "no", "--dir", self.workdir, "--protected-mode", "no",
                "--loglevel", "warning"] + (["--requirepass", self.password]
                                            if self.password else [])

    def ready(self):
        if self.password:       # an unauthenticated PING is refused with -NOAUTH
            return _tcp_ping(self.host, self.port, b"PING\r\n", b"-NOAUTH")
        return _tcp_ping(self.host, self.port, b"PING\r\n", b"+PONG")


class EtcdServer(_Server):
    """A one-member etcd cluster; its data directory survives restarts."""

    name = "etcd"
    label = "etcd"
    binary = "etcd"
    extras = (("etcd3gw", "etcd"),)

    def _pick_ports(self):
        self.port = free_port()
        self.peer_port = free_port()

    @property
    def url(self) -> str:
        return f"etcd://{self.host}:{self.port}"

    def command(self):
        client = f"http://{self.host}:{self.port}"
        peer = f"http://{self.host}:{self.peer_port}"
        return [self.binary, "--name", "mte", "--data-dir", os.path.join(self.workdir, "data"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"mte={peer}", "--logger", "zap", "--log-level", "warn"]

    def env(self):
        env = dict(os.environ)
        # etcd reads ETCD_* variables as flags; keep the caller's out of it.
        for k in [k for k in env if k.startswith("ETCD_")]:
            del env[k]
        return env

    def ready(self):
        return _http_ok(f"http://{self.host}:{self.port}/health")


class HttpMetadataServer(_Server):
    """``python -m mooncake_te metadata-server`` in its own process.

    Parameters
    ----------
    persist : bool
        Keep the keys in a file in the work directory (survives ``kill()``/``start()``).
    token : str, optional
        The cluster's auth token: requests must be signed with it and replies are signed
        (engines with a token refuse unsigned replies).
    """

    name = "http-metadata"
    label = "HTTP"
    extras = (("aiohttp", "http"), ("requests", "http"))

    def __init__(self, workdir: str | None = None, persist: bool = True,
                 token: str | None = None):
        super().__init__(workdir)
        self.persist_path = os.path.join(self.workdir, "metadata.json") if persist else None
        self.token = token

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metadata"

    def command(self):
        cmd = [sys.executable, "-m", "mooncake_te", "metadata-server", "--host", self.host,
               "--port", str(self.port), "--log-level", "WARNING"]
        if self.persist_path:
            cmd += ["--persist", self.persist_path]
        if self.token:
            path = os.path.join(self.workdir, "token")
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                f.write(self.token)
            cmd += ["--auth-token-file", path]
        return cmd

    def env(self):
        env = dict(os.environ)
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        return env

    def ready(self):
        return _http_ok(f"http://{self.host}:{self.port}/health")


def _serve(cls, **kwargs):
    if getattr(cls, "binary", None) and shutil.which(cls.binary) is None:
        _missing(cls.binary, "redis-server" if cls is RedisServer else "etcd-server")
    srv = cls(**kwargs)
    try:
        srv.start()
        yield srv
    finally:
        srv.close()


@pytest.fixture(scope="module")
def redis_server():
    """A running ``redis-server`` on 127.0.0.1 (``.url`` is ``redis://127.0.0.1:PORT``)."""
    yield from _serve(RedisServer)


@pytest.fixture(scope="module")
def etcd_server():
    """A running one-member etcd on 127.0.0.1 (``.url`` is ``etcd://127.0.0.1:PORT``)."""
    yield from _serve(EtcdServer)


@pytest.fixture(scope="module")
def http_metadata_server():
    """A running ``mooncake-te metadata-server`` with persistence (``.url`` ends ``/metadata``)."""
    yield from _serve(HttpMetadataServer)


@pytest.fixture(params=["etcd", "redis", "http"])
def store_server(request):
    """Each kind of store server in turn, fresh for the test (may be killed/restarted)."""
    cls = {"etcd": EtcdServer, "redis": RedisServer, "http": HttpMetadataServer}[request.param]
    yield from _serve(cls)


__all__ = ["redis_server", "etcd_server", "http_metadata_server", "store_server",
           "require_client", "CLIENTS",
           "RedisServer", "EtcdServer", "HttpMetadataServer", "free_port"]
