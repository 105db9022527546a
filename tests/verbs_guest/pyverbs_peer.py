"""A UD peer written with Debian's pyverbs (python3-pyverbs), for the interop test.

Runs under /usr/bin/python3 (a different interpreter from the project's), imports nothing of
ud_transport, and knows nothing of its wire format: it sends the bytes it is given and reports
the bytes it receives. Protocol: one JSON object per line on stdin, one reply per line on stdout.

    started:  {"gid": hex, "qpn": n, "stranger_qpn": n, "mtu": n}
    {"op": "send", "items": [{"hex", "dgid", "dqpn", "qkey", "from": "main"|"stranger"}]} -> {"sent": n}
    {"op": "wait_for", "prefix": hex, "timeout": s}  -> {"found": bool}   (a datagram starting so)
    {"op": "collect", "idle": s}                      -> {"received": [{"src_qp", "hex", "grh"}]}
    {"op": "quit"}
"""
import argparse
import json
import sys
import time

import pyverbs.enums as e
from pyverbs.addr import AH, AHAttr, GID, GlobalRoute
from pyverbs.cq import CQ
from pyverbs.device import Context
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.wr import SGE, RecvWR, SendWR

GRH = 40
RECEIVES = 256


def gid_text(raw):
    return ":".join(raw[i:i + 2].hex() for i in range(0, 16, 2))


class Peer:
    def __init__(self, device, port, gid_index, qkey):
        self.port, self.gid_index, self.qkey = port, gid_index, qkey
        self.context = Context(name=device)
        self.mtu = {e.IBV_MTU_1024: 1024, e.IBV_MTU_2048: 2048, e.IBV_MTU_4096: 4096}.get(
            self.context.query_port(port).active_mtu, 1024)
        self.pd = PD(self.context)
        self.cq = CQ(self.context, 2 * RECEIVES + 64)
        self.slot = GRH + self.mtu
        self.recv_mr = MR(self.pd, RECEIVES * self.slot, e.IBV_ACCESS_LOCAL_WRITE)
        self.send_mr = MR(self.pd, self.mtu, e.IBV_ACCESS_LOCAL_WRITE)
        self.qps = {name: self._qp() for name in ("main", "stranger")}
        for slot in range(RECEIVES):
            self._post_receive(slot)
        self.received = []
        self.ahs = {}

    def _qp(self):
        cap = QPCap(max_send_wr=64, max_recv_wr=RECEIVES, max_send_sge=1, max_recv_sge=1)
        attr = QPAttr()
        attr.qkey = self.qkey
        attr.port_num = self.port
        attr.pkey_index = 0
        return QP(self.pd, QPInitAttr(qp_type=e.IBV_QPT_UD, scq=self.cq, rcq=self.cq, cap=cap), attr)  # -> RTS

    def _post_receive(self, slot):
        sge = SGE(self.recv_mr.buf + slot * self.slot, self.slot, self.recv_mr.lkey)
        self.qps["main"].post_recv(RecvWR(wr_id=slot, num_sge=1, sg=[sge]))

    def gid(self):
        return bytes.fromhex(str(self.context.query_gid(self.port, self.gid_index)).replace(":", ""))

    def _ah(self, dgid_hex):
        if dgid_hex not in self.ahs:
            route = GlobalRoute(dgid=GID(gid_text(bytes.fromhex(dgid_hex))), sgid_index=self.gid_index, hop_limit=64)
            self.ahs[dgid_hex] = AH(self.pd, attr=AHAttr(gr=route, is_global=1, port_num=self.port))
        return self.ahs[dgid_hex]

    def poll(self):
        """Record received datagrams (and re-post their buffers); returns how many completions."""
        count, completions = self.cq.poll(num_entries=32)
        for wc in completions[:count]:
            if wc.opcode & e.IBV_WC_RECV:
                self._record(wc)
            elif wc.status != e.IBV_WC_SUCCESS:
                raise RuntimeError(f"send completed with status {wc.status}")
        return count

    def send(self, items):
        for item in items:
            data = bytes.fromhex(item["hex"])
            if data:
                self.send_mr.write(data, len(data), 0)
            wr = SendWR(wr_id=1, opcode=e.IBV_WR_SEND, num_sge=1, sg=[SGE(self.send_mr.buf, len(data), self.send_mr.lkey)],
                        send_flags=e.IBV_SEND_SIGNALED)
            wr.set_wr_ud(self._ah(item["dgid"]), item["dqpn"], item["qkey"])
            self.qps[item.get("from", "main")].post_send(wr)
            deadline = time.monotonic() + 10
            while True:  # the buffer is reused: wait for this send's completion
                count, completions = self.cq.poll(num_entries=1)
                if count:
                    wc = completions[0]
                    if wc.opcode & e.IBV_WC_RECV:
                        self._record(wc)
                        continue
                    if wc.status != e.IBV_WC_SUCCESS:
                        raise RuntimeError(f"send completed with status {wc.status}")
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("send did not complete")
        return len(items)

    def _record(self, wc):
        """Keep a datagram that reached the main QP and post its buffer again."""
        if wc.status != e.IBV_WC_SUCCESS:
            raise RuntimeError(f"receive completed with status {wc.status}")
        if wc.qp_num == self.qps["main"].qp_num:
            data = self.recv_mr.read(wc.byte_len, wc.wr_id * self.slot)
            self.received.append({"src_qp": wc.src_qp, "hex": data[GRH:].hex(), "grh": data[:GRH].hex()})
            self._post_receive(wc.wr_id)

    def wait_for(self, prefix, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(r["hex"].startswith(prefix) for r in self.received):
                return True
            if not self.poll():
                time.sleep(0.001)
        return any(r["hex"].startswith(prefix) for r in self.received)

    def collect(self, idle):
        last = time.monotonic()
        while time.monotonic() - last < idle:
            if self.poll():
                last = time.monotonic()
            else:
                time.sleep(0.002)
        received, self.received = self.received, []
        return received


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", required=True)
    parser.add_argument("--port", type=int, default=1)
    parser.add_argument("--gid-index", type=int, required=True)
    parser.add_argument("--qkey", type=int, required=True)
    arguments = parser.parse_args()
    peer = Peer(arguments.device, arguments.port, arguments.gid_index, arguments.qkey)

    def reply(value):
        sys.stdout.write(json.dumps(value) + "\n")
        sys.stdout.flush()

    reply({"gid": peer.gid().hex(), "qpn": peer.qps["main"].qp_num, "stranger_qpn": peer.qps["stranger"].qp_num,
           "mtu": peer.mtu})
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "send":
            reply({"sent": peer.send(command["items"])})
        elif command["op"] == "wait_for":
            reply({"found": peer.wait_for(command["prefix"], command["timeout"])})
        elif command["op"] == "collect":
            reply({"received": peer.collect(command["idle"])})
        elif command["op"] == "quit":
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
