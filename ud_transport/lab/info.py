"""python -m ud_transport info: which transports are available here (and why not), RDMA devices,
ports, GID tables, the UDP socket's batching and buffers, and what ud_transport would use.

    python -m ud_transport info               # every device
    python -m ud_transport info --device rxe0 --json
"""
import json
import os
import sys

from .. import _native, cpu_cache, options, rendezvous, stripe_choice, transports, verbs_extension
from .arguments import ArgumentParser


def gather(device=None):
    """Everything `info` prints, as a dict (no exceptions: problems become text)."""
    report = {"devices": [], "problem": None, "choice": None, "transport": None}
    verbs = verbs_extension.load()  # None when the RDMA extension is not built or cannot load
    names = verbs.device_names() if verbs else []
    if verbs and not names:
        try:
            verbs.Context()
        except OSError as error:
            report["problem"] = str(error)
        else:  # pragma: no cover - a device appeared between the two calls
            report["problem"] = "no RDMA devices"
    for name in names:
        if device and name != device:
            continue
        entry = {"name": name, "ports": [], "problem": None}
        try:
            with verbs.Context(name) as context:
                attributes = context.query_device()
                entry["max_qp_wr"] = attributes["max_qp_wr"]
                entry["max_cqe"] = attributes["max_cqe"]
                table = context.gid_table()
                for number in range(1, attributes["phys_port_cnt"] + 1):
                    port = context.query_port(number)
                    port["number"] = number
                    port["gids"] = [{"index": g["index"], "gid": verbs.format_gid(g["gid"]), "type": g["type"],
                                     "ipv4": verbs.gid_ipv4(g["gid"])} for g in table if g["port"] == number]
                    entry["ports"].append(port)
        except OSError as error:
            entry["problem"] = str(error)
        report["devices"].append(entry)
    wanted_device, wanted_port, wanted_gid = transports.verbs_settings(_settings_from_environment(device))
    if names:
        try:
            choice = verbs.choose_endpoint(wanted_device, wanted_port, wanted_gid)
            choice["gid"] = verbs.format_gid(choice["gid"])
            report["choice"] = choice
        except OSError as error:
            report["choice_problem"] = str(error)
    report["udp"] = udp_report()
    settings = options.build()
    report["ranks_here"] = ranks_here()
    report["in_place_min_bytes"] = settings.resolved_in_place_min_bytes(report["ranks_here"])
    report["stripes_option"] = settings.stripes  # "auto" or a count
    report["stripes"] = stripes_here(settings)
    report["cores"] = len(os.sched_getaffinity(0))  # what this process may run on (a container's share)
    report["transports"] = availability(report["udp"])
    try:
        report["transport"] = transports.choose("auto")
    except Exception as error:  # an invalid UD_TRANSPORT, say
        report["transport"] = f"error: {error}"
    return report


def ranks_here():
    """The ranks `info` assumes share this machine: torchrun's LOCAL_WORLD_SIZE, else 1."""
    return stripe_choice.local_world_size() or 1


def stripes_here(settings):
    """The stripes a communicator opened here would run ("auto" resolved for ranks_here() ranks
    like this process on this machine, and ranks elsewhere with as many cores each)."""
    return stripe_choice.stripes_alone(ranks_here()) if settings.stripes == "auto" else settings.stripes


def availability(udp):
    """{udp, verbs}: each {"available": bool, "problem": why not or None}."""
    udp_problem = udp.get("problem")
    verbs_problem = None if transports.rdma_available() else transports.why_no_rdma()
    return {"udp": {"available": udp_problem is None, "problem": udp_problem},
            "verbs": {"available": verbs_problem is None, "problem": verbs_problem}}


def udp_report():
    """What a UDP transport opened here gets: GSO/GRO, the receive buffer the kernel granted, and the
    credit window that fits it (for datagrams as large as the interface allows)."""
    try:
        settings = options.build()
        bind = settings.bind_address or rendezvous.local_address_towards(os.environ.get("MASTER_ADDR", "127.0.0.1"))
        transport = _native.Transport.udp(bind, 0, settings.socket_buffer_bytes)
    except (OSError, ValueError, TypeError) as error:
        return {"problem": str(error)}
    features = transport.udp_features
    datagram = transport.max_datagram_bytes
    if settings.chunk_bytes:
        datagram = min(datagram, settings.chunk_bytes + _native.HEADER_BYTES)
    datagram -= (datagram - _native.HEADER_BYTES) % 8  # chunks are whole elements, as the communicator makes them
    granted = transport.receive_buffer_bytes
    return {"bind_address": bind, "gso": bool(features & _native.UDP_GSO), "gro": bool(features & _native.UDP_GRO),
            "receive_buffer_bytes": granted, "receive_buffer_asked": settings.socket_buffer_bytes,
            "receive_buffer_forced": bool(features & _native.UDP_RCVBUF_FORCED), "datagram_bytes": datagram,
            "overflow_drops_counted": bool(features & _native.UDP_DROPS_COUNTED),
            "stripes": (stripes := stripes_here(settings)),  # each stripe's socket gets this window over the stripe count
            "window_bytes_asked": (asked := options.credit_window_bytes(settings.window_bytes, datagram - _native.HEADER_BYTES)
                                   // stripes),
            "window_bytes": transports.window_that_fits(granted, datagram, asked),
            "description": transport.describe()}


class _settings_from_environment:
    """The Options fields verbs_settings reads, with --device overriding UD_DEVICE."""

    def __init__(self, device):
        self.device = device or ""
        self.port = 0
        self.gid_index = -1


def render(report, out):
    for name, state in report["transports"].items():
        print(f"{name}: " + ("available" if state["available"] else f"unavailable: {state['problem']}"), file=out)
    if report["problem"]:
        print(f"no RDMA devices: {report['problem']}", file=out)
    for device in report["devices"]:
        print(f"{device['name']}:", file=out)
        if device["problem"]:
            print(f"  {device['problem']}", file=out)
            continue
        print(f"  max_qp_wr {device['max_qp_wr']}  max_cqe {device['max_cqe']}", file=out)
        for port in device["ports"]:
            print(f"  port {port['number']}: {port['state_name']}  link {port['link_layer']}  "
                  f"active_mtu {port['active_mtu']}  max_mtu {port['max_mtu']}  lid {port['lid']}", file=out)
            for gid in port["gids"]:
                print(f"    gid {gid['index']:3d}  {gid['type']:7s}  {gid['gid']}", file=out)
    choice = report.get("choice")
    if choice:
        print(f"ud_transport would use: {choice['device']} port {choice['port']} gid_index {choice['gid_index']} "
              f"({choice['gid_type']} {choice['gid']}), datagrams up to {choice['active_mtu']} bytes", file=out)
    elif report.get("choice_problem"):
        print(f"ud_transport cannot use verbs here: {report['choice_problem']}", file=out)
    udp = report.get("udp") or {}
    if udp.get("problem"):
        print(f"udp: cannot open a socket here: {udp['problem']}", file=out)
    elif udp:
        asked = udp["receive_buffer_asked"]
        capped = not udp["receive_buffer_forced"] and udp["receive_buffer_bytes"] < 2 * asked
        how = "SO_RCVBUFFORCE" if udp["receive_buffer_forced"] else "capped by net.core.rmem_max" if capped else "plain"
        print(f"udp on {udp['bind_address']}: GSO {'on' if udp['gso'] else 'off'}, GRO {'on' if udp['gro'] else 'off'}, "
              f"receive buffer granted {udp['receive_buffer_bytes']} bytes (asked {asked}, {how}), "
              f"credit window {udp['window_bytes']} of {udp['window_bytes_asked']} bytes "
              f"for {udp['datagram_bytes']}-byte datagrams"
              + (f", per socket of {udp['stripes']} stripes" if udp["stripes"] > 1 else ""), file=out)
        print(f"  {udp['description']}", file=out)
        if capped and udp["window_bytes"] < udp["window_bytes_asked"]:
            print(f"  the window was lowered to fit the buffer; `sysctl -w net.core.rmem_max={asked}` "
                  "would give the socket what it asks", file=out)
    print(f"allreduce sums in the caller's tensor from {report['in_place_min_bytes']} bytes up, in the scratch below "
          "(in_place_min_bytes / UD_IN_PLACE_MIN_BYTES; by default the CPU's largest cache, counting at most "
          f"{cpu_cache.MAX_CACHE_PER_CPU_BYTES >> 20} MiB per CPU sharing it, split among the "
          f"{report['ranks_here']} rank{'s' if report['ranks_here'] > 1 else ''} on this machine)", file=out)
    stripes = report["stripes"]
    print(f"allreduce and broadcast of {options.STRIPE_MIN_BYTES} bytes per stripe and more run on {stripes} "
          f"stripe{'s' if stripes > 1 else ''} (stripes / UD_STRIPES), with {report['cores']} cores available to this "
          "process: each stripe is a thread and a socket of its own, which pays only where every local rank has "
          "cores to spare", file=out)
    if report["stripes_option"] == "auto":
        ranks = report["ranks_here"]
        print(f"  stripes=auto: one per core of each rank's share of its machine, at most {stripe_choice.AUTO_MAX_STRIPES}, "
              f"the least over all ranks; {stripes} for {ranks} rank{'s' if ranks > 1 else ''} on this machine "
              "(LOCAL_WORLD_SIZE); the communicator counts the ranks that share each machine itself", file=out)
    print(f"transport='auto' resolves to: {report['transport']}"
          + (f" (UD_TRANSPORT={os.environ['UD_TRANSPORT']})" if os.environ.get("UD_TRANSPORT") else ""), file=out)
    print("override with device= / UD_DEVICE, port= / UD_PORT, gid_index= / UD_GID_INDEX", file=out)


def build_parser():
    parser = ArgumentParser(prog="python -m ud_transport info", description=__doc__)
    parser.add_argument("--device", help="only this device, and what ud_transport would pick on it (default: every device)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def check_device(parser, device):
    """A --device that does not exist is a bad value: without this check info would print nothing
    about it and exit 0."""
    if device is None:
        return
    verbs = verbs_extension.load()
    names = verbs.device_names() if verbs else []
    if device not in names:
        here = f"devices here: {', '.join(names)}" if names else f"there are none here: {transports.why_no_rdma()}"
        parser.error(f"argument --device: no RDMA device {device!r}; {here}")


def main(argv=None):
    parser = build_parser()
    arguments = parser.parse_args(argv)
    check_device(parser, arguments.device)
    report = gather(arguments.device)
    if arguments.json:
        json.dump(report, sys.stdout, indent=2, default=lambda value: value.hex() if isinstance(value, bytes) else str(value))
        print()
    else:
        render(report, sys.stdout)
    # 0 when a transport works: UDP without RDMA is the expected state on most machines
    working = report.get("choice") or "problem" not in report.get("udp", {"problem": "not probed"})
    return 0 if working else 1


if __name__ == "__main__":
    sys.exit(main())
