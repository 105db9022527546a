"""One verdict per call under a partial partition: a verdict that reaches some ranks and never
others is passed on by a rank that holds it.

Each rank in its own network namespace on a bridge. After a first call, the deaf rank's namespace
drops every verdict datagram (AGREE, kind 4 at byte 5 of the UDP payload) that comes from the
silent ranks, and nothing else. Before relays, the other ranks held every verdict and returned OK
while the deaf rank failed with PeerTimeout at its deadline, its tensor unchanged: the outcomes
split. Now a rank acknowledges a verdict only once it has decided, so the ranks that hold every
verdict wait for the deaf one; it names the verdict it lacks in its answers, and they pass it on
(native/verdict.c). Every rank returns OK with the sum, and the deaf rank's stats count the
verdicts it took from a relay. With two silent ranks its hints walk round both."""
import numpy as np
import pytest

from conftest import skip_or_fail


def _one_call(comm):
    tensor = np.full(1000, float(comm.rank), np.float32)
    try:
        stats = comm.allreduce(tensor, loss_budget=0.1, deadline=2.0)
        return "ok", float(tensor[0]), stats.verdicts_relayed
    except Exception as error:  # noqa: BLE001  (the outcome is what is compared)
        return type(error).__name__, None, None


@pytest.mark.parametrize("world, silent", [(3, (1,)), (4, (1, 3))])
def test_ranks_agree_when_some_peers_verdicts_to_one_rank_are_all_dropped(world, silent):
    from ud_transport.lab.hosts import RankNetwork, unavailable_reason
    from ud_transport.lab.local_cluster import LocalCluster, free_tcp_port

    reason = unavailable_reason()
    if reason:
        skip_or_fail(f"network namespaces: {reason}")
    deaf = 2
    total = float(sum(range(world)))
    port = free_tcp_port()
    with RankNetwork(world, store_port=port, hosts="veth", switch=True) as network:
        hosts = network.hosts
        sources = ", ".join(hosts.addresses[rank] for rank in silent)
        rules = ("table inet verdict_split {\n  chain input {\n    type filter hook input priority 0; policy accept;\n"
                 f"    ip saddr {{ {sources} }} udp length > 13 @th,104,8 4 counter drop\n  }}\n}}\n")
        with LocalCluster(world, store_port=port, **network.cluster_arguments) as cluster:
            control = cluster.run(_one_call)
            if [outcome[:2] for outcome in control] != [("ok", total)] * world:  # nothing dropped yet
                pytest.fail(f"the control call failed before any verdict was dropped: {control}")
            hosts.run(deaf, ["nft", "-f", "-"], input=rules, text=True, check=True)
            outcomes = cluster.run(_one_call, timeout_s=120)
            dropped = hosts.run(deaf, ["nft", "list", "table", "inet", "verdict_split"], capture_output=True,
                                text=True, check=True).stdout
    assert [outcome[:2] for outcome in outcomes] == [("ok", total)] * world, f"the ranks' outcomes: {outcomes}"
    assert "packets 0 " not in dropped, f"the rule dropped nothing, so nothing was tested:\n{dropped}"
    relayed = [outcome[2] for outcome in outcomes]
    # (another rank may take a relay too, where its own copy comes later than a relayed one)
    assert relayed[deaf] == len(silent), f"verdicts taken from a relay, by rank: {relayed}"
