"""stripes="auto" (ud_transport/stripe_choice.py): each rank's fair share of its machine's cores,
the least over all ranks, 1 to 4. The arithmetic on records; the cgroup quota reader on a
written tree; and real communicators that agree on the count through the rendezvous, read
their affinity mask, and run their large calls on that many stripes."""
import datetime
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch.distributed as dist

import ud_transport
from ud_transport import options as options_module, stripe_choice
from ud_transport.communicator import Communicator
from ud_transport.lab.local_cluster import free_tcp_port
from ud_transport.options import STRIPE_MIN_BYTES

SIXTEEN = list(range(16))


def agreed(*records):
    return stripe_choice.agreed_stripes(list(records))


def test_ranks_sharing_a_machine_share_its_cores():
    # the counts measured best on 16 cores (docs/performance/stripes.md): 4 at 2 and 4 ranks, 2 at 8, 1 at 16
    for ranks, expected in ((1, 4), (2, 4), (4, 4), (8, 2), (16, 1), (40, 1)):
        assert agreed(*[("m", SIXTEEN, None)] * ranks) == expected, ranks
    assert agreed(("m", [0, 1], None), ("m", [0, 1], None)) == 1  # this build machine at 2 ranks
    assert agreed(("m", [0, 1], None)) == 2


def test_a_pinned_rank_counts_only_its_own_cpus():
    # two ranks pinned to halves of 16 CPUs: 8 each; pinned to two CPUs each: 2
    assert agreed(("m", list(range(8)), None), ("m", list(range(8, 16)), None)) == 4
    assert agreed(("m", [0, 1], None), ("m", [2, 3], None)) == 2
    # one rank pinned to one CPU holds every rank to one stripe
    assert agreed(("m", [0], None), ("m", SIXTEEN, None)) == 1


def test_the_least_machine_decides_for_every_rank():
    big = [("a", SIXTEEN, None)] * 2
    assert agreed(*big) == 4
    assert agreed(*big, ("b", [0, 1], None), ("b", [0, 1], None)) == 1
    assert agreed(*big, ("b", [0, 1, 2, 3], None)) == 4  # alone on 4 CPUs: a share of 4


def test_a_cgroup_quota_caps_the_share():
    assert agreed(("m", SIXTEEN, 2.0)) == 2
    assert agreed(("m", SIXTEEN, 0.5)) == 1
    # two ranks under one quota (one container) share it: 6 CPUs' worth gives 3 each
    assert agreed(("m", SIXTEEN, 6.0, "0:7"), ("m", SIXTEEN, 6.0, "0:7")) == 3
    # eight pods of 8 CPUs each on a 64-CPU machine: each quota is its own pod's
    pods = [("m", list(range(64)), 8.0, f"0:{pod}") for pod in range(8)]
    assert agreed(*pods) == 4
    assert agreed(*[("m", list(range(64)), 2.0, f"0:{pod}") for pod in range(8)]) == 2


def test_ranks_of_other_groups_on_the_machine_count_too():
    # two ranks of a subgroup, of 8 that torchrun started on this 16-CPU machine: 2 CPUs each, not 8
    assert agreed(("m", SIXTEEN, None, "", 8), ("m", SIXTEEN, None, "", 8)) == 2
    assert agreed(("m", SIXTEEN, None, "", 1), ("m", SIXTEEN, None, "", 1)) == 4  # fewer than seen: the records count


def test_the_ranks_sharing_a_rank_s_machine_are_counted_from_the_records():
    """What splits the cache for the in-place threshold: the records on the rank's machine, or
    LOCAL_WORLD_SIZE's count where torchrun started more there than this group holds."""
    records = [("a", SIXTEEN), ("b", SIXTEEN), ("a", SIXTEEN), ("a", SIXTEEN)]
    assert [stripe_choice.ranks_sharing_machine(records, rank) for rank in range(4)] == [3, 1, 3, 3]
    subgroup = [("a", SIXTEEN, None, "", 8), ("b", SIXTEEN, None, "", 0)]
    assert [stripe_choice.ranks_sharing_machine(subgroup, rank) for rank in range(2)] == [8, 1]


def test_each_rank_s_share_of_cores_is_counted_in_whole_cpus():
    """What busy_poll_us=-1 goes by: each rank's own share, in the records' order, 0 where the
    ranks outnumber their machine's CPUs (8 ranks on this 2-CPU machine)."""
    assert stripe_choice.core_shares([("m", [0, 1])] * 2) == [1, 1]
    assert stripe_choice.core_shares([("m", [0, 1])] * 8) == [0] * 8
    assert stripe_choice.core_shares([("a", SIXTEEN), ("b", [0, 1]), ("b", [0, 1]), ("b", [0, 1])]) == [16, 0, 0, 0]
    assert stripe_choice.core_shares([("m", SIXTEEN, 0.5)]) == [0]  # half a CPU's quota: no core of its own
    assert stripe_choice.core_shares([("m", SIXTEEN, None, "", 32)]) == [0]  # torchrun's 32 ranks on 16 CPUs


def test_records_survive_the_rendezvous_encoding():
    for record in (("boot-id", [0, 3, 17], None, "", 0), ("host:x", [5], 2.5, "34:1029", 8), ("m", [], None, "", 0),
                   ("m", list(range(192)), None, "", 0)):
        assert tuple(stripe_choice.decode(stripe_choice.encode(record))) == record
    assert len(stripe_choice.encode(("0" * 36, list(range(192)), None, "", 0))) < 50  # ranges, not 192 numbers


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_cgroup_reader_takes_the_tightest_quota_on_the_path(tmp_path):
    """A written /proc/self/cgroup and cgroup tree (the parser's input, not a live cgroup)."""
    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    write(proc / "self/cgroup", "0::/job/rank0\n")
    assert stripe_choice.cgroup_cpu_limit(proc, cgroups) is None  # no cpu.max anywhere
    write(cgroups / "cpu.max", "max 100000\n")
    write(cgroups / "job/cpu.max", "400000 100000\n")
    write(cgroups / "job/rank0/cpu.max", "max 100000\n")
    assert stripe_choice.cgroup_cpu_limit(proc, cgroups) == 4.0
    write(cgroups / "job/rank0/cpu.max", "150000 100000\n")
    assert stripe_choice.cgroup_cpu_limit(proc, cgroups) == 1.5
    assert stripe_choice.cgroup_cpu_limit(tmp_path / "absent", cgroups) is None
    write(cgroups / "job/cpu.max", "bogus\n")  # unreadable content is no quota, not an error
    write(cgroups / "job/rank0/cpu.max", "max 100000\n")
    assert stripe_choice.cgroup_cpu_limit(proc, cgroups) is None


def test_the_cgroup_reader_takes_v1_quotas_too(tmp_path):
    """cgroup v1 (this build machine's kind): cpu.cfs_quota_us over cpu.cfs_period_us, -1 for none,
    under the controllers' mount; a container sees its own cgroup as the mount's root."""
    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    write(proc / "self/cgroup", "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    write(cgroups / "cpu,cpuacct/cpu.cfs_quota_us", "-1\n")
    write(cgroups / "cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    assert stripe_choice.cgroup_cpu_limit(proc, cgroups) is None
    write(cgroups / "cpu,cpuacct/cpu.cfs_quota_us", "250000\n")  # the container's own, at the mount's root
    assert stripe_choice.cgroup_cpu_limit(proc, cgroups) == 2.5
    write(cgroups / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "100000\n")  # seen from the host: the path
    write(cgroups / "cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    assert stripe_choice.cgroup_cpu_limit(proc, cgroups) == 1.0
    write(cgroups / "cpu.max", "300000 100000\n")  # a hybrid machine's v2 quota counts too: the least wins
    assert stripe_choice.cgroup_cpu_limit(proc, cgroups) == 1.0
    write(cgroups / "cpu.max", "50000 100000\n")
    assert stripe_choice.cgroup_cpu_limit(proc, cgroups) == 0.5


def test_the_option_and_its_variable_take_auto_or_a_count(monkeypatch):
    assert options_module.Options().stripes == "auto"
    assert options_module.build(stripes=2).stripes == 2
    monkeypatch.setenv("UD_STRIPES", "auto")
    assert options_module.build().stripes == "auto"
    monkeypatch.setenv("UD_STRIPES", "3")
    assert options_module.build().stripes == 3
    for wrong in ("many", "2.0"):
        monkeypatch.setenv("UD_STRIPES", wrong)
        with pytest.raises(ValueError, match="UD_STRIPES must be \"auto\" or an integer"):
            options_module.build()
    monkeypatch.setenv("UD_STRIPES", "")  # empty is as if unset, as for every variable
    assert options_module.build().stripes == "auto"
    monkeypatch.delenv("UD_STRIPES")
    with pytest.raises(ValueError, match="stripes must be \"auto\" or an integer"):
        options_module.Options(stripes="Auto").validate()


def store():
    return dist.TCPStore("127.0.0.1", free_tcp_port(), is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=30))


def client_of(master):
    return dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=datetime.timedelta(seconds=30))


def run_ranks(world_size, task, name, stripes_of_rank=lambda rank: "auto"):
    """task(rank, communicator or the error that creating it raised) on a thread per rank; the results by rank."""
    shared, results = store(), {}

    def rank_thread(rank):
        try:
            comm = Communicator(rank, world_size, client_of(shared), "udp",
                                options_module.build(store_timeout_s=30, stripes=stripes_of_rank(rank)), name=name)
        except ud_transport.TransportError as error:
            results[rank] = task(rank, error)
            return
        with comm:
            results[rank] = task(rank, comm)

    threads = [threading.Thread(target=rank_thread, args=(rank,), name=f"rank{rank}") for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return [results.get(rank) for rank in range(world_size)]


def striped_sum(rank, comm):
    """(comm.stripes, the stripes of a large allreduce, whether its result is exact)."""
    count = 4 * STRIPE_MIN_BYTES // 4 + 5
    tensor = np.full(count, rank + 1, dtype=np.float32)
    stats = comm.allreduce(tensor, loss_budget=0.0)
    return comm.stripes, stats.stripes, bool((tensor == 3).all())


def test_ranks_on_different_machines_agree_through_the_rendezvous(monkeypatch):
    """Two ranks in this process, each told (a stand-in for being on another machine, the one
    thing replaced here) that it runs alone on a machine of its own: each has its 2 CPUs to itself,
    so both run 2 stripes, over real sockets; when rank 1's machine has one CPU, both run 1."""
    cpus = {"rank0": [0, 1], "rank1": [0, 1]}
    monkeypatch.setattr(stripe_choice, "this_process",
                        lambda: (f"machine of {threading.current_thread().name}", cpus[threading.current_thread().name], None))
    assert run_ranks(2, striped_sum, "two machines") == [(2, 2, True)] * 2
    cpus["rank1"] = [0]
    assert run_ranks(2, striped_sum, "a small machine") == [(1, 1, True)] * 2


def test_two_ranks_on_this_machine_agree_on_their_share():
    """No stand-in: both ranks read this machine's boot id and their affinity masks."""
    cpus, quota = len(os.sched_getaffinity(0)), stripe_choice.cgroup_cpu_limit()
    share = min(cpus // 2, int(quota // 2) if quota is not None else cpus)  # 1 on the 2-CPU CI machine
    expected = max(1, min(4, share))
    assert run_ranks(2, striped_sum, "this machine") == [(expected, expected, True)] * 2


def test_auto_and_a_count_are_named_as_disagreeing():
    errors = run_ranks(2, lambda rank, comm: str(comm), "auto against one", stripes_of_rank=lambda rank: "auto" if rank == 0 else 1)
    assert "rank 0: rank 1 disagrees" in errors[0] and "stripes auto" in errors[0], errors
    assert "rank 1: rank 0 disagrees" in errors[1], errors


ALONE = textwrap.dedent("""
    import datetime, numpy as np, torch.distributed as dist, ud_transport
    from ud_transport.lab.local_cluster import free_tcp_port
    store = dist.TCPStore("127.0.0.1", free_tcp_port(), 1, is_master=True, timeout=datetime.timedelta(seconds=30))
    with ud_transport.init(0, 1, store=store, transport="udp") as comm:
        tensor = np.arange(1 << 21, dtype=np.float32)
        stats = comm.allreduce(tensor)
        print(comm.stripes, stats.stripes, bool((tensor == np.arange(1 << 21, dtype=np.float32)).all()))
""")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or (stripe_choice.cgroup_cpu_limit() or 2) < 2,
                    reason="needs 2 CPUs to run on (and a cgroup quota of at least 2), to restrict one process to one of them")
def test_a_rank_reads_the_cpus_it_may_run_on():
    """A world of one rank: 2 stripes where it may run on two CPUs, 1 where its mask is one CPU."""
    environment = {k: v for k, v in os.environ.items() if k not in ("UD_STRIPES", "UD_TRANSPORT", "LOCAL_WORLD_SIZE")}
    two = sorted(os.sched_getaffinity(0))[:2]

    def alone(cpus):
        finished = subprocess.run([sys.executable, "-c", ALONE], capture_output=True, text=True, timeout=120, env=environment,
                                  preexec_fn=lambda: os.sched_setaffinity(0, cpus))
        assert finished.returncode == 0, finished.stderr
        return finished.stdout.split()

    assert alone(two) == ["2", "2", "True"]
    assert alone(two[:1]) == ["1", "1", "True"]
