"""The README's commands run: the demo, the benchmark (with its JSON), info."""
import json
import subprocess
import sys


def run(*arguments, timeout=300):
    return subprocess.run([sys.executable, "-m", "ud_transport", *arguments], capture_output=True, text=True,
                          timeout=timeout)


def test_demo_runs_and_reports_every_rank():
    result = run("demo", "--world-size", "3", "--calls", "1", "--count", "5000", "--loss", "0.1")
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.strip().startswith("0 ")]
    assert len(rows) == 3 and "%" in rows[0]


def test_bench_prints_both_backends_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    result = run("bench", "--sizes", "4K,64K", "--iterations", "3", "--warmup", "1", "--no-progress", "--json", str(out))
    assert result.returncode == 0, result.stderr
    table = [line.split() for line in result.stdout.splitlines() if not line.startswith("#")][1:]
    assert {row[3] for row in table} == {"ud-auto", "gloo"} and len(table) == 4
    rows = json.loads(out.read_text())["rows"]
    assert all(row["delivered_percent"] == 100.0 and row["max_relative_error"] < 1e-6 for row in rows)


def test_bench_across_veth_hosts_runs_both_backends_over_the_links():
    """--hosts veth: each rank in its own namespace at the given MTU, Gloo beside it; without root it says it skipped."""
    result = run("bench", "--hosts", "veth", "--mtu", "9000", "--sizes", "64K", "--iterations", "2", "--warmup", "1",
                 "--no-progress")
    assert result.returncode == 0, result.stderr
    from ud_transport.hosts import unavailable_reason

    reason = unavailable_reason()
    if reason:
        assert f"skipped: {reason}" in result.stdout
        return
    assert "namespaces on a veth pair, MTU 9000" in result.stdout
    table = [line.split() for line in result.stdout.splitlines() if not line.startswith("#")][1:]
    assert {row[3] for row in table} == {"ud-auto", "gloo"} and all(row[8] == "100.000" for row in table)
    assert "# 64K ud-auto / gloo: p50 " in result.stdout


def test_info_explains_what_it_finds():
    """Exit status 0 when a transport works (UDP without RDMA is the normal
    case); it says what auto picks."""
    result = run("info")
    resolved = "resolves to: verbs" in result.stdout
    assert resolved or "resolves to: udp" in result.stdout, result.stdout + result.stderr
    assert result.returncode == 0, result.stdout + result.stderr


def test_info_shows_udp_batching_and_the_granted_receive_buffer():
    result = run("info", "--json")
    udp = json.loads(result.stdout)["udp"]
    assert "problem" not in udp, udp
    assert udp["receive_buffer_bytes"] > 0 and udp["window_bytes"] <= udp["window_bytes_asked"]
    assert f"rcvbuf={udp['receive_buffer_bytes']}" in udp["description"]
    text = run("info").stdout
    assert f"GSO {'on' if udp['gso'] else 'off'}, GRO {'on' if udp['gro'] else 'off'}" in text
    assert f"receive buffer granted {udp['receive_buffer_bytes']} bytes" in text


def test_unknown_command_says_what_was_wrong_and_exits_2():
    result = run("frobnicate")
    assert result.returncode == 2 and result.stdout == ""
    first = result.stderr.splitlines()[0]
    assert first.startswith("ud_transport: error: unknown command 'frobnicate'") and "bench" in first


def test_version_and_help():
    import ud_transport

    version = run("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"ud_transport {ud_transport.__version__}"
    helped = run("--help")
    assert helped.returncode == 0 and "exit codes" in helped.stdout and "simulate" in helped.stdout
