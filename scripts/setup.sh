#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Sets up mooncake_te on a fresh Debian 12 machine (run as root, or with the system
# packages already installed): system packages, a virtual environment in .venv, and the
# package itself. Idempotent and quick when everything is already there.
#
#   scripts/setup.sh           everything the tests use (scripts/test.sh, CI)
#   scripts/setup.sh --demo    only what the loopback benchmark uses (scripts/demo.sh)
#   scripts/setup.sh [--demo] --list   print the Debian packages that set-up needs, and stop
set -euo pipefail
cd "$(dirname "$0")/.."

demo=0 list=0
for a in "$@"; do
    case $a in
        --demo) demo=1 ;;
        --list) list=1 ;;
        *) echo "setup: unknown option $a (use --demo, --list)" >&2; exit 2 ;;
    esac
done

# The demo (a loopback benchmark): a compiler and a Python with venv and headers, to build
# the native code. Nothing else.
DEMO_PKGS=(python3 python3-venv python3-dev gcc libc6-dev)
# The tests: the real servers they start (redis-server, etcd-server), iperf3 for the
# loopback ceiling in the benchmarks, openssl for the doctor's HTTPS test certificate, fio
# for the kvcache benchmark's disk ceiling.
TEST_PKGS=(redis-server etcd-server iperf3 fio procps openssl iproute2
      # the docs' commands: etcdctl (docs/metadata.md), curl
      etcd-client curl
      # the fabric lab (docs/fabric-lab.md): a qemu guest with Soft-RoCE and NVMe-oF
      qemu-system-x86 busybox-static kmod rdma-core ibverbs-providers ibverbs-utils perftest
      # the RDMA transport is built against infiniband/verbs.h (docs/rdma.md)
      libibverbs-dev
      nvme-cli)
if ((demo)); then
    PKGS=("${DEMO_PKGS[@]}")
    EXTRAS=""
else
    PKGS=("${DEMO_PKGS[@]}" "${TEST_PKGS[@]}")
    EXTRAS="[dev,docs,bench,redis,etcd,http,metrics,kvcache]"
fi
if ((list)); then
    printf '%s\n' "${PKGS[@]}"
    exit 0
fi
echo "setup ($( ((demo)) && echo "demo" || echo "tests")): Debian packages ${PKGS[*]}"
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
echo "setup: pip install -e .$EXTRAS into .venv"
.venv/bin/python -m pip install -q -e ".$EXTRAS"
echo "setup: ready ($(.venv/bin/python -c 'import mooncake_te; print("mooncake_te", mooncake_te.__version__)'))"
