"""Facts of libibverbs and rxe that the verbs transport is built on, observed through Debian's pyverbs.

Runs under /usr/bin/python3 (python3-pyverbs; not the project's interpreter) in the SoftRoCE
guest, imports nothing of ud_transport, and only observes: it prints one JSON object, a dict of
what each experiment saw, and tests/verbs_guest/guest_bindings.py asserts on it. An experiment
that raises reports {"error": text} instead, so the others still report.

    pyverbs_facts.py --device rxe0 --port 1 --gid-index 1 --qkey 0x1234

missing_qpn        a UD send to a QPN nobody has: its completion, what arrived; then the same
                   send to a real QPN (arrives with the 40-byte GRH in front); the sender's state
oversized_send     a UD send of active MTU + 1 bytes, then one of exactly the MTU: completions, arrivals
privileged_qkey    RESET -> INIT with Q_Key 0x80000000, and with an ordinary Q_Key, by this process
                   (run it without CAP_NET_RAW, as guest_bindings.py does, to see what a rank without
                   privileges gets)
unpopulated_gid_ah an address handle whose source GID index has no GID
"""
import argparse
import json
import sys
import time
import traceback

import pyverbs.enums as e
from pyverbs.addr import AH, AHAttr, GID, GlobalRoute
from pyverbs.cq import CQ
from pyverbs.device import Context
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.pyverbs_error import PyverbsError
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.wr import SGE, RecvWR, SendWR

GRH = 40
PRIVILEGED_QKEY = 0x80000000
UNPOPULATED_GID_INDEX = 200  # inside rxe's 1024-entry table, never populated on the rig
CAP_NET_RAW = 13
MTU_BYTES = {e.IBV_MTU_256: 256, e.IBV_MTU_512: 512, e.IBV_MTU_1024: 1024, e.IBV_MTU_2048: 2048, e.IBV_MTU_4096: 4096}
STATES = {e.IBV_QPS_RESET: "RESET", e.IBV_QPS_INIT: "INIT", e.IBV_QPS_RTR: "RTR", e.IBV_QPS_RTS: "RTS",
          e.IBV_QPS_SQD: "SQD", e.IBV_QPS_SQE: "SQE", e.IBV_QPS_ERR: "ERR"}


def gid_text(raw):
    return ":".join(raw[i:i + 2].hex() for i in range(0, 16, 2))


def errno_of(error):
    return getattr(error, "error_code", None)


class Bench:
    """One device, two UD QPs in RTS (each with its own CQ), registered send and receive buffers."""

    def __init__(self, device, port, gid_index, qkey):
        self.port, self.gid_index, self.qkey = port, gid_index, qkey
        self.context = Context(name=device)
        self.mtu = MTU_BYTES[self.context.query_port(port).active_mtu]
        self.gid = bytes.fromhex(str(self.context.query_gid(port, gid_index)).replace(":", ""))
        self.pd = PD(self.context)
        self.slot = GRH + 2 * self.mtu  # room for a datagram above the MTU, were one delivered
        self.send_mr = MR(self.pd, 2 * self.mtu, e.IBV_ACCESS_LOCAL_WRITE)
        self.recv_mr = MR(self.pd, 16 * self.slot, e.IBV_ACCESS_LOCAL_WRITE)
        self.sender, self.send_cq = self.rts_qp()
        self.receiver, self.recv_cq = self.rts_qp()
        route = GlobalRoute(dgid=GID(gid_text(self.gid)), sgid_index=gid_index, hop_limit=64)
        self.ah = AH(self.pd, attr=AHAttr(gr=route, is_global=1, port_num=port))
        for slot in range(16):
            sge = SGE(self.recv_mr.buf + slot * self.slot, self.slot, self.recv_mr.lkey)
            self.receiver.post_recv(RecvWR(wr_id=slot, num_sge=1, sg=[sge]))

    def qp(self, attr=None):
        cq = CQ(self.context, 64)
        cap = QPCap(max_send_wr=16, max_recv_wr=16, max_send_sge=1, max_recv_sge=1)
        init = QPInitAttr(qp_type=e.IBV_QPT_UD, scq=cq, rcq=cq, cap=cap)
        return (QP(self.pd, init, attr) if attr is not None else QP(self.pd, init)), cq

    def rts_qp(self):
        attr = QPAttr()
        attr.qkey, attr.port_num, attr.pkey_index = self.qkey, self.port, 0
        return self.qp(attr)  # pyverbs takes a UD QP given attributes through INIT, RTR to RTS

    def state(self, qp):
        attr, _ = qp.query(e.IBV_QP_STATE)
        return STATES.get(attr.qp_state, str(attr.qp_state))

    def send(self, data, qpn, wr_id):
        self.send_mr.write(data, len(data), 0)
        wr = SendWR(wr_id=wr_id, opcode=e.IBV_WR_SEND, num_sge=1, sg=[SGE(self.send_mr.buf, len(data), self.send_mr.lkey)],
                    send_flags=e.IBV_SEND_SIGNALED)
        wr.set_wr_ud(self.ah, qpn, self.qkey)
        self.sender.post_send(wr)

    def drain(self, seconds=1.0):
        """(send completions [[wr_id, status]], arrivals [{status, byte_len, src_qp, data hex after the GRH}])."""
        sends, arrivals = [], []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            count, completions = self.send_cq.poll(num_entries=16)
            sends += [[wc.wr_id, wc.status] for wc in completions[:count]]
            count, completions = self.recv_cq.poll(num_entries=16)
            for wc in completions[:count]:
                data = self.recv_mr.read(min(wc.byte_len, self.slot), wc.wr_id * self.slot)
                arrivals.append({"status": wc.status, "byte_len": wc.byte_len, "src_qp": wc.src_qp,
                                 "data": data[GRH:].hex()})
            time.sleep(0.005)
        return sends, arrivals


def missing_qpn(bench):
    payload = b"lost in space"
    missing = max(bench.sender.qp_num, bench.receiver.qp_num) + 1000
    bench.send(payload, missing, wr_id=1)
    lost_sends, lost_arrivals = bench.drain()
    bench.send(payload, bench.receiver.qp_num, wr_id=2)
    sends, arrivals = bench.drain()
    return {"missing_qpn": missing, "sender_qpn": bench.sender.qp_num, "payload": payload.hex(),
            "lost": {"sends": lost_sends, "arrivals": lost_arrivals},
            "control": {"sends": sends, "arrivals": arrivals}, "sender_state": bench.state(bench.sender)}


def oversized_send(bench):
    bench.send(bytes(bench.mtu + 1), bench.receiver.qp_num, wr_id=1)
    over_sends, over_arrivals = bench.drain()
    bench.send(bytes(bench.mtu), bench.receiver.qp_num, wr_id=2)
    sends, arrivals = bench.drain()
    for arrival in over_arrivals + arrivals:
        del arrival["data"]
    return {"mtu": bench.mtu, "oversized": {"sends": over_sends, "arrivals": over_arrivals},
            "at_mtu": {"sends": sends, "arrivals": arrivals}, "sender_state": bench.state(bench.sender)}


def privileged_qkey(bench):
    with open("/proc/self/status") as status:
        effective = int(next(line for line in status if line.startswith("CapEff:")).split()[1], 16)
    result = {"cap_net_raw": bool(effective >> CAP_NET_RAW & 1)}
    for name, qkey in (("privileged", PRIVILEGED_QKEY), ("ordinary", bench.qkey)):
        qp, _ = bench.qp()
        attr = QPAttr()
        attr.qkey, attr.port_num, attr.pkey_index = qkey, bench.port, 0
        try:
            qp.to_init(attr)
            result[name] = {"errno": None, "state": bench.state(qp)}
        except PyverbsError as error:
            result[name] = {"errno": errno_of(error), "state": bench.state(qp), "message": str(error)}
    return result


def unpopulated_gid_ah(bench):
    route = GlobalRoute(dgid=GID(gid_text(bench.gid)), sgid_index=UNPOPULATED_GID_INDEX, hop_limit=64)
    try:
        AH(bench.pd, attr=AHAttr(gr=route, is_global=1, port_num=bench.port))
        return {"gid_index": UNPOPULATED_GID_INDEX, "errno": None}
    except PyverbsError as error:
        return {"gid_index": UNPOPULATED_GID_INDEX, "errno": errno_of(error), "message": str(error)}


EXPERIMENTS = [missing_qpn, oversized_send, privileged_qkey, unpopulated_gid_ah]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", required=True)
    parser.add_argument("--port", type=int, default=1)
    parser.add_argument("--gid-index", type=int, required=True)
    parser.add_argument("--qkey", type=lambda text: int(text, 0), required=True)
    arguments = parser.parse_args()
    bench = Bench(arguments.device, arguments.port, arguments.gid_index, arguments.qkey)
    seen = {}
    for experiment in EXPERIMENTS:
        try:
            seen[experiment.__name__] = experiment(bench)
        except Exception:  # noqa: BLE001 - reported, and the test of this experiment fails with it
            seen[experiment.__name__] = {"error": traceback.format_exc()}
    json.dump(seen, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
