"""Test support shared by the host tests and the SoftRoCE guest's (tests/verbs_guest), so it
needs numpy only (the guest does not import torch): the inputs every rank derives from its
rank and the exact results they give, the rank tasks both sides run, the z-score, the
delivered-fraction model of each schedule (closed forms, checked against an exact enumeration
over loss patterns and a Monte Carlo in test_loss_models.py), datagrams with a forged source
address, the environment a child Python needs to import what this one did, and scripts/*.py
loaded as modules.

Importable wherever tests/ is on sys.path: pytest puts it there for every file under tests/
(LocalCluster's ranks inherit it, and so does the guest's pytest run, which sees this checkout
at the same path); a child Python started by a test gets it through child_pythonpath()."""
import importlib.util
import itertools
import os
import socket
import struct

import numpy as np

WORLD = 4
COUNT = 240
CHUNK_BYTES = 32  # 4 float64 per datagram: 60 datagrams per block


# ---- inputs derived from the rank, and their exact results ------------------------------------

def rank_values(rank, count, dtype="float64", integer_valued=True):
    """Deterministic per-rank input (numpy dtypes; tasks.rank_values adds bfloat16).
    Integer-valued data sums exactly in every dtype."""
    base = np.arange(count, dtype=np.int64)
    values = (base * 7 + rank * 3) % 11 - 5 if integer_valued else np.sin(base + rank) * (rank + 1)
    return values.astype(dtype)


def expected_allreduce(world, count, op="sum", integer_valued=True):
    """The exact allreduce of rank_values over `world` ranks, in float64."""
    total = sum(rank_values(rank, count, "float64", integer_valued) for rank in range(world))
    total = np.asarray(total, dtype=np.float64)
    return total / world if op == "mean" else total


def rank_fill(rank):
    """The value every element of a rank's tensor holds in the fill tests."""
    return rank + 1


def rank_fill_sum(world):
    """Their exact sum over `world` ranks."""
    return sum(rank_fill(rank) for rank in range(world))


def marked_values(rank, count):
    """arange(count) + 2**rank: the rank's mark 2**rank tells which contributions an element holds."""
    return np.arange(count, dtype=np.float64) + 2.0 ** rank


def rescaled_marks(world):
    """{N / |S| * (sum of the marks of S): S} for every nonempty set S of ranks: what an element
    of the allreduce of marked_values holds beyond N * its index when the contributions of S
    reached it and were rescaled (the unbiased estimator). Raises if two sets give one value."""
    marks = {}
    for size in range(1, world + 1):
        for ranks in itertools.combinations(range(world), size):
            value = world / size * sum(2.0 ** rank for rank in ranks)
            if value in marks:
                raise ValueError(f"sets {marks[value]} and {ranks} both give {value} in a world of {world}")
            marks[value] = ranks
    return marks


def fresh_values(seed, trial, rank, count):
    """Inputs drawn anew for each trial and rank, exchangeable across ranks (as gradients are)."""
    return np.random.default_rng([seed, trial, rank]).normal(1.0, 1.0, count)


def fixed_inputs(world=WORLD, count=COUNT):
    element = np.arange(count)
    return [((rank + 1) * (1.0 + element % 5) + 3 * rank).astype(np.float64) for rank in range(world)]


def many_large(comm, count, calls):
    """Rank task: `calls` allreduces of `count` float32 filled with rank_fill, nothing lost
    allowed. Returns (delivered fraction per call, chunks lost in all, every result exact)."""
    tensor = np.full(count, rank_fill(comm.rank), dtype=np.float32)
    fractions, lost, exact = [], 0, True
    for _ in range(calls):
        tensor.fill(rank_fill(comm.rank))
        stats = comm.allreduce(tensor, loss_budget=0.0, deadline=60.0)
        fractions.append(stats.delivered_fraction)
        lost += stats.chunks_lost
        exact = exact and bool(np.all(tensor == rank_fill_sum(comm.world_size)))
    return fractions, lost, exact


# ---- statistics ---------------------------------------------------------------------------------

def in_place_at_cache_share(comm):
    """(ranks on this machine, whether a float32 allreduce of this rank's share of the cache sums in
    place, whether one of 4 bytes less does)."""
    from ud_transport import cpu_cache

    count = cpu_cache.largest_cache_bytes() // comm.ranks_on_this_machine // 4
    at_the_share = comm.allreduce(np.ones(count, dtype=np.float32), deadline=30.0).in_place
    below_it = comm.allreduce(np.ones(count - 1, dtype=np.float32), deadline=30.0).in_place
    return comm.ranks_on_this_machine, at_the_share, below_it


def standard_error(samples):
    """Standard error of the mean of `samples`."""
    samples = np.asarray(samples)
    return samples.std(ddof=1) / np.sqrt(len(samples))


def z_score(samples):
    """The mean of `samples` in units of its standard error (how far from zero it sits)."""
    samples = np.asarray(samples)
    error = standard_error(samples)
    return samples.mean() / error if error > 0 else np.inf * np.sign(samples.mean())


def relative_error_per_trial(results, truth):
    """results[rank, trial, element] against the exact truth[element]: per trial, the ranks'
    average result relative to the truth, averaged over the elements."""
    return ((np.asarray(results).mean(axis=0) - truth) / truth).mean(axis=1)


# ---- the delivered-fraction model ---------------------------------------------------------------
# Each datagram is lost independently with probability `loss`; a rank whose result misses the
# owner's estimate keeps its own partial (unbiased) or nothing (zero fill). The fraction is the
# share of all N contributions present in a rank's result, per element.

def ring_delivered_fraction(world, loss):
    """Ring: contributions present per element under i.i.d. datagram loss,
    averaged over ranks. Reduce-scatter keeps the run of hops since the last
    loss; a rank that misses the all-gather keeps its own partial."""
    q = 1.0 - loss
    total = 0.0
    for distance in range(world):  # all-gather hops from the owner to this rank
        owner_count = sum(q ** k for k in range(world))  # E[contributions at the owner]
        reached = q ** distance
        # the rank at distance d >= 1 held a partial of d hops; the owner itself never misses
        own_count = sum(q ** k for k in range(distance))
        total += reached * owner_count + (1 - reached) * own_count
    return total / (world * world)


def direct_delivered_fraction(world, loss):
    """Direct: each of the N-1 pieces of a block reaches its owner with
    probability q; the owner's result reaches each other rank with probability
    q, else that rank keeps its own input (one contribution)."""
    q = 1.0 - loss
    owner_count = 1 + (world - 1) * q
    return (owner_count + (world - 1) * (q * owner_count + (1 - q))) / (world * world)


DELIVERED_FRACTION = {"ring": ring_delivered_fraction, "direct": direct_delivered_fraction}


def _outcomes(hops, loss, lossy_hops=None):
    """Every arrived/lost pattern of `hops` (one datagram each) with its probability; only the
    hops in `lossy_hops` (all when None) lose datagrams. Impossible patterns are left out."""
    for outcome in itertools.product((True, False), repeat=len(hops)):
        weight = 1.0
        for hop, arrived in zip(hops, outcome):
            p = loss if lossy_hops is None or hop in lossy_hops else 0.0
            weight *= (1 - p) if arrived else p
        if weight:
            yield outcome, weight


def ring_enumerated(world, loss, lossy_hops=None):
    """Ring, exactly: per rank, the expected delivered fraction (unbiased and zero-fill) and
    the expected share of its chunks lost, when each datagram on a hop of `lossy_hops`
    ((sender, receiver) pairs; every hop when None) is lost with probability `loss`.
    Enumerates every outcome of the 2(N-1) hops a chunk takes (reduce-scatter from its first
    sender to its owner, then all-gather from the owner), for each of the N positions a chunk
    can start at."""
    unbiased, zero_fill, lost = [0.0] * world, [0.0] * world, [0.0] * world
    for start in range(world):
        owner = (start + world - 1) % world
        rs = [((start + k - 1) % world, (start + k) % world) for k in range(1, world)]
        ag = [((owner + k - 1) % world, (owner + k) % world) for k in range(1, world)]
        for outcome, weight in _outcomes(rs + ag, loss, lossy_hops):
            count = {start: 1}  # contributions summed at each rank in reduce-scatter
            for (source, target), arrived in zip(rs, outcome):
                count[target] = count[source] + 1 if arrived else 1
                lost[target] += 0.0 if arrived else weight
            has = {owner: True}  # did the owner's estimate reach this rank in all-gather
            for (source, target), arrived in zip(ag, outcome[world - 1:]):
                has[target] = has[source] and arrived
                lost[target] += 0.0 if has[target] else weight
            for rank in range(world):
                unbiased[rank] += weight * (count[owner] if has[rank] else count[rank]) / world / world
                zero_fill[rank] += weight * (count[owner] if has[rank] else 0) / world / world
    steps = 2 * (world - 1)
    return unbiased, zero_fill, [x / steps if steps else 0.0 for x in lost]


def direct_enumerated(world, loss):
    """Direct, exactly: per rank, the expected delivered fraction (unbiased and zero-fill) and
    the expected share of its chunks lost. For each owner, enumerates every outcome of the N-1
    pieces sent to it and the N-1 copies of its result sent back."""
    unbiased, zero_fill, lost = [0.0] * world, [0.0] * world, [0.0] * world
    for owner in range(world):
        others = [rank for rank in range(world) if rank != owner]
        hops = [(rank, owner) for rank in others] + [(owner, rank) for rank in others]
        for outcome, weight in _outcomes(hops, loss):
            pieces, results = outcome[:len(others)], dict(zip(others, outcome[len(others):]))
            owner_count = 1 + sum(pieces)
            lost[owner] += weight * pieces.count(False)
            for rank in range(world):
                reached = rank == owner or results[rank]
                lost[rank] += 0.0 if reached else weight
                unbiased[rank] += weight * (owner_count if reached else 1) / world / world
                zero_fill[rank] += weight * (owner_count if reached else 0) / world / world
    steps = 2 * (world - 1)
    return unbiased, zero_fill, [x / steps if steps else 0.0 for x in lost]


ENUMERATED = {"ring": ring_enumerated, "direct": direct_enumerated}


def simulate_delivered_fraction(algorithm, world, loss, trials, seed=0):
    """Monte Carlo of the same model, datagram by datagram (one chunk per block)."""
    rng = np.random.default_rng(seed)
    totals = []
    for _ in range(trials):
        present = 0
        for owner in range(world):
            if algorithm == "ring":
                # the chain starts just after the owner; a loss restarts it from the receiver's own input
                count = 1
                partial_at = {}
                for hop in range(1, world):
                    rank = (owner + 1 + hop) % world
                    count = count + 1 if rng.random() < 1 - loss else 1
                    partial_at[rank] = count
                partial_at[(owner + 1) % world] = 1
                owner_count = partial_at[owner]
                reached = True
                for distance in range(world):
                    rank = (owner + distance) % world
                    if distance > 0:
                        reached = reached and rng.random() < 1 - loss
                    present += owner_count if reached else partial_at[rank]
            else:
                owner_count = 1 + int((rng.random(world - 1) < 1 - loss).sum())
                present += owner_count
                arrived = rng.random(world - 1) < 1 - loss
                present += int(np.where(arrived, owner_count, 1).sum())
        totals.append(present / world ** 3)  # averaged over ranks and blocks, per N contributions
    return float(np.mean(totals)), float(np.std(totals, ddof=1) / np.sqrt(trials))


# ---- rendezvous and child processes -------------------------------------------------------------

def child_pythonpath():
    """PYTHONPATH for a child Python (`python -c` or `-m`, in a subprocess or the rig's guest):
    tests/ and the ud_transport this process imported first, so the child imports the same test
    modules and the same library as the test that starts it."""
    import ud_transport

    tests = os.path.dirname(os.path.abspath(__file__))
    library = os.path.dirname(os.path.dirname(os.path.abspath(ud_transport.__file__)))
    paths = [tests, library] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys(paths))


def child_environment():
    """This process's environment with child_pythonpath()."""
    return {**os.environ, "PYTHONPATH": child_pythonpath()}


def raw_sender():
    """A raw IPv4 socket whose packets carry the IP header we write (root only)."""
    return socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)


def spoof(raw, source, destination, payload):
    """Send `payload` as one UDP datagram from `source` to `destination` ((address, port) pairs)
    through `raw` (raw_sender()): the receiver sees the forged source address."""
    udp = struct.pack("!HHHH", source[1], destination[1], 8 + len(payload), 0) + payload
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, socket.IPPROTO_UDP, 0,
                     socket.inet_aton(source[0]), socket.inet_aton(destination[0]))
    raw.sendto(ip + udp, (destination[0], 0))


def load_script(name):
    """scripts/<name>.py as a module (a script, not a package member), for its pure functions."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
