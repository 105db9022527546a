"""Real packet loss from the kernel, without a VM: a private network namespace
whose nftables input hook drops packets at random (the output hook would make
sendto fail with EPERM instead of losing the packet). Needs root, iproute2
and nftables. Traffic never leaves the namespace's own loopback."""
import os
import re
import shutil
import subprocess
import uuid


def unavailable_reason():
    """None when a lossy namespace can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root to create a network namespace"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"needs the '{tool}' command (apt-get install {'iproute2' if tool == 'ip' else 'nftables'})"
    return None


def loss_rules(udp_loss, tcp_loss, exempt_tcp_port, table="inet udt_loss", chain="input"):
    """nftables rules dropping UDP and TCP packets at random on the hook `chain` of `table`
    (a namespace's input here, a bridge's forward path in ud_transport.lab.hosts). The exemption
    is a separate accept rule: on the kernels and nftables we run, `tcp sport != P tcp
    dport != P` matched every packet."""
    per_million = lambda p: int(round(p * 1_000_000))  # noqa: E731
    lines = [f"table {table} {{", f"  chain {chain} {{", f"    type filter hook {chain} priority 0; policy accept;"]
    if tcp_loss > 0 and exempt_tcp_port:
        lines.append(f"    tcp dport {exempt_tcp_port} counter accept")
        lines.append(f"    tcp sport {exempt_tcp_port} counter accept")
    if udp_loss > 0:
        lines.append(f"    meta l4proto udp numgen random mod 1000000 < {per_million(udp_loss)} counter drop")
    if tcp_loss > 0:
        lines.append(f"    meta l4proto tcp numgen random mod 1000000 < {per_million(tcp_loss)} counter drop")
    lines += ["  }", "}"]
    return "\n".join(lines) + "\n"


class LossyNamespace:
    """with LossyNamespace(udp_loss=0.01, tcp_loss=0.01) as ns: ... ns.name ..."""

    def __init__(self, udp_loss=0.0, tcp_loss=0.0, exempt_tcp_port=None, name=None):
        self.name = name or f"udt-{uuid.uuid4().hex[:8]}"
        self.udp_loss, self.tcp_loss, self.exempt_tcp_port = udp_loss, tcp_loss, exempt_tcp_port

    def __enter__(self):
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(f"cannot create a lossy network namespace: {reason}")
        subprocess.run(["ip", "netns", "add", self.name], check=True)
        try:
            subprocess.run(["ip", "-n", self.name, "link", "set", "lo", "up"], check=True)
            subprocess.run(["ip", "netns", "exec", self.name, "nft", "-f", "-"], check=True, text=True,
                           input=loss_rules(self.udp_loss, self.tcp_loss, self.exempt_tcp_port))
        except BaseException:
            self.close()
            raise
        return self

    def counters(self):
        """The nftables rule set with packet counters, for diagnostics."""
        out = subprocess.run(["ip", "netns", "exec", self.name, "nft", "list", "ruleset"], capture_output=True, text=True)
        return out.stdout

    def dropped_packets(self, protocol="udp"):
        """Packets the drop rule for `protocol` has dropped so far."""
        for line in self.counters().splitlines():
            if f"l4proto {protocol}" in line and line.rstrip().endswith("drop"):
                return int(re.search(r"packets (\d+)", line).group(1))
        return 0

    def close(self):
        subprocess.run(["ip", "netns", "del", self.name], check=False, capture_output=True)

    def __exit__(self, *exc):
        self.close()
