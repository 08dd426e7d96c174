# SPDX-License-Identifier: Apache-2.0
"""``mooncake-te p2p``: publish a file as a P2P store object, fetch it, list objects.

``publish`` maps the file read-only and serves it until interrupted; ``fetch`` maps the
output file and has chunks land in it directly (no copy), with a progress bar, then
optionally keeps serving (``--linger``) so later fetchers can take chunks from it.
Without a metadata store (``--metadata p2p``, the default) fetchers name the
publisher with ``--seed HOST:PORT``, which ``publish`` prints.
"""
from __future__ import annotations

import json
import mmap
import os
import signal
import sys
import threading
import time

from ._parser import metadata_url, port

def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "p2p", help="distribute a large file to many nodes (P2P store: publish, fetch, list)",
        description="Publish a file as a named object and fetch it on other nodes; every "
                    "fetcher serves the chunks it has verified to the others, so the "
                    "publisher's NIC is not the bottleneck. See docs/p2p_store.md.")
    sub = p.add_subparsers(dest="p2p_command", metavar="<publish|fetch|list>")

    def common(q):
        q.add_argument("--metadata", default=None, type=metadata_url,
                       help="etcd://h:2379, redis://h:6379, http://h:8080/metadata, or p2p "
                            "(no server: fetchers give --seed) (default: config.toml "
                            "[p2p_store] / [metadata], MC_METADATA_SERVER, else p2p)")
        q.add_argument("--config", default=None, metavar="PATH",
                       help="a config.toml ([metadata], [transfer_engine], [p2p_store])")
        q.add_argument("--seed", action="append", default=[], metavar="HOST:PORT",
                       help="with --metadata p2p: the publisher's store address (repeatable)")
        q.add_argument("--host", default=None,
                       help="address peers reach this node at (default: the engine's: "
                            "MC_TCP_BIND_ADDRESS or the first UP interface)")
        q.add_argument("--port", type=port, default=0,
                       help="store control port (0: any free)")
        q.add_argument("--json", action="store_true", help="print results as JSON")

    q = sub.add_parser("publish", help="publish a file and serve it until interrupted")
    q.add_argument("file", help="the file to publish")
    q.add_argument("--name", help="object name (default: the file's base name)")
    q.add_argument("--chunk-size", default="4M", help="bytes per chunk (default 4M)")
    q.add_argument("--duration", type=float, default=None,
                   help="serve this many seconds, then withdraw (default: until Ctrl-C)")
    common(q)
    q.set_defaults(func=run)

    q = sub.add_parser("fetch", help="fetch an object into a file, with a progress bar")
    q.add_argument("name", help="the object's name (as `p2p list` shows it)")
    q.add_argument("-o", "--output", help="file to write (default: ./NAME's base name)")
    q.add_argument("--centralized", action="store_true",
                   help="fetch everything from the publisher and serve nothing "
                        "(p2p_store decentralized = false)")
    q.add_argument("--linger", type=float, default=0.0,
                   help="keep serving the object this many seconds after the fetch")
    q.add_argument("--parallelism", type=int, default=4, help="chunk reads in flight")
    q.add_argument("--timeout", type=float, default=None, help="give up after SECONDS")
    q.add_argument("--no-progress", action="store_true", help="no progress bar")
    common(q)
    q.set_defaults(func=run)

    q = sub.add_parser("list", help="list published objects")
    common(q)
    q.set_defaults(func=run)
    p.set_defaults(func=run, _p2p_parser=p)


def run(args) -> int:
    """Dispatch ``mooncake-te p2p <command>``; returns the exit status."""
    from ..errors import MooncakeError
    cmd = getattr(args, "p2p_command", None)
    if cmd is None:
        args._p2p_parser.print_help()
        return 2
    try:
        return {"publish": _publish, "fetch": _fetch, "list": _list}[cmd](args)
    except MooncakeError as e:
        print(f"mooncake-te p2p {cmd}: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        from .main import listen_failed
        print(f"mooncake-te p2p {cmd}: {e.strerror if listen_failed(e) else e}",
              file=sys.stderr)
        return 2 if listen_failed(e) else 1


def _open(args, **kwargs):
    import mooncake_te as mte
    from ..p2p_store import P2PStore
    metadata = args.metadata
    if metadata is None and args.seed:
        metadata = "p2p"            # seeds only mean something without a store
    eng = mte.TransferEngine(host=args.host, metadata=metadata, config=args.config)
    try:
        store = P2PStore(eng, metadata=metadata, seeds=args.seed or None, host=args.host,
                         port=args.port, **kwargs)
    except BaseException:
        eng.close()
        raise
    return eng, store


def _stop_event(duration=None) -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if duration is not None:
        timer = threading.Timer(duration, stop.set)
        timer.daemon = True         # an interrupted run must not wait for it
        timer.start()
    return stop


def _progress(enabled: bool, description: str, total: int):
    """A rich progress bar (bytes, rate, ETA) and its update callable: on stderr, and only
    when stderr is a terminal, so stdout carries results alone."""
    if not enabled or not sys.stderr.isatty():
        return None, None
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TimeRemainingColumn,
                               TransferSpeedColumn)
    bar = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                   TransferSpeedColumn(), TimeRemainingColumn(), transient=False,
                   console=Console(stderr=True))
    task = bar.add_task(description, total=total)
    return bar, (lambda done, _total: bar.update(task, completed=done))


def _publish(args) -> int:
    from ..units import parse_size
    path = args.file
    name = args.name or os.path.basename(path)
    size = os.path.getsize(path)
    if size == 0:
        print(f"mooncake-te p2p publish: {path} is empty; nothing to publish", file=sys.stderr)
        return 1
    eng, store = _open(args, chunk_size=parse_size(args.chunk_size))
    try:
        with open(path, "rb") as f:
            mem = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
        bar, update = _progress(not args.json, f"checksums {name}", size)
        if bar:
            bar.start()
        try:
            m = store.register(name, mem, progress=update)
        finally:
            if bar:
                bar.stop()
        backend = getattr(store.directory, "backend", None)
        where = getattr(backend, "address", None) or "p2p"
        info = {"name": name, "size": m.size, "chunks": m.chunks, "chunk_size": m.chunk_size,
                "store": store.address, "segment": eng.name, "metadata": where}
        if args.json:
            print(json.dumps(info), flush=True)
        else:
            how = f"--metadata {where}" if backend is not None else f"--seed {store.address}"
            print(f"published {name!r}: {m.size} bytes in {m.chunks} chunks of {m.chunk_size}; "
                  f"store {store.address}\nfetch it with: mooncake-te p2p fetch {name} {how}",
                  flush=True)
        _stop_event(args.duration).wait()
        s = store.stats()
        # With --json, stdout carries one document (the one above, which fetchers need
        # while this serves); the closing tally is a status line on stderr.
        print(f"uploaded {s['bytes_uploaded']} bytes ({s['chunks_uploaded']} chunks) to "
              f"{len(s['chunks_to'])} fetchers", file=sys.stderr if args.json else sys.stdout,
              flush=True)
    finally:
        store.close()
        eng.close()
    return 0


def _fetch(args) -> int:
    out = args.output or os.path.basename(args.name) or "object"
    eng, store = _open(args, parallelism=args.parallelism,
                       decentralized=False if args.centralized else None)
    try:
        m = store.directory.manifest(args.name)
        if m is None:
            store.get(args.name)        # raises the full "not found" error
        fd = os.open(out, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, m.size)
            mem = mmap.mmap(fd, m.size)
        finally:
            os.close(fd)
        bar, update = _progress(not (args.no_progress or args.json), args.name, m.size)
        t0 = time.monotonic()
        if bar:
            bar.start()
        try:
            store.get(args.name, into=mem, progress=update, timeout=args.timeout)
        finally:
            if bar:
                bar.stop()
        seconds = time.monotonic() - t0
        mem.flush()
        g = store.stats()["gets"][args.name]
        result = {"name": args.name, "output": out, "size": m.size, "seconds": seconds,
                  "gbps": m.size / seconds / 1e9, "chunks_from": g["chunks_from"],
                  "failed_holders": g["failed_holders"], "corrupt_chunks": g["corrupt_chunks"]}
        if args.json:
            print(json.dumps(result), flush=True)
        else:
            frm = ", ".join(f"{k}: {v}" for k, v in sorted(g["chunks_from"].items()))
            print(f"fetched {args.name!r} to {out}: {m.size} bytes in {seconds:.2f} s "
                  f"({result['gbps']:.2f} GB/s); chunks from {frm}", flush=True)
            for holder, why in g["failed_holders"].items():
                print(f"  avoided {holder}: {why}", flush=True)
        if args.linger > 0 and not args.centralized:
            _stop_event(args.linger).wait()
            if not args.json:
                print(f"served {store.stats()['bytes_uploaded']} bytes while lingering",
                      flush=True)
    finally:
        store.close()
        eng.close()
    return 0


def _list(args) -> int:
    import os as _os
    if not (args.metadata or args.seed or args.config or _os.environ.get("MC_METADATA_SERVER")):
        # With neither, the store would ask nobody and print an empty table.
        print("mooncake-te p2p list: nothing to ask: give --metadata URL (the store the "
              "publishers use) or --seed HOST:PORT (a publisher's store, as `p2p publish` "
              "prints)", file=sys.stderr)
        return 2
    eng, store = _open(args)
    try:
        objs = store.list()
    finally:
        store.close()
        eng.close()
    if args.json:
        print(json.dumps([o.__dict__ for o in objs]))
        return 0
    if not objs:                 # a header over nothing reads as a broken table
        store_url = args.metadata or _os.environ.get("MC_METADATA_SERVER") \
            or f"of {args.config}"
        where = "seed " + ", ".join(args.seed) if args.seed else f"metadata {store_url}"
        print(f"no objects published ({where}); publish one with "
              f"`mooncake-te p2p publish FILE` against the same store")
        return 0
    from rich.console import Console
    from rich.table import Table
    t = Table("name", "size", "chunks", "chunk size", "origin")
    for o in objs:
        t.add_row(o.name, str(o.size), str(o.chunks), str(o.chunk_size), o.origin)
    Console().print(t)
    return 0
