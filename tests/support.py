"""Test support shared by the loss tests: fixed inputs, the z-score, and the
delivered-fraction model of each schedule (closed forms, checked against a
Monte Carlo of the same model in test_loss_models.py); the environment a child
Python needs to import what this one did.

Importable wherever tests/ is on sys.path: pytest puts it there for every file under tests/
(LocalCluster's ranks inherit it, and so does the guest's pytest run, which sees this checkout
at the same path); a child Python started by a test gets it through child_pythonpath()."""
import os

import numpy as np

WORLD = 4
COUNT = 240
CHUNK_BYTES = 32  # 4 float64 per datagram: 60 datagrams per block


def z_score(samples):
    samples = np.asarray(samples)
    standard_error = samples.std(ddof=1) / np.sqrt(len(samples))
    return samples.mean() / standard_error if standard_error > 0 else np.inf * np.sign(samples.mean())


def fixed_inputs(world=WORLD, count=COUNT):
    element = np.arange(count)
    return [((rank + 1) * (1.0 + element % 5) + 3 * rank).astype(np.float64) for rank in range(world)]


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
