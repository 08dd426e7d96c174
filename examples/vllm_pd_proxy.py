# SPDX-License-Identifier: Apache-2.0
"""A minimal prefill/decode proxy for two (or more) ``vllm serve`` instances running
MooncakeTEConnector (docs/vllm.md). Standard library only.

For each OpenAI request (``/v1/completions``, ``/v1/chat/completions``) it:

1. sends a copy to a prefill instance with ``max_tokens = 1``, no streaming, and
   ``kv_transfer_params = {"do_remote_decode": true}``: the prefill instance computes
   the prompt's KV and keeps its blocks under a lease;
2. sends the original request to a decode instance with the ``kv_transfer_params`` the
   prefill instance returned: the decode instance reads the blocks through mooncake_te
   and generates; its answer (streamed or not) goes back to the client as it is.

Usage::

    python vllm_pd_proxy.py --port 8000 \\
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

Several ``--prefill`` / ``--decode`` URLs are used round-robin. Not for production: no
retries, no authentication, one thread per request. It shows the protocol; to serve, use
``mooncake-te conductor`` (docs/conductor.md), which routes by where the KV is cached.
"""
import argparse
import itertools
import json
import sys
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROUTES = ("/v1/completions", "/v1/chat/completions")


def make_handler(prefill, decode, timeout):
    prefill, decode = itertools.cycle(prefill), itertools.cycle(decode)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send_json(self, code, obj):
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):                      # /v1/models, /health: from a decode node
            try:
                with urllib.request.urlopen(next(decode) + self.path, timeout=timeout) as r:
                    self._send_json(r.status, json.load(r))
            except urllib.error.URLError as e:
                self._send_json(502, {"error": f"decode instance unreachable: {e}"})

        def do_POST(self):
            if self.path not in ROUTES:
                self._send_json(404, {"error": f"only {', '.join(ROUTES)}"})
                return
            req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            pre = dict(req, max_tokens=1, stream=False,
                       kv_transfer_params={"do_remote_decode": True})
            pre.pop("stream_options", None)
            if "max_completion_tokens" in pre:
                pre["max_completion_tokens"] = 1
            try:
                answer = _post(next(prefill) + self.path, pre, timeout)
                params = json.load(answer).get("kv_transfer_params")
            except urllib.error.URLError as e:
                self._send_json(502, {"error": f"prefill failed: {e}"})
                return
            # Without params (prefill refused) the decode instance computes everything.
            dec = dict(req, kv_transfer_params=params) if params else req
            try:
                r = _post(next(decode) + self.path, dec, timeout)
            except urllib.error.HTTPError as e:
                self._send_json(e.code, json.loads(e.read() or b"{}"))
                return
            except urllib.error.URLError as e:
                self._send_json(502, {"error": f"decode failed: {e}"})
                return
            with r:
                self.send_response(r.status)
                self.send_header("Content-Type", r.headers.get("Content-Type",
                                                               "application/json"))
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for chunk in iter(lambda: r.read1(65536), b""):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

        def log_message(self, fmt, *args):
            sys.stderr.write("proxy: " + fmt % args + "\n")

    return Handler


def _post(url, obj, timeout):
    data = json.dumps(obj).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill", action="append", required=True, metavar="URL")
    ap.add_argument("--decode", action="append", required=True, metavar="URL")
    ap.add_argument("--timeout", type=float, default=600)
    a = ap.parse_args()
    srv = ThreadingHTTPServer((a.host, a.port), make_handler(
        [u.rstrip("/") for u in a.prefill], [u.rstrip("/") for u in a.decode], a.timeout))
    print(f"proxy on http://{a.host}:{a.port}: prefill {a.prefill}, decode {a.decode}")
    srv.serve_forever()


if __name__ == "__main__":
    main()
