# SPDX-License-Identifier: Apache-2.0
"""Issue 23, items 6-8 and 10: the command line's manners, through real processes (exit
status and stderr checked): --version, did-you-mean, Mooncake's bench flag names, no
traceback into a closed pipe, progress only on a terminal, one JSON document per --json,
help for every option, validation before work (exit 2) in the CLI's words, no silent
empty results, and children that run the package their parent runs."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

import pytest

import mooncake_te
from mooncake_te.cli.main import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = [sys.executable, "-m", "mooncake_te"]
TRACE = os.path.join(ROOT, "data", "traces", "synthetic_trace.jsonl")


def cli(*args, timeout=120, **kw):
    env = dict(os.environ, PYTHONPATH=ROOT, COLUMNS="200")
    env.update(kw.pop("env", {}))
    return subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=timeout,
                          env=env, **kw)


def usage_error(r, *words):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in r.stderr, (w, r.stderr)


# --- item 6: conventions ----------------------------------------------------------------
def test_version_flag():
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"mooncake-te {mooncake_te.__version__}"


def test_did_you_mean_for_commands_flags_and_choices():
    usage_error(cli("benhc"), "invalid choice: 'benhc'", "did you mean 'bench'?")
    usage_error(cli("doctor", "--chek", "config"), "did you mean --check?")
    usage_error(cli("trace", "stats", TRACE, "--jsno"), "did you mean --json?")
    usage_error(cli("bench", "--block_sizes", "4K"), "did you mean --block-sizes?")
    usage_error(cli("trace", "replay", TRACE, "--policy", "lur"), "did you mean 'lru'?")


@pytest.mark.parametrize("flag,ours", [
    ("--metadata_server", "--metadata"), ("--segment_id", "--segment"),
    ("--operation", "--op"), ("--block_size", "--block-sizes"),
    ("--batch_size", "--batch-size"), ("--protocol", "--protocol"),
    ("--threads", "--threads"), ("--duration", "--duration")])
def test_mooncake_bench_flag_names_are_accepted(flag, ours):
    p = build_parser()
    bench = p._subparsers._group_actions[0].choices["bench"]
    assert bench._option_string_actions[flag] is bench._option_string_actions[ours]


def test_mooncake_bench_flags_run():
    r = cli("bench", "--metadata_server", "p2p", "--operation", "write", "--block_size", "4K",
            "--batch_size", "8", "--threads", "1", "--duration", "0.1", "--buffer-size", "1M",
            "--no-sync", "--json", "--protocol", "tcp")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert [p["op"] for p in res["points"]] == ["write"]


def test_no_traceback_into_a_closed_pipe():
    # `mooncake-te ... | head -1`: the reader leaves after one line.
    sh = f"{sys.executable} -m mooncake_te trace stats {TRACE} | head -1"
    r = subprocess.run(["bash", "-o", "pipefail", "-c", sh], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=ROOT), timeout=60)
    assert r.stdout.count("\n") == 1
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr


def _all_parsers():
    def walk(p, path):
        yield path, p
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                summaries = {c.dest: c.help for c in a._choices_actions}
                for name, sub in a.choices.items():
                    assert summaries.get(name), f"{' '.join(path + [name])} has no summary"
                    yield from walk(sub, path + [name])
    yield from walk(build_parser(), ["mooncake-te"])


def test_every_option_has_help_and_defaults_are_said_once():
    for path, p in _all_parsers():
        fmt = p._get_formatter()
        for a in p._actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction,
                              argparse._VersionAction)):
                continue
            where = f"{' '.join(path)} {a.option_strings or a.dest}"
            assert a.help, f"{where} has no help text"
            text = fmt._expand_help(a) if a.help else ""
            assert "(default: None)" not in text, where
            assert text.count("(default") <= 1, f"{where}: {text!r}"


def test_top_level_summaries_are_whole_sentences():
    out = cli("--help").stdout
    assert "for machines without the hardware" in out


def test_p2p_publish_json_is_one_document_and_fetch_draws_no_bar(tmp_path):
    src = tmp_path / "blob.bin"
    src.write_bytes(os.urandom(300_000))
    pub = subprocess.Popen(CLI + ["p2p", "publish", str(src), "--host", "127.0.0.1",
                                  "--chunk-size", "64K", "--duration", "3", "--json"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        info = json.loads(pub.stdout.readline())
        r = cli("p2p", "fetch", "blob.bin", "-o", str(tmp_path / "copy"), "--seed",
                info["store"], "--host", "127.0.0.1")
        assert r.returncode == 0, r.stderr
        # stdout is a pipe here: results only, no progress bar on either stream.
        assert r.stdout.startswith("fetched 'blob.bin'") and r.stdout.count("\n") == 1
        assert "━" not in r.stdout + r.stderr
        out, err = pub.communicate(timeout=30)
    finally:
        pub.kill()
    assert pub.returncode == 0, err
    assert out.strip() == "", "a second JSON document on stdout"
    assert "uploaded" in err


# --- item 7: validation before work, in the CLI's words ---------------------------------
@pytest.mark.parametrize("args,words", [
    (["bench", "--protocol", "tpc"], ["did you mean 'tcp'?"]),
    (["bench", "--metadata", "foo://x"], ["unknown metadata backend 'foo://x'", "etcd://"]),
    (["bench", "--buffer-size", "1T"], ["--buffer-size", "of memory", "smaller"]),
    (["bench", "--buffer-size", "lots"], ["not a size"]),
    (["bench", "--port", "99999"], ["99999 is not a port"]),
    (["metadata-server", "--port", "99999"], ["99999 is not a port"]),
    (["p2p", "list", "--port", "-1"], ["-1 is not a port"]),
    (["doctor", "--check", "metadta"], ["no check named 'metadta'", "did you mean 'metadata'?"]),
    (["trace", "replay", TRACE, "--real", "--dram-gb", "0.0001"],
     ["--dram-gb 0.0001 holds no block", "use --dram-gb 0.0010 or more"]),
])
def test_bad_values_are_usage_errors_before_work(args, words):
    r = cli(*args)
    usage_error(r, *words)
    assert "dram_cache_gb" not in r.stderr and "protocol='" not in r.stderr


def test_unavailable_protocol_is_said_in_cli_words():
    from mooncake_te.transports import probe
    t = probe().get("rdma")
    if t is None or t.available:
        pytest.skip("this machine has RDMA: --protocol rdma is fine here")
    r = cli("bench", "--protocol", "rdma")
    usage_error(r, "--protocol rdma is unavailable here", "--protocol tcp")
    assert "protocol='tcp'" not in r.stderr


def test_doctor_missing_config_says_check_the_path(tmp_path):
    r = cli("doctor", "--check", "config", "--config", str(tmp_path / "nope.toml"))
    assert r.returncode == 2
    assert "check the path given to --config" in r.stdout
    assert "parses as TOML" not in r.stdout


# --- item 8: no silent emptiness --------------------------------------------------------
def test_p2p_list_without_a_place_to_ask_is_an_error():
    r = cli("p2p", "list", env={"MC_METADATA_SERVER": ""})
    usage_error(r, "--metadata", "--seed")
    assert r.stdout == ""


def test_trace_replay_real_has_working_defaults():
    r = cli("trace", "replay", TRACE, "--real", "--requests", "50", "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["dram_capacity_bytes"] > 0 and s["requests"] == 50
    assert "using --dram-gb 1" in r.stderr
    r = cli("trace", "replay", TRACE, "--real", "--requests", "50", "--ssd-gb", "0.05",
            "--dram-gb", "0.01", "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["ssd_capacity_bytes"] > 0 and "without --cache-dir" in r.stderr


# --- item 10: children run the package their parent runs --------------------------------
def test_bench_child_imports_the_parents_package(tmp_path):
    # A source checkout that was never built, in the current directory: `python -m` in a
    # child would import it ahead of the package the parent runs.
    shadow = tmp_path / "mooncake_te"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('the unbuilt checkout')\n")
    # The parent is started as a console script is: its own directory first on sys.path,
    # then the installed (here: this checkout's) package.
    script = tmp_path / "bin" / "mooncake-te"
    script.parent.mkdir()
    script.write_text(textwrap.dedent("""\
        import sys
        from mooncake_te.cli.main import main
        sys.exit(main())
        """))
    r = subprocess.run([sys.executable, str(script), "bench", "--block-sizes", "4K",
                        "--duration", "0.1", "--no-sync", "--buffer-size", "1M", "--json"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr
    assert "the unbuilt checkout" not in r.stderr
    assert json.loads(r.stdout)["points"]


# --- item 11: the doctor on a deployment's settings.json --------------------------------
def test_doctor_reads_prefill_decode_disaggregation_role(tmp_path):
    f = tmp_path / "settings.json"
    f.write_text(json.dumps({
        "prefill_decode_disaggregation": {"role": "decode"},
        "kv_transfer_config": {"kv_connector": "MooncakeTEConnector",
                               "kv_connector_module_path": "mooncake_te.integrations.vllm",
                               "kv_role": "kv_producer"}}))
    r = cli("doctor", "--vllm-config", str(f), "--check", "kv_role", "--json")
    assert r.returncode == 2, r.stdout + r.stderr
    (finding,) = json.loads(r.stdout)["findings"]
    assert finding["code"] == "MTE502" and "prefill_decode_disaggregation.role" in \
        finding["message"] and "kv_consumer" in finding["fix"]


def test_doctor_explains_vllms_builtin_mooncake_connector(tmp_path):
    import importlib.util
    f = tmp_path / "settings.json"
    f.write_text(json.dumps({"kv_transfer_config": {"kv_connector": "MooncakeConnector",
                                                    "kv_role": "kv_both"}}))
    r = cli("doctor", "--vllm-config", str(f), "--check", "vllm_connector", "--json")
    (finding,) = json.loads(r.stdout)["findings"]
    assert finding["code"] == "MTE505"
    assert "built-in MooncakeConnector" in finding["message"]
    assert "mooncake_te.integrations.vllm" in finding["fix"]
    have_mooncake = importlib.util.find_spec("mooncake") is not None
    assert finding["severity"] == ("warning" if have_mooncake else "error")
    assert r.returncode == (1 if have_mooncake else 2)
