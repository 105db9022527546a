"""How soon the survivors of a killed rank know it, with the UDP transport's ICMP evidence on
(the default) and off (UD_UDP_ICMP=0): the seconds until a call started after the kill raises
PeerTimeout on the survivors, over several trials. What ICMP handling is worth, for SECURITY.md.

    python3 scripts/dead_rank_detection.py --trials 10 --world 3 --join-timeout 10
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import numpy as np  # noqa: E402

import ud_transport  # noqa: E402
from ud_transport.lab.local_cluster import LocalCluster  # noqa: E402


def timed_allreduce(comm, count, deadline):
    tensor = np.ones(count, dtype=np.float32)
    start = time.monotonic()
    try:
        comm.allreduce(tensor, loss_budget=0.0, deadline=deadline)
        outcome = "OK"
    except ud_transport.TransportError as error:
        outcome = f"{type(error).__name__} rank={getattr(error, 'rank', None)}"
    return outcome, time.monotonic() - start


def trial(world, join_timeout, icmp):
    os.environ["UD_UDP_ICMP"] = "1" if icmp else "0"
    with LocalCluster(world, chunk_bytes=1024, join_timeout_s=join_timeout) as cluster:
        cluster.run(timed_allreduce, 4096, 2.0)
        cluster.kill(world - 1)
        return cluster.run(timed_allreduce, 4096, 2.0, ranks=list(range(world - 1)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--join-timeout", type=float, default=10.0)
    args = parser.parse_args()
    for icmp in (True, False):
        seconds, outcomes = [], set()
        for _ in range(args.trials):
            for outcome, elapsed in trial(args.world, args.join_timeout, icmp):
                outcomes.add(outcome)
                seconds.append(elapsed)
        print(f"ICMP {'on ' if icmp else 'off'}: survivors knew in median {statistics.median(seconds):.3f} s, "
              f"max {max(seconds):.3f} s over {args.trials} trials x {args.world - 1} survivors "
              f"(join timeout {args.join_timeout} s); outcomes {sorted(outcomes)}")


if __name__ == "__main__":
    main()
