"""Soak: many allreduces under loss on local ranks, watching each rank's resident memory and open
file descriptors, then communicators opened and closed in a loop. Exits 1 when memory grows by
SOAK_RSS_LIMIT_MIB or more after the warm-up, or when descriptors change.

    python scripts/soak.py                       # 4 ranks, 10 000 allreduces at 5% loss
    python scripts/soak.py --calls 1000 --cycles 20 --json
"""
import argparse
import json
import os
import sys
import time

import numpy as np

import ud_transport
from ud_transport.communicator import Communicator
from ud_transport.lab.local_cluster import LocalCluster

RSS_LIMIT_MIB = 10.0


def resident_mib():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def open_descriptors():
    return len(os.listdir("/proc/self/fd"))


def soak_rank(comm, calls, count, warmup, loss_budget, cycles):
    """Runs on every rank. Returns what the summary needs."""
    tensor = np.empty(count, dtype=np.float32)
    ok = misses = errors = 0
    elapsed, samples = [], []
    for call in range(warmup + calls):
        if call == warmup:
            rss_start, fds_start = resident_mib(), open_descriptors()
        if call >= warmup and (call - warmup) % max(calls // 10, 1) == 0:
            samples.append(round(resident_mib(), 2))
        tensor.fill(comm.rank + 1)
        try:
            stats = comm.allreduce(tensor, op="mean", loss_budget=loss_budget)
        except ud_transport.LossBudgetExceeded:
            misses += call >= warmup
            continue
        except ud_transport.TransportError:
            errors += call >= warmup
            continue
        if call >= warmup:
            ok += 1
            elapsed.append(stats.elapsed_s)
    rss_end, fds_end = resident_mib(), open_descriptors()
    # communicators opened and closed in a loop: each must give back its socket and buffers
    fds_before_cycles, rss_before_cycles = open_descriptors(), resident_mib()
    for cycle in range(cycles):
        with Communicator(comm.rank, comm.world_size, comm.store, "udp", comm.options, name=f"soak-cycle-{cycle}") as extra:
            small = np.full(1000, comm.rank + 1, dtype=np.float32)
            extra.allreduce(small, loss_budget=1.0)
    fds_after_cycles, rss_after_cycles = open_descriptors(), resident_mib()
    comm.close()
    return {
        "rank": comm.rank, "calls": calls, "ok": ok, "budget_misses": misses, "errors": errors,
        "rss_start_mib": round(rss_start, 2), "rss_end_mib": round(rss_end, 2), "rss_samples_mib": samples,
        "rss_growth_mib": round(rss_end - rss_start, 2), "fds_start": fds_start, "fds_end": fds_end,
        "cycles": cycles, "fds_before_cycles": fds_before_cycles, "fds_after_cycles": fds_after_cycles,
        "rss_cycles_growth_mib": round(rss_after_cycles - rss_before_cycles, 2),
        "fds_after_close": open_descriptors(),
        "p50_ms": round(float(np.percentile(elapsed, 50)) * 1e3, 3) if elapsed else None,
        "p99_ms": round(float(np.percentile(elapsed, 99)) * 1e3, 3) if elapsed else None,
    }


def verdicts(result, rss_limit_mib):
    """Why this rank fails the soak (empty: it passes)."""
    problems = []
    if result["rss_growth_mib"] >= rss_limit_mib:
        problems.append(f"resident memory grew {result['rss_growth_mib']} MiB over the calls")
    if result["rss_cycles_growth_mib"] >= rss_limit_mib:
        problems.append(f"resident memory grew {result['rss_cycles_growth_mib']} MiB over the open/close cycles")
    if result["fds_end"] != result["fds_start"]:
        problems.append(f"descriptors {result['fds_start']} -> {result['fds_end']} over the calls")
    if result["fds_after_cycles"] != result["fds_before_cycles"]:
        problems.append(f"descriptors {result['fds_before_cycles']} -> {result['fds_after_cycles']} over the cycles")
    if result["fds_after_close"] >= result["fds_end"]:
        problems.append("close() gave back no descriptor")
    if result["errors"]:
        problems.append(f"{result['errors']} calls raised an error other than a budget miss")
    return problems


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--count", type=int, default=65_536, help="float32 elements per allreduce")
    parser.add_argument("--chunk-bytes", type=int, default=8192, help="payload per datagram (8192: a jumbo-frame link)")
    parser.add_argument("--loss", type=float, default=0.05, help="i.i.d. loss injected below each rank's engine")
    parser.add_argument("--loss-budget", type=float, default=0.2)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--cycles", type=int, default=50, help="communicators opened and closed after the calls")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rss-limit-mib", type=float, default=RSS_LIMIT_MIB)
    parser.add_argument("--json", action="store_true", help="print the per-rank results as JSON")
    args = parser.parse_args(argv)
    start = time.monotonic()
    with LocalCluster(args.ranks, chunk_bytes=args.chunk_bytes,
                      inject=ud_transport.Bernoulli(args.loss, seed=args.seed)) as cluster:
        results = cluster.run(soak_rank, args.calls, args.count, args.warmup, args.loss_budget, args.cycles,
                              timeout_s=36_000)
    failed = {r["rank"]: verdicts(r, args.rss_limit_mib) for r in results}
    if args.json:
        print(json.dumps({"arguments": vars(args), "seconds": round(time.monotonic() - start, 1), "ranks": results,
                          "problems": failed}, indent=1))
    else:
        print(f"# {args.ranks} ranks, {args.calls} allreduces of {args.count} float32 in {args.chunk_bytes}-byte chunks "
              f"at {args.loss:.0%} loss "
              f"(after {args.warmup} warm-up calls), then {args.cycles} communicators opened and closed; "
              f"{time.monotonic() - start:.0f} s")
        print(f"{'rank':>4} {'ok':>6} {'misses':>6} {'errors':>6} {'rss MiB start':>13} {'growth':>7} "
              f"{'cycles growth':>13} {'fds':>9} {'fds cycles':>10} {'after close':>11} {'p50 ms':>7} {'p99 ms':>7}")
        for r in results:
            print(f"{r['rank']:>4} {r['ok']:>6} {r['budget_misses']:>6} {r['errors']:>6} {r['rss_start_mib']:>13.1f} "
                  f"{r['rss_growth_mib']:>7.2f} {r['rss_cycles_growth_mib']:>13.2f} "
                  f"{str(r['fds_start']) + '->' + str(r['fds_end']):>9} "
                  f"{str(r['fds_before_cycles']) + '->' + str(r['fds_after_cycles']):>10} {r['fds_after_close']:>11} "
                  f"{r['p50_ms']:>7} {r['p99_ms']:>7}")
        for rank, problems in failed.items():
            for problem in problems:
                print(f"rank {rank}: {problem}")
    return 1 if any(failed.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
