# SPDX-License-Identifier: Apache-2.0
"""The docs run as written (issue 23, item 12).

Every fenced block in README.md and docs/*.md is one of:

- ``python``: run in a fresh interpreter, in a scratch directory that holds a copy of
  ``data/``; it must exit 0.
- ``sh``/``console``/``bash``: each command (``$ `` lines in ``console`` blocks, every
  non-comment line otherwise) must be something a fresh clone has after
  ``scripts/setup.sh``. ``mooncake-te`` commands must parse: command, subcommands,
  flags and choices as the parser has them today. Quick read-only commands
  (``version``, ``topology``, ``doctor``, ``trace stats``) are also run and must exit 0 (or
  the exit status the doctor documents for findings, 1 or 2).
- anything else (``text`` output, ``toml``, ``json``): not run.

A block the reader should not run as it is (part of a larger program, needs hardware or a
second host) is marked with an HTML comment on the line before its fence, which neither
GitHub nor the docs site shows::

    <!-- excerpt: why -->

Placeholders are the documented default addresses, filled by fixtures: the metadata
servers' default ports on 127.0.0.1 (etcd 2379, redis 6379, HTTP metadata server 8080)
are replaced by the ports of real servers these tests start.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from servers import etcd_server, http_metadata_server, redis_server  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(
    os.path.join(ROOT, "docs")) if f.endswith(".md"))
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<info>[^\n`]*)$")
MARK = re.compile(r"<!--\s*excerpt\b.*-->")
SHELL = {"sh", "bash", "console", "shell"}
# Shell builtins and commands every reader has; anything else must be on PATH after
# scripts/setup.sh (the venv's bin first), i.e. installed by it.
BUILTINS = {"cd", "export", "source", ".", "echo", "ulimit", "time", "env", "kill", "sudo"}
# mooncake-te commands that read and print, quickly: also run them.
QUICK = [("version",), ("topology",), ("doctor",), ("trace", "stats")]


def blocks(page: str):
    """(line, info, text, excerpt) of every fenced block of ``page``."""
    with open(os.path.join(ROOT, page)) as f:
        lines = f.read().split("\n")
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent = m.group("fence"), len(m.group("indent"))
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][indent:] if lines[i][:indent].isspace() else lines[i])
            i += 1
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        yield start + 1, m.group("info").strip().split(" ")[0].lower(), "\n".join(body), \
            bool(MARK.search(prev))
        i += 1


def _cases(kind):
    out = []
    for page in PAGES:
        for line, info, text, excerpt in blocks(page):
            if (kind == "python" and info in ("python", "py")) or \
                    (kind == "shell" and info in SHELL):
                out.append(pytest.param(page, line, text, excerpt, id=f"{page}:{line}"))
    return out


@pytest.fixture(scope="module")
def fill(etcd_server, redis_server, http_metadata_server):  # noqa: F811
    """Placeholder -> value: the documented default addresses -> the fixture servers."""
    return {"127.0.0.1:2379": f"127.0.0.1:{etcd_server.port}",
            "127.0.0.1:6379": f"127.0.0.1:{redis_server.port}",
            "127.0.0.1:8080": f"127.0.0.1:{http_metadata_server.port}"}


def _filled(text: str, fill: dict) -> str:
    for k, v in fill.items():
        text = text.replace(k, v)
    return text


@pytest.fixture
def scratch(tmp_path):
    """A directory to run in, with the repository's sample data where the docs say it is."""
    shutil.copytree(os.path.join(ROOT, "data"), tmp_path / "data")
    return tmp_path


def _skip_unless_runnable(page, line, excerpt):
    if excerpt:
        pytest.skip("marked as an excerpt")


def _env():
    return dict(os.environ, PYTHONPATH=ROOT, MC_METADATA_SERVER="", COLUMNS="100")


@pytest.mark.parametrize("page,line,text,excerpt", _cases("python"))
def test_python_blocks_run(page, line, text, excerpt, fill, scratch):
    _skip_unless_runnable(page, line, excerpt)
    r = subprocess.run([sys.executable, "-c", _filled(text, fill)], cwd=scratch, env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{page}:{line} failed:\n{r.stderr[-3000:]}"


def commands(info: str, text: str):
    """The commands of a shell block: ``$ `` lines of console blocks, else every line
    that is not a comment; continuation lines joined; trailing comments dropped."""
    out, cur = [], ""
    for raw in text.split("\n"):
        ln = raw.rstrip()
        if not cur:
            if info == "console" and not ln.startswith("$ "):
                continue                        # output
            if ln.startswith("$ "):
                ln = ln[2:]
            if not ln.strip() or ln.lstrip().startswith("#"):
                continue
        if ln.endswith("\\"):
            cur += ln[:-1] + " "
            continue
        cur += ln
        try:
            shlex.split(cur, comments=True)
        except ValueError:                      # a quote spans lines: keep reading
            cur += "\n"
            continue
        out.append(cur.strip())
        cur = ""
    return out


def _words(cmd: str):
    try:
        words = shlex.split(cmd, comments=True)
    except ValueError:
        return []
    # Drop leading VAR=value assignments and stop at the first pipe or list operator.
    while words and (re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]) or words[0] == "sudo"):
        words.pop(0)
    for i, w in enumerate(words):
        if w in ("|", "||", "&&", ";", ">", ">>", "2>&1", "&", "2>/dev/null", "<"):
            return words[:i]
    return words


def _check_program(prog: str, where: str):
    if prog.startswith("$"):
        return                      # the reader's own ($EDITOR)
    if prog.startswith("./") or "/" in prog:
        assert os.path.exists(os.path.join(ROOT, prog)), f"{where}: {prog} is not in the repo"
        return
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    assert prog in BUILTINS or shutil.which(prog, path=path), (
        f"{where}: `{prog}` is neither in the repository nor installed by scripts/setup.sh; "
        f"install it in setup.sh, use another command, or mark the block <!-- excerpt -->")


@pytest.mark.parametrize("page,line,text,excerpt", _cases("shell"))
def test_shell_blocks_name_real_commands_and_flags(page, line, text, excerpt, fill, scratch):
    from mooncake_te.cli.main import build_parser
    _skip_unless_runnable(page, line, excerpt)
    info = next(i for ln, i, t, _ in blocks(page) if ln == line)
    for cmd in commands(info, text):
        where = f"{page}:{line}: {cmd}"
        words = _words(_filled(cmd, fill))
        if not words:
            continue
        if words[0] in ("python", "python3") and words[1:3] == ["-m", "mooncake_te"]:
            words = ["mooncake-te"] + words[3:]
        _check_program(words[0], where)
        if words[0] in ("python", "python3") and len(words) > 1 and \
                os.path.isfile(os.path.join(ROOT, words[1])) and words[1].startswith("tests/"):
            # A helper script of the repository that later commands rely on: run it.
            r = subprocess.run([sys.executable, os.path.join(ROOT, words[1])] + words[2:],
                               cwd=scratch, env=_env(), capture_output=True, text=True,
                               timeout=120)
            assert r.returncode == 0, f"{where}: exit {r.returncode}\n{r.stderr[-2000:]}"
            continue
        if words[0] != "mooncake-te":
            continue
        argv = words[1:]
        parser = build_parser()
        try:
            parser.parse_args(argv)
        except SystemExit as e:
            assert e.code == 0, f"{where}: the command line does not parse (exit {e.code})"
            continue
        if any(tuple(argv[:len(q)]) == q for q in QUICK) and "--help" not in argv:
            r = subprocess.run([sys.executable, "-m", "mooncake_te"] + argv, cwd=scratch,
                               env=_env(), capture_output=True, text=True, timeout=120)
            ok = (0, 1, 2) if argv[0] == "doctor" else (0,)
            assert r.returncode in ok and "Traceback" not in r.stderr, \
                f"{where}: exit {r.returncode}\n{r.stderr[-2000:]}"


# `pip install mooncake-te` (or `mooncake-te[extra]`) asks PyPI, which has no such package
# (issue 41, item 1): the docs say `pip install .` in a clone, or a wheel from
# scripts/wheel.sh.
PYPI_INSTALL = re.compile(
    r"pip3? install\b[^`\n;&|#]*?(?<![\w./-])['\"]?mooncake-te(?![\w-])")


def test_no_doc_installs_mooncake_te_from_pypi():
    found = []
    for page in PAGES:
        with open(os.path.join(ROOT, page)) as f:
            for n, line in enumerate(f, 1):
                if PYPI_INSTALL.search(line):
                    found.append(f"{page}:{n}: {line.strip()}")
    assert not found, ("mooncake-te is not on PyPI; say `pip install .` (or '.[extra]') in "
                       "a clone, or a wheel from scripts/wheel.sh:\n" + "\n".join(found))


def test_pypi_pattern_catches_the_forms_that_fail():
    assert PYPI_INSTALL.search("pip install mooncake-te && mooncake-te compat install")
    assert PYPI_INSTALL.search("`pip install 'mooncake-te[bench]'`")
    assert PYPI_INSTALL.search("pip install vllm mooncake-te   # x")
    assert not PYPI_INSTALL.search("pip install . && mooncake-te compat install")
    assert not PYPI_INSTALL.search("`pip install mooncake-transfer-engine`")
    assert not PYPI_INSTALL.search("pip install '.[metrics]'")
    assert not PYPI_INSTALL.search("pip install .   # the mooncake-te command")


def test_wheel_script_is_documented_and_sound():
    path = os.path.join(ROOT, "scripts", "wheel.sh")
    assert os.access(path, os.X_OK)
    assert subprocess.run(["bash", "-n", path]).returncode == 0
    with open(os.path.join(ROOT, "docs", "index.md")) as f:
        assert "./scripts/wheel.sh" in f.read()


def test_every_page_is_in_the_site_nav_and_linked_from_home():
    """mkdocs only warns about a page left out of ``nav`` (issue 41, item 9)."""
    with open(os.path.join(ROOT, "mkdocs.yml")) as f:
        nav = set(re.findall(r"^\s*- [^:\n]+:\s*(\S+\.md)\s*$", f.read(), re.M))
    with open(os.path.join(ROOT, "docs", "index.md")) as f:
        home = set(re.findall(r"\]\(([\w-]+\.md)", f.read()))
    pages = {p[len("docs/"):] for p in PAGES if p.startswith("docs/")}
    assert pages - nav == set(), f"not in mkdocs.yml's nav: {sorted(pages - nav)}"
    assert pages - home - {"index.md"} == set(), \
        f"not linked from index.md: {sorted(pages - home - {'index.md'})}"


def test_no_page_points_readers_at_our_issue_numbers():
    """Readers of the command's page cannot see our issues (issue 41, item 12: bench.md
    said "issue-2 target" and "see issue 9"); Mooncake's or vLLM's issues are URLs.
    benchmarks.md, a record of runs against targets, still names them: not checked."""
    found = []
    for page in ["README.md", "docs/bench.md", "docs/index.md"]:
        with open(os.path.join(ROOT, page)) as f:
            for n, line in enumerate(f, 1):
                if re.search(r"\bissue[- ]\d+\b", line, re.I) and "github.com" not in line:
                    found.append(f"{page}:{n}: {line.strip()}")
    assert not found, "\n".join(found)


def readme_extras() -> list:
    """The extras the README's "Extras (...)" sentence names, in order."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    m = re.search(r"Extras \(.*?(?:\n\n|\Z)", text, re.S)
    assert m, "README.md has no 'Extras (...)' paragraph"
    return re.findall(r"`\[([\w-]+)\]`", m.group(0))


def test_readme_lists_every_extra_of_pyproject():
    """Issue 41, item 4: the README left out [metrics] and [kvcache]."""
    try:
        import tomllib
    except ModuleNotFoundError:            # Python < 3.11
        import tomli as tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = set(tomllib.load(f)["project"]["optional-dependencies"])
    listed = readme_extras()
    assert sorted(set(listed)) == sorted(extras), (
        f"README.md's extras differ from pyproject.toml's: missing "
        f"{sorted(extras - set(listed))}, not in pyproject {sorted(set(listed) - extras)}")


def test_readme_tour_prints_what_its_comments_say(scratch):
    """Issue 41, item 12: the tour's ``print(...)  # output`` comments are the real output
    (``...`` stands for anything): the TransferStatus comment had drifted from the repr."""
    tour = next(text for _, info, text, _ in blocks("README.md")
                if info == "python" and "TransferStatus" in text)
    wants = [m.group(1).strip() for m in re.finditer(r"^\s*print\(.*\)\s+# (.+)$", tour, re.M)]
    assert len(wants) >= 3
    r = subprocess.run([sys.executable, "-c", tour], cwd=scratch, env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = r.stdout.strip().splitlines()
    assert len(got) == len(wants), r.stdout
    for want, line in zip(wants, got):
        pattern = ".*".join(re.escape(p) for p in want.split("..."))
        assert re.fullmatch(pattern, line.strip()), f"README says {want!r}, prints {line!r}"


# How each placeholder server is started, as the docs must say before an example that
# needs it (issue 41, item 8: kvcache.md needed redis and p2p_store.md etcd, unsaid).
SERVER_START = {"127.0.0.1:6379": "redis-server --port 6379",
                "127.0.0.1:2379": "etcd --data-dir",
                "127.0.0.1:8080": "mooncake-te metadata-server"}


def test_examples_that_need_a_server_say_how_to_start_it():
    missing = []
    for page in PAGES:
        with open(os.path.join(ROOT, page)) as f:
            lines = f.read().split("\n")
        for line, info, text, excerpt in blocks(page):
            if excerpt or info not in ("python", "py"):
                continue
            top = next((i for i in range(line - 1, -1, -1) if lines[i].startswith("#")), 0)
            before = "\n".join(lines[top:line - 1])
            for addr, start in SERVER_START.items():
                if addr in text and start not in before:
                    missing.append(f"{page}:{line} uses {addr} but its section does not "
                                   f"say how to start it ({start!r} ...)")
    assert not missing, "\n".join(missing)


def _error_table():
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "error_table", os.path.join(ROOT, "scripts", "error_table.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_api_md_error_table_is_current():
    """Issue 41, item 10: api.md listed none of 21 error classes a user meets; the table
    is generated (scripts/error_table.py) and must match errors.py and status.h."""
    mod = _error_table()
    with open(mod.API_MD) as f:
        text = f.read()
    assert mod.render(text) == text, "docs/api.md's error table is stale: run " \
                                     "scripts/error_table.py"
    from mooncake_te import errors as E
    every = {n for n, v in vars(E).items() if isinstance(v, type)
             and issubclass(v, E.MooncakeError) and v.__module__ == E.__name__}
    listed = set(re.findall(r"^\| `(\w+)` \|", text, re.M))
    assert every <= listed, f"not in api.md: {sorted(every - listed)}"
    for cls in ("RemoteAccessError", "ConnectionLostError", "PeerRestartedError"):
        assert f"| `{cls}` |" in text


def test_error_table_check_fails_when_stale(tmp_path, monkeypatch):
    mod = _error_table()
    with open(mod.API_MD) as f:
        text = f.read()
    stale = tmp_path / "api.md"
    stale.write_text(text.replace("| `ConnectionLostError` |", "| `ConnectionLost` |"))
    monkeypatch.setattr(mod, "API_MD", str(stale))
    assert mod.main(["--check"]) == 1
    assert mod.main([]) == 0 and stale.read_text() == text     # rewritten as it should be
