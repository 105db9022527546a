"""Flow control that knows its buffers: without CAP_NET_ADMIN the kernel caps the UDP receive
buffer at net.core.rmem_max, and the credit window must fit what it granted. With no loss
injected, large allreduces then deliver everything, and one warning per process names the
sysctl that would raise the buffer.

The ranks run in a subprocess started by setpriv with CAP_NET_ADMIN removed from the bounding
and inheritable sets: a root process exec'd that way has no CAP_NET_ADMIN, so SO_RCVBUFFORCE
fails. The probe checks that by reading back what the kernel granted, in the subprocess and in
every rank."""
import json
import logging
import os
import shutil
import subprocess
import sys

import pytest

from conftest import skip_or_fail
from support import child_environment
from ud_transport import transports
from ud_transport.options import Options

MIB = 1 << 20

PROBE = r"""
import json, socket
import tasks
from ud_transport.lab.local_cluster import LocalCluster

SO_RCVBUFFORCE = 33
probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    probe.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 64 << 20)
    forced = True
except PermissionError:
    forced = False
report = dict(forced=forced, runs=[])
for world_size, nbytes, calls in {plan!r}:
    with LocalCluster(world_size, log_level="WARNING") as cluster:
        buffers = cluster.run(tasks.receive_buffer_of)
        outcomes = cluster.run(tasks.many_large, nbytes // 4, calls, timeout_s=600)
    report["runs"].append(dict(world_size=world_size, nbytes=nbytes, buffers=buffers, outcomes=outcomes))
print("REPORT " + json.dumps(report))
"""


def rmem_max():
    with open("/proc/sys/net/core/rmem_max") as f:
        return int(f.read())


@pytest.mark.slow
def test_large_allreduces_without_cap_net_admin_deliver_everything_and_warn_once():
    if os.geteuid() != 0:
        skip_or_fail("needs root, to run ranks with CAP_NET_ADMIN removed")
    if not shutil.which("setpriv"):
        skip_or_fail("needs setpriv (util-linux) to drop CAP_NET_ADMIN")
    asked = Options().socket_buffer_bytes
    if rmem_max() >= asked:
        skip_or_fail(f"net.core.rmem_max={rmem_max()} already grants the {asked} bytes asked: nothing is capped here")
    plan = [(2, 32 * MIB, 4), (4, 64 * MIB, 3)]
    script = PROBE.format(plan=plan)
    run = subprocess.run(["setpriv", "--bounding-set=-net_admin", "--inh-caps=-net_admin", sys.executable, "-c", script],
                         capture_output=True, text=True, timeout=1500, env=child_environment())
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout.split("REPORT ", 1)[1])
    assert not report["forced"], "CAP_NET_ADMIN was not dropped: SO_RCVBUFFORCE took"
    for entry in report["runs"]:
        world_size = entry["world_size"]
        for rank, (fractions, lost, exact) in enumerate(entry["outcomes"]):
            assert all(f == 1.0 for f in fractions), f"{world_size} ranks, rank {rank}: delivered {fractions}"
            assert lost == 0 and exact, f"{world_size} ranks, rank {rank}: {lost} chunks lost, exact={exact}"
        for rank, (granted, window) in enumerate(entry["buffers"]):
            assert granted == 2 * rmem_max(), f"rank {rank}: the kernel granted {granted}, not the capped 2 x rmem_max"
            assert window < granted, f"rank {rank}: window {window} does not fit the granted buffer {granted}"
    # one warning per rank process, however many calls; every rank of both clusters is its own process
    warnings = [line for line in run.stderr.splitlines() if "sysctl -w net.core.rmem_max=" in line]
    assert len(warnings) == sum(entry["world_size"] for entry in report["runs"]), run.stderr[-4000:]


def test_window_fits_the_granted_buffer_by_the_kernels_accounting():
    """Each queued datagram is charged its skb truesize; the window counts payload only."""
    granted = 8 * MIB
    for datagram in (288, 1472, 4000, 8972, 16000, 65507):
        payload = datagram - 32
        window = transports.window_that_fits(granted, datagram, asked=1 << 30)
        charged = window // payload * transports.datagram_truesize(datagram)
        assert charged <= granted * transports.WINDOW_SHARE_OF_BUFFER, (datagram, window, charged)
        assert window >= 16 * payload  # the engine's floor of 16 chunks still fits
    # what was asked wins when it fits
    assert transports.window_that_fits(1 << 30, 1472, asked=16 * MIB) == 16 * MIB


@pytest.mark.parametrize("datagram, measured", [(288, 1280), (1472, 2305), (4000, 8456), (8972, 16644),
                                                 (16000, 16644), (32000, 33026), (65507, 66576)])
def test_truesize_model_covers_what_the_kernel_charged(datagram, measured):
    """Per-datagram charges measured on loopback with GRO off (Linux 6.18; bench_wire --fill gives the same
    on veth): the model never charges less, nor wildly more."""
    model = transports.datagram_truesize(datagram)
    assert measured <= model <= 1.15 * measured


def test_the_buffer_warning_is_logged_once_per_process(caplog, monkeypatch):
    monkeypatch.setattr(transports, "_buffer_warning_given", False)
    with caplog.at_level(logging.WARNING, logger="ud_transport"):
        for _ in range(3):
            transports.fit_window(16 * MIB, granted=8 * MIB, asked_buffer=64 * MIB, forced=False, datagram_bytes=1472)
    warnings = [r for r in caplog.records if "net.core.rmem_max" in r.getMessage()]
    assert len(warnings) == 1
    assert "sysctl -w net.core.rmem_max=" in warnings[0].getMessage()
