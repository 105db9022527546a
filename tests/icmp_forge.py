"""Forged ICMP errors, sent from a raw socket (root only) to a rank's UDP socket on loopback, as
an attacker who can reach the rank would send them: each quotes a datagram the rank never sent
(from its port to a peer's), carrying a wire header with a session id of the forger's choice."""
import socket
import struct

from wire_format import HEADER, MAGIC, VERSION

# (type, code) of every ICMP error a UDP socket hears of: destination unreachable 0-15, time
# exceeded 0-1, parameter problem 0.
ALL_ERRORS = [(3, code) for code in range(16)] + [(11, 0), (11, 1), (12, 0)]


def raw_socket_available():
    try:
        socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP).close()
        return True
    except PermissionError:
        return False


def _checksum(data):
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def endpoint(address):
    """(host, port) of a communicator's 6-byte UDP address (IPv4, then the port in network order)."""
    return socket.inet_ntoa(address[:4]), struct.unpack("!H", address[4:6])[0]


def quoted_datagram(session_id, sender_rank, sequence=1):
    """The first bytes of a datagram as the wire format has them (a JOIN request)."""
    return HEADER.pack(MAGIC, VERSION, 5, 0, 0, session_id, sequence, 0, sender_rank, 0, 0, 0, 0, 0, 0)


def icmp_error(kind, code, victim, peer, quoted):
    """An ICMP error (kind, code) saying that `quoted`, sent from `victim` to `peer` ((host, port)
    each), could not be delivered."""
    udp = struct.pack("!HHHH", victim[1], peer[1], 8 + len(quoted), 0) + quoted
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0x1234, 0, 64, socket.IPPROTO_UDP, 0,
                     socket.inet_aton(victim[0]), socket.inet_aton(peer[0]))
    ip = ip[:10] + struct.pack("!H", _checksum(ip)) + ip[12:]
    rest = struct.pack("!HH", 0, 1400 if (kind, code) == (3, 4) else 0)  # a plausible next-hop MTU for "fragmentation needed"
    body = struct.pack("!BBH", kind, code, 0) + rest + ip + udp
    return body[:2] + struct.pack("!H", _checksum(body)) + body[4:]


class Forger:
    """A raw ICMP socket that sends errors to `victim` ((host, port)) about datagrams to `peer`."""

    def __init__(self, victim, peer, session_id, sender_rank):
        self.victim, self.peer = victim, peer
        self.quoted = quoted_datagram(session_id, sender_rank)
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)

    def send(self, kind=3, code=3):
        self.socket.sendto(icmp_error(kind, code, self.victim, self.peer, self.quoted), (self.victim[0], 0))

    def close(self):
        self.socket.close()


def storm(targets, session_id, rate, stop, counter):
    """Send forged ICMP errors of every type and code, round robin over `targets` (a list of
    (victim, peer, sender_rank)), at `rate` packets a second until `stop` (an Event) is set;
    `counter` (a Value) ends as the number sent. Runs in its own process."""
    import time

    forgers = [Forger(victim, peer, session_id, sender) for victim, peer, sender in targets]
    kinds = ALL_ERRORS
    sent, start = 0, time.monotonic()
    while not stop.is_set():
        for _ in range(50):  # a batch, then sleep to keep the pace
            forgers[sent % len(forgers)].send(*kinds[sent % len(kinds)])
            sent += 1
        ahead = sent / rate - (time.monotonic() - start)
        if ahead > 0:
            time.sleep(ahead)
    counter.value = sent
    for forger in forgers:
        forger.close()
