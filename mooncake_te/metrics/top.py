# SPDX-License-Identifier: Apache-2.0
"""``mooncake-te top``: what a running engine is doing, from its /metrics endpoint.

:func:`scrape` reads the text format, :func:`summarize` turns one scrape (and, for rates,
the one before it) into a plain dict (what ``--once --json`` prints), :func:`render` into
rich tables (the live view).
"""
from __future__ import annotations

import os
import time
import urllib.error
import urllib.request

from .. import errors as E
from .cells import quantile
from ..units import format_binary

P = "mooncake_te_"


def scrape(url: str, timeout: float = 5.0) -> dict:
    """``{metric family name: [(labels dict, sample name, value)]}`` of one scrape."""
    from prometheus_client.parser import text_string_to_metric_families
    from ..metadata.framing import metrics_credential
    req = urllib.request.Request(url)
    token = os.environ.get("MC_AUTH_TOKEN")
    if token:                          # an engine with a token wants the scrape credential
        req.add_header("Authorization", f"Bearer {metrics_credential(token)}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read().decode()
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise E.MooncakeError(f"{url} wants the metrics credential: the engine has an "
                                  f"auth_token; set MC_AUTH_TOKEN to it") from None
        raise E.MooncakeError(f"cannot read {url}: HTTP {e.code}") from None
    except (urllib.error.URLError, OSError) as e:
        raise E.MooncakeError(f"cannot read {url}: {getattr(e, 'reason', e)}; is an engine "
                              f"running with metrics_port (MC_METRICS_PORT) set to that "
                              f"port?") from None
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name] = [(dict(s.labels), s.name, s.value) for s in fam.samples]
    return out


def _totals(snap: dict, family: str, keys: tuple, suffix: str = "_total") -> dict:
    """{label values: value} of a counter or gauge family."""
    out: dict = {}
    for labels, name, value in snap.get(family, ()):
        if suffix and not name.endswith(suffix):
            continue
        k = tuple(labels.get(x, "") for x in keys)
        out[k] = out.get(k, 0.0) + value
    return out


def _histograms(snap: dict, family: str, keys: tuple) -> dict:
    """{label values: {"count", "sum_s", "buckets"}} of a histogram family."""
    out: dict = {}
    for labels, name, value in snap.get(family, ()):
        k = tuple(labels.get(x, "") for x in keys)
        h = out.setdefault(k, {"count": 0, "sum_s": 0.0, "buckets": []})
        if name.endswith("_bucket"):
            h["buckets"].append((float(labels["le"]), value))
        elif name.endswith("_count"):
            h["count"] = value
        elif name.endswith("_sum"):
            h["sum_s"] = value
    for h in out.values():
        h["buckets"].sort()
    return out


def _minus(cur: dict, prev: dict | None) -> dict:
    """The histogram of what happened between two scrapes."""
    if not prev or len(prev["buckets"]) != len(cur["buckets"]):
        return cur
    return {"count": cur["count"] - prev["count"], "sum_s": cur["sum_s"] - prev["sum_s"],
            "buckets": [(b, c - p) for (b, c), (_, p) in zip(cur["buckets"], prev["buckets"])]}


def summarize(cur: dict, prev: dict | None = None, dt: float = 0.0) -> dict:
    """The view of one scrape: totals, rates (when ``prev`` was taken ``dt`` s earlier),
    latency percentiles (of the interval when ``prev`` is given, else since start)."""
    rate = prev is not None and dt > 0
    tk = ("engine", "peer", "transport", "op")
    nbytes = _totals(cur, P + "transfer_bytes", tk)
    reqs = _totals(cur, P + "transfer_requests", tk)
    fails = _totals(cur, P + "transfer_failures", tk)
    if rate:
        assert prev is not None
        pb = _totals(prev, P + "transfer_bytes", tk)
        pr = _totals(prev, P + "transfer_requests", tk)
    transfers = []
    for k in sorted(set(nbytes) | set(reqs) | set(fails)):
        row = dict(zip(tk, k), bytes=int(nbytes.get(k, 0)), requests=int(reqs.get(k, 0)),
                   failures=int(fails.get(k, 0)))
        if rate:
            row["bytes_per_s"] = (nbytes.get(k, 0) - pb.get(k, 0)) / dt
            row["requests_per_s"] = (reqs.get(k, 0) - pr.get(k, 0)) / dt
        transfers.append(row)
    latency = []
    for kind, fam, keys in (("request", "transfer_request_duration_seconds",
                             ("engine", "transport", "op")),
                            ("batch", "transfer_batch_duration_seconds", ("engine", "transport"))):
        hc = _histograms(cur, P + fam, keys)
        hp = _histograms(prev, P + fam, keys) if prev is not None and rate else {}
        for k, h in sorted(hc.items()):
            h = _minus(h, hp.get(k))
            n = h["count"]
            latency.append(dict(zip(keys, k), kind=kind, count=int(n),
                                mean_s=h["sum_s"] / n if n else 0.0,
                                p50_s=quantile(h, 0.5), p90_s=quantile(h, 0.9),
                                p99_s=quantile(h, 0.99)))
    failures = [dict(zip(tk + ("status",), k), count=int(v)) for k, v in
                sorted(_totals(cur, P + "transfer_failures", tk + ("status",)).items()) if v]
    engines: dict = {}
    for fam, key in (("connections", "connections"), ("notifications_dropped",
                                                      "notifications_dropped"),
                     ("notifications_received", "notifications_received"),
                     ("registered_regions", "regions")):
        suffix = "_total" if "notifications" in fam else ""
        for (eng,), v in _totals(cur, P + fam, ("engine",), suffix).items():
            engines.setdefault(eng, {})[key] = int(v)
    for (eng, _ch), v in _totals(cur, P + "auth_failures", ("engine", "channel")).items():
        e = engines.setdefault(eng, {})
        e["auth_failures"] = e.get("auth_failures", 0) + int(v)
    for (eng, loc), v in _totals(cur, P + "registered_bytes", ("engine", "location"), "").items():
        engines.setdefault(eng, {}).setdefault("registered_bytes", {})[loc] = int(v)
    for (eng, peer), v in _totals(cur, P + "queue_depth", ("engine", "peer"), "").items():
        engines.setdefault(eng, {}).setdefault("queue_depth", {})[peer] = int(v)
    kv = {}
    for (cache,), v in _totals(cur, P + "kvcache_lookup_blocks", ("cache",)).items():
        hits = sum(x for (c, _t), x in _totals(cur, P + "kvcache_hit_blocks",
                                               ("cache", "tier")).items() if c == cache)
        kv[cache] = {"lookup_blocks": int(v), "hit_blocks": int(hits),
                     "hit_rate": hits / v if v else 0.0}
    p2p = {s: {"bytes_uploaded": int(v)} for (s,), v in
           _totals(cur, P + "p2p_bytes_uploaded", ("store",)).items()}
    for (s,), v in _totals(cur, P + "p2p_bytes_downloaded", ("store",)).items():
        p2p.setdefault(s, {})["bytes_downloaded"] = int(v)
    cond: dict = {}
    for (inst, _role), v in _totals(cur, P + "conductor_requests", ("instance", "role")).items():
        c = cond.setdefault(inst, {})
        c["routed"] = c.get("routed", 0) + int(v)
    for fam, key in (("conductor_ttft_expected_seconds", "expected_s"),
                     ("conductor_ttft_measured_seconds", "measured_s"),
                     ("conductor_ttft_samples", "samples")):
        for (inst,), v in _totals(cur, P + fam, ("instance",)).items():
            cond.setdefault(inst, {})[key] = v
    for fam, key in (("conductor_instance_inflight", "inflight"),
                     ("conductor_instance_healthy", "healthy")):
        for (inst,), v in _totals(cur, P + fam, ("instance",), "").items():
            cond.setdefault(inst, {})[key] = int(v)
    if cond:
        cond = {"instances": cond, "retries": int(sum(_totals(
            cur, P + "conductor_retries", ()).values()))}
    return {"time": time.time(), "interval_s": dt if rate else None, "transfers": transfers,
            "latency": latency, "failures": failures, "engines": engines, "kvcache": kv,
            "p2p_store": p2p, "conductor": cond}


def _bytes(n: float) -> str:
    return format_binary(n, 1)


def _secs(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.0f} us"


NAMES = ("engine", "peer", "cache", "instance")


def _table(title: str, columns, names, right=(), expand: bool = True):
    """A table whose cells never lose characters: names (engines, peers, caches) keep
    their full width up to 24 columns and fold beyond it; other cells fold too, never an
    ellipsis (``127.0.0.…`` made two engines' rows look the same on 80 columns)."""
    from rich.table import Table
    t = Table(title=title, expand=expand)
    wide = min(max([len(n) for n in names] + [6]), 24)
    for c in columns:
        t.add_column(c, overflow="fold", justify="right" if c in right else "left",
                     min_width=wide if c in NAMES else None)
    return t


def render(view: dict, url: str, expand: bool = True):
    """Rich renderables of a :func:`summarize` view (``expand``: as wide as the console;
    else each table as wide as its cells, see :func:`width`)."""
    from rich.console import Group
    rate = view["interval_s"] is not None
    names = ([r["engine"] for r in view["transfers"]] + [r["peer"] for r in view["transfers"]]
             + list(view["engines"]) + list(view["kvcache"]))
    nums = (("throughput", "req/s") if rate else ()) + ("bytes", "requests", "failures")
    t = _table(f"transfers  ({url})", ("engine", "peer", "transport", "op") + nums, names,
               nums, expand=expand)
    for r in view["transfers"]:
        cells = [r["engine"], r["peer"], r["transport"], r["op"]]
        if rate:
            cells += [f"{_bytes(r['bytes_per_s'])}/s", f"{r['requests_per_s']:.0f}"]
        cells += [_bytes(r["bytes"]), str(r["requests"]),
                  f"[red]{r['failures']}[/red]" if r["failures"] else "0"]
        t.add_row(*cells)
    nums = ("count", "mean", "p50", "p90", "p99")
    lat = _table("latency, submit to complete" + (" (this interval)" if rate else ""),
                 ("engine", "kind", "transport", "op") + nums, names, nums, expand=expand)
    for r in view["latency"]:
        lat.add_row(r["engine"], r["kind"], r["transport"], r.get("op", ""), str(r["count"]),
                    _secs(r["mean_s"]), _secs(r["p50_s"]), _secs(r["p90_s"]),
                    _secs(r["p99_s"]))
    parts = [t, lat]
    if view["failures"]:
        err = _table("failures by status",
                     ("engine", "peer", "transport", "op", "status", "count"), names,
                     ("count",), expand=expand)
        for r in view["failures"]:
            err.add_row(r["engine"], r["peer"], r["transport"], r["op"], r["status"],
                        f"[red]{r['count']}[/red]")
        parts.append(err)
    eng = _table("engines", ("engine", "connections", "auth refusals", "notif. dropped",
                             "registered", "queued"), names, expand=expand)
    for name, e in sorted(view["engines"].items()):
        reg = ", ".join(f"{k} {_bytes(v)}" for k, v in sorted(e.get("registered_bytes",
                                                                      {}).items()))
        eng.add_row(name, str(e.get("connections", 0)), str(e.get("auth_failures", 0)),
                    str(e.get("notifications_dropped", 0)), reg,
                    str(sum(e.get("queue_depth", {}).values())))
    parts.append(eng)
    if view["kvcache"]:
        kv = _table("kv cache", ("cache", "lookup blocks", "hit blocks", "hit rate"), names,
                    expand=expand)
        for name, k in sorted(view["kvcache"].items()):
            kv.add_row(name, str(k["lookup_blocks"]), str(k["hit_blocks"]),
                       f"{k['hit_rate']:.1%}")
        parts.append(kv)
    if view.get("conductor"):
        c = view["conductor"]
        t = _table(f"conductor (retries {c['retries']})",
                   ("instance", "healthy", "routed", "in flight", "TTFT expected",
                    "TTFT measured"), list(c["instances"]),
                   right=("routed", "in flight", "TTFT expected", "TTFT measured"),
                   expand=expand)
        for name, i in sorted(c["instances"].items()):
            n = i.get("samples", 0)
            t.add_row(name, "yes" if i.get("healthy") else "no", str(i.get("routed", 0)),
                      str(i.get("inflight", 0)),
                      _secs(i.get("expected_s", 0) / n) if n else "-",
                      _secs(i.get("measured_s", 0) / n) if n else "-")
        parts.append(t)
    return Group(*parts)


def width(group) -> int:
    """The columns ``group`` (``render(..., expand=False)``) needs to show every cell
    whole: ``top --once`` prints that wide rather than crop its rightmost columns."""
    from rich.console import Console
    console = Console(width=1000)
    return max(console.measure(r).maximum for r in group.renderables)
