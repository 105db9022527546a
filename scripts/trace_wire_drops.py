"""Where datagrams go missing on the emulated wire when no loss is injected.

Builds hosts (ud_transport.lab.hosts: every rank in a network namespace, a bridge in a namespace of
its own), runs one allreduce at a time, and for every call that is not whole prints what each
rank missed and every drop counter that moved during the call: each interface's rx/tx drops and
errors in every namespace (`ip -s -j link`), the UDP and IP error counters (/proc/net/snmp), each
CPU's backlog drops (/proc/net/softnet_stat) and, with --port-queue, the switch ports' qdisc drops.

    python3 scripts/trace_wire_drops.py                              # 4 ranks, MTU 1500, 100 calls
    python3 scripts/trace_wire_drops.py --calls 150 --port-queue 1000 --window-mib 16
    python3 scripts/trace_wire_drops.py --algorithm ring --window-mib 16   # one sender per rank

Needs root (network namespaces).
"""
import argparse
import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ud_transport.lab.hosts import Hosts, unavailable_reason  # noqa: E402
from ud_transport.lab.local_cluster import LocalCluster, free_tcp_port  # noqa: E402


def run_in(namespace, *argv):
    return subprocess.run(["ip", "netns", "exec", namespace, *argv], check=True, capture_output=True, text=True).stdout


def drop_counters(namespaces, switch):
    counters = {}
    for namespace in namespaces:
        for link in json.loads(run_in(namespace, "ip", "-s", "-j", "link")):
            for direction in ("rx", "tx"):
                for name, value in link.get("stats64", {}).get(direction, {}).items():
                    if any(word in name for word in ("drop", "error", "over", "missed")):
                        counters[f"{namespace}:{link['ifname']}:{direction}_{name}"] = value
        lines = run_in(namespace, "cat", "/proc/net/snmp").split("\n")
        for names, values in zip(lines[::2], lines[1::2]):
            protocol = names.split(":")[0]
            if protocol in ("Ip", "Udp"):
                for name, value in zip(names.split()[1:], values.split()[1:]):
                    if any(word in name for word in ("Err", "Discard", "Drop", "Fail")):
                        counters[f"{namespace}:{protocol}:{name}"] = int(value)
    if switch:
        device = None
        for line in run_in(switch, "tc", "-s", "qdisc", "show").split("\n"):
            words = line.split()
            if words[:1] == ["qdisc"]:
                device = words[words.index("dev") + 1]
            elif "dropped" in words and device:
                counters[f"{switch}:{device}:qdisc_dropped"] = int(words[words.index("(dropped") + 1].rstrip(","))
    with open("/proc/net/softnet_stat") as stat:
        for cpu, line in enumerate(stat):
            counters[f"cpu{cpu}:backlog_dropped"] = int(line.split()[1], 16)
    return counters


def one_call(comm, count, algorithm):
    tensor = np.random.default_rng(comm.rank).standard_normal(count).astype(np.float32)
    stats = comm.allreduce(tensor, loss_budget=1.0, algorithm=algorithm)
    closed = {name: getattr(stats, name) for name in ("steps_ended", "steps_superseded", "steps_answered",
                                                      "steps_timed_out", "dropped_stale") if getattr(stats, name)}
    return stats.delivered_fraction, stats.datagrams_received, stats.chunks_lost, stats.elapsed_s, closed


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--mtu", type=int, default=1500)
    parser.add_argument("--mib", type=int, default=64, help="tensor size in MiB (float32)")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--algorithm", default="auto", choices=("auto", "ring", "direct"))
    parser.add_argument("--window-mib", type=float, default=0,
                        help="the communicators' credit window (0: the library's default, 192 datagrams)")
    parser.add_argument("--port-queue", type=int, default=0,
                        help="give each switch port a pfifo of this many packets (0: veth's default, no queue)")
    args = parser.parse_args(argv)
    reason = unavailable_reason()
    if reason:
        print(f"# trace_wire_drops: skipped: {reason}")
        return 0
    port = free_tcp_port()
    count = args.mib * (1 << 20) // 4
    with Hosts(args.world_size, mtu=args.mtu, exempt_tcp_port=port) as hosts:
        switch = hosts.switch_namespace
        if args.port_queue:
            for index in range(args.world_size):
                run_in(switch, "tc", "qdisc", "replace", "dev", f"p{index}", "root", "pfifo", "limit", str(args.port_queue))
        with LocalCluster(args.world_size, store_port=port, hosts=hosts, window_bytes=int(args.window_mib * (1 << 20))) as cluster:
            namespaces = hosts.namespaces + ([switch] if switch else [])
            broken, elapsed = 0, []
            for call in range(args.calls):
                before = drop_counters(namespaces, switch)
                per_rank = cluster.run(one_call, count, args.algorithm)
                elapsed.append(max(rank[3] for rank in per_rank))
                if all(rank[0] == 1.0 for rank in per_rank):
                    continue
                broken += 1
                after = drop_counters(namespaces, switch)
                moved = {name: after[name] - before.get(name, 0) for name in after if after[name] != before.get(name, 0)}
                missed = [f"rank {r}: {rank[2]} chunks lost, {rank[1]} datagrams received {rank[4]}"
                          for r, rank in enumerate(per_rank) if rank[2]]
                print(f"call {call}: {'; '.join(missed) or 'lost elsewhere'}; counters moved: {moved}", flush=True)
    print(f"{broken} of {args.calls} calls not whole; engine elapsed p50 {np.median(elapsed) * 1e3:.1f} ms "
          f"({args.world_size} ranks, {args.algorithm}, MTU {args.mtu}, window {f'{args.window_mib} MiB' if args.window_mib else 'default'}, "
          f"port queue {args.port_queue or 'none'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
