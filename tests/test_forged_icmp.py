"""ICMP is a hint, never a verdict (issue 38). Forged ICMP errors, sent from a raw socket to rank
0's UDP socket on loopback and quoting a datagram from rank 0 to rank 2, must not split the
ranks' verdicts, fail a call, raise a socket errno, or blame a live rank. Before the fix one
forged port unreachable made rank 0 mark rank 2 gone for good: every later call failed or, with a
budget of 1, returned OK with different values on different ranks; code 8 (host isolated) made
rank 0's call raise "sendmmsg failed: ENONET" while its peers waited out the join timeout.

Needs root (a raw socket); CI runs as root, elsewhere the tests skip."""
import random
import subprocess

import icmp_forge
import icmp_tasks
import pytest
from conftest import skip_or_fail

import ud_transport
from ud_transport.lab.local_cluster import LocalCluster

WORLD, VICTIM, ABSENTEE = 3, 0, 2
COUNT = 5000  # float32 / int32 elements: many datagrams at chunk_bytes 1024


@pytest.fixture(scope="module", autouse=True)
def forget_forged_path_mtus():
    """A forged "fragmentation needed" lowers the kernel's path MTU to loopback for ten minutes
    (net.ipv4.route.mtu_expires): flush it after these tests, so nothing outlives them."""
    yield
    subprocess.run(["ip", "route", "flush", "cache"], check=False)


@pytest.fixture(scope="module")
def cluster():
    if not icmp_forge.raw_socket_available():
        skip_or_fail("forging ICMP needs a raw socket (root)")
    # join timeout 30 s: a rank left waiting on a peer that moved on shows as a call that takes it
    with LocalCluster(WORLD, chunk_bytes=1024, join_timeout_s=30.0) as cluster:
        yield cluster


def _forger(cluster, session_id):
    identities = cluster.run(icmp_tasks.identity)
    victim, peer = (icmp_forge.endpoint(identities[rank][0]) for rank in (VICTIM, ABSENTEE))
    return icmp_forge.Forger(victim, peer, session_id, VICTIM), identities[0][1]


def _agreed_ok(outcomes, what):
    statuses = {(status, blamed) for status, blamed, _ in outcomes}
    assert statuses == {("OK", None)}, f"{what}: {outcomes}"
    assert len({digest for _, _, digest in outcomes}) == 1, f"{what}: values differ across ranks: {outcomes}"


def test_forged_port_unreachable_changes_nothing(cluster):
    """One forged port unreachable (a stranger does not know the session id): the next calls,
    a lossy one with budget 0, an exact one and a lossy one with budget 1, are OK on every rank
    with the same values, and rank 0 counted the ICMP as unverified (so it did arrive)."""
    session = cluster.run(icmp_tasks.identity)[0][1]
    forger, _ = _forger(cluster, random.Random(5).getrandbits(64) ^ session or 1)
    before = cluster.run(icmp_tasks.counters)[VICTIM]
    for _ in range(3):
        forger.send(3, 3)
        per_rank = cluster.run(icmp_tasks.sequence_of_calls, COUNT, 0.0, timeout_s=120)
        for index in range(3):
            _agreed_ok([calls[index] for calls in per_rank], f"call {index} after a forged port unreachable")
    forger.close()
    after = cluster.run(icmp_tasks.counters)[VICTIM]
    assert after["icmp_unverified"] - before["icmp_unverified"] == 3, (before, after)


def test_every_forged_icmp_error_is_loss_at_most(cluster):
    """Every ICMP error a UDP socket hears of (destination unreachable codes 0-15, time exceeded,
    parameter problem), forged, one before each call: every call OK on every rank, same values,
    no socket errno raised; rank 0 read every one of them from its error queue."""
    session = cluster.run(icmp_tasks.identity)[0][1]
    forger, _ = _forger(cluster, session ^ 0x5A5A5A5A5A5A5A5A)
    before = cluster.run(icmp_tasks.counters)[VICTIM]
    for kind, code in icmp_forge.ALL_ERRORS:
        forger.send(kind, code)
        outcomes = cluster.run(icmp_tasks.lossy_allreduce, COUNT, 0.0, timeout_s=60)
        _agreed_ok(outcomes, f"ICMP type {kind} code {code}")
    forger.close()
    after = cluster.run(icmp_tasks.counters)[VICTIM]
    # Linux hands every one of them to the socket but time exceeded code 1 (fragment reassembly).
    # At least that many: an ICMP error this test did not forge may come too (the clean-clone CI of
    # 2026-12-02, on a slow host, counted 19 of 18 with every call OK and agreed).
    delivered = [error for error in icmp_forge.ALL_ERRORS if error != (11, 1)]
    assert after["icmp_errors"] - before["icmp_errors"] >= len(delivered), (before, after)


def test_a_port_closed_for_a_moment_fails_one_call_alike_and_the_next_is_ok(cluster):
    """The same packet quoting this session, as rank 2's own kernel would send it were its port
    closed (or a NAT or firewall reset on the path): evidence rank 0 acts on. Every rank reaches
    the same verdict (PeerTimeout naming rank 2 on all three, its port seen closed), keeps its
    tensor, and the next call is OK everywhere: nothing is sticky."""
    forger, session = _forger(cluster, 0)
    forger = icmp_forge.Forger(forger.victim, forger.peer, session, VICTIM)
    forger.send(3, 3)
    outcomes = cluster.run(icmp_tasks.lossy_allreduce, COUNT, 1.0, timeout_s=60)
    forger.close()
    assert {(status, blamed) for status, blamed, _ in outcomes} == {("PeerTimeout", ABSENTEE)}, outcomes
    for rank in (0, 1):
        assert f"rank {ABSENTEE} is gone: its port is closed" in outcomes[rank][2], outcomes[rank]
    assert f"rank {ABSENTEE} (this rank)" in outcomes[ABSENTEE][2], outcomes[ABSENTEE]
    for index, outcomes in enumerate(zip(*cluster.run(icmp_tasks.sequence_of_calls, COUNT, 0.0, timeout_s=120))):
        _agreed_ok(list(outcomes), f"call {index} after the port reopened")


def _fragments_created():
    """IP fragments this host's stack has made (Ip: FragCreates in /proc/net/snmp)."""
    with open("/proc/net/snmp") as snmp:
        names, values = [line.split() for line in snmp if line.startswith("Ip:")][:2]
    return int(values[names.index("FragCreates")])


def test_a_forged_fragmentation_needed_shrinks_no_datagram():
    """A "fragmentation needed" (next-hop MTU 1400) about a datagram to the peer lowers the
    kernel's path MTU to loopback for ten minutes whoever sent it. The library sizes its datagrams
    by the interface (64 KiB here, default options), not by ICMP: a call with budget 0 after it
    delivers everything and no datagram is cut into IP fragments. Before IP_PMTUDISC_PROBE every
    larger datagram went out in 1400-byte fragments, lost whole when reassembly ran out of room: in
    CI, a later test's healthy 64 MiB allreduces on 4 ranks failed at budget 0. Only the
    packet quoting the session, as a router on the path would send it, counts as `icmp_too_big`."""
    if not icmp_forge.raw_socket_available():
        skip_or_fail("forging ICMP needs a raw socket (root)")
    with LocalCluster(2) as cluster:
        identities = cluster.run(icmp_tasks.identity)
        victim, peer = (icmp_forge.endpoint(identities[rank][0]) for rank in (0, 1))
        session = identities[0][1]
        before = cluster.run(icmp_tasks.counters)[0]
        for quoted_session in (session ^ 0x77, session):
            forger = icmp_forge.Forger(victim, peer, quoted_session, 0)
            forger.send(3, 4)
            forger.close()
        route = subprocess.run(["ip", "route", "get", victim[0]], capture_output=True, text=True).stdout
        assert "mtu 1400" in route, f"the kernel did not take the forged path MTU: {route!r}"
        fragments_before = _fragments_created()
        outcomes = cluster.run(icmp_tasks.lossy_allreduce, 4 << 20, 0.0, timeout_s=120)
        fragments = _fragments_created() - fragments_before
        _agreed_ok(outcomes, "a budget-0 allreduce of 16 MiB after a forged fragmentation needed")
        after = cluster.run(icmp_tasks.counters)[0]
    assert fragments == 0, f"{fragments} IP fragments made of our datagrams after the forged path MTU"
    assert after["icmp_too_big"] - before["icmp_too_big"] == 1, (before, after)
    assert after["send_refused"] == before["send_refused"], (before, after)


STORM_RATE = 10_000  # forged ICMP packets a second, spread over every rank
STORM_CALLS = 100    # rounds of an exact and a lossy allreduce
STORM_COUNT = 1 << 16  # elements: 256 chunks, so 1% loss stays well inside the budget of 0.1


def _storm_loop(storm):
    """The loop of icmp_tasks.loop on 4 ranks at 1% injected loss, with or without a storm of
    forged ICMP errors of every kind against every rank: (per-rank outcomes, packets sent, seconds)."""
    import multiprocessing

    world = 4
    with LocalCluster(world, chunk_bytes=1024, join_timeout_s=30.0, inject=ud_transport.Bernoulli(0.01, seed=3)) as cluster:
        identities = cluster.run(icmp_tasks.identity)
        addresses = [icmp_forge.endpoint(address) for address, _ in identities]
        targets = [(addresses[rank], addresses[(rank + 1) % world], rank) for rank in range(world)] + \
                  [(addresses[rank], addresses[(rank + 2) % world], rank) for rank in range(world)]
        context = multiprocessing.get_context("spawn")
        stop, sent = context.Event(), context.Value("q", 0)
        sender = context.Process(target=icmp_forge.storm, args=(targets, identities[0][1] ^ 0xA5A5, STORM_RATE, stop, sent))
        if storm:
            sender.start()
        try:
            results = cluster.run(icmp_tasks.loop, STORM_COUNT, STORM_CALLS, 0.1, timeout_s=600)
        finally:
            stop.set()
            if storm:
                sender.join(30)
        seconds = max(elapsed for _, elapsed in results)
        return [outcomes for outcomes, _ in results], sent.value, seconds


def test_an_icmp_storm_of_every_kind_fails_nothing_at_one_percent_loss():
    """4 ranks, 1% loss injected, 100 rounds of an exact int32 allreduce and a lossy float one
    (budget 0.1), once quiet and once under forged ICMP errors of every type and code at 10,000
    packets a second against every rank (issue 38's "done when"): no call fails under the storm
    that failed without it (none does), and every exact result agrees bit for bit across ranks."""
    if not icmp_forge.raw_socket_available():
        skip_or_fail("forging ICMP needs a raw socket (root)")
    quiet, _, quiet_seconds = _storm_loop(storm=False)
    stormy, sent, stormy_seconds = _storm_loop(storm=True)
    assert sent >= STORM_RATE * stormy_seconds * 0.5, f"the storm sent {sent} in {stormy_seconds:.1f} s"
    for label, per_rank in (("quiet", quiet), ("storm", stormy)):
        failures = [(rank, index, outcome) for rank, outcomes in enumerate(per_rank)
                    for index, outcome in enumerate(outcomes) if outcome[0] != "OK"]
        assert not failures, f"{label}: {failures[:5]}"
        for index in range(0, len(per_rank[0]), 2):  # the exact calls
            assert len({outcomes[index][2] for outcomes in per_rank}) == 1, f"{label}: exact call {index // 2} differs"
    print(f"storm: {sent} forged ICMP in {stormy_seconds:.1f} s; the loop took {quiet_seconds:.1f} s quiet")


def test_ddp_over_the_backend_trains_through_an_icmp_storm():
    """The issue's training loop: 4 ranks, DDP on a "ud" group for 30 steps, each rank forging ICMP
    errors of every type and code against its own group socket (2,500 a second a rank: 10,000 in
    all) about datagrams to each peer. Every step succeeds on every rank, the parameters are equal
    bit for bit across ranks (no loss injected: every gradient sum is whole), and every rank read
    and dropped forged port unreachable messages."""
    if not icmp_forge.raw_socket_available():
        skip_or_fail("forging ICMP needs a raw socket (root)")
    import torch
    import torch_tasks

    with LocalCluster(4, chunk_bytes=1024) as cluster:
        results = cluster.run(torch_tasks.ddp_under_icmp_storm, "ddp", 30, 2500, 0.0, timeout_s=600)
    for rank, (errors, parameters, sent, counted) in enumerate(results):
        assert not errors, f"rank {rank}: {errors[:3]}"
        assert torch.equal(parameters, results[0][1]), f"rank {rank}: parameters differ from rank 0's"
        assert sent > 0 and counted["icmp_unverified"] > 0, f"rank {rank}: {sent} sent, {counted}"
