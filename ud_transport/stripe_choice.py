"""How many stripes `stripes="auto"` runs: each rank's fair share of its machine's cores, the
least over all ranks, at most AUTO_MAX_STRIPES.

Measured with the wire benchmark (docs/performance/stripes.md): on the 2-core build machine 2 stripes were
slower than 1 for 2 ranks; on a 16-core machine (loopback, and MTU 1500 on veth and a bridge),
4 stripes beat 2 and 1 for 2 ranks and beat 1 for 4 ranks (2 not run), 2 beat 1 for 8 ranks, and
1 beat 2 for 16 ranks. One stripe per core a rank can call its own fits every one of those.

Ranks on one machine share its cores: the rendezvous tells each rank which ranks run on the same
kernel (its boot id, which every network namespace and container on that kernel shares) and
which CPUs they may run on. Every rank computes the same number from the same records. The same
records count the ranks that share a machine's cache (ranks_sharing_machine: the in-place
threshold, options.py).
"""
import os
import socket
from collections import Counter, namedtuple

# The most stripes "auto" picks: 4 is the most measured; 8 threads per rank would each have too
# little of a 64 MiB call to do (1 MiB per stripe is the floor of a striped call).
AUTO_MAX_STRIPES = 4

# What a rank publishes: its machine (boot id), the CPUs it may run on, its cgroup CPU quota in
# CPUs (None: none) and the cgroup that sets it ("dev:inode", so ranks in one container share it
# and ranks in two do not), and torchrun's LOCAL_WORLD_SIZE (0: unset), which counts the ranks of
# every group on the machine where a communicator of a subgroup sees only its own.
Record = namedtuple("Record", "machine cpus cpu_limit quota_owner local_ranks", defaults=(None, "", 0))


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
    return cgroup_cpu_quota(proc_root, cgroup_root)[0]


def cgroup_cpu_quota(proc_root="/proc", cgroup_root="/sys/fs/cgroup"):
    """(cgroup_cpu_limit, the "dev:inode" of the cgroup directory that sets it), or (None, "")."""
    try:
        with open(f"{proc_root}/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None, ""
    found = []
    for fields in lines:
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # v2: one hierarchy
            found += _limits_along(path, [cgroup_root], _read_cpu_max)
        elif "cpu" in controllers.split(","):  # v1: mounted under its controllers' names, or as cpu
            found += _limits_along(path, [os.path.join(cgroup_root, controllers), os.path.join(cgroup_root, "cpu")],
                                   _read_cfs_quota)
    if not found:
        return None, ""
    limit, directory = min(found)
    try:
        status = os.stat(directory)
        return limit, f"{status.st_dev}:{status.st_ino}"
    except OSError:
        return limit, ""


def _limits_along(path, roots, read):
    """(quota, directory) for each quota `read` finds in `path`'s directory and each above it,
    under the first root that has any (a container sees its own cgroup as the mount's root)."""
    parts = [part for part in path.split("/") if part]
    for root in roots:
        directories = [os.path.join(root, *parts[:depth]) for depth in range(len(parts), -1, -1)]
        found = [(limit, directory) for directory in directories if (limit := read(directory)) is not None]
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


def local_world_size():
    """torchrun's LOCAL_WORLD_SIZE, the processes it started on this machine; 0 if unset or not a number."""
    try:
        return max(int(os.environ.get("LOCAL_WORLD_SIZE", "0")), 0)
    except ValueError:
        return 0


def this_process():
    """This process's Record."""
    limit, owner = cgroup_cpu_quota()
    return Record(machine_key(), sorted(os.sched_getaffinity(0)), limit, owner, local_world_size())


def cpu_ranges(cpus):
    """"0-15,32-47" for those CPUs: a record stays short on machines of hundreds of CPUs."""
    runs, cpus = [], sorted(cpus)
    for cpu in cpus:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def parse_cpu_ranges(text):
    cpus = []
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        cpus += range(int(first), int(last or first) + 1)
    return cpus


def encode(record):
    """One rank's Record for the rendezvous: text, one field a line."""
    record = Record(*record)
    return "\n".join([record.machine, cpu_ranges(record.cpus), "" if record.cpu_limit is None else repr(float(record.cpu_limit)),
                      record.quota_owner, str(record.local_ranks)]).encode()


def decode(data):
    """The Record of `encode`'s bytes."""
    machine, cpus, cpu_limit, owner, local_ranks = bytes(data).decode().split("\n")
    return Record(machine, parse_cpu_ranges(cpus), float(cpu_limit) if cpu_limit else None, owner, int(local_ranks))


def agreed_stripes(records):
    """The stripes every rank runs: the least of the ranks' fair shares, 1 to AUTO_MAX_STRIPES."""
    return max(1, min(AUTO_MAX_STRIPES, *core_shares(records)))


def core_shares(records):
    """Each rank's fair share of its machine's CPUs, whole CPUs (0 where the ranks outnumber
    them), in the records' order. A rank's share is the CPUs it may run on, but no more than an
    even share of its machine's CPUs among the ranks there (these records' or LOCAL_WORLD_SIZE's,
    the more), nor of its cgroup quota among the ranks under the same quota."""
    records = [Record(*record) for record in records]
    machines = {}
    for index, record in enumerate(records):
        machines.setdefault(record.machine, []).append(index)
    shares = [0] * len(records)
    for indices in machines.values():
        neighbours = [records[index] for index in indices]
        ranks_here = _ranks_among(neighbours)
        even_share = len(set().union(*(other.cpus for other in neighbours))) // ranks_here
        under_quota = Counter(other.quota_owner for other in neighbours)
        for index, mine in zip(indices, neighbours):
            share = min(len(mine.cpus), even_share)
            if mine.cpu_limit is not None:
                share = min(share, int(mine.cpu_limit // under_quota[mine.quota_owner]))
            shares[index] = share
    return shares


def _ranks_among(neighbours):
    """How many ranks share the machine of these records: theirs, or LOCAL_WORLD_SIZE's if more."""
    return max(len(neighbours), *(other.local_ranks for other in neighbours))


def ranks_sharing_machine(records, rank):
    """How many ranks (rank's own included) run on the machine of `rank`'s record."""
    records = [Record(*record) for record in records]
    return _ranks_among([other for other in records if other.machine == records[rank].machine])


def stripes_alone(ranks_here):
    """What "auto" picks when `ranks_here` ranks like this process share this machine (for `info`)."""
    return agreed_stripes([this_process()._replace(local_ranks=0)] * ranks_here)
