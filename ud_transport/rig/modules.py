"""Kernel module selection: which .ko files the guest needs, in load order.

Pure functions over the text of ``modules.dep`` / ``modules.builtin`` so they
can be tested without a kernel tree.
"""

from __future__ import annotations

import os

# What the guest must load by hand. There is no working modprobe inside the
# guest (the host root has no /lib/modules for the guest kernel), so anything
# the kernel would normally request on demand is listed here explicitly.
GUEST_MODULES: tuple[str, ...] = (
    # virtio transport + 9p: the host's root and the writable shares
    "virtio_ring", "virtio", "virtio_pci_legacy_dev", "virtio_pci_modern_dev",
    "virtio_pci", "netfs", "fscache", "9pnet", "9pnet_virtio", "9p",
    # a writable layer over the read-only host root
    "overlay",
    # rxe; crc32_generic is requested at runtime by rxe (ICRC), without it
    # `rdma link add` fails with ENOENT
    "crc32_generic", "ib_core", "ib_uverbs", "udp_tunnel", "ip6_udp_tunnel",
    "rdma_rxe",
    # one-guest link, loss injection, and the two-guest NIC
    "veth", "sch_netem", "failover", "net_failover", "virtio_net",
)


def module_name(path: str) -> str:
    """'kernel/net/9p/9pnet_virtio.ko.xz' -> '9pnet_virtio' (dashes become underscores)."""
    base = os.path.basename(path)
    base = base.split(".ko", 1)[0]
    return base.replace("-", "_")


def parse_modules_dep(text: str) -> dict[str, tuple[str, list[str]]]:
    """Map module name -> (relative path, [dependency names]) from modules.dep text."""
    table: dict[str, tuple[str, list[str]]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or ":" not in line:
            continue
        path, _, deps = line.partition(":")
        table[module_name(path)] = (path.strip(), [module_name(d) for d in deps.split()])
    return table


def parse_modules_builtin(text: str) -> set[str]:
    return {module_name(line.strip()) for line in text.splitlines() if line.strip()}


class MissingModule(LookupError):
    pass


def load_order(
    wanted: list[str] | tuple[str, ...],
    dep_table: dict[str, tuple[str, list[str]]],
    builtin: set[str] = frozenset(),
) -> list[str]:
    """Every module needed for ``wanted``, dependencies first (depth-first topological order).

    Built-in modules are dropped; a name that is neither loadable nor built in raises
    MissingModule. The order among independent modules follows ``wanted``.
    """
    order: list[str] = []
    state: dict[str, str] = {}  # name -> "visiting" | "done"

    def visit(name: str, chain: tuple[str, ...]) -> None:
        name = name.replace("-", "_")
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            raise ValueError("dependency cycle: " + " -> ".join(chain + (name,)))
        if name not in dep_table:
            if name in builtin:
                state[name] = "done"
                return
            raise MissingModule(f"module {name!r} is neither in modules.dep nor built in"
                                + (f" (needed by {chain[-1]})" if chain else ""))
        state[name] = "visiting"
        for dep in dep_table[name][1]:
            visit(dep, chain + (name,))
        state[name] = "done"
        order.append(name)

    for name in wanted:
        visit(name, ())
    return order
