"""scripts/bench_wire.py still builds against native/transport_udp.c and its streams arrive whole.

A smoke run (a fraction of a second per variant), not a timing test: it checks what the script
reports about the streams, not how fast they went."""
import json
import pathlib
import subprocess
import sys

import pytest

from conftest import skip_or_fail

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "bench_wire.py"


@pytest.mark.netns
def test_bench_wire_streams_arrive_in_order_and_zerocopy_sends_complete(tmp_path):
    from ud_transport.lab.hosts import unavailable_reason

    reason = unavailable_reason()
    if reason:
        skip_or_fail(f"veth hosts: {reason}")
    report = tmp_path / "runs.json"
    finished = subprocess.run([sys.executable, str(SCRIPT), "--mtu", "1500", "--wire", "segmented", "--variants",
                               "gso+gro,raw,raw+zerocopy", "--seconds", "0.3", "--repeats", "1", "--json", str(report)],
                              capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr
    runs = {run["variant"]: run["runs"][0] for run in json.loads(report.read_text())["runs"]}
    assert set(runs) == {"gso+gro", "raw", "raw+zerocopy"}
    for variant, (sent, received) in runs.items():
        assert received["datagrams"] > 0, variant
        assert received["wrong_size"] == received["reordered"] == received["foreign"] == 0, variant
        assert received["datagrams"] <= sent["datagrams"], variant
        assert received["machine_cpu_seconds"] > 0 and sent["cpu_seconds"] > 0, variant
    assert runs["gso+gro"][0]["send_gso_datagrams"] > runs["gso+gro"][0]["send_gso_messages"]  # GSO batched
    zerocopy = runs["raw+zerocopy"][0]
    assert zerocopy["mode"] == "zerocopy" and zerocopy["zerocopy_notices"] > 0
    assert zerocopy["zerocopy_completed"] == zerocopy["send_calls"]  # every send reported done, none twice
