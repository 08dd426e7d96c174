# SPDX-License-Identifier: Apache-2.0
"""The one child-process harness of the test suite.

A :class:`Child` is a real OS process (multiprocessing, spawn) holding some state (an
engine with buffers, a GPU engine, a P2P store) built by a module-level factory; the test
drives it over a pipe with ``call(cmd, *args)``, which runs ``state.do_<cmd>(*args)`` in
the child and returns its result or raises the child's error. Every call has a timeout,
so a wedged child fails the test instead of hanging it; ``close`` asks the child to
exit (``state.close()``), then kills it.
"""
from __future__ import annotations

import multiprocessing as mp
import traceback


def _main(conn, factory, args, kwargs):
    """The child: build the state, say hello, serve commands until "exit" or EOF."""
    state = factory(*args, **kwargs)
    conn.send(("ready", state.hello()))
    while True:
        try:
            cmd, cargs = conn.recv()
        except EOFError:
            break
        try:
            if cmd == "exit":
                state.close()
                conn.send(("ok", None))
                break
            fn = getattr(state, f"do_{cmd}", None)
            if fn is None:
                raise ValueError(f"unknown command {cmd}")
            conn.send(("ok", fn(*cargs)))
        except BaseException as e:  # report, keep serving
            conn.send(("error", (repr(e), traceback.format_exc())))


class Child:
    """A child process serving ``factory(*args, **kwargs)``'s ``do_*`` methods.

    Parameters
    ----------
    factory : callable
        Module-level (picklable) class or function building the child's state: an object
        with ``hello()`` (sent back once ready), ``close()`` and ``do_<cmd>`` methods.
    what : str
        How errors name this child ("peer process", "GPU peer", ...).
    timeout : float
        Default seconds to wait for the hello and for each call.
    wait : bool
        Wait for the hello now (False: at :meth:`ready`, so several children can start
        together; spawning is the slow part).
    """

    exit_timeout = 10.0

    def __init__(self, factory, *args, what: str = "child process", timeout: float = 60.0,
                 wait: bool = True, **kwargs):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_main, args=(child, factory, args, kwargs), daemon=True)
        self.proc.start()
        child.close()
        self.what = what
        self.timeout = timeout
        self.hello = None
        self._ready = False
        if wait:
            self.ready()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def ready(self):
        """Wait for the child's hello (once); returns self."""
        if not self._ready:
            self.hello = self._reply(self.timeout)
            self._ready = True
            self.on_ready(self.hello)
        return self

    def on_ready(self, hello) -> None:
        """Subclasses unpack the hello here."""

    def _reply(self, timeout):
        if not self._conn.poll(timeout):
            self.kill()
            raise TimeoutError(f"{self.what} {self.proc.pid} did not answer in {timeout} s")
        kind, value = self._conn.recv()
        if kind == "error":
            raise RuntimeError(f"{self.what} failed: {value[0]}\n{value[1]}")
        return value

    def call(self, cmd, *args, timeout: float | None = None):
        self.ready()
        self._conn.send((cmd, args))
        return self._reply(self.timeout if timeout is None else timeout)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit", timeout=self.exit_timeout)
            except Exception:
                pass
        self.proc.join(self.exit_timeout / 2)
        self.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
