# SPDX-License-Identifier: Apache-2.0
"""pytest plugin: the fabric tier, tests marked ``rdma`` or ``nvmeof`` run in the lab.

Where this machine has the devices (RDMA NICs, an nvmet-capable kernel) the marked
tests run natively like any other. Where it has not, this plugin runs them inside ONE
boot of the fabric lab guest per pytest session (``mooncake_te.lab``: Soft-RoCE devices
``rxe0``/``rxe1`` and an NVMe-oF namespace, the host's own Python and files) and
reports their results as ordinary pytest results, tracebacks included.

How (see docs/fabric-lab.md, "The fabric test tier"):

1. ``pytest_collection_modifyitems`` (after conftest.py's) picks the marked items whose
   markers this host cannot satisfy.
2. ``pytest_runtestloop``, before the first test runs, boots the guest once with
   ``python -m pytest -p fabric --fabric-report FILE <node ids>`` as its command. In the
   guest the devices exist, so conftest.py does not skip the tests; this same plugin,
   guest side, writes every test report to FILE as JSON lines with pytest's own report
   serialisation (``pytest_report_to_serializable``, the hook pytest-xdist uses).
3. ``pytest_runtest_protocol`` for each picked item reads its reports back
   (``pytest_report_from_serializable``) and logs them in place of running the test.
   It runs first and returns True, so the item never runs (nor is skipped) on the host.

The guest is booted once per session, not per test: a boot under software emulation
costs tens of seconds. ``--fabric=off`` leaves the marked tests to conftest.py (skipped
with its reason); ``--fabric=required`` (or ``MOONCAKE_FABRIC=required``) turns "this
machine cannot run the lab" from a skip into a failure, for CI that must run the tier.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

FABRIC_MARKERS = ("rdma", "nvmeof")


def pytest_addoption(parser):
    g = parser.getgroup("fabric", "fabric tier (tests marked rdma/nvmeof, in the lab guest)")
    g.addoption("--fabric", choices=("auto", "off", "required"),
                default=os.environ.get("MOONCAKE_FABRIC", "auto"),
                help="run rdma/nvmeof tests in the fabric lab guest when this host lacks "
                     "the devices: auto (skip with the reason if the lab cannot run), "
                     "required (fail instead), off (default: $MOONCAKE_FABRIC or auto)")
    # Under tcg on the 2-core VM the guest took 700 s on 2026-12-02 and had run 36 of
    # its 44 tests when 900 s were up on 2026-12-03: leave room, CI allows 90 minutes.
    g.addoption("--fabric-timeout", type=float, default=1800, metavar="S",
                help="seconds the one guest boot may take in all (default 1800)")
    g.addoption("--fabric-report", default=None, help=argparse.SUPPRESS)


def host_lacks(item) -> list[str]:
    """The fabric markers on ``item`` that this host cannot satisfy natively."""
    from mooncake_te import lab
    have = {"rdma": lab.has_rdma, "nvmeof": lab.has_nvmeof}
    return [m for m in FABRIC_MARKERS if item.get_closest_marker(m) and not have[m]()]


class GuestRecorder:
    """Guest side: write each test report, serialised, to the host's report file."""

    def __init__(self, config, path):
        self.config = config
        self.f = open(path, "a", buffering=1)

    def _put(self, kind, report):
        data = self.config.hook.pytest_report_to_serializable(config=self.config,
                                                              report=report)
        self.f.write(json.dumps({"kind": kind, "data": data}) + "\n")

    def pytest_runtest_logreport(self, report):
        self._put("test", report)

    def pytest_collectreport(self, report):
        if report.failed:
            self._put("collect", report)

    def pytest_unconfigure(self):
        self.f.close()


def guest_progress(report: Path, total: int, elapsed: float) -> str:
    """One line on where the guest run stands, from the reports it has written so far
    (a test is done at its teardown report): booting, or tests done of ``total``."""
    done = failed = 0
    try:
        lines = report.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            d = json.loads(line)
        except ValueError:            # a line being written
            continue
        data = d.get("data", {})
        if d.get("kind") == "collect":
            failed += 1
        elif data.get("when") == "teardown":
            done += 1
        if data.get("outcome") == "failed":
            failed += 1
    m, s = divmod(int(elapsed), 60)
    if not lines:
        return (f"fabric: {m}:{s:02d} booting the guest and setting up its devices "
                f"(under software emulation this takes minutes)")
    return (f"fabric: {m}:{s:02d} {done} of {total} test(s) done in the guest"
            + (f", {failed} failed" if failed else ""))


class FabricTier:
    """Host side: run the picked items in one guest boot and report their results."""

    def __init__(self, config):
        self.config = config
        self.mode = config.getoption("fabric")
        self.items = []
        self.results: dict[str, list] = {}
        self.problem: str | None = None     # why the guest run gave no results
        self.log_path: Path | None = None
        self.seconds = 0.0
        self.guest_rc = None

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, session, config, items):
        self.items = [it for it in items if host_lacks(it)]

    def pytest_report_header(self, config):
        return ("fabric: rdma/nvmeof tests this host cannot run go to the lab guest "
                f"(--fabric={self.mode})")

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session):
        if self.items and not session.config.option.collectonly:
            self._run_guest()

    _say_lock = threading.Lock()

    def _say(self, msg):
        tr = self.config.pluginmanager.getplugin("terminalreporter")
        capman = self.config.pluginmanager.getplugin("capturemanager")
        if tr is None:
            return
        with self._say_lock:              # the progress thread says things too
            if capman is not None:
                with capman.global_and_fixture_disabled():
                    tr.write_line(msg)
            else:
                tr.write_line(msg)

    # Seconds between progress lines while the guest runs (each test's end is said at
    # the next tick): without them `scripts/test.sh` sat silent for ~11 minutes.
    PROGRESS_EVERY = 30.0

    def _progress(self, report: Path, stop: threading.Event, t0: float) -> None:
        """Until ``stop``: a line whenever the guest's state changes (checked every 5 s),
        and at least every PROGRESS_EVERY seconds (``MTE_FABRIC_PROGRESS_S``)."""
        every = float(os.environ.get("MTE_FABRIC_PROGRESS_S", self.PROGRESS_EVERY))
        tick = min(every, 5.0)
        said, said_at = None, time.monotonic()
        while not stop.wait(tick):
            now = time.monotonic()
            line = guest_progress(report, len(self.items), now - t0)
            state = line.split(" ", 2)[2]        # the line without its clock
            if state != said or now - said_at >= every:
                self._say(line)
                said, said_at = state, now

    def _run_guest(self):
        from mooncake_te import lab
        needs = sorted({m for it in self.items for m in host_lacks(it)})
        cache = lab.cache_dir() / "fabric"
        cache.mkdir(parents=True, exist_ok=True)
        report = cache / f"reports-{os.getpid()}.jsonl"
        self.log_path = cache / "last-guest-run.log"
        report.unlink(missing_ok=True)
        ids = [it.nodeid for it in self.items]
        plugins = [a for m in self._guest_plugins() for a in ("-p", m)]
        argv = [sys.executable, "-m", "pytest", "-p", "fabric", *plugins,
                "-p", "no:cacheprovider", "--fabric-report", str(report), "-q", "-rfE",
                "--color=no", "--rootdir", str(self.config.rootpath), *ids]
        # Plugins installed as packages are loaded by name only where the picked tests
        # use them: under software emulation importing every installed plugin (hypothesis
        # alone) costs more than the tests (pytest docs, PYTEST_DISABLE_PLUGIN_AUTOLOAD).
        env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
        self._say(f"fabric: {len(ids)} test(s) need {', '.join(needs)}, which this host "
                  f"lacks: running them in one lab guest boot (mooncake-te lab; guest "
                  f"output in {self.log_path})")
        t0 = time.monotonic()
        stop = threading.Event()
        ticker = threading.Thread(target=self._progress, args=(report, stop, t0),
                                  name="fabric-progress", daemon=True)
        ticker.start()
        try:
            with open(self.log_path, "wb") as log:
                log.write(("$ " + " ".join(argv) + "\n").encode())
                r = lab.run(argv, rxe=self._rxe(), nvmeof="nvmeof" in needs, env=env,
                            timeout=self.config.getoption("fabric_timeout"),
                            # node ids are relative to the rootdir, wherever pytest
                            # was started from
                            cwd=str(self.config.rootpath), out=log,
                            log=lambda m: (log.write((m + "\n").encode()),
                                           self._say(f"fabric: {m}")))
            self.guest_rc = r.returncode
            self._say(f"fabric: guest run took {r.wall_s:.0f} s (boot and setup "
                      f"{r.boot_s:.0f} s, accel={r.accel}), pytest in the guest exited "
                      f"{r.returncode}")
        except lab.LabUnavailableError as e:
            self.problem = f"the fabric lab cannot run on this machine: {e}"
        except lab.LabError as e:
            self.problem = f"the fabric lab guest failed: {e}"
        finally:
            stop.set()
            ticker.join()
            self.seconds = time.monotonic() - t0
        self._load(report)
        report.unlink(missing_ok=True)
        if self.problem:
            self._say(f"fabric: {self.problem.splitlines()[0]}")

    def _rxe(self) -> int:
        """Soft-RoCE devices to make: 2, or the most any picked test asks for with
        ``@pytest.mark.rdma(rxe=N)`` (three or more sit on one bridge)."""
        n = 2
        for it in self.items:
            m = it.get_closest_marker("rdma")
            if m is not None:
                n = max(n, int(m.kwargs.get("rxe", 2)))
        return n

    def _guest_plugins(self) -> list[str]:
        """Modules of the installed plugins the picked tests need in the guest.

        pytest-timeout always (the ini's ``timeout`` guards the guest's tests too), and
        any installed plugin that defines a fixture one of the picked tests requests.
        """
        pm = self.config.pluginmanager
        installed = {}
        for plugin, _dist in pm.list_plugin_distinfo():
            name = getattr(plugin, "__name__", "")
            if name:
                installed[name.split(".")[0]] = name
        wanted = [installed["pytest_timeout"]] if "pytest_timeout" in installed else []
        for item in self.items:
            info = getattr(item, "_fixtureinfo", None)
            for defs in getattr(info, "name2fixturedefs", {}).values():
                for fd in defs:
                    top = getattr(fd.func, "__module__", "").split(".")[0]
                    if top in installed and installed[top] not in wanted:
                        wanted.append(installed[top])
        return wanted

    def _load(self, path: Path):
        collect_errors = []
        try:
            lines = path.read_text().splitlines()
        except OSError:
            return
        for line in lines:
            d = json.loads(line)
            rep = self.config.hook.pytest_report_from_serializable(config=self.config,
                                                                   data=d["data"])
            if isinstance(rep.longrepr, list):
                # A skip's (path, lineno, reason) is a tuple to pytest; JSON made it a
                # list (pytest-xdist's execnet keeps tuples, plain JSON does not).
                rep.longrepr = tuple(rep.longrepr)
            if d["kind"] == "collect":
                collect_errors.append(f"{rep.nodeid}: {rep.longreprtext.strip()[-800:]}")
            else:
                self.results.setdefault(rep.nodeid, []).append(rep)
        if collect_errors and not self.problem:
            self.problem = "collection failed in the guest:\n" + "\n".join(collect_errors)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        if item not in self.items:
            return None
        ihook = item.ihook
        ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        reports = self.results.get(item.nodeid)
        if not reports:
            reports = self._stand_in(item)
        for rep in reports:
            ihook.pytest_runtest_logreport(report=rep)
        # The item did not run here, but what earlier items set up and the next one does
        # not need must still be torn down, as pytest's runner does after every item;
        # otherwise a host-run item in another folder after a run of lab items fails
        # its setup with "previous item was not torn down properly".
        item.session._setupstate.teardown_exact(nextitem)
        ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    def _stand_in(self, item):
        """Reports for an item the guest gave no result for: a skip or a failure."""
        from _pytest.runner import CallInfo
        lacks = ", ".join(host_lacks(item))
        if self.problem and self.mode != "required" and "cannot run" in self.problem:
            msg = f"{lacks}: no devices here and {self.problem}"
            call = CallInfo.from_call(lambda: pytest.skip(msg), "setup")
        else:
            msg = (f"fabric: the lab guest gave no result for this test: "
                   f"{self.problem or 'the guest pytest did not report it'} "
                   f"(guest output: {self.log_path})")
            call = CallInfo.from_call(lambda: pytest.fail(msg, pytrace=False), "setup")
        setup = pytest.TestReport.from_item_and_call(item, call)
        teardown = pytest.TestReport.from_item_and_call(
            item, CallInfo.from_call(lambda: None, "teardown"))
        return [setup, teardown]

    def pytest_terminal_summary(self, terminalreporter):
        if not self.items or (self.log_path is None and self.problem is None):
            return                          # nothing was tried (--collect-only, -x ...)
        ran = sum(1 for it in self.items if it.nodeid in self.results)
        terminalreporter.write_sep("-", "fabric tier")
        terminalreporter.write_line(
            f"{ran} of {len(self.items)} rdma/nvmeof test(s) ran in the lab guest in "
            f"{self.seconds:.0f} s" + (f"; guest output: {self.log_path}"
                                       if self.log_path else ""))
        if self.problem:
            terminalreporter.write_line(self.problem)


def pytest_configure(config):
    report = config.getoption("fabric_report")
    if report:
        config.pluginmanager.register(GuestRecorder(config, report), "fabric-guest")
        return
    from mooncake_te import lab
    if config.getoption("fabric") == "off" or lab.in_guest():
        return
    config.pluginmanager.register(FabricTier(config), "fabric-tier")
