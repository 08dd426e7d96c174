# SPDX-License-Identifier: Apache-2.0
"""``mooncake-te conductor``: the KV-cache-aware router (docs/conductor.md)."""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys

from ._parser import port as _port


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "conductor",
        help="route OpenAI requests to vLLM instances by where their prompt's KV is cached",
        description="An OpenAI-compatible front (/v1/completions, /v1/chat/completions, "
                    "/v1/models, /health, /metrics) for prefill, decode and plain vLLM "
                    "instances running MooncakeTEConnector. Flags win over the "
                    "[conductor] section of --config.")
    p.add_argument("--config", metavar="FILE", help="config.toml with a [conductor] section")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_port, help="port (default 8000; 0 = any free)")
    for role in ("prefill", "decode", "plain"):
        p.add_argument(f"--{role}", action="append", metavar="URL",
                       help=f"a {role} instance's http://host:port (repeatable)")
    p.add_argument("--metadata", metavar="URL",
                   help="metadata store where instances announce themselves and the pools "
                        "publish their blocks (etcd://, redis://, http://.../metadata)")
    p.add_argument("--model", help="the model as vLLM serves it (--model): the key root of "
                                   "configured instances and the default tokenizer")
    p.add_argument("--tokenizer", help="tokenizer directory or name (default: --model)")
    p.add_argument("--dtype", help="vLLM's --dtype, for the key root (default bfloat16)")
    p.add_argument("--block-size", type=int, help="vLLM's --block-size (default 16)")
    p.add_argument("--namespace", help="the pools' index namespace of configured instances "
                                       "(announced instances send theirs)")
    p.add_argument("--kv-events", action="append", metavar="URL=ENDPOINT[,REPLAY]",
                   help="a configured instance's vLLM KV events publisher (its "
                        "--kv-events-config endpoint, and replay_endpoint after a comma), "
                        "e.g. http://127.0.0.1:8100=tcp://127.0.0.1:5557,tcp://127.0.0.1:5558 "
                        "(repeatable; announced instances send theirs)")
    p.add_argument("--policy", choices=["cost", "round_robin", "least_loaded"],
                   help="cost: least expected TTFT (default); the others are baselines")
    p.add_argument("--api-key-file", metavar="FILE",
                   help="require 'Authorization: Bearer <key in FILE>' (default: "
                        "MTE_CONDUCTOR_API_KEY, else no authentication)")
    p.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="log level of the conductor's own log (on stderr)")
    p.add_argument("--json", action="store_true",
                   help="print the listening address as one JSON line on start")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..config import Config
    from ..conductor.config import build
    from ..errors import ConfigError
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s: %(message)s")
    try:
        cfg = Config.load(args.config)
        over = {k: v for k, v in {
            "host": args.host, "port": args.port, "prefill": args.prefill,
            "decode": args.decode, "plain": args.plain, "metadata_server": args.metadata,
            "model": args.model, "tokenizer": args.tokenizer, "dtype": args.dtype,
            "block_size": args.block_size, "namespace": args.namespace,
            "policy": args.policy, "kv_events": args.kv_events}.items()
            if v is not None}
        if args.api_key_file:
            with open(args.api_key_file) as f:
                over["api_key"] = f.read().strip()
        cfg = cfg.with_overrides({"conductor": over}, "the command line")
        conductor = build(cfg)
    except (ConfigError, RuntimeError, OSError) as e:
        print(f"mooncake-te conductor: {e}", file=sys.stderr)
        return 2

    async def main():
        url = await conductor.start()
        if args.json:
            print(json.dumps({"url": url}), flush=True)
        else:
            print(f"conductor on {url}: {len(conductor.cluster.records)} instances "
                  f"configured", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await conductor.stop()

    asyncio.run(main())
    return 0
