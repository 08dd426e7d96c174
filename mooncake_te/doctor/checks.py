# SPDX-License-Identifier: Apache-2.0
"""The doctor's checks. Each code is documented in ``docs/troubleshooting.md``; codes are
stable: a check may get better messages, never a different code for the same problem.

=======  ===========================================================================
MTE1xx   configuration files and environment
MTE2xx   RDMA devices, topology and GPUDirect
MTE3xx   metadata server
MTE4xx   local resources: cache directory, locked memory
MTE5xx   vLLM configuration
=======  ===========================================================================
"""
from __future__ import annotations

import difflib
import os
import re
import resource

from ..errors import ConfigError, DeviceNotFoundError
from ..metadata.url import P2P_NAMES, parse as parse_metadata_url
from .base import GiB, check, error, ok, skip, warning
from .probe import identify, parse_endpoints

# ---- MTE1xx: configuration --------------------------------------------------------


@check("config", "config.toml parses and every key is known and well-typed",
       ("MTE101", "MTE100", "MTE102", "MTE103"))
def check_config(ctx):
    if ctx.config_path is None:
        yield skip("MTE101", "no --config given: checking built-in defaults and MC_* "
                             "variables only")
    for p in ctx.config_problems:
        if p.kind == "syntax" and not os.path.isfile(p.where):
            yield error("MTE100", p.message,
                        f"check the path given to --config ({p.where!r} is "
                        f"{'a directory' if os.path.isdir(p.where) else 'not there'}; "
                        f"relative paths start from {os.getcwd()})", file=p.where)
        elif p.kind == "syntax":
            yield error("MTE100", p.message,
                        "fix the file so it parses as TOML (https://toml.io); the message "
                        "gives the line and column", file=p.where)
        elif p.kind == "unknown":
            fix = (f"rename it to {p.suggestion!r}" if p.suggestion and p.key
                   else f"rename the section to [{p.suggestion}]" if p.suggestion
                   else "remove it; see the [sections] and keys in docs/troubleshooting.md "
                        "(MTE101)")
            yield error("MTE101", p.message, fix, file=p.where, section=p.section, key=p.key,
                        suggestion=p.suggestion)
        elif p.where == "environment":
            yield error("MTE103", p.message, "correct or unset the variable")
        else:
            yield error("MTE102", p.message, "use a value of the expected type and range",
                        file=p.where, section=p.section, key=p.key, value=_jsonable(p.value))


def _jsonable(v):
    return v if isinstance(v, (str, int, float, bool, list, dict, type(None))) else repr(v)


@check("custom_topology", "MC_CUSTOM_TOPO_JSON (if set) is a valid matrix of existing NICs",
       ("MTE104",))
def check_custom_topology(ctx):
    from ..topology import local_priority_matrix
    path = ctx.env.get("MC_CUSTOM_TOPO_JSON")
    if not path:
        yield skip("MTE104", "MC_CUSTOM_TOPO_JSON not set: the matrix is discovered")
        return
    try:
        local_priority_matrix(ctx.topology, env=ctx.env)
    except (ConfigError, DeviceNotFoundError) as e:
        yield error("MTE104", f"MC_CUSTOM_TOPO_JSON={path}: {e}",
                    "write the file as {\"cpu:0\": [[\"mlx5_0\"], [\"mlx5_1\"]], ...} naming "
                    "devices from `mooncake-te topology`, or unset the variable")


# ---- MTE2xx: devices and topology -------------------------------------------------

def _port_states(dev) -> str:
    if not dev.ports:
        return "no ports"
    return ", ".join(f"port {p.number} {p.state}" + ("" if p.gids else " (no GID)")
                     for p in dev.ports)


@check("rdma_devices", "configured RDMA devices exist and have an ACTIVE port with a GID",
       ("MTE201", "MTE200", "MTE202", "MTE203"))
def check_rdma_devices(ctx):
    cfg, topo = ctx.config, ctx.topology
    te = cfg["transfer_engine"]
    names = list(te["device_names"])
    protocol = te["protocol"]
    found = topo.nic_names
    source = ("MC_TE_FILTERS" if "MC_TE_FILTERS" in cfg.env_applied
              else "[transfer_engine] device_names")
    if protocol in ("tcp", "shm"):
        yield skip("MTE201", f"protocol = {protocol!r}: RDMA devices are not used")
        return
    if not names:
        usable = [d.name for d in topo.nics if d.usable]
        if protocol == "rdma" and not usable:
            detail = ("no RDMA device at all (/sys/class/infiniband is empty)" if not found
                      else "none usable: " + "; ".join(f"{d.name}: {_port_states(d)}"
                                                       for d in topo.nics))
            yield error("MTE200", f"protocol = \"rdma\" but {detail}",
                        "load the NIC driver (mlx5_ib) or set up Soft-RoCE (rdma link add "
                        "rxe0 type rxe netdev eth0) and bring a port up; or set protocol = "
                        "\"tcp\" (or \"auto\")", devices=found)
        elif not usable and protocol == "auto":
            yield ok("MTE200", "no usable RDMA device; protocol \"auto\" will use TCP")
        return
    for name in names:
        if name not in found:
            close = difflib.get_close_matches(name, found, n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            yield error("MTE201",
                        f"{source} names {name!r}, but there is no such RDMA device{hint} "
                        f"found: {', '.join(found) or 'none'} (Mooncake reports this as "
                        f"\"no available device\")",
                        (f"replace {name!r} with {close[0]!r}" if close else
                         "use names from `ibv_devices` or `mooncake-te topology`")
                        + (f" in {source}" if close else ""),
                        device=name, found=found, suggestion=close[0] if close else None)
            continue
        dev = topo.nic(name)
        if not dev.active_ports:
            yield error("MTE202", f"RDMA device {name!r} has no ACTIVE port "
                                  f"({_port_states(dev)})",
                        "check the cable/switch port and the subnet manager (InfiniBand: "
                        "opensm) or the netdev link (RoCE: ip link set <netdev> up); "
                        "`ibv_devinfo` shows the state", device=name)
        elif not dev.usable:
            yield error("MTE203", f"RDMA device {name!r} has an ACTIVE port but an empty GID "
                                  f"table, so it cannot be addressed ({_port_states(dev)})",
                        "give its netdev an IP address (RoCE GIDs come from the netdev's "
                        "addresses) and check `show_gids`", device=name)


def _effective_nics(ctx):
    """The NICs the engine would use: the allow-list (existing, usable) or all usable."""
    te = ctx.config["transfer_engine"]
    names = [n for n in te["device_names"] if n in ctx.topology.nic_names]
    if te["device_names"] and not names:
        return []
    return [d for d in ctx.topology.nics if d.usable and (not te["device_names"] or d.name in names)]


@check("gpu_nic_affinity", "each GPU's preferred NIC is on its NUMA node and PCIe switch",
       ("MTE205", "MTE204"))
def check_gpu_nic_affinity(ctx):
    from ..topology import Link, build_priority_matrix, load_priority_matrix
    te = ctx.config["transfer_engine"]
    topo = ctx.topology
    if not (te["use_gpu_direct"] or te["topology_aware"]):
        yield skip("MTE205", "use_gpu_direct and topology_aware are both off")
        return
    if te["protocol"] in ("tcp", "shm"):
        yield skip("MTE205", f"protocol = {te['protocol']!r}: no RDMA NIC carries GPU data")
        return
    if not topo.gpus:
        yield skip("MTE205", "no GPU found")
        return
    nics = _effective_nics(ctx)
    if not nics:
        yield skip("MTE205", "no usable RDMA device to pair GPUs with")
        return
    custom = ctx.env.get("MC_CUSTOM_TOPO_JSON")
    try:
        matrix = (load_priority_matrix(custom) if custom
                  else build_priority_matrix(topo, [n.name for n in nics]))
    except (ConfigError, DeviceNotFoundError):
        return                              # reported by MTE104
    source = f"MC_CUSTOM_TOPO_JSON ({custom})" if custom else "the discovered matrix"
    by_name = {d.name: d for d in topo.nics}
    for gpu in topo.gpus:
        entry = matrix.get(gpu.location)
        if not entry:
            continue
        chosen = [by_name[n] for n in (entry[0] or entry[1]) if n in by_name]
        if not chosen:
            continue
        # The best NIC this machine offers this GPU, among all usable ones: what to suggest.
        candidates = [d for d in topo.nics if d.usable]
        best = min(candidates, key=lambda d: (topo.link(gpu, d), d.name))
        best_link = topo.link(gpu, best)[0]
        for nic in chosen:
            link = topo.link(gpu, nic)[0]
            gnode, nnode = topo.numa_of(gpu), topo.numa_of(nic)
            if link == Link.SYS:
                where = (f"NUMA node {nnode}" if nnode >= 0 else "an unknown NUMA node")
                yield warning(
                    "MTE204",
                    f"{gpu.location} ({gpu.pci}, NUMA node {gnode}) prefers {nic.name} on "
                    f"{where} in {source}: every byte crosses the inter-socket link (SYS), "
                    f"so GPUDirect RDMA gains little and TTFT will not improve",
                    _affinity_fix(gpu, best, best_link, custom, te),
                    gpu=gpu.location, nic=nic.name, link=str(link), suggestion=best.name)
            elif link > Link.PIX:
                hw = ("" if best_link <= Link.PIX else
                      " No NIC on this machine shares a PCIe switch with it, so this is "
                      "the board's layout.")
                yield warning(
                    "MTE205",
                    f"{gpu.location} ({gpu.pci}) prefers {nic.name} ({nic.pci or 'virtual'}) "
                    f"in {source}, which is not under the same PCIe switch ({link}): "
                    f"GPUDirect traffic goes through {_through(link)}.{hw}",
                    _affinity_fix(gpu, best, best_link, custom, te),
                    gpu=gpu.location, nic=nic.name, link=str(link), suggestion=best.name)


def _through(link) -> str:
    return {"PXB": "several PCIe switches", "PHB": "the CPU's root complex",
            "NODE": "the CPU between PCIe host bridges"}.get(str(link), str(link))


def _affinity_fix(gpu, best, best_link, custom, te) -> str:
    if best_link.name not in ("PIX", "PXB") and best_link.name != "X":
        return ("move the NIC or the GPU to slots under one PCIe switch, or accept "
                "the lower GPUDirect bandwidth")
    if custom:
        return f"in {custom}, make {best.name} ({best_link}) the preferred NIC of {gpu.location}"
    if te["device_names"]:
        return (f"add {best.name} ({best_link} to {gpu.location}) to [transfer_engine] "
                f"device_names")
    return f"use {best.name} ({best_link}) for {gpu.location}"


_VERSION_RE = re.compile(r"\b(\d{3})\.(\d+)(?:\.(\d+))?\b")


@check("gpudirect", "GPUDirect RDMA registration is possible (dma-buf or nvidia-peermem)",
       ("MTE206",))
def check_gpudirect(ctx):
    te = ctx.config["transfer_engine"]
    topo = ctx.topology
    if not te["use_gpu_direct"]:
        yield skip("MTE206", "use_gpu_direct = false")
        return
    nvidia = [g for g in topo.gpus if g.kind == "cuda"]
    if not nvidia:
        yield skip("MTE206", "no NVIDIA GPU found")
        return
    if te["protocol"] in ("tcp", "shm") or not any(d.usable for d in topo.nics):
        yield skip("MTE206", "no RDMA transport in use: GPU memory is staged through host "
                             "memory")
        return
    # nvidia-peermem (R470+; nv_peer_mem is the older out-of-tree module) lets
    # ibv_reg_mr pin GPU memory directly; Mooncake uses it with WITH_NVIDIA_PEERMEM=1.
    mods = [m for m in ("nvidia_peermem", "nv_peer_mem")
            if os.path.isdir(os.path.join(ctx.sysfs_root, "module", m))]
    if mods:
        return
    # Otherwise dma-buf: ibv_reg_dmabuf_mr needs Linux 5.12+ and the NVIDIA open kernel
    # modules R515+ (NVIDIA GPUDirect RDMA docs, "Using DMA-BUF"), which is Mooncake's
    # default path (cuMemGetHandleForAddressRange + ibv_reg_dmabuf_mr).
    version_text = ctx.read_proc("driver", "nvidia", "version") or ""
    kernel = (ctx.read_proc("sys", "kernel", "osrelease") or os.uname().release).strip()
    kmatch = re.match(r"(\d+)\.(\d+)", kernel)
    kernel_ok = bool(kmatch) and (int(kmatch.group(1)), int(kmatch.group(2))) >= (5, 12)
    m = _VERSION_RE.search(version_text)
    driver = int(m.group(1)) if m else None
    open_modules = "Open Kernel Module" in version_text
    if driver is not None and open_modules and driver >= 515 and kernel_ok:
        return
    why = []
    if not version_text:
        why.append("the NVIDIA driver is not loaded (/proc/driver/nvidia/version missing)")
    else:
        if not open_modules:
            why.append(f"driver {driver or '?'} is the proprietary kernel module (dma-buf "
                       f"export needs the open kernel modules)")
        elif driver is not None and driver < 515:
            why.append(f"driver {driver} is older than R515")
    if not kernel_ok:
        why.append(f"kernel {kernel} is older than 5.12")
    yield error("MTE206",
                "GPUDirect RDMA registration of GPU memory will fail: nvidia-peermem is not "
                "loaded and dma-buf is unavailable (" + "; ".join(why or ["unknown"]) + ")",
                "modprobe nvidia-peermem (and set WITH_NVIDIA_PEERMEM=1 for Mooncake), or "
                "install the NVIDIA open kernel modules R515+ on Linux 5.12+; or set "
                "use_gpu_direct = false to stage through host memory",
                driver=driver, open_modules=open_modules, kernel=kernel)


# ---- MTE3xx: metadata server ------------------------------------------------------

_PROTO_WORDS = {"redis": "a redis server", "etcd": "an etcd server", "http": "an HTTP server"}


def _metadata_targets(ctx):
    cfg = ctx.config
    md = cfg["metadata"]
    label = f"--metadata {ctx.metadata}:" if ctx.metadata else "[metadata]"
    yield label, md["server_type"], md["server_address"]
    ps = cfg["p2p_store"]
    kind = (ps["metadata_server"] or "p2p").lower()
    if kind and kind not in P2P_NAMES:
        yield "[p2p_store]", kind, ps["metadata_address"]


@check("metadata", "the metadata server is reachable and speaks its server_type",
       ("MTE301", "MTE300", "MTE302", "MTE303"))
def check_metadata(ctx):
    for section, kind, address in _metadata_targets(ctx):
        kind = kind.lower()
        if kind in P2P_NAMES:
            yield skip("MTE301", f"{section} server_type = \"p2p\": no metadata server (peers "
                                 f"exchange descriptors over the handshake port)")
            continue
        if kind not in ("etcd", "redis", "http"):
            yield error("MTE300", f"{section} names metadata server type {kind!r}",
                        "use one of \"etcd\", \"redis\", \"http\", \"p2p\"")
            continue
        addr_key = "server_address" if section == "[metadata]" else "metadata_address"
        if not address.strip():
            yield error("MTE300", f"{section} server_type = {kind!r} but {addr_key} is empty",
                        f"set {section} {addr_key} = \"host:port\" (e.g. "
                        f"\"127.0.0.1:{ {'etcd': 2379, 'redis': 6379, 'http': 8080}[kind]}\")")
            continue
        given = parse_metadata_url(address)
        if given.explicit:
            scheme = given.scheme
            if scheme != kind and not (kind == "http" and scheme == "https") \
                    and not (kind == "etcd" and scheme in ("http", "https")):
                yield error("MTE300", f"{section} server_type = {kind!r} but {addr_key} = "
                                      f"{address!r} is a {scheme}:// address",
                            "make server_type and the address scheme agree")
                continue
        try:
            endpoints = parse_endpoints(kind, address)
        except ValueError as e:
            yield error("MTE300", f"{section} {addr_key} = {address!r}: {e}",
                        "write it as host:port")
            continue
        yield from _probe_endpoints(ctx, section, kind, address, endpoints)


def _probe_endpoints(ctx, section, kind, address, endpoints):
    down, wrong, good = [], [], []
    for ep in endpoints:
        r = identify(ep.host, ep.port, ctx.timeout_s, expect=kind, tls=ep.tls)
        if not r.reachable:
            down.append(r)
        elif r.kind != kind:
            wrong.append(r)
        else:
            good.append(r)
    where = f"{section} server_type = {kind!r}, server address {address!r}"
    for r in wrong:
        what = _PROTO_WORDS.get(r.kind, "something that is not redis, etcd or HTTP")
        fix = (f"set {section} server_type = \"{r.kind}\" to match the server, or point "
               f"the address at your {kind} server"
               if r.kind in _PROTO_WORDS else f"point the address at your {kind} server")
        yield error("MTE302", f"{where}: {what} answers at {r.host}:{r.port} ({r.detail}), "
                              f"not {_PROTO_WORDS[kind]}", fix,
                    endpoint=f"{r.host}:{r.port}", expected=kind, found=r.kind)
    if good and down:
        yield warning("MTE303", f"{where}: {', '.join(f'{r.host}:{r.port}' for r in good)} "
                                f"answer(s), but " + "; ".join(f"{r.host}:{r.port}: {r.detail}"
                                                               for r in down),
                      "bring the other members back or remove them from the address list",
                      down=[f"{r.host}:{r.port}" for r in down])
    elif down and not wrong:
        yield error("MTE301", f"{where}: cannot connect: "
                              + "; ".join(f"{r.host}:{r.port}: {r.detail}" for r in down),
                    _start_hint(kind, down[0]),
                    endpoints=[f"{r.host}:{r.port}" for r in down])


def _start_hint(kind, r) -> str:
    start = {"etcd": f"etcd --listen-client-urls http://0.0.0.0:{r.port} "
                     f"--advertise-client-urls http://{r.host}:{r.port}",
             "redis": f"redis-server --port {r.port}",
             "http": f"mooncake-te metadata-server --port {r.port}"}[kind]
    return (f"start the server ({start}) or correct the address; from this host, check it "
            f"with `nc -vz {r.host} {r.port}`")


# ---- MTE4xx: local resources ------------------------------------------------------

def _gb(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def _dir_usage(path: str, limit: int = 100000) -> int:
    """Bytes already in ``path`` (what an existing cache occupies), walking at most
    ``limit`` entries so a huge cache cannot stall the doctor."""
    total, seen = 0, 0
    for root, dirs, files in os.walk(path):
        for f in files:
            seen += 1
            if seen > limit:
                return total
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total


@check("cache_dir", "cache_dir exists, is writable and has room for ssd_cache_gb",
       ("MTE400", "MTE401", "MTE402", "MTE404"))
def check_cache_dir(ctx):
    kv = ctx.config["kvcache"]
    path = kv["cache_dir"]
    want = float(kv["ssd_cache_gb"]) * GiB
    if not path:
        if want > 0:
            yield error("MTE400", f"[kvcache] ssd_cache_gb = {kv['ssd_cache_gb']} but cache_dir "
                                  f"is not set", "set [kvcache] cache_dir to a folder on an SSD")
        else:
            yield skip("MTE400", "[kvcache] cache_dir not set (no SSD cache)")
        return
    from ..kvcache.cache_dir import mount_of, problem
    why = problem(path, create=False)       # what the cache itself would say
    if why:
        code, message, fix = why
        yield error(code, message, fix, path=path)
        return
    if not os.path.exists(path):
        # The cache creates it at start (its parent exists): say on which file system, so
        # a cache_dir meant for an SSD that landed on "/" shows here.
        parent = os.path.dirname(os.path.abspath(path))
        mnt, fstype = mount_of(parent)
        yield ok("MTE400", f"[kvcache] cache_dir {path!r} does not exist yet; the cache "
                           f"creates it in {parent!r} (file system {fstype or '?'} mounted at "
                           f"{mnt or '?'}) when it starts", path=path, mount=mnt)
        path = parent
    else:
        # Whoever can write the directory can plant records the cache serves as KV: the
        # engine refuses one of another uid or writable by everyone (kvcache/ssd.py).
        st = os.stat(path)
        if st.st_uid != os.geteuid() or st.st_mode & 0o002:
            owner = (f"belongs to uid {st.st_uid}" if st.st_uid != os.geteuid()
                     else f"is writable by every user (mode {st.st_mode & 0o7777:o})")
            yield error("MTE404", f"[kvcache] cache_dir {path!r} {owner}; the engine (uid "
                                  f"{os.geteuid()}) refuses it, since another user could "
                                  f"plant blocks it would serve as KV",
                        f"use a directory the engine's user created (mkdir -m 700), or chown "
                        f"{os.geteuid()} {path} and chmod o-w {path}", path=path)
            return
    if want > 0:
        vfs = os.statvfs(path)
        free = vfs.f_bavail * vfs.f_frsize
        have = free + _dir_usage(path)
        if have < want:
            yield error("MTE402", f"[kvcache] ssd_cache_gb = {kv['ssd_cache_gb']} needs "
                                  f"{_gb(want)} but {path!r} has {_gb(free)} free "
                                  f"({_gb(have)} counting what the cache already holds)",
                        f"lower ssd_cache_gb to at most {int(have / GiB)} or free space",
                        path=path, free_bytes=free, needed_bytes=int(want))


@check("kv_sharing", "KV pool sharing between instances is authenticated (auth_token)",
       ("MTE405", "MTE406"))
def check_kv_sharing(ctx):
    stores = [(sec, kind) for sec, kind, _ in _metadata_targets(ctx)
              if kind.lower() in ("etcd", "redis", "http")]
    if not stores:
        yield skip("MTE405", "no metadata store: KV pools are not shared between instances")
        return
    cfg = ctx.config
    if cfg["transfer_engine"]["auth_token"]:
        yield ok("MTE405", "auth_token is set: owner-index records are MAC'd and blocks are "
                           "read only from engines that proved the token")
    elif cfg["kvcache"]["share_without_token"]:
        yield warning("MTE406", "[kvcache] share_without_token = true: KV pool blocks are "
                                "shared with no authentication (any process that can write "
                                "the metadata store can make a cache serve forged KV)",
                      "set the same auth_token on every engine (MC_AUTH_TOKEN), then drop "
                      "share_without_token")
    else:
        yield warning("MTE405", "no auth_token: KV pools do not share blocks between "
                                "instances (nothing could authenticate an index record or a "
                                "block), and vLLM P/D KV is never saved into the pool",
                      "set the same auth_token on every engine (MC_AUTH_TOKEN); on a network "
                      "where everything that can reach the metadata store is trusted, "
                      "[kvcache] share_without_token = true shares without one")


@check("memlock", "the locked-memory limit (ulimit -l) covers dram_cache_gb",
       ("MTE403",))
def check_memlock(ctx):
    gb = float(ctx.config["kvcache"]["dram_cache_gb"])
    if gb <= 0:
        yield skip("MTE403", "[kvcache] dram_cache_gb = 0: no DRAM cache to pin")
        return
    limit, cap = ctx.memlock
    need = int(gb * GiB)
    if cap:
        return          # CAP_IPC_LOCK: RLIMIT_MEMLOCK does not apply (mm/mlock.c)
    if limit == resource.RLIM_INFINITY or limit >= need:
        return
    yield error("MTE403", f"[kvcache] dram_cache_gb = {gb:g} must be pinned for RDMA, but the "
                          f"locked-memory limit is {limit // 1024} KiB (ulimit -l): "
                          f"registration fails with ENOMEM/EPERM",
                "raise it: `ulimit -l unlimited` in the launching shell, `memlock "
                "unlimited` in /etc/security/limits.conf, LimitMEMLOCK=infinity in the "
                "systemd unit, or `--ulimit memlock=-1` for docker",
                limit_bytes=limit, needed_bytes=need)


# ---- MTE5xx: vLLM ----------------------------------------------------------------


def _load_vllm(ctx):
    try:
        return ctx.vllm, None
    except ConfigError as e:
        return None, e


@check("vllm_config", "the vLLM config parses and its keys are known",
       ("MTE503", "MTE500"))
def check_vllm_config(ctx):
    if not ctx.vllm_config_path:
        yield skip("MTE503", "no --vllm-config given")
        return
    v, e = _load_vllm(ctx)
    if e is not None:
        yield error("MTE500", str(e), "fix the file: JSON or YAML with vLLM engine arguments "
                                      "or a kv_transfer_config")
        return
    for where, key, suggestion in v.unknown:
        yield warning("MTE503", f"{v.path}: unknown key {key!r} in {where}"
                      + (f"; did you mean {suggestion!r}?" if suggestion else ""),
                      f"rename it to {suggestion!r}" if suggestion else
                      "remove it (vLLM ignores or rejects unknown keys)",
                      key=key, suggestion=suggestion)


@check("block_size", "block_size is the same in config.toml and vLLM", ("MTE501",))
def check_block_size(ctx):
    if not ctx.vllm_config_path:
        yield skip("MTE501", "no --vllm-config given")
        return
    v, e = _load_vllm(ctx)
    if v is None:
        return
    ours = ctx.config["kvcache"]["block_size"]
    if v.block_size is None:
        # vLLM's CacheConfig.DEFAULT_BLOCK_SIZE is 16 on CUDA; some attention backends
        # (FlashMLA: 64) change it, so an unset value is a warning, not a match.
        if ours != 16:
            yield warning("MTE501", f"[kvcache] block_size = {ours} but {v.path} does not set "
                                    f"block_size; vLLM then uses its default (16 on CUDA)",
                          f"set block_size: {ours} in the vLLM config (--block-size {ours})")
        return
    if v.block_size != ours:
        yield error("MTE501", f"block_size differs: {ctx.config.source} [kvcache] block_size "
                              f"= {ours}, {v.path} {v.block_size_key} = {v.block_size}; KV "
                              f"blocks would be cut at different token boundaries on the "
                              f"two sides",
                    f"make them equal (both {v.block_size}, or both {ours})",
                    toml=ours, vllm=v.block_size)


_ROLE_FOR = {"kv_producer": "prefill", "kv_consumer": "decode"}


@check("kv_role", "kv_role matches the disaggregation role", ("MTE502", "MTE504"))
def check_kv_role(ctx):
    if not ctx.vllm_config_path:
        yield skip("MTE502", "no --vllm-config given")
        return
    v, e = _load_vllm(ctx)
    if v is None:
        return
    kv = v.kv_transfer
    if not kv:
        yield skip("MTE502", f"{v.path} has no kv_transfer_config: not a disaggregated "
                             f"instance")
        return
    role_kv = kv.get("kv_role")
    if role_kv is None:
        if kv.get("kv_connector"):
            yield error("MTE504", f"{v.path}: kv_connector = {kv['kv_connector']!r} without "
                                  f"kv_role; vLLM refuses to start",
                        "add \"kv_role\": \"kv_producer\" (prefill) or \"kv_consumer\" "
                        "(decode) or \"kv_both\"")
        return
    if role_kv not in ("kv_producer", "kv_consumer", "kv_both"):
        close = difflib.get_close_matches(str(role_kv), ["kv_producer", "kv_consumer",
                                                         "kv_both"], n=1, cutoff=0.5)
        yield error("MTE504", f"{v.path}: kv_role = {role_kv!r} is not one of kv_producer, "
                              f"kv_consumer, kv_both",
                    f"use {close[0]!r}" if close else "use kv_producer, kv_consumer or kv_both")
        return
    role = ctx.role or v.role
    source = "--role" if ctx.role else v.role_key
    if role is None:
        yield skip("MTE502", "the disaggregation role is not known: pass --role prefill|decode "
                             "(or set disaggregation_mode in the vLLM config)")
        return
    expected = _ROLE_FOR.get(role_kv)
    if expected is not None and expected != role:
        want = {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
        yield error("MTE502", f"this instance is a {role} instance ({source}) but {v.path} "
                              f"says kv_role = {role_kv!r}, the {expected} side: the "
                              f"{'prefill would wait for KV it should send' if role == 'prefill' else 'decode would try to send KV it should receive'}",
                    f"set kv_role = {want!r} (or fix the role)", role=role, kv_role=role_kv)


@check("vllm_connector", "MooncakeTEConnector's kv_transfer_config is complete and valid",
       ("MTE505", "MTE506"))
def check_vllm_connector(ctx):
    if not ctx.vllm_config_path:
        yield skip("MTE505", "no --vllm-config given")
        return
    v, _ = _load_vllm(ctx)
    if v is None:
        return
    if not v.uses_mooncake_te:
        kv = v.kv_transfer or {}
        if kv.get("kv_connector") == "MooncakeConnector":
            yield from _mooncake_builtin(v)
            return
        yield skip("MTE505", f"{v.path} does not select mooncake_te's connector")
        return
    from ..integrations.vllm.settings import parse_extra_config
    from .vllm import OUR_CLASS, OUR_MODULE
    kv = v.kv_transfer
    module = kv.get("kv_connector_module_path")
    if module != OUR_MODULE:
        yield error("MTE505", f"{v.path}: kv_connector = {kv.get('kv_connector')!r} but "
                              f"kv_connector_module_path = {module!r}; vLLM then looks the "
                              f"class up in its own registry (or the wrong module)",
                    f'set "kv_connector_module_path": "{OUR_MODULE}"')
    elif kv.get("kv_connector") not in (OUR_CLASS, "MooncakeConnector"):
        yield error("MTE505", f"{v.path}: {OUR_MODULE} has no class "
                              f"{kv.get('kv_connector')!r}; vLLM fails with AttributeError",
                    f'set "kv_connector": "{OUR_CLASS}"')
    extra = dict(v.extra_config)
    path = extra.pop("mooncake_config_path", None)
    if path is not None and not os.path.exists(v.mooncake_config_path or path):
        yield error("MTE505", f"{v.path}: kv_connector_extra_config.mooncake_config_path = "
                              f"{path!r} does not exist",
                    "point it at mooncake_te's config.toml (relative paths are taken from "
                    "the directory vllm serve runs in)")
    try:
        parse_extra_config(extra, env={})
    except ConfigError as e:
        yield error("MTE505", f"{v.path}: {e}", "fix kv_connector_extra_config; every key "
                                                "is listed in docs/vllm.md")
    if v.kv_role in ("kv_consumer", "kv_both") and \
            kv.get("kv_load_failure_policy", "fail") != "recompute":
        yield warning("MTE506", f"{v.path}: kv_load_failure_policy is "
                                f"{kv.get('kv_load_failure_policy', 'fail')!r}: a KV load "
                                f"that fails (producer died, lease ran out, incompatible "
                                f"peer) fails the request instead of recomputing it",
                      'set "kv_load_failure_policy": "recompute" in kv_transfer_config')


def _thp_mode(sysfs_root: str) -> str:
    """The bracketed word of ``kernel/mm/transparent_hugepage/enabled`` under a sysfs
    tree (``always``, ``madvise``, ``never``), or ``unavailable``."""
    try:
        with open(os.path.join(sysfs_root, "kernel", "mm", "transparent_hugepage",
                               "enabled")) as f:
            text = f.read()
    except OSError:
        return "unavailable"
    words = [w[1:-1] for w in text.split() if w.startswith("[") and w.endswith("]")]
    return words[0] if words else "unavailable"


@check("vllm_cpu_host", "a CPU vLLM host gives the KV cache huge pages and the KV "
                        "transfers CPU time", ("MTE507", "MTE508"))
def check_vllm_cpu_host(ctx):
    """vLLM on CPU keeps the KV cache in host memory and runs its forward pass on the same
    cores as the connector's copies (docs/vllm.md, "CPU hosts"). Two settings decide how
    fast a P/D load or a pool hit moves there: transparent huge pages for the KV cache
    (the connector asks for them; THP ``never`` refuses) and GNU OpenMP's spin-wait,
    which keeps an idle vLLM thread burning a core for ~300,000 spins after every
    forward pass, right when the prompt's KV is sent."""
    if not ctx.vllm_config_path:
        yield skip("MTE507", "no --vllm-config given")
        return
    v, _ = _load_vllm(ctx)
    if v is None or not v.uses_mooncake_te or not v.kv_role:
        yield skip("MTE507", "the vLLM config does not run mooncake_te's connector")
        return
    if ctx.topology.gpus:
        yield skip("MTE507", f"{len(ctx.topology.gpus)} GPU(s) here: vLLM keeps the KV cache "
                             f"in GPU memory")
        return
    mode = _thp_mode(ctx.sysfs_root)
    if mode == "never" and v.extra_config.get("hugepages", True) is not False:
        yield warning("MTE507", "transparent huge pages are off (transparent_hugepage/enabled "
                                "= never): vLLM's host KV cache stays on 4 KiB pages, and KV "
                                "copies on them ran 30% slower than on 2 MiB pages",
                      "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled (as root; "
                      "transparent_hugepage=madvise on the kernel command line to keep it)",
                      thp=mode)
    spin = ctx.env.get("GOMP_SPINCOUNT"), ctx.env.get("OMP_WAIT_POLICY")
    if spin == (None, None):
        yield warning("MTE508", "GOMP_SPINCOUNT and OMP_WAIT_POLICY are unset: vLLM's OpenMP "
                                "threads (libgomp) spin-wait ~300,000 times after each forward "
                                "pass and hold a CPU core that the KV transfer right after a "
                                "prefill needs (on a 2-core host the P/D load reached 44% of "
                                "`mooncake-te bench` this way, 78% with GOMP_SPINCOUNT=10000)",
                      "export GOMP_SPINCOUNT=10000 in the shell or unit that starts vllm serve "
                      "(libgomp reads it once, at start)")


# What vLLM's built-in MooncakeConnector reads from kv_connector_extra_config (vLLM 0.32,
# v1/mooncake/mooncake_connector.py): the protocol and devices for
# TransferEngine.initialize(), its sender threads, the bootstrap address; nothing else.
BUILTIN_MOONCAKE_KEYS = ("mooncake_protocol", "device_name", "num_workers",
                         "bootstrap_server_address")


def _mooncake_builtin(v):
    """``"kv_connector": "MooncakeConnector"`` without a module path: vLLM's own, which
    imports ``mooncake.engine``. Two ways onto mooncake_te: the drop-in (``mooncake-te
    compat install``: the settings stay as they are, but vLLM's connector reads only a few
    keys) or our connector (the module path: every key is read)."""
    from ..compat.shim import status
    from .vllm import OUR_CLASS, OUR_MODULE
    extra = dict(v.extra_config)
    ignored = sorted(k for k in extra if k not in BUILTIN_MOONCAKE_KEYS)
    lost = (f"; {', '.join(ignored)} in kv_connector_extra_config "
            f"{'is' if len(ignored) == 1 else 'are'} ignored that way") if ignored else ""
    drop_in = (f"(a) keep these settings unchanged: run `mooncake-te compat install` in "
               f"vLLM's environment, and vLLM's own MooncakeConnector runs on mooncake_te "
               f"(it reads only {', '.join(BUILTIN_MOONCAKE_KEYS)}{lost})")
    ours = (f'add "kv_connector_module_path": "{OUR_MODULE}" to kv_transfer_config '
            f'("MooncakeConnector" may stay; "{OUR_CLASS}" is the same class): '
            f'mooncake_te\'s connector reads every key of kv_connector_extra_config'
            + (f", {', '.join(ignored)} included" if ignored else ""))
    what = (f"{v.path}: kv_connector = 'MooncakeConnector' with no "
            f"kv_connector_module_path: vLLM loads its built-in MooncakeConnector, which "
            f"imports `mooncake.engine`")
    have = status()
    if have["kind"] == "shim":
        what += f" (mooncake_te's drop-in at {have['path']}, so it runs on mooncake_te)"
        if ignored:
            yield warning("MTE505", what + f", but reads only "
                                           f"{', '.join(BUILTIN_MOONCAKE_KEYS)}: "
                                           f"{', '.join(ignored)} here "
                                           f"{'is' if len(ignored) == 1 else 'are'} ignored",
                          f"to have them honoured, {ours}", ignored=ignored)
        else:
            yield ok("MTE505", what)
        return
    if have["kind"] == "real":
        yield warning("MTE505", what + f": Mooncake's own package "
                                       f"({have.get('distribution')} {have['version']}) is "
                                       f"installed, so this runs on Mooncake, not mooncake_te",
                      f"to run on mooncake_te, either {ours}, or {drop_in} after pip "
                      f"uninstall {have.get('distribution')}", ignored=ignored)
        return
    yield error("MTE505", what + "; no `mooncake` package is installed here, so vLLM fails at "
                                 "start with ModuleNotFoundError",
                f"either {drop_in}, or (b) {ours}", ignored=ignored)
