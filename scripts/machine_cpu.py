"""The whole machine's busy CPU time, for benchmarks whose work partly runs in the kernel's
softirqs (packet processing), which no process is charged for."""
import os

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def busy_seconds():
    """CPU seconds all cores spent working so far: user, nice, system, irq and softirq (not idle,
    iowait, or steal, which is another guest's; guest time is already inside user)."""
    with open("/proc/stat") as stat:
        user, nice, system, _idle, _iowait, irq, softirq = [int(v) for v in stat.readline().split()[1:8]]
    return (user + nice + system + irq + softirq) * _TICK_S
