"""Every environment variable ud_transport reads, in one table: its name, what it sets, its
default and what it means. Options and the c10d backend take their variables from here,
the rest of the library reads through `read`; the "Environment variables" table in
docs/configuration.md is this one (tests/test_environment.py checks that, and that no other
UD_* name is read).
Keyword arguments win over the environment wherever both exist."""
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Variable:
    name: str
    sets: tuple  # ("option", field) of Options, ("backend", field) of BackendOptions; () = read where it is used
    default: str  # as text, for the table
    meaning: str


VARIABLES = (
    Variable("UD_CHUNK_BYTES", (("option", "chunk_bytes"),), "0", "payload bytes per datagram; 0 = the largest the path MTU allows"),
    Variable("UD_WINDOW_BYTES", (("option", "window_bytes"),), "0",
             "data all senders together may have in flight to one rank; 0 = 192 datagrams on UDP, 16 MiB on verbs"),
    Variable("UD_SOCKET_BUFFER_BYTES", (("option", "socket_buffer_bytes"),), "67108864", "UDP send and receive buffer asked of the kernel"),
    Variable("UD_BIND_ADDRESS", (("option", "bind_address"),), "", "local IPv4 address to bind; empty = the one that reaches MASTER_ADDR"),
    Variable("UD_DEADLINE_CAP", (("option", "deadline_cap_s"),), "30.0", "seconds: the adaptive default deadline never exceeds this"),
    Variable("UD_LOSS_BUDGET", (("option", "default_loss_budget"), ("backend", "loss_budget")), "0.1",
             "the most of a lossy call's result that may be missing"),
    Variable("UD_JOIN_TIMEOUT", (("option", "join_timeout_s"),), "300.0", "seconds a call waits for every rank to join it"),
    Variable("UD_STORE_TIMEOUT", (("option", "store_timeout_s"),), "60.0", "seconds within which every rendezvous failure is raised"),
    Variable("UD_ALGORITHM", (("option", "algorithm"),), "auto", "ring, direct or auto (by world size)"),
    Variable("UD_COPIES", (("option", "copies"),), "1", "times each data datagram is sent (1-4): lost only if every copy is"),
    Variable("UD_STRIPES", (("option", "stripes"),), "auto",
             "UDP: sockets and threads per rank a large allreduce or broadcast is split over; auto = each rank's share of its machine's cores, 1 to 4"),
    Variable("UD_IN_PLACE_MIN_BYTES", (("option", "in_place_min_bytes"),), "-1",
             "an allreduce at least this large sums in the caller's tensor; -1 = this rank's share of the CPU's largest cache (at most 32 MiB per CPU sharing it, split among the ranks on the machine), 0 = every one"),
    Variable("UD_BUSY_POLL_US", (("option", "busy_poll_us"),), "-1",
             "microseconds an engine spins (yielding its core) for the next datagram before sleeping; -1 = 50 where each rank on the machine has a core of its own for each of its stripes, else 0"),
    Variable("UD_TRANSPORT", (("backend", "transport"),), "auto",
             "udp, verbs or auto (verbs when an RDMA port is active); overrides the transport argument"),
    Variable("UD_ON_BUDGET_MISS", (("backend", "on_budget_miss"),), "use", "c10d backend: use, skip or raise when a call misses its budget"),
    Variable("UD_LOSSY_COLLECTIVES", (("backend", "lossy"),), "allreduce,reduce_scatter",
             "c10d backend: which collectives may lose data (empty = all exact)"),
    Variable("UD_DEVICE", (), "", "verbs: the RDMA device (e.g. mlx5_0); empty = chosen"),
    Variable("UD_PORT", (), "0", "verbs: the device port, 1-based; 0 = chosen"),
    Variable("UD_GID_INDEX", (), "-1", "verbs: the source GID index (RoCE: the RoCEv2 GID); -1 = chosen"),
    Variable("UD_INJECT", (), "", "inject loss at every rank: bernoulli:P or gilbert_elliott:G2B,B2G,LG,LB"),
    Variable("UD_INJECT_SEED", (), "0", "seed of the injected loss (each rank derives its own)"),
    Variable("UD_LOG", (), "", "debug, info, warning or error: log to stderr at that level; empty = silent"),
    Variable("UD_UDP_GSO", (), "on", "0/off: no UDP segmentation offload on send (read by the C transport)"),
    Variable("UD_UDP_GRO", (), "on", "0/off: no UDP receive offload (read by the C transport)"),
    Variable("UD_UDP_ICMP", (), "on",
             "0/off: ignore ICMP errors, so a dead rank is known at the timeouts only (read by the C transport)"),
    Variable("UD_BUILD_VERBS", (), "", "build time: 0 skips the RDMA extension, 1 requires it; empty = where headers exist"),
    Variable("UD_RIG_CACHE", (), "~/.cache/ud_transport/rig", "where the SoftRoCE rig keeps its kernel and guest kit"),
)

BY_NAME = {variable.name: variable for variable in VARIABLES}


def read(name, default=None, environ=os.environ):
    """The value of one of VARIABLES, or `default` when unset (an unlisted name is a bug)."""
    if name not in BY_NAME:
        raise KeyError(f"{name} is not in ud_transport.environment.VARIABLES")
    return environ.get(name, default)


def fields_of(target):
    """{field: variable name} for the variables that set fields of `target` ("option", "backend")."""
    return {field: variable.name for variable in VARIABLES for kind, field in variable.sets if kind == target}


def markdown_table():
    """The table in docs/configuration.md, "Environment variables"."""
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    rows += [f"| `{v.name}` | {f'`{v.default}`' if v.default else '(unset)'} | {v.meaning} |" for v in VARIABLES]
    return "\n".join(rows)
