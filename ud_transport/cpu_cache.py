"""The size of this machine's largest CPU cache: an allreduce of a tensor at least this large
sums in the caller's tensor (Options.in_place_min_bytes), a smaller one in the scratch."""
import functools
import os

from . import sizes

CACHE_DIRECTORY = "/sys/devices/system/cpu/cpu0/cache"
FALLBACK_BYTES = 32 << 20  # where the kernel does not say (not Linux, or no sysfs)
# More last-level cache per CPU (hardware thread) than any x86 part we know of has: the largest
# shares are on AMD's EPYC parts with few cores and stacked cache (EPYC 7373X: 768 MiB for 16
# cores, 24 MiB per thread; EPYC 72F3: 32 MiB per core, 16 per thread). A larger share is a host's
# cache seen from a VM and shared with other tenants: the 2-vCPU build machine of 2026-11-26
# lists 480 MiB, yet summing in place won there from 2 MiB up (docs/performance/wire_measurements.md).
MAX_CACHE_PER_CPU_BYTES = 32 << 20


def parse_size(text):
    """Bytes of a sysfs cache size such as "32768K"; None if it is not one."""
    try:
        return sizes.parse_size(text)
    except ValueError:
        return None


def count_cpus(text):
    """CPUs in a sysfs CPU list such as "0-3,8"; None if it is not one."""
    count = 0
    try:
        for part in text.strip().split(","):
            first, _, last = part.partition("-")
            count += int(last or first) - int(first) + 1
    except ValueError:
        return None
    return count if count > 0 else None


def _read(path):
    try:
        with open(path) as file:
            return file.read()
    except OSError:
        return ""


@functools.lru_cache(maxsize=None)
def largest_cache_bytes(directory=CACHE_DIRECTORY):
    """The largest cache the kernel lists for the first CPU (usually L3), at most
    MAX_CACHE_PER_CPU_BYTES for each CPU sharing it; else FALLBACK_BYTES.
    sysfs, not sysconf(_SC_LEVEL3_CACHE_SIZE): in a VM the latter can be wrong (256 MiB on an
    earlier build machine, whose L3 is 32 MiB)."""
    try:
        entries = [entry for entry in os.listdir(directory) if entry.startswith("index")]
    except OSError:
        return FALLBACK_BYTES
    sizes = []
    for entry in entries:
        size = parse_size(_read(os.path.join(directory, entry, "size")))
        if size:
            sharing = count_cpus(_read(os.path.join(directory, entry, "shared_cpu_list")))
            sizes.append(min(size, sharing * MAX_CACHE_PER_CPU_BYTES) if sharing else size)
    return max(sizes, default=FALLBACK_BYTES)
