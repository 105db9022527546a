"""Shell scripts for ``rig check``: what the rig must show to be trusted."""

from __future__ import annotations

# rxe0 is listed, ACTIVE, and has the 4096-byte MTU that the veth/NIC MTU of 9000 gives.
DEVICE = (
    "set -e; echo '== ibv_devices'; ibv_devices; echo '== ibv_devinfo -d rxe0'; ibv_devinfo -d rxe0; "
    "echo '== rdma link'; rdma link show; "
    "ibv_devinfo -d rxe0 | grep -q PORT_ACTIVE || { echo 'rxe0 port is not ACTIVE'; exit 1; }; "
    "ibv_devinfo -d rxe0 | grep -q 'active_mtu:.*4096' || { echo 'rxe0 active_mtu is not 4096'; exit 1; }"
)

# UD traffic between two processes on the one rxe device (rxe loops back internally).
PERF_ONE_GUEST = (
    "set -e; echo '== ibv_ud_pingpong -g 1 (server and client in this guest)'; "
    "ibv_ud_pingpong -d rxe0 -g 1 -n 1000 > /tmp/pingpong-server.log 2>&1 & server=$!; sleep 1; "
    "ibv_ud_pingpong -d rxe0 -g 1 -n 1000 127.0.0.1; wait $server; cat /tmp/pingpong-server.log; "
    "echo '== ib_send_bw -c UD -x 1'; "
    "ib_send_bw -d rxe0 -c UD -x 1 > /tmp/send-bw-server.log 2>&1 & server=$!; sleep 2; "
    "ib_send_bw -d rxe0 -c UD -x 1 127.0.0.1; wait $server"
)

# UD pingpong across the link between two guests (node 1 is the client).
PINGPONG_TWO_GUESTS = (
    "set -e; ibv_devinfo -d rxe0 | grep -E 'state|active_mtu'; "
    'if [ "$UD_RIG_NODE" = 0 ]; then ibv_ud_pingpong -d rxe0 -g 1 -n 1000; '
    'else sleep 1; ibv_ud_pingpong -d rxe0 -g 1 -n 1000 "$UD_RIG_PEER_IP"; fi'
)
