"""One stream of UDP datagrams between two hosts (network namespaces), with and without
the kernel's batching (UDP GSO on send, UDP GRO on receive), at MTU 1500 and 9000.

It compiles a small C program against native/transport_udp.c (the transport the library
uses, nothing else of it) in a temporary directory, builds hosts with ud_transport.lab.hosts,
and runs the receiver in host 1 and the sender in host 0 for a few seconds per case. The
sender sends as fast as the socket takes datagrams, in batches like the engine's; the
receiver counts what arrived, in order, at the right size. Reported: GB/s delivered
(header + payload bytes of datagrams the receiver got, per second), the median of
--repeats runs, what the sender offered, and CPU seconds per GB delivered (the whole
machine's busy time, which includes the kernel's packet work in softirqs, and the two
programs' own). The variants `raw` and `raw+zerocopy` use a sender of the program's own,
one 64 KB GSO message per sendmsg, without and with MSG_ZEROCOPY; "zc copied" is the
share of zerocopy sends the kernel reports it copied after all (by notice: the kernel merges
neighbouring completions under the first one's code, so it is approximate).

    python3 scripts/bench_wire.py                       # both MTUs, all variants
    python3 scripts/bench_wire.py --mtu 1500 --variants plain,gso+gro --seconds 2
    python3 scripts/bench_wire.py --fill                # payload a granted receive buffer holds
    python3 scripts/bench_wire.py --variants raw,raw+zerocopy --repeats 5   # MSG_ZEROCOPY

Needs root (network namespaces) and a C compiler.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from machine_cpu import busy_seconds  # noqa: E402  (a script: its own directory is sys.path[0])
from ud_transport.lab.hosts import Hosts, unavailable_reason  # noqa: E402

VARIANTS = {  # name -> environment of both programs
    "plain": {"UD_UDP_GSO": "0", "UD_UDP_GRO": "0"},
    "gso": {"UD_UDP_GSO": "1", "UD_UDP_GRO": "0"},
    "gro": {"UD_UDP_GSO": "0", "UD_UDP_GRO": "1"},
    "gso+gro": {"UD_UDP_GSO": "1", "UD_UDP_GRO": "1"},
    # a sender of the program's own (one 64 KB GSO message per sendmsg), with and without MSG_ZEROCOPY
    "raw": {"UD_UDP_GSO": "1", "UD_UDP_GRO": "1"},
    "raw+zerocopy": {"UD_UDP_GSO": "1", "UD_UDP_GRO": "1"},
}
SENDER_MODE = {"raw": "rawsend", "raw+zerocopy": "zerocopy"}  # others send through native/transport_udp.c
HEADER_BYTES = 32  # the wire header's size; the program fills its first 8 bytes with a sequence number
PORT_RECEIVER, PORT_SENDER = 47001, 47002

PROGRAM = r'''
/* One stream of datagrams through native/transport_udp.c, sender or receiver. */
#define _GNU_SOURCE
#include "transport_udp.h"

#include <arpa/inet.h>
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void print_common(struct udt_transport *t)
{
    struct udt_udp_counters c;
    char text[256];
    udt_udp_counters(t, &c);
    udt_udp_describe(t, text, sizeof text);
    printf("\"transport\": \"%s\", \"features\": %u, \"receive_buffer_bytes\": %u, "
           "\"send_calls\": %llu, \"send_messages\": %llu, \"send_gso_messages\": %llu, \"send_gso_datagrams\": %llu, "
           "\"recv_calls\": %llu, \"recv_messages\": %llu, \"recv_gro_messages\": %llu, \"recv_gro_datagrams\": %llu",
           text, udt_udp_features(t), udt_udp_receive_buffer_bytes(t), (unsigned long long)c.send_calls,
           (unsigned long long)c.send_messages, (unsigned long long)c.send_gso_messages,
           (unsigned long long)c.send_gso_datagrams, (unsigned long long)c.recv_calls,
           (unsigned long long)c.recv_messages, (unsigned long long)c.recv_gro_messages,
           (unsigned long long)c.recv_gro_datagrams);
}

/* A UDP GSO sender of its own, with or without MSG_ZEROCOPY, so that the two differ only in that flag.
 * Messages of `per_message` datagrams are laid out back to back in a ring of `ring` messages; each
 * datagram starts with its sequence number. With zerocopy, the kernel holds the pages until it
 * reports the send complete (on the socket's error queue), so a ring slot is rewritten only after. */
#include <linux/errqueue.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#ifndef SOL_UDP
#define SOL_UDP 17
#endif
#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#ifndef SO_ZEROCOPY
#define SO_ZEROCOPY 60
#endif
#ifndef MSG_ZEROCOPY
#define MSG_ZEROCOPY 0x4000000
#endif
#ifndef SO_EE_ORIGIN_ZEROCOPY
#define SO_EE_ORIGIN_ZEROCOPY 5
#endif
#ifndef SO_EE_CODE_ZEROCOPY_COPIED
#define SO_EE_CODE_ZEROCOPY_COPIED 1
#endif

enum { RING = 1024 }; /* messages in the sender's ring */

/* Completion notices name ranges of send ids (counted per socket from 0); the kernel merges
 * neighbouring ranges but does not promise their order, so a slot is free only once every
 * send before it is done. */
struct completions {
    uint64_t through;   /* sends [0, through) are all complete */
    uint64_t completed; /* sends reported complete, in any order */
    uint64_t notices, copied;
    uint8_t done[RING]; /* by id % RING: reported, not yet passed by `through` */
};

static int reap(int fd, struct completions *z)
{
    for (;;) {
        char control[128];
        struct msghdr m = {.msg_control = control, .msg_controllen = sizeof control};
        if (recvmsg(fd, &m, MSG_ERRQUEUE | MSG_DONTWAIT) < 0)
            return errno == EAGAIN ? 0 : -1;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c)) {
            struct sock_extended_err *e = (struct sock_extended_err *)CMSG_DATA(c);
            if (e->ee_origin != SO_EE_ORIGIN_ZEROCOPY)
                continue;
            /* sends ee_info..ee_data (32-bit ids) completed; a merged range carries its first notice's
             * code, so `copied` counts by notice and is approximate */
            uint32_t count = e->ee_data - e->ee_info + 1;
            z->notices++;
            z->completed += count;
            if (e->ee_code & SO_EE_CODE_ZEROCOPY_COPIED)
                z->copied += count;
            for (uint32_t i = 0; i < count; i++)
                z->done[(e->ee_info + i) % RING] = 1;
            while (z->done[z->through % RING]) {
                z->done[z->through % RING] = 0;
                z->through++;
            }
        }
    }
}

static double cpu_seconds(void)
{
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return u.ru_utime.tv_sec + u.ru_utime.tv_usec * 1e-6 + u.ru_stime.tv_sec + u.ru_stime.tv_usec * 1e-6;
}

static int raw_send(char **argv, double seconds, uint32_t datagram, int zerocopy)
{
    int fd = socket(AF_INET, SOCK_DGRAM, 0), one = 1, segment = (int)datagram, buffer = 64 << 20;
    struct sockaddr_in self = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(argv[3]))};
    struct sockaddr_in peer = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(argv[5]))};
    inet_pton(AF_INET, argv[2], &self.sin_addr);
    inet_pton(AF_INET, argv[4], &peer.sin_addr);
    if (fd < 0 || bind(fd, (struct sockaddr *)&self, sizeof self) || connect(fd, (struct sockaddr *)&peer, sizeof peer) ||
        setsockopt(fd, SOL_UDP, UDP_SEGMENT, &segment, sizeof segment) ||
        (zerocopy && setsockopt(fd, SOL_SOCKET, SO_ZEROCOPY, &one, sizeof one))) {
        perror("raw sender socket");
        return 1;
    }
    setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &buffer, sizeof buffer);
    uint32_t per_message = 65000 / datagram;
    size_t message_bytes = (size_t)per_message * datagram;
    uint8_t *ring = per_message ? calloc(RING, message_bytes) : NULL;
    struct completions *z = calloc(1, sizeof *z);
    if (!ring || !z) {
        fprintf(stderr, "raw sender: datagrams of %u bytes do not fit a 65000-byte message, or out of memory\n", datagram);
        return 1;
    }
    uint64_t sequence = 0, sends = 0, ring_waits = 0, buffer_waits = 0;
    double start = now(), end = start + seconds, cpu = cpu_seconds();
    while (now() < end) {
        if (zerocopy) {
            if (reap(fd, z) < 0)
                return perror("reap"), 1;
            if (sends >= z->through + RING) { /* the slot's last send is still the kernel's */
                struct pollfd p = {.fd = fd, .events = 0}; /* wakes on an error-queue notice */
                poll(&p, 1, 10);
                ring_waits++;
                continue;
            }
        }
        uint8_t *message = ring + (size_t)(sends % RING) * message_bytes;
        for (uint32_t i = 0; i < per_message; i++) {
            uint64_t s = sequence + i;
            memcpy(message + (size_t)i * datagram, &s, sizeof s);
        }
        struct iovec v = {.iov_base = message, .iov_len = message_bytes};
        struct msghdr m = {.msg_iov = &v, .msg_iovlen = 1};
        if (sendmsg(fd, &m, zerocopy ? MSG_ZEROCOPY : 0) < 0) {
            if (errno == ENOBUFS || errno == EAGAIN) { /* out of option memory for notifications */
                struct pollfd p = {.fd = fd, .events = 0};
                poll(&p, 1, 10);
                buffer_waits++;
                continue;
            }
            return perror("sendmsg"), 1;
        }
        sends++;
        sequence += per_message;
    }
    double elapsed = now() - start;
    cpu = cpu_seconds() - cpu;
    for (int i = 0; zerocopy && z->completed < sends && i < 200; i++) { /* collect the last notifications */
        struct pollfd p = {.fd = fd, .events = 0};
        poll(&p, 1, 10);
        reap(fd, z);
    }
    printf("{\"mode\": \"%s\", \"datagrams\": %llu, \"bytes\": %llu, \"seconds\": %.6f, \"gbytes_per_s\": %.4f, "
           "\"cpu_seconds\": %.4f, \"send_calls\": %llu, \"send_gso_messages\": %llu, \"send_gso_datagrams\": %llu, "
           "\"zerocopy_completed\": %llu, \"zerocopy_copied\": %llu, \"zerocopy_notices\": %llu, \"ring_waits\": %llu, "
           "\"buffer_waits\": %llu}\n",
           zerocopy ? "zerocopy" : "copy", (unsigned long long)sequence, (unsigned long long)sequence * datagram, elapsed,
           sequence * (double)datagram / elapsed / 1e9, cpu, (unsigned long long)sends, (unsigned long long)sends,
           (unsigned long long)sequence, (unsigned long long)z->completed, (unsigned long long)z->copied,
           (unsigned long long)z->notices, (unsigned long long)ring_waits, (unsigned long long)buffer_waits);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 8) {
        fprintf(stderr, "usage: %s send|rawsend|zerocopy|recv|fill BIND PORT PEER PEER_PORT SECONDS DATAGRAM_BYTES [BATCH] [BUFFER]\n", argv[0]);
        return 2;
    }
    const char *mode = argv[1];
    double seconds = atof(argv[6]);
    uint32_t datagram = (uint32_t)atoi(argv[7]);
    int batch = argc > 8 ? atoi(argv[8]) : 64;
    uint32_t buffer = argc > 9 ? (uint32_t)strtoul(argv[9], NULL, 0) : 64u << 20;
    if (!strcmp(mode, "rawsend") || !strcmp(mode, "zerocopy"))
        return raw_send(argv, seconds, datagram, !strcmp(mode, "zerocopy"));
    double cpu = cpu_seconds();
    struct udt_error error = {0};
    struct udt_transport *t = udt_udp_open(argv[2], (uint16_t)atoi(argv[3]), buffer, &error);
    if (!t) {
        fprintf(stderr, "%s\n", error.message);
        return 1;
    }
    uint8_t peer[6];
    inet_pton(AF_INET, argv[4], peer);
    uint16_t peer_port = htons((uint16_t)atoi(argv[5]));
    memcpy(peer + 4, &peer_port, 2);
    udt_transport_set_peers(t, peer, 6, 1);
    if (batch < 1 || batch > 512)
        batch = 64;
    if (datagram < 16 || datagram > t->max_datagram_bytes) {
        fprintf(stderr, "datagram %u outside 16..%u\n", datagram, t->max_datagram_bytes);
        return 2;
    }

    if (!strcmp(mode, "send")) {
        enum { HEADER = 32 };
        uint8_t *payload = calloc(1, datagram);
        uint8_t(*headers)[HEADER] = calloc((size_t)batch, HEADER);
        struct udt_send_item *items = calloc((size_t)batch, sizeof *items);
        uint64_t sequence = 0, spins = 0;
        double start = now(), end = start + seconds;
        while (now() < end) {
            for (int i = 0; i < batch; i++) {
                uint64_t s = sequence + (uint64_t)i;
                memcpy(headers[i], &s, sizeof s);
                items[i] = (struct udt_send_item){.peer = 0, .header = headers[i], .header_bytes = HEADER,
                                                  .payload = payload, .payload_bytes = datagram - HEADER};
            }
            int done = 0;
            while (done < batch) {
                int rc = udt_transport_send(t, items + done, batch - done);
                if (rc < 0) {
                    fprintf(stderr, "send: %s\n", t->error.message);
                    return 1;
                }
                done += rc;
                if (rc == 0) {
                    spins++;
                    sched_yield();
                }
            }
            sequence += (uint64_t)batch;
        }
        double elapsed = now() - start;
        printf("{\"mode\": \"send\", \"datagrams\": %llu, \"bytes\": %llu, \"seconds\": %.6f, \"gbytes_per_s\": %.4f, \"full_spins\": %llu, \"cpu_seconds\": %.4f, ",
               (unsigned long long)sequence, (unsigned long long)sequence * datagram, elapsed,
               sequence * (double)datagram / elapsed / 1e9, (unsigned long long)spins, cpu_seconds() - cpu);
        print_common(t);
        printf("}\n");
        return 0;
    }

    /* recv: count until `seconds` of traffic, or 0.3 s of silence after traffic */
    /* fill: count what the buffer held when the sender had already finished */
    struct udt_recv_item items[64];
    uint64_t datagrams = 0, bytes = 0, expected = 0, gaps = 0, reordered = 0, wrong_size = 0, foreign = 0;
    double first = 0, last = 0, began = now();
    int fill = !strcmp(mode, "fill");
    if (fill) {
        /* wait until the sender is done: the sender's end is signalled by 0.5 s of nothing new in the queue */
        struct timespec pause = {.tv_sec = (time_t)seconds, .tv_nsec = (long)((seconds - (time_t)seconds) * 1e9)};
        nanosleep(&pause, NULL);
    }
    for (;;) {
        int got = udt_transport_recv(t, items, 64);
        double at = now();
        if (got < 0) {
            fprintf(stderr, "recv: %s\n", t->error.message);
            return 1;
        }
        for (int i = 0; i < got; i++) {
            if (items[i].peer != 0) {
                foreign++;
                continue;
            }
            uint64_t s;
            memcpy(&s, items[i].data, sizeof s);
            if (items[i].bytes != datagram)
                wrong_size++;
            if (s > expected)
                gaps += s - expected;
            if (s < expected)
                reordered++;
            else
                expected = s + 1;
            datagrams++;
            bytes += items[i].bytes;
        }
        if (got > 0) {
            if (!first)
                first = at;
            last = at;
            if (!fill && at - first >= seconds)
                break;
            continue;
        }
        if (first && at - last > (fill ? 0.05 : 0.3))
            break;
        if (!first && at - began > 30)
            break;
        udt_transport_wait(t, 1000);
    }
    double elapsed = last > first ? last - first : 1e-9;
    printf("{\"mode\": \"%s\", \"datagrams\": %llu, \"bytes\": %llu, \"seconds\": %.6f, \"gbytes_per_s\": %.4f, "
           "\"lost_before_last\": %llu, \"reordered\": %llu, \"wrong_size\": %llu, \"foreign\": %llu, \"cpu_seconds\": %.4f, ",
           mode, (unsigned long long)datagrams, (unsigned long long)bytes, elapsed, bytes / elapsed / 1e9,
           (unsigned long long)gaps, (unsigned long long)reordered, (unsigned long long)wrong_size, (unsigned long long)foreign,
           cpu_seconds() - cpu);
    print_common(t);
    printf("}\n");
    return 0;
}
'''


def build(directory):
    source = os.path.join(directory, "wire_stream.c")
    with open(source, "w") as out:
        out.write(PROGRAM)
    binary = os.path.join(directory, "wire_stream")
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not compiler:
        sys.exit("bench_wire: needs a C compiler (cc, gcc or clang)")
    subprocess.run([compiler, "-O2", "-std=gnu11", "-Wall", "-I", os.path.join(ROOT, "native"), source,
                    os.path.join(ROOT, "native", "transport_udp.c"), "-o", binary], check=True)
    return binary


def one_run(hosts, binary, variant, seconds, datagram, batch, buffer_bytes):
    """(sender's report, receiver's report); the receiver's carries `machine_cpu_seconds`, the whole
    machine's busy time while both ran (the kernel's packet work runs in softirqs, charged to nobody)."""
    environment = {**os.environ, **VARIANTS[variant]}
    busy = busy_seconds()
    receiver = hosts.popen(1, [binary, "recv", hosts.addresses[1], str(PORT_RECEIVER), hosts.addresses[0],
                               str(PORT_SENDER), str(seconds + 30), str(datagram), str(batch), str(buffer_bytes)],
                           stdout=subprocess.PIPE, env=environment, text=True)
    time.sleep(0.2)
    try:
        # the receiver outlasts the sender and stops at 0.3 s of silence, so it sees the whole stream
        sender = hosts.run(0, [binary, SENDER_MODE.get(variant, "send"), hosts.addresses[0], str(PORT_SENDER),
                               hosts.addresses[1], str(PORT_RECEIVER), str(seconds), str(datagram), str(batch),
                               str(buffer_bytes)],
                           capture_output=True, env=environment, text=True, check=True)
        out, _ = receiver.communicate(timeout=60)
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
    received = json.loads(out)
    received["machine_cpu_seconds"] = busy_seconds() - busy
    return json.loads(sender.stdout), received


def fill_run(hosts, binary, variant, datagram, buffer_bytes):
    """The sender sends 1 s while the receiver sleeps; then the receiver drains what its buffer held."""
    environment = {**os.environ, **VARIANTS[variant]}
    receiver = hosts.popen(1, [binary, "fill", hosts.addresses[1], str(PORT_RECEIVER), hosts.addresses[0],
                               str(PORT_SENDER), "1.5", str(datagram), "64", str(buffer_bytes)],
                           stdout=subprocess.PIPE, env=environment, text=True)
    time.sleep(0.2)
    hosts.run(0, [binary, "send", hosts.addresses[0], str(PORT_SENDER), hosts.addresses[1], str(PORT_RECEIVER),
                  "0.5", str(datagram), "64", str(buffer_bytes)], capture_output=True, env=environment, check=True)
    out, _ = receiver.communicate(timeout=60)
    return json.loads(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mtu", default="1500,9000")
    parser.add_argument("--variants", default="plain,gso,gro,gso+gro",
                        help=f"any of {','.join(VARIANTS)} (raw, raw+zerocopy: the program's own GSO sender, "
                             "one 64 KB message per sendmsg, without and with MSG_ZEROCOPY)")
    parser.add_argument("--wire", default="segmented,offload",
                        help="segmented: MTU-sized packets on the links, GRO at the receiver (like NICs); "
                             "offload: veth defaults (super-packets cross whole)")
    parser.add_argument("--switch", action="store_true", help="through a bridge (default: one veth pair)")
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32, help="send items per send_batch call (the engine uses 32)")
    parser.add_argument("--buffer-bytes", type=int, default=64 << 20, help="socket buffer asked for")
    parser.add_argument("--fill", action="store_true",
                        help="instead: how many datagrams a receive buffer holds when nobody reads it")
    parser.add_argument("--json", help="write every run here")
    args = parser.parse_args(argv)
    reason = unavailable_reason()
    if reason:
        print(f"bench_wire: skipped: {reason}")
        return 0
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench_wire-") as directory:
        binary = build(directory)
        for mtu in [int(m) for m in args.mtu.split(",")]:
            datagram = mtu - 28
            for wire in args.wire.split(","):
                with Hosts(2, mtu=mtu, switch=args.switch, wire=wire) as hosts:
                    print(f"# {hosts.describe()}; datagrams of {datagram} bytes, sends in batches of {args.batch}",
                          flush=True)
                    if args.fill:
                        print(f"{'variant':>8} {'rcvbuf granted':>14} {'datagrams held':>14} {'bytes held':>11} "
                              f"{'held/granted':>12}")
                    else:
                        print(f"{'variant':>12} {'GB/s recv':>9} {'runs':>23} {'GB/s sent':>9} {'delivered%':>10} "
                              f"{'dgrams/send msg':>15} {'dgrams/recv msg':>15} {'CPU s/GB':>8} {'sender':>6} "
                              f"{'receiver':>8} {'zc copied':>9}")
                    for variant in args.variants.split(","):
                        if args.fill:
                            got = fill_run(hosts, binary, variant, datagram, args.buffer_bytes)
                            runs.append(dict(mtu=mtu, wire=wire, variant=variant, fill=got))
                            print(f"{variant:>8} {got['receive_buffer_bytes']:>14} {got['datagrams']:>14} "
                                  f"{got['bytes']:>11} {got['bytes'] / got['receive_buffer_bytes']:>12.3f}", flush=True)
                            continue
                        results = [one_run(hosts, binary, variant, args.seconds, datagram, args.batch, args.buffer_bytes)
                                   for _ in range(args.repeats)]
                        runs.append(dict(mtu=mtu, wire=wire, variant=variant, runs=results))
                        received = [r["gbytes_per_s"] for _, r in results]
                        sent = [s["gbytes_per_s"] for s, _ in results]
                        delivered = [r["datagrams"] / max(r["datagrams"] + r["lost_before_last"], 1) for _, r in results]
                        send_ratio = statistics.median(s["send_gso_datagrams"] / max(s["send_gso_messages"], 1)
                                                       if s["send_gso_messages"] else 1.0 for s, _ in results)
                        recv_ratio = statistics.median(r["datagrams"] / max(r["recv_messages"], 1) for _, r in results)
                        bad = sum(r["wrong_size"] + r["reordered"] + r["foreign"] for _, r in results)
                        # CPU seconds per GB delivered: the whole machine's, the sender's and the receiver's own
                        per_gb = [[x / (max(r["bytes"], 1) / 1e9) for x in (r["machine_cpu_seconds"], s["cpu_seconds"],
                                                                      r["cpu_seconds"])] for s, r in results]
                        machine, sender_cpu, receiver_cpu = (statistics.median(c[i] for c in per_gb) for i in range(3))
                        copied = ("-" if variant != "raw+zerocopy" else
                                  f"{sum(s['zerocopy_copied'] for s, _ in results) / max(sum(s['zerocopy_completed'] for s, _ in results), 1):.0%}")
                        print(f"{variant:>12} {statistics.median(received):>9.3f} "
                              f"{'/'.join(f'{x:.2f}' for x in received):>23} {statistics.median(sent):>9.3f} "
                              f"{100 * statistics.median(delivered):>10.2f} {send_ratio:>15.1f} {recv_ratio:>15.1f}"
                              f" {machine:>8.3f} {sender_cpu:>6.3f} {receiver_cpu:>8.3f} {copied:>9}"
                              + (f"   {bad} datagrams reordered, of a wrong size or foreign!" if bad else "")
                              + (f"   waits for ring slots {sum(s['ring_waits'] for s, _ in results)}, for notice memory "
                                 f"{sum(s['buffer_waits'] for s, _ in results)}" if variant == "raw+zerocopy" else ""),
                              flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(dict(arguments=vars(args), runs=runs), out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
