#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Sets up everything mooncake_te needs on a fresh Debian 12 machine (run as root, or with
# the system packages already installed): system packages, a virtual environment in
# .venv, and the package itself with its test and benchmark extras. Idempotent and quick
# when everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

# Build tools, a Python with venv and headers, and the real servers the tests start
# (redis-server, etcd-server), iperf3 for the loopback ceiling in the benchmarks, openssl
# for the doctor's HTTPS test certificate, fio for the kvcache benchmark's disk ceiling.
PKGS=(python3 python3-venv python3-dev gcc libc6-dev redis-server etcd-server iperf3 fio procps
      openssl iproute2
      # the docs' commands: etcdctl (docs/metadata.md), curl
      etcd-client curl
      # the fabric lab (docs/fabric-lab.md): a qemu guest with Soft-RoCE and NVMe-oF
      qemu-system-x86 busybox-static kmod rdma-core ibverbs-providers ibverbs-utils perftest
      # the RDMA transport is built against infiniband/verbs.h (docs/rdma.md)
      libibverbs-dev
      nvme-cli)
missing=()
for p in "${PKGS[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
    if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
        echo "setup: please install these Debian packages first: ${missing[*]}" >&2
        exit 1
    fi
    echo "setup: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # Package scripts may try to start the services; the tests start their own instances.
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip setuptools wheel
.venv/bin/python -m pip install -q -e ".[dev,docs,bench,redis,etcd,http,metrics,kvcache]"
echo "setup: ready ($(.venv/bin/python -c 'import mooncake_te; print("mooncake_te", mooncake_te.__version__)'))"
