# SPDX-License-Identifier: Apache-2.0
"""Where the cost conductor's routing lost hits, from one ``conductor_ttft.py --isolate
--cost-log-level DEBUG`` run: its JSON (the per-request ``raw`` figures, in the order
sent) and the cost conductor's log (one ``route:`` line per decision, same order).

    python3 analyze_routes.py RUN.json RUN.conductor-cost.log

Prints, over the trace's requests (the overhead requests that follow are left out):
decisions that went to an instance holding fewer prefix blocks than another candidate
("routed away"), blocks the conductor expected against the blocks vLLM reported cached,
and the requests per instance. A fully cached prompt shows one block less than expected:
vLLM computes the last token, so its block is never reported cached.
"""
import collections
import json
import re
import sys

LINE = re.compile(r"route: (\d+) tokens -> (\S+); (.*)$")
CAND = re.compile(r"(\S+) (\d+) ms \(queue (\d+), ahead (\d+)(?:/\d+ tok, elsewhere \d+ tok)?, "
                  r"(.*)\)")


def decisions(log_path: str) -> list:
    out = []
    with open(log_path) as f:
        for line in f:
            m = LINE.search(line)
            if not m:
                continue
            cands = {}
            for part in m.group(3).split("; "):
                c = CAND.match(part)
                hits = {} if c.group(5) == "no hit" else {
                    k: int(v) for k, v in (x.split("=") for x in c.group(5).split("/"))}
                cands[c.group(1)] = {"ttft_ms": int(c.group(2)), "ahead": int(c.group(4)),
                                     "blocks": sum(hits.values())}
            out.append((m.group(2), cands))
    return out


def main() -> None:
    raw = json.load(open(sys.argv[1]))["raw"]["cost"]
    routes = decisions(sys.argv[2])[:len(raw)]
    kinds = collections.Counter()
    expected = best = got = 0
    for (pick, cands), (_ttft, _prompt, cached) in zip(routes, raw):
        e = cands[pick]["blocks"]
        b = max(c["blocks"] for c in cands.values())
        a = (cached or 0) // 32
        expected, best, got = expected + e, best + b, got + a
        kinds["routed away from more hits" if b > e else "to the best holder"] += 1
    print(f"decisions: {len(routes)}; {dict(kinds)}")
    print(f"prefix blocks: expected {expected}, most any candidate held {best}, "
          f"reported cached {got}")
    print("requests per instance:", dict(collections.Counter(p for p, _ in routes)))


if __name__ == "__main__":
    main()
