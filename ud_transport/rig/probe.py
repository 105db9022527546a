"""List RDMA devices and port 1's state through libibverbs with ctypes (no ibverbs-utils needed).

``python -m ud_transport.rig.probe`` prints one line per device::

    rxe0 state=4 active_mtu=4096 max_mtu=4096

and exits non-zero when libibverbs lists no device. Used by the rig's integration test.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# enum ibv_mtu: 1..5 -> 256..4096
_MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}


def probe() -> list[tuple[str, int, int, int]]:
    """[(device name, port state, active_mtu bytes, max_mtu bytes)] for port 1 of every device."""
    try:
        verbs = ctypes.CDLL("libibverbs.so.1", use_errno=True)
    except OSError:
        # find_library spawns ldconfig/gcc, slow under TCG: only when the soname is not found
        verbs = ctypes.CDLL(ctypes.util.find_library("ibverbs") or "libibverbs.so", use_errno=True)
    verbs.ibv_get_device_list.restype = ctypes.POINTER(ctypes.c_void_p)
    verbs.ibv_get_device_list.argtypes = [ctypes.POINTER(ctypes.c_int)]
    verbs.ibv_get_device_name.restype = ctypes.c_char_p
    verbs.ibv_get_device_name.argtypes = [ctypes.c_void_p]
    verbs.ibv_open_device.restype = ctypes.c_void_p
    verbs.ibv_open_device.argtypes = [ctypes.c_void_p]
    verbs.ibv_close_device.argtypes = [ctypes.c_void_p]
    verbs.ibv_query_port.argtypes = [ctypes.c_void_p, ctypes.c_uint8, ctypes.c_void_p]
    verbs.ibv_free_device_list.argtypes = [ctypes.POINTER(ctypes.c_void_p)]

    count = ctypes.c_int(0)
    devices = verbs.ibv_get_device_list(ctypes.byref(count))
    if not devices:
        errno = ctypes.get_errno()
        raise OSError(errno, f"ibv_get_device_list failed: errno {errno}")
    found = []
    try:
        for index in range(count.value):
            device = devices[index]
            device_name = verbs.ibv_get_device_name(device).decode()
            context = verbs.ibv_open_device(device)
            if not context:
                raise OSError(ctypes.get_errno(), f"ibv_open_device({device_name}) failed")
            try:
                # struct ibv_port_attr begins: enum state, enum max_mtu, enum active_mtu, ...
                # (the exported symbol takes the old, smaller struct; 256 bytes is ample)
                attr = (ctypes.c_int * 64)()
                if verbs.ibv_query_port(context, 1, attr) != 0:
                    raise OSError(ctypes.get_errno(), f"ibv_query_port({device_name}, 1) failed")
                found.append((device_name, attr[0], _MTU_BYTES.get(attr[2], 0), _MTU_BYTES.get(attr[1], 0)))
            finally:
                verbs.ibv_close_device(context)
    finally:
        verbs.ibv_free_device_list(devices)
    return found


def main() -> int:
    try:
        devices = probe()
    except OSError as error:
        print(f"probe: {error}", file=sys.stderr)
        return 1
    for name, state, active_mtu, max_mtu in devices:
        print(f"{name} state={state} active_mtu={active_mtu} max_mtu={max_mtu}")
    return 0 if devices else 1


if __name__ == "__main__":
    sys.exit(main())
