#!/usr/bin/env bash
# Issue 8's wire cases, once per stripe count, on a lent many-core machine (the `device` tool's
# run): it has Python, a compiler and torch (hence Gloo), but neither iproute2 nor nftables, and
# no network to fetch them. So the Debian packages travel with the working tree.
#
#   here:   bash scripts/device_wire_targets.sh --download        # apt-get download into .netdebs/ (ignored)
#   test:   NETDEBS_ROOT=/tmp/netdebs PATH=... bash scripts/device_wire_targets.sh --tools
#   there:  bash scripts/device_wire_targets.sh --run [wire_targets.py arguments]
#           bash scripts/device_wire_targets.sh --ddp [ddp_step_time.py arguments]   # DDP steps, loopback
#           run(command="bash scripts/device_wire_targets.sh --run", carry=[".netdebs"], timeout_s=600)
#
# --run unpacks the packages into $NETDEBS_ROOT (default /opt/netdebs) unless `ip` and `nft` are
# already there, puts wrappers that find their libraries first on PATH, builds the extension
# without verbs, prints what `info` says stripes="auto" gives there, and runs
# scripts/wire_targets.py (default: loopback,veth1500,bridge4,bridge8 at 100 iterations in one
# round, UD_STRIPES 1 and auto taking turns within the round: about 6 minutes on 16 cores, where
# loopback, veth1500 and bridge4 at stripes 1,2,4 did not fit 320 s), the log also in
# $OUT/wire_targets.log when $OUT is set.
set -euo pipefail
SCRIPT=$(realpath "$0")
cd "$(dirname "$SCRIPT")/.."

# ip, nft and what they link that a Python image may lack; the base libraries (libc, libselinux,
# libtinfo, ...) are taken from the machine. Only ip and nft (and what `ip netns exec` starts) see
# these libraries: the ranks enter their namespaces with setns, not through ip.
PACKAGES=(nftables libnftables1 libnftnl11 libmnl0 libjansson4 libxtables12 libgmp10 libedit2 libbsd0 libmd0
          iproute2 libbpf1 libelf1 libcap2 libdb5.3 libtirpc3)
ROOT=${NETDEBS_ROOT:-/opt/netdebs}

download() {
    mkdir -p .netdebs
    (cd .netdebs && apt-get download "${PACKAGES[@]}")
    ls .netdebs
}

# The wrappers live in their own directory: iproute2's `ip` is $ROOT/bin/ip, and a wrapper of the
# same name beside it would find itself on PATH and exec itself forever.
install_tools() {
    if command -v ip >/dev/null && command -v nft >/dev/null; then
        return
    fi
    ls .netdebs/*.deb >/dev/null 2>&1 || { echo "no .netdebs/*.deb: run --download here and carry .netdebs" >&2; exit 2; }
    mkdir -p "$ROOT/wrap"
    for deb in .netdebs/*.deb; do
        dpkg -x "$deb" "$ROOT"
    done
    local libraries="$ROOT/usr/lib/x86_64-linux-gnu:$ROOT/lib/x86_64-linux-gnu"
    for tool in ip nft; do
        local binary
        binary=$(find "$ROOT" -path "$ROOT/wrap" -prune -o -type f -name "$tool" -perm -u+x -print | head -n 1)
        [ -n "$binary" ] || { echo "$tool is in none of the packages" >&2; exit 2; }
        printf '#!/bin/sh\nLD_LIBRARY_PATH=%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec %s "$@"\n' \
            "$libraries" "$binary" >"$ROOT/wrap/$tool"
        chmod +x "$ROOT/wrap/$tool"
    done
}

tools() {
    install_tools
    export PATH="$ROOT/wrap:$PATH"
    timeout 5 ip -V
    timeout 5 nft --version
    local probe="udt-probe-$$"
    ip netns add "$probe"
    trap "ip netns del $probe 2>/dev/null || true" EXIT
    ip -n "$probe" link add probe0 type veth peer name probe1
    ip -n "$probe" link add probebr type bridge
    echo "netns, veth and bridge work"
    ip netns del "$probe"
    trap - EXIT
}

build() {
    echo "$(nproc) cores, kernel $(uname -r), $(python3 -V)"
    python3 -c "import torch, torch.distributed as d; print('torch', torch.__version__, 'gloo', d.is_gloo_available())"
    UD_BUILD_VERBS=0 python3 setup.py -q build_ext --inplace -j "$(nproc)" >/dev/null
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
}

run() {
    tools
    build
    local arguments=("$@")
    if [ ${#arguments[@]} -eq 0 ]; then
        arguments=(--only loopback,veth1500,bridge4,bridge8 --iterations 100 --rounds 1 --stripes 1,auto)
    fi
    for ranks in 2 4 8; do
        LOCAL_WORLD_SIZE=$ranks python3 -m ud_transport info | grep -A1 "(stripes / UD_STRIPES)" | tail -n 1
    done
    local log=${OUT:+$OUT/wire_targets.log}
    python3 scripts/wire_targets.py "${arguments[@]}" 2>&1 | tee ${log:+"$log"}
}

# DDP steps on loopback (no iproute2 or nftables needed): Gloo against "ud" at 1 stripe and at
# "auto", with the model's torch threads on the same cores (CPUs / ranks each), 2 and 4 ranks.
ddp() {
    build
    local log=${OUT:+$OUT/ddp_step_time.log}
    {
        if [ $# -gt 0 ]; then
            python3 scripts/ddp_step_time.py "$@"
        else
            for ranks in 2 4; do
                python3 scripts/ddp_step_time.py --ranks "$ranks" --stripes 1,auto --steps 100
            done
        fi
    } 2>&1 | tee ${log:+"$log"}
}

case "${1:-}" in
    --download) download ;;
    --tools) tools ;;
    --run) shift; run "$@" ;;
    --ddp) shift; ddp "$@" ;;
    *) sed -n '2,18p' "$SCRIPT"; exit 2 ;;
esac
