"""Several "hosts" on one machine, for benchmarks across a wire instead of loopback.

Each host is a private network namespace with one interface, `eth0`, at a chosen
MTU (1500, or 9000 for jumbo frames) and an address in 198.18.0.0/15 (the
benchmarking range, RFC 2544). The hosts are joined by veth pairs to a Linux
bridge in a namespace of its own (the switch); two hosts may instead be joined
by one veth pair directly (`switch=False`). Nothing touches the machine's own
network namespace, and every namespace is deleted on close.

    with Hosts(4, mtu=1500, udp_loss=0.01, exempt_tcp_port=store_port) as hosts:
        with LocalCluster(4, hosts=hosts) as cluster: ...     # rank r runs in hosts.namespaces[r]
        hosts.run(0, ["ping", "-c1", hosts.addresses[1]])

What the links look like (so that figures mean what they would between real hosts):
- By default (`wire="segmented"`) every packet on a link is at most one MTU: each
  host's eth0 has TCP and UDP segmentation offload off, so a GSO/TSO super-packet
  is cut into MTU-sized packets where a NIC would cut it, when it leaves the host;
  the receiving eth0 has GRO on (veth then receives through NAPI, like a NIC
  driver), so the receiver coalesces again, as it would behind a real NIC.
  `wire="offload"` keeps veth's defaults: super-packets of up to 64 KiB cross
  whole, which no physical link does.
- Loss (`udp_loss`, `tcp_loss`) is real: nftables drops packets at random
  (`numgen random`) in the switch, on the bridge's forward path. There, each
  packet is one MTU-sized datagram; dropping on the receiving host's input hook
  (as kernel_loss.LossyNamespace does on loopback) would come after GRO and drop a
  whole train of up to 64 datagrams at once, and dropping on the sender's output
  would make sendto fail with EPERM instead of losing the packet. So loss needs
  the switch, and segmented links.
- Neighbours are static (permanent ARP entries), so a first burst is never
  dropped waiting for ARP resolution.

Needs root, iproute2 and nftables (for loss); see `unavailable_reason()`.
"""
import ctypes
import fcntl
import ipaddress
import json
import logging
import socket
import struct
import subprocess
import threading
import uuid

from .kernel_loss import loss_rules, unavailable_reason as _kernel_loss_unavailable
from .local_cluster import enter_network_namespace

log = logging.getLogger("ud_transport")

NETWORK = ipaddress.ip_network("198.18.0.0/15")
INTERFACE = "eth0"
MTUS = (1500, 9000)


def unavailable_reason():
    """None when hosts can be made here, else why not."""
    return _kernel_loss_unavailable()


def address_of(index):
    """The address of host `index` (0-based): 198.18.0.1, 198.18.0.2, ..."""
    if not 0 <= index < NETWORK.num_addresses - 2:
        raise ValueError(f"host index {index} outside {NETWORK}")
    return str(NETWORK.network_address + 1 + index)


# ---- offload features through the ethtool ioctl (no ethtool binary needed) ----------------
_SIOCETHTOOL = 0x8946
_ETHTOOL_GSTRINGS = 0x1B
_ETHTOOL_GSSET_INFO = 0x37
_ETHTOOL_GFEATURES = 0x3A
_ETHTOOL_SFEATURES = 0x3B
_ETH_SS_FEATURES = 4
_ETH_GSTRING_LEN = 32


def _ethtool(sock, device, buffer):
    request = struct.pack("16sP", device.encode(), ctypes.addressof(buffer)).ljust(40, b"\0")
    fcntl.ioctl(sock.fileno(), _SIOCETHTOOL, request)


def _feature_names(sock, device):
    info = ctypes.create_string_buffer(struct.pack("IIQI", _ETHTOOL_GSSET_INFO, 0, 1 << _ETH_SS_FEATURES, 0))
    _ethtool(sock, device, info)
    count = struct.unpack_from("I", info.raw, 16)[0]
    strings = ctypes.create_string_buffer(struct.pack("III", _ETHTOOL_GSTRINGS, _ETH_SS_FEATURES, count)
                                          + bytes(count * _ETH_GSTRING_LEN))
    _ethtool(sock, device, strings)
    raw = strings.raw[12:]
    return [raw[i * _ETH_GSTRING_LEN:(i + 1) * _ETH_GSTRING_LEN].split(b"\0")[0].decode() for i in range(count)]


def _features_here(device, changes):
    """In the calling thread's namespace: apply {feature name: bool}, return {name: active} of all features."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        names = _feature_names(sock, device)
        blocks = (len(names) + 31) // 32
        if changes:
            words = [0] * (2 * blocks)
            for name, on in changes.items():
                if name not in names:
                    raise ValueError(f"{device} has no feature {name!r}")
                bit = names.index(name)
                words[2 * (bit // 32)] |= 1 << (bit % 32)  # valid
                if on:
                    words[2 * (bit // 32) + 1] |= 1 << (bit % 32)  # requested
            request = ctypes.create_string_buffer(struct.pack(f"II{2 * blocks}I", _ETHTOOL_SFEATURES, blocks, *words))
            _ethtool(sock, device, request)
        state = ctypes.create_string_buffer(struct.pack("II", _ETHTOOL_GFEATURES, blocks) + bytes(16 * blocks))
        _ethtool(sock, device, state)
        active = struct.unpack_from(f"{4 * blocks}I", state.raw, 8)[2::4]
        return {name: bool(active[i // 32] >> (i % 32) & 1) for i, name in enumerate(names)}


def _in_namespace(namespace, function, *arguments):
    """Run function(*arguments) on a thread of its own that has entered `namespace`
    (setns changes only the calling thread, so this process stays where it is)."""
    outcome = {}

    def body():
        try:
            enter_network_namespace(namespace)
            outcome["value"] = function(*arguments)
        except BaseException as error:  # handed to the caller
            outcome["error"] = error

    thread = threading.Thread(target=body, name=f"netns-{namespace}")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def interface_features(namespace, device, changes=None):
    """Offload features of `device` in `namespace` ({"rx-gro": True, ...}), after applying `changes`.
    A change the driver cannot make leaves the feature as it was: that is logged as a warning."""
    changes = dict(changes or {})
    features = _in_namespace(namespace, _features_here, device, changes)
    refused = {name: on for name, on in changes.items() if features.get(name) != on}
    if refused:
        log.warning("hosts: %s in %s kept %s as they were (the driver refused the change)", device, namespace,
                    ", ".join(f"{name}={'on' if not on else 'off'}" for name, on in refused.items()))
    return features


_NO_SEGMENTATION_OFFLOAD = {"tx-udp-segmentation": False, "tx-tcp-segmentation": False, "tx-tcp-ecn-segmentation": False,
                            "tx-tcp-mangleid-segmentation": False, "tx-tcp6-segmentation": False}


def switch_without_ip_filtering(namespace):
    """Where br_netfilter is loaded, every frame the bridge forwards also passes the IP
    firewall hooks (net.bridge.bridge-nf-call-*, 1 in a new namespace): per-packet work a
    switch does not do, paid here by the CPUs the ranks run on. Off in the switch's namespace
    (the loss rules use the bridge family and do not need it); nothing to do without the module."""
    script = "for f in /proc/sys/net/bridge/bridge-nf-call-*; do [ -e \"$f\" ] && echo 0 > \"$f\"; done; true"
    subprocess.run(["ip", "netns", "exec", namespace, "sh", "-c", script], check=True, capture_output=True, text=True)


# ---- the hosts ---------------------------------------------------------------------------
class Hosts:
    """`count` hosts, each a network namespace (`namespaces[i]`, address `addresses[i]`, interface eth0).

    mtu: 1500 or 9000 (any value 68..65535 works; those two are what users have).
    switch: join through a bridge in its own namespace (default; needed for more than 2 hosts and for loss),
        or, for 2 hosts, one veth pair between them.
    udp_loss, tcp_loss: share of packets the switch drops at random; exempt_tcp_port: TCP traffic to or
        from this port is never dropped (a rendezvous store).
    wire: "segmented" (packets on a link are at most one MTU; the receiving host coalesces with GRO) or
        "offload" (veth defaults: super-packets cross whole). See the module docstring.
    """

    def __init__(self, count, *, mtu=1500, switch=True, udp_loss=0.0, tcp_loss=0.0, exempt_tcp_port=None,
                 wire="segmented", name=None):
        if count < 1:
            raise ValueError("need at least one host")
        if not 68 <= mtu <= 65535:
            raise ValueError(f"mtu {mtu} outside 68..65535")
        if not switch and count != 2:
            raise ValueError("without a switch, exactly two hosts (one veth pair)")
        if (udp_loss or tcp_loss) and not switch:
            raise ValueError("loss is applied in the switch: use switch=True")
        if wire not in ("segmented", "offload"):
            raise ValueError("wire must be 'segmented' or 'offload'")
        if (udp_loss or tcp_loss) and wire != "segmented":
            raise ValueError("with wire='offload' a dropped packet can be 64 datagrams: loss needs wire='segmented'")
        for p in (udp_loss, tcp_loss):
            if not 0 <= p <= 1:
                raise ValueError("loss must be in [0, 1]")
        self.count, self.mtu, self.switch, self.wire = count, mtu, switch, wire
        self.udp_loss, self.tcp_loss, self.exempt_tcp_port = udp_loss, tcp_loss, exempt_tcp_port
        token = name or uuid.uuid4().hex[:8]
        self.namespaces = [f"udt-{token}-h{i}" for i in range(count)]
        self.switch_namespace = f"udt-{token}-sw" if switch else None
        self.addresses = [address_of(i) for i in range(count)]
        self.interface = INTERFACE
        self._created = []

    # -- setup --
    def _ip(self, namespace, *arguments):
        subprocess.run(["ip", "-n", namespace, *arguments], check=True, capture_output=True, text=True)

    def _add_namespace(self, namespace):
        subprocess.run(["ip", "netns", "add", namespace], check=True, capture_output=True, text=True)
        self._created.append(namespace)
        self._ip(namespace, "link", "set", "lo", "up")

    def __enter__(self):
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(f"cannot create hosts: {reason}")
        try:
            self._build()
        except subprocess.CalledProcessError as error:
            self.close()
            raise RuntimeError(f"hosts: `{' '.join(error.cmd)}` failed: {error.stderr.strip()}") from error
        except BaseException:
            self.close()
            raise
        return self

    def _build(self):
        for namespace in self.namespaces:
            self._add_namespace(namespace)
        if self.switch:
            sw = self.switch_namespace
            self._add_namespace(sw)
            self._ip(sw, "link", "add", "br0", "type", "bridge", "stp_state", "0", "forward_delay", "0")
            for i, namespace in enumerate(self.namespaces):
                port = f"p{i}"
                self._ip(sw, "link", "add", port, "mtu", str(self.mtu), "type", "veth", "peer", "name", INTERFACE,
                         "netns", namespace)
                self._ip(sw, "link", "set", port, "master", "br0", "up")
            self._ip(sw, "link", "set", "br0", "mtu", str(self.mtu), "up")
            switch_without_ip_filtering(sw)
        else:
            a, b = self.namespaces
            self._ip(a, "link", "add", INTERFACE, "mtu", str(self.mtu), "type", "veth", "peer", "name", INTERFACE,
                     "netns", b)
        prefix = NETWORK.prefixlen
        for namespace, address in zip(self.namespaces, self.addresses):
            self._ip(namespace, "link", "set", INTERFACE, "mtu", str(self.mtu), "up")
            self._ip(namespace, "addr", "add", f"{address}/{prefix}", "dev", INTERFACE)
        if self.wire == "segmented":
            for i, namespace in enumerate(self.namespaces):
                interface_features(namespace, INTERFACE, {**_NO_SEGMENTATION_OFFLOAD, "rx-gro": True})
                if self.switch:
                    # veth only hands a packet to its peer's GRO when the sending end has no TSO
                    # (veth_skb_is_eligible_for_gro), so the switch's ports must not claim it either
                    interface_features(self.switch_namespace, f"p{i}", _NO_SEGMENTATION_OFFLOAD)
        self._static_neighbours()
        if self.udp_loss or self.tcp_loss:
            subprocess.run(["ip", "netns", "exec", self.switch_namespace, "nft", "-f", "-"], check=True, text=True,
                           capture_output=True, input=loss_rules(self.udp_loss, self.tcp_loss, self.exempt_tcp_port,
                                                                  table="bridge udt_wire_loss", chain="forward"))

    def _static_neighbours(self):
        macs = []
        for namespace in self.namespaces:
            out = subprocess.run(["ip", "-n", namespace, "-j", "link", "show", INTERFACE], check=True,
                                 capture_output=True, text=True).stdout
            macs.append(json.loads(out)[0]["address"])
        for i, namespace in enumerate(self.namespaces):
            for j, (address, mac) in enumerate(zip(self.addresses, macs)):
                if i != j:
                    self._ip(namespace, "neigh", "replace", address, "lladdr", mac, "dev", INTERFACE, "nud", "permanent")

    # -- use --
    def command(self, index, argv):
        """argv run inside host `index`."""
        return ["ip", "netns", "exec", self.namespaces[index], *argv]

    def run(self, index, argv, **kwargs):
        """subprocess.run(argv) inside host `index`."""
        return subprocess.run(self.command(index, argv), **kwargs)

    def popen(self, index, argv, **kwargs):
        return subprocess.Popen(self.command(index, argv), **kwargs)

    def rank_environment(self, index):
        """What a rank on host `index` needs: the rendezvous store on host 0, its own bind address,
        and the interface Gloo should use."""
        return {"MASTER_ADDR": self.addresses[0], "UD_BIND_ADDRESS": self.addresses[index],
                "GLOO_SOCKET_IFNAME": self.interface}

    def socket(self, index, family=socket.AF_INET, type=socket.SOCK_DGRAM):
        """A socket that lives in host `index` (usable from any thread of this process)."""
        return _in_namespace(self.namespaces[index], socket.socket, family, type)

    def in_host(self, index, function, *arguments):
        """function(*arguments) called on a thread inside host `index`: whatever it opens (a socket, a
        transport) belongs to that host's network."""
        return _in_namespace(self.namespaces[index], function, *arguments)

    def features(self, index):
        """eth0's offload features on host `index` ({name: active})."""
        return interface_features(self.namespaces[index], INTERFACE)

    def counters(self):
        """The switch's nftables rule set with packet counters (empty without loss)."""
        if not self.switch_namespace:
            return ""
        out = subprocess.run(["ip", "netns", "exec", self.switch_namespace, "nft", "list", "ruleset"],
                             capture_output=True, text=True)
        return out.stdout

    def dropped_packets(self, protocol="udp"):
        """Packets of `protocol` the switch has dropped so far."""
        for line in self.counters().splitlines():
            if f"l4proto {protocol}" in line and line.rstrip().endswith("drop"):
                return int(line.split("packets", 1)[1].split()[0])
        return 0

    def describe(self):
        """One line for a benchmark's header."""
        topology = f"{self.count} namespaces on a bridge" if self.switch else "2 namespaces on a veth pair"
        loss = []
        if self.udp_loss:
            loss.append(f"UDP {self.udp_loss:.2%}")
        if self.tcp_loss:
            loss.append(f"TCP {self.tcp_loss:.2%}")
        wire = "MTU-sized packets on the links, GRO at the receiver" if self.wire == "segmented" else "veth offloads"
        return (f"{topology}, MTU {self.mtu}, {wire}"
                + (f", switch drops {' and '.join(loss)} at random (nftables)" if loss else ", no loss"))

    def close(self):
        for namespace in reversed(self._created):
            subprocess.run(["ip", "netns", "del", namespace], check=False, capture_output=True)
        self._created = []

    def __exit__(self, *exc):
        self.close()


class RankNetwork:
    """Where a benchmark's local ranks talk, made and removed as one: loopback; loopback in a
    private namespace that drops `kernel_loss` of UDP and TCP (kernel_loss.LossyNamespace); or,
    with `hosts="veth"`, a host per rank (Hosts: a veth pair for 2 ranks, the bridge for more or
    under loss). The store's TCP port is exempt from loss.

        with RankNetwork(4, store_port=port, hosts="veth", kernel_loss=0.01) as network:
            with LocalCluster(4, store_port=port, **network.cluster_arguments) as cluster: ...

    `where` describes it for a benchmark's header."""

    def __init__(self, world_size, *, store_port, hosts="loopback", mtu=1500, kernel_loss=0.0, switch=False):
        self.world_size, self.store_port, self.hosts_kind = world_size, store_port, hosts
        self.mtu, self.kernel_loss, self.switch = mtu, kernel_loss, switch
        self.hosts = self.namespace = None
        self.where = "loopback"

    def __enter__(self):
        from .kernel_loss import LossyNamespace

        if self.hosts_kind == "veth":
            self.hosts = Hosts(self.world_size, mtu=self.mtu,
                               switch=self.switch or self.world_size > 2 or self.kernel_loss > 0,
                               udp_loss=self.kernel_loss, tcp_loss=self.kernel_loss, exempt_tcp_port=self.store_port)
            self.hosts.__enter__()
            self.where = self.hosts.describe()
        elif self.kernel_loss:
            self.namespace = LossyNamespace(udp_loss=self.kernel_loss, tcp_loss=self.kernel_loss,
                                            exempt_tcp_port=self.store_port)
            self.namespace.__enter__()
        return self

    @staticmethod
    def unavailable_reason(hosts="loopback", kernel_loss=0.0):
        """None when this network can be made here, else why not (hosts and loss need root,
        iproute2 and nftables)."""
        return unavailable_reason() if hosts == "veth" or kernel_loss else None

    @property
    def description(self):
        """`where`, with the loss on loopback (Hosts.describe names its own)."""
        if self.hosts is None and self.kernel_loss:
            return f"{self.where}, {self.kernel_loss:.2%} of UDP and TCP packets dropped"
        return self.where

    @property
    def cluster_arguments(self):
        """LocalCluster's keyword arguments for ranks on this network."""
        return dict(hosts=self.hosts, netns=self.namespace.name if self.namespace else None)

    def close(self):
        for made in (self.namespace, self.hosts):
            if made:
                made.close()
        self.hosts = self.namespace = None

    def __exit__(self, *exc):
        self.close()


def run_on_network(world_size, function, *arguments, hosts="loopback", mtu=1500, kernel_loss=0.0, timeout_s=3600,
                   **cluster_options):
    """function(comm, *arguments) on every rank of a LocalCluster on a RankNetwork made for it;
    returns (the results in rank order, the network's description)."""
    from .local_cluster import LocalCluster, free_tcp_port

    port = free_tcp_port()
    with RankNetwork(world_size, store_port=port, hosts=hosts, mtu=mtu, kernel_loss=kernel_loss) as network:
        with LocalCluster(world_size, store_port=port, **network.cluster_arguments, **cluster_options) as cluster:
            return cluster.run(function, *arguments, timeout_s=timeout_s), network.description


def main(argv=None):
    """python -m ud_transport.lab.hosts [N] [MTU]: build hosts, print what they look like, remove them."""
    import sys

    argv = sys.argv[1:] if argv is None else argv
    count = int(argv[0]) if argv else 2
    mtu = int(argv[1]) if len(argv) > 1 else 1500
    reason = unavailable_reason()
    if reason:
        print(f"hosts: {reason}")
        return 0
    with Hosts(count, mtu=mtu) as hosts:
        print(hosts.describe())
        for i in range(count):
            features = hosts.features(i)
            shown = {k: features[k] for k in ("tx-udp-segmentation", "tx-tcp-segmentation", "rx-gro") if k in features}
            print(f"  {hosts.namespaces[i]} {hosts.addresses[i]} {shown}")
        if count > 1:
            with hosts.socket(1) as receiver, hosts.socket(0) as sender:
                receiver.bind((hosts.addresses[1], 0))
                receiver.settimeout(1.0)
                sender.sendto(b"x" * (mtu - 28), receiver.getsockname())
                try:
                    data, source = receiver.recvfrom(65536)
                    print(f"  {len(data)}-byte datagram from {source[0]} reached {hosts.addresses[1]}")
                except socket.timeout:
                    print(f"  no datagram from host 0 reached {hosts.addresses[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
