"""The size of this machine's largest CPU cache: an allreduce of a tensor at least this large
sums in the caller's tensor (Options.in_place_min_bytes), a smaller one in the scratch."""
import functools
import os

from . import sizes

CACHE_DIRECTORY = "/sys/devices/system/cpu/cpu0/cache"
FALLBACK_BYTES = 32 << 20  # where the kernel does not say (not Linux, or no sysfs)


def parse_size(text):
    """Bytes of a sysfs cache size such as "32768K"; None if it is not one."""
    try:
        return sizes.parse_size(text)
    except ValueError:
        return None


@functools.lru_cache(maxsize=None)
def largest_cache_bytes(directory=CACHE_DIRECTORY):
    """The largest cache the kernel lists for the first CPU (usually L3), else FALLBACK_BYTES.
    sysfs, not sysconf(_SC_LEVEL3_CACHE_SIZE): in a VM the latter can be wrong (256 MiB on the
    build machine, whose L3 is 32 MiB)."""
    try:
        entries = [entry for entry in os.listdir(directory) if entry.startswith("index")]
    except OSError:
        return FALLBACK_BYTES
    sizes = []
    for entry in entries:
        try:
            with open(os.path.join(directory, entry, "size")) as file:
                size = parse_size(file.read())
        except OSError:
            continue
        if size:
            sizes.append(size)
    return max(sizes, default=FALLBACK_BYTES)
