"""UD_LOG turns the library's logging up, in a fresh process as a user would set it; unset, the
library prints nothing; a value that is not a level is warned about and changes nothing."""
import os
import subprocess
import sys

from ud_transport.lab.local_cluster import free_tcp_port

ONE_RANK = ("import datetime, torch.distributed as dist, ud_transport; "
            "store = dist.TCPStore('127.0.0.1', {port}, 1, True, timeout=datetime.timedelta(seconds=10)); "
            "ud_transport.init(0, 1, store=store, transport='udp').close()")


def run(ud_log):
    environment = {k: v for k, v in os.environ.items() if k not in ("UD_LOG", "RANK")}
    if ud_log is not None:
        environment["UD_LOG"] = ud_log
    environment["RANK"] = "0"
    return subprocess.run([sys.executable, "-c", ONE_RANK.format(port=free_tcp_port())], capture_output=True, text=True,
                          env=environment, timeout=120)


def test_ud_log_info_shows_the_ready_line_naming_the_rank():
    finished = run("info")
    assert finished.returncode == 0, finished.stderr
    assert "ud_transport[rank 0] INFO: rank 0/1 ready on udp" in finished.stderr, finished.stderr


def test_without_ud_log_the_library_is_silent():
    finished = run(None)
    assert finished.returncode == 0, finished.stderr
    assert "ud_transport" not in finished.stderr, finished.stderr


def test_a_value_that_is_not_a_level_is_warned_about():
    finished = run("loud")
    assert finished.returncode == 0, finished.stderr
    assert "UD_LOG='loud' is not one of debug, info, warning, error" in finished.stderr
    assert "INFO" not in finished.stderr
