"""One guest's half of the two-guest test: 2 guests x 2 ranks over rxe, real netem loss.

    PYTHONPATH=tests python -m verbs_guest.two_node --store DIR/store --out DIR --trials 40

Node N (UD_RIG_NODE) runs ranks 2N and 2N+1 of a world of 4, sharing its rxe device; the two
guests rendezvous through a DirectoryStore on the 9p share both mount. Ring hops 1->2 and 3->0
cross the link (netem loss on each guest's eth0); 0->1 and 2->3 stay inside one rxe device.
Both rxe devices number their QPs from 0x11, so ranks 0/2 and 1/3 have the same QPN: senders
are told apart by QPN and GID. Each rank runs `trials` allreduces of fresh random inputs, alternating the unbiased estimator
and the zero-fill baseline, and writes per-call numbers to OUT/rank-R.json for the host test.
"""
import argparse
import json
import os
import sys
import time

import numpy as np

from support import fresh_values
from verbs_guest.ranks import run_ranks

WORLD, COUNT, SEED = 4, 4096, 20260
OPTIONS = {"chunk_bytes": 256, "window_bytes": 256 << 10, "idle_close_us": 500_000, "deadline_cap_s": 60.0}


def trials(comm, count, deadline):
    rows = []
    for trial in range(count):
        estimator = "unbiased" if trial % 2 == 0 else "zero_fill"
        values = fresh_values(SEED, trial, comm.rank, COUNT)
        truth = sum(fresh_values(SEED, trial, r, COUNT) for r in range(comm.world_size))
        start = time.monotonic()
        # the ring: the test compares against the ring's loss model with crossing hops (test_verbs_allreduce.py)
        stats = comm.allreduce(values, loss_budget=1.0, deadline=deadline, estimator=estimator, algorithm="ring")
        rows.append({"trial": trial, "estimator": estimator, "mean_error": float(np.mean(values - truth)),
                     "delivered_fraction": stats.delivered_fraction, "chunks_lost": stats.chunks_lost,
                     "chunks_total": stats.chunks_total, "elapsed_s": stats.elapsed_s, "wall_s": time.monotonic() - start,
                     "deadline_s": deadline, "deadline_expired": bool(stats.deadline_expired),
                     "steps_timed_out": stats.steps_timed_out, "datagrams_sent": stats.datagrams_sent})
    return {"rank": comm.rank, "transport": comm.transport_name, "chunk_bytes": comm.chunk_bytes, "rows": rows}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--deadline", type=float, default=20.0)
    arguments = parser.parse_args()
    node = int(os.environ.get("UD_RIG_NODE", "0"))
    ranks = [2 * node, 2 * node + 1]
    started = time.monotonic()
    results = run_ranks(ranks, WORLD, arguments.store, trials, arguments.trials, arguments.deadline,
                        timeout_s=900, transport="verbs", **OPTIONS)
    for result in results:
        with open(os.path.join(arguments.out, f"rank-{result['rank']}.json"), "w") as out:
            json.dump(result, out)
    print(f"node {node}: ranks {ranks} ran {arguments.trials} allreduces in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
