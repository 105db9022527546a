"""Benchmark on the rig's rxe device, in one guest run: perftest's ib_send_bw -c UD (the rig's
physical limit), ud_transport's point-to-point datagram stream (the verbs transport driven by the
C program verbs_stream.c, compiled here; needs cc and libibverbs-dev), and its allreduce busbw.

    python -m ud_transport.rig run --timeout 900 -- python tests/verbs_guest/bench_rig.py

Prints a Markdown table (see docs/performance/rig.md, "The full tables of the first run"). TCG speed is not NIC speed:
compare the rows with each other, not with hardware.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from ranks import run_ranks  # a script: its own directory is sys.path[0]
from ud_transport import _verbs as verbs

SESSION = 0x5EED
QKEY = 0x77
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STREAM_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verbs_stream.c")


def perftest(size, iterations):
    """ib_send_bw -c UD -x 1 between two processes on the one device: (MB/s, messages/s)."""
    endpoint = verbs.choose_endpoint()
    common = ["ib_send_bw", "-d", endpoint["device"], "-i", str(endpoint["port"]), "-x", str(endpoint["gid_index"]),
              "-c", "UD", "-s", str(size), "-n", str(iterations), "-F"]
    server = subprocess.Popen(["timeout", "120"] + common, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(2)
    client = subprocess.run(["timeout", "120"] + common + ["127.0.0.1"], capture_output=True, text=True)
    server_out = server.communicate()[0]
    rows = []
    for text in (client.stdout, server_out):
        for line in text.splitlines():
            fields = line.split()
            if len(fields) == 5 and fields[0] == str(size) and re.match(r"^\d+$", fields[1]):
                rows.append((float(fields[3]), float(fields[4]) * 1e6))  # BW average [MB/sec], MsgRate [Mpps]
    if not rows:
        raise RuntimeError(f"no ib_send_bw result:\n{client.stdout}\n{client.stderr}\n{server_out}")
    return rows[0], " ".join(common) + " [127.0.0.1]"


def build_stream(directory):
    """Compile verbs_stream.c with the library's verbs transport (native/transport_verbs.c)."""
    binary = os.path.join(directory, "verbs_stream")
    subprocess.run(["cc", "-O2", "-std=gnu11", "-Wall", "-I", os.path.join(ROOT, "native"), STREAM_SOURCE,
                    os.path.join(ROOT, "native", "transport_verbs.c"), "-libverbs", "-o", binary], check=True)
    return binary


def stream(binary, count, size, recv_depth=16384):
    """ud_transport's verbs transport streaming datagrams from one process to another, both ends in
    C (verbs_stream.c): (sender's {sent, seconds, ring_full_waits}, receiver's {received, seconds, ...})."""
    endpoint = verbs.choose_endpoint()
    common = [endpoint["device"], str(endpoint["port"]), str(endpoint["gid_index"]), str(QKEY), str(count), str(size),
              str(SESSION)]
    receiver = subprocess.Popen([binary, "recv", *common, str(recv_depth)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    sender = subprocess.Popen([binary, "send", *common], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        table = f"{sender.stdout.readline().strip()} {receiver.stdout.readline().strip()}\n"
        receiver.stdin.write(table)
        receiver.stdin.flush()
        assert receiver.stdout.readline().strip() == "ready"
        sender.stdin.write(table)
        sender.stdin.flush()
        sent = json.loads(sender.stdout.readline())
        received = json.loads(receiver.stdout.readline())
    finally:
        for process in (sender, receiver):
            try:
                process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                process.kill()
    return sent, received


def allreduce_calls(comm, nbytes, warmup, iterations):
    count = nbytes // 4
    data = np.random.default_rng(comm.rank).standard_normal(count).astype(np.float32)
    times, fractions = [], []
    for i in range(warmup + iterations):
        work = data.copy()
        stats = comm.allreduce(work, loss_budget=1.0, deadline=60.0)
        if i >= warmup:
            times.append(stats.elapsed_s)
            fractions.append(stats.delivered_fraction)
    return times, fractions, comm.chunk_bytes


def allreduce(world, nbytes, transport, warmup=1, iterations=5):
    results = run_ranks(range(world), world, tempfile.mkdtemp(), allreduce_calls, nbytes, warmup, iterations,
                        transport=transport, idle_close_us=500_000, deadline_cap_s=60.0)
    per_call = [max(r[0][i] for r in results) for i in range(iterations)]  # the slowest rank ends the call
    seconds = statistics.median(per_call)
    delivered = min(min(r[1]) for r in results)
    return seconds, delivered, results[0][2]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    arguments = parser.parse_args()
    print(f"device: {verbs.choose_endpoint()}", flush=True)
    binary = build_stream(tempfile.mkdtemp())

    print("\n| what | size | messages | MB/s | messages/s | delivered |\n|---|---|---|---|---|---|")
    perf_rates, ours = [], []
    for _ in range(arguments.repeats):  # alternate, so drift in the emulator hits both alike
        (mbps, rate), command = perftest(arguments.size, arguments.messages)
        perf_rates.append(rate)
        print(f"| ib_send_bw -c UD -x 1 | {arguments.size} | {arguments.messages} | {mbps:.1f} | {rate:,.0f} | |", flush=True)
        sent, received = stream(binary, arguments.messages, arguments.size)
        send_rate = sent["sent"] / sent["seconds"]
        receive_rate = received["received"] / received["seconds"] if received["seconds"] > 0 else float("nan")
        ours.append(min(send_rate, receive_rate))
        print(f"| ud_transport stream | {arguments.size} | {arguments.messages} | "
              f"{receive_rate * arguments.size / 1e6:.1f} | send {send_rate:,.0f} / receive {receive_rate:,.0f} | "
              f"{received['received'] / arguments.messages:.2%} |", flush=True)
    ratio = statistics.median(ours) / statistics.median(perf_rates)
    print(f"\nstream / ib_send_bw message rate (medians): {ratio:.2f} (target >= 0.70)")
    print(f"perftest command: {command}", flush=True)

    print("\n| transport | ranks | size | chunk | time (median) | algbw MB/s | busbw MB/s | delivered |\n|---|---|---|---|---|---|---|---|")
    for transport in ("verbs", "udp"):
        for world in (2, 4):
            for nbytes in (1 << 20, 8 << 20):
                seconds, delivered, chunk = allreduce(world, nbytes, transport)
                algbw = nbytes / seconds / 1e6
                busbw = algbw * 2 * (world - 1) / world
                print(f"| {transport} | {world} | {nbytes >> 20} MiB | {chunk} | {seconds * 1e3:.1f} ms | {algbw:.1f} | "
                      f"{busbw:.1f} | {delivered:.2%} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
