"""How many stripes `stripes="auto"` runs: each rank's fair share of its machine's cores, the
least over all ranks, at most AUTO_MAX_STRIPES.

Measured with the wire benchmark (README, "Stripes"): on the 2-core build machine 2 stripes were
slower than 1 for 2 ranks; on a 16-core machine (loopback, and MTU 1500 on veth and a bridge),
4 stripes beat 2 and 1 for 2 ranks and beat 1 for 4 ranks (2 not run), 2 beat 1 for 8 ranks, and
1 beat 2 for 16 ranks. One stripe per core a rank can call its own fits every one of those.

Ranks on one machine share its cores: the rendezvous tells each rank which ranks run on the same
kernel (its boot id, which every network namespace and container on that kernel shares) and
which CPUs they may run on. Every rank computes the same number from the same records.
"""
import os
import socket

# The most stripes "auto" picks: 4 is the most measured; 8 threads per rank would each have too
# little of a 64 MiB call to do (1 MiB per stripe is the floor of a striped call).
AUTO_MAX_STRIPES = 4


def machine_key():
    """What every process on this kernel shares and processes on other machines do not."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:  # not Linux, or /proc hidden: the host name is the next best guess
        return "host:" + socket.gethostname()


def cgroup_cpu_limit(proc_root="/proc", cgroup_root="/sys/fs/cgroup"):
    """The CPUs' worth of time cgroup quotas allow this process (the tightest along its path, v2's
    cpu.max or v1's cpu.cfs_quota_us), or None where no quota is set or none can be read."""
    try:
        with open(f"{proc_root}/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    limits = []
    for fields in lines:
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # v2: one hierarchy
            limits += _limits_along(path, [cgroup_root], _read_cpu_max)
        elif "cpu" in controllers.split(","):  # v1: mounted under its controllers' names, or as cpu
            limits += _limits_along(path, [os.path.join(cgroup_root, controllers), os.path.join(cgroup_root, "cpu")],
                                    _read_cfs_quota)
    return min(limits) if limits else None


def _limits_along(path, roots, read):
    """The quotas `read` finds in `path`'s directory and each above it, under the first root that
    has any of them (a container sees its own cgroup as the root of the mount)."""
    parts = [part for part in path.split("/") if part]
    for root in roots:
        found = [limit for depth in range(len(parts), -1, -1)
                 if (limit := read(os.path.join(root, *parts[:depth]))) is not None]
        if found:
            return found
    return []


def _read_cpu_max(directory):
    try:
        with open(os.path.join(directory, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" or int(period) <= 0 else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _read_cfs_quota(directory):
    try:
        with open(os.path.join(directory, "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
        with open(os.path.join(directory, "cpu.cfs_period_us")) as f:
            period = int(f.read())
        return None if quota < 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def this_process():
    """(machine key, the CPUs this process may run on, its cgroup CPU limit or None)."""
    return machine_key(), sorted(os.sched_getaffinity(0)), cgroup_cpu_limit()


def encode(machine, cpus, cpu_limit):
    """One rank's record for the rendezvous: text, one line each."""
    return "\n".join([machine, ",".join(map(str, cpus)), "" if cpu_limit is None else repr(float(cpu_limit))]).encode()


def decode(record):
    """(machine key, CPU list, CPU limit or None) of `encode`'s record."""
    machine, cpus, cpu_limit = bytes(record).decode().split("\n")
    return machine, [int(c) for c in cpus.split(",") if c], float(cpu_limit) if cpu_limit else None


def fair_share(records, index):
    """The cores rank `index` may call its own: those it may run on, but no more than its even
    share of all its machine's ranks' CPUs (nor of its cgroup quota), and at least 1."""
    machine, cpus, cpu_limit = records[index]
    neighbours = [other for other in records if other[0] == machine]
    every_cpu = set().union(*(set(other[1]) for other in neighbours))
    share = min(len(cpus), len(every_cpu) // len(neighbours))
    if cpu_limit is not None:  # as if its neighbours shared its quota (they may, in one container)
        share = min(share, int(cpu_limit // len(neighbours)))
    return max(share, 1)


def agreed_stripes(records):
    """The stripes every rank runs: the least fair share, 1 to AUTO_MAX_STRIPES."""
    return max(1, min(AUTO_MAX_STRIPES, *(fair_share(records, index) for index in range(len(records)))))


def stripes_alone(ranks_here):
    """What "auto" picks when `ranks_here` ranks like this process share this machine (for `info`)."""
    machine, cpus, cpu_limit = this_process()
    return agreed_stripes([(machine, cpus, cpu_limit)] * ranks_here)
