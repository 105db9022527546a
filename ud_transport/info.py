"""python -m ud_transport info: RDMA devices, ports, GID tables, and what ud_transport would use.

    python -m ud_transport info               # every device
    python -m ud_transport info --device rxe0 --json
"""
import argparse
import json
import os
import sys

from . import _native, transports


def gather(device=None):
    """Everything `info` prints, as a dict (no exceptions: problems become text)."""
    report = {"devices": [], "problem": None, "choice": None, "transport": None}
    names = _native.device_names()
    if not names:
        try:
            _native.Context()
        except OSError as error:
            report["problem"] = str(error)
        else:  # pragma: no cover - a device appeared between the two calls
            report["problem"] = "no RDMA devices"
    for name in names:
        if device and name != device:
            continue
        entry = {"name": name, "ports": [], "problem": None}
        try:
            with _native.Context(name) as context:
                attributes = context.query_device()
                entry["max_qp_wr"] = attributes["max_qp_wr"]
                entry["max_cqe"] = attributes["max_cqe"]
                table = context.gid_table()
                for number in range(1, attributes["phys_port_cnt"] + 1):
                    port = context.query_port(number)
                    port["number"] = number
                    port["gids"] = [{"index": g["index"], "gid": _native.format_gid(g["gid"]), "type": g["type"],
                                     "ipv4": _native.gid_ipv4(g["gid"])} for g in table if g["port"] == number]
                    entry["ports"].append(port)
        except OSError as error:
            entry["problem"] = str(error)
        report["devices"].append(entry)
    wanted_device, wanted_port, wanted_gid = transports.verbs_settings(_settings_from_environment(device))
    if names:
        try:
            choice = _native.choose_endpoint(wanted_device, wanted_port, wanted_gid)
            choice["gid"] = _native.format_gid(choice["gid"])
            report["choice"] = choice
        except OSError as error:
            report["choice_problem"] = str(error)
    try:
        report["transport"] = transports.choose("auto")
    except Exception as error:  # an invalid UD_TRANSPORT, say
        report["transport"] = f"error: {error}"
    return report


class _settings_from_environment:
    """The Options fields verbs_settings reads, with --device overriding UD_DEVICE."""

    def __init__(self, device):
        self.device = device or ""
        self.port = 0
        self.gid_index = -1


def render(report, out):
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
    print(f"transport='auto' resolves to: {report['transport']}"
          + (f" (UD_TRANSPORT={os.environ['UD_TRANSPORT']})" if os.environ.get("UD_TRANSPORT") else ""), file=out)
    print("override with device= / UD_DEVICE, port= / UD_PORT, gid_index= / UD_GID_INDEX", file=out)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m ud_transport info", description=__doc__.splitlines()[0])
    parser.add_argument("--device", help="only this device (also what ud_transport would pick on it)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    arguments = parser.parse_args(argv)
    report = gather(arguments.device)
    if arguments.json:
        json.dump(report, sys.stdout, indent=2, default=lambda value: value.hex() if isinstance(value, bytes) else str(value))
        print()
    else:
        render(report, sys.stdout)
    return 0 if report.get("choice") else 1


if __name__ == "__main__":
    sys.exit(main())
