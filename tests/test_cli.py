"""The README's commands run: the demo, the benchmark (with its JSON), info; and every subcommand
follows the CLI conventions (issue 11): a bad value is one line on stderr and exit status 2, and
--help shows every default. Those checks parse arguments only: nothing runs."""
import argparse
import io
import json
import os
import subprocess
import sys

import pytest

from ud_transport.lab import bench, cli, demo, info, simulate
from ud_transport.rig import cli as rig_cli


def run(*arguments, timeout=300, env=None):
    return subprocess.run([sys.executable, "-m", "ud_transport", *arguments], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_demo_runs_and_reports_every_rank():
    result = run("demo", "--world-size", "3", "--calls", "1", "--count", "5000", "--loss", "0.1")
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.strip().startswith("0 ")]
    assert len(rows) == 3 and "%" in rows[0]


def test_bench_prints_both_backends_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    result = run("bench", "--sizes", "4K,64K", "--iterations", "3", "--warmup", "1", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "allreduce" not in result.stderr and "\r" not in result.stderr  # no progress bar into a pipe
    table = [line.split() for line in result.stdout.splitlines() if not line.startswith("#")][1:]
    assert {row[3] for row in table} == {"ud-auto", "gloo"} and len(table) == 4
    written = json.loads(out.read_text())
    rows = written["rows"]
    assert all(row["delivered_percent"] == 100.0 and row["max_relative_error"] < 1e-6 for row in rows)
    # the machine's memory speed goes with every run: ud_transport's ratio to Gloo depends on it
    copy_line = next(line for line in result.stdout.splitlines() if line.startswith("# this machine: one 64 MiB memory copy"))
    assert written["copy_64mib_ms"] > 0 and f"{written['copy_64mib_ms']:.1f} ms" in copy_line


def test_bench_across_veth_hosts_runs_both_backends_over_the_links():
    """--hosts veth: each rank in its own namespace at the given MTU, Gloo beside it; without root it says it skipped."""
    result = run("bench", "--hosts", "veth", "--mtu", "9000", "--sizes", "64K", "--iterations", "2", "--warmup", "1",
                 "--no-progress")
    assert result.returncode == 0, result.stderr
    from ud_transport.lab.hosts import unavailable_reason

    reason = unavailable_reason()
    if reason:
        assert f"skipped: {reason}" in result.stdout
        return
    assert "namespaces on a veth pair, MTU 9000" in result.stdout
    table = [line.split() for line in result.stdout.splitlines() if not line.startswith("#")][1:]
    assert {row[3] for row in table} == {"ud-auto", "gloo"} and all(row[8] == "100.000" for row in table)
    assert "# 64K ud-auto / gloo: p50 " in result.stdout


def test_info_explains_what_it_finds():
    """Exit status 0 when a transport works (UDP without RDMA is the normal
    case); it says what auto picks."""
    result = run("info")
    resolved = "resolves to: verbs" in result.stdout
    assert resolved or "resolves to: udp" in result.stdout, result.stdout + result.stderr
    assert result.returncode == 0, result.stdout + result.stderr


def test_info_shows_udp_batching_and_the_granted_receive_buffer():
    result = run("info", "--json")
    udp = json.loads(result.stdout)["udp"]
    assert "problem" not in udp, udp
    assert udp["receive_buffer_bytes"] > 0 and udp["window_bytes"] <= udp["window_bytes_asked"]
    assert f"rcvbuf={udp['receive_buffer_bytes']}" in udp["description"]
    text = run("info").stdout
    assert f"GSO {'on' if udp['gso'] else 'off'}, GRO {'on' if udp['gro'] else 'off'}" in text
    assert f"receive buffer granted {udp['receive_buffer_bytes']} bytes" in text


def test_info_says_from_what_size_an_allreduce_sums_in_place():
    env = dict(os.environ, UD_IN_PLACE_MIN_BYTES="65536")
    assert json.loads(run("info", "--json", env=env).stdout)["in_place_min_bytes"] == 65536
    assert "in the caller's tensor from 65536 bytes up" in run("info", env=env).stdout


def test_info_says_how_many_stripes_and_cores():
    env = dict(os.environ, UD_STRIPES="2")
    report = json.loads(run("info", "--json", env=env).stdout)
    assert report["stripes"] == 2 and report["cores"] == len(os.sched_getaffinity(0))
    text = run("info", env=env).stdout
    assert f"run on 2 stripes (stripes / UD_STRIPES), with {report['cores']} cores available" in text
    assert "run on 1 stripe (" in run("info", env=dict(os.environ, UD_STRIPES="1")).stdout


def test_info_says_what_auto_stripes_give_here():
    from ud_transport import stripe_choice

    env = {k: v for k, v in os.environ.items() if k != "UD_STRIPES"}
    for ranks in (1, 2):
        env["LOCAL_WORLD_SIZE"] = str(ranks)
        report = json.loads(run("info", "--json", env=env).stdout)
        expected = stripe_choice.stripes_alone(ranks)
        assert (report["stripes_option"], report["ranks_here"], report["stripes"]) == ("auto", ranks, expected)
        assert report["udp"]["stripes"] == expected
        assert f"stripes=auto: one per core of each rank's share of its machine, at most 4, the least over all ranks; " \
               f"{expected} for {ranks} rank" in run("info", env=env).stdout


def test_unknown_command_says_what_was_wrong_and_exits_2():
    result = run("frobnicate")
    assert result.returncode == 2 and result.stdout == ""
    first = result.stderr.splitlines()[0]
    assert first.startswith("ud_transport: error: unknown command 'frobnicate'") and "bench" in first


def test_version_and_help():
    import ud_transport

    version = run("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"ud_transport {ud_transport.__version__}"
    helped = run("--help")
    assert helped.returncode == 0 and "exit codes" in helped.stdout and "simulate" in helped.stdout


# Each subcommand (the rig's have their own options) and the parser that reads its options.
SUBCOMMANDS = {
    "demo": demo.build_parser, "bench": bench.build_parser, "simulate": simulate.build_parser,
    "info": info.build_parser, **{f"rig {name}": (lambda name=name: rig_subparser(name))
                                  for name in ("deps", "kit", "check", "run")},
}

BAD_VALUES = [
    "demo --loss 2", "demo --calls 0", "demo --world-size x", "demo --loss-budget 1.5", "demo --chunk-bytes -1",
    "bench --iterations 0", "bench --sizes 4Q", "bench --sizes 0", "bench --algorithm tree", "bench --loss 2",
    "bench --deadline -1", "bench --mtu 9", "bench --burst 0,0,0,0.8", "bench --burst 0.1,0.2",
    "simulate --worlds x", "simulate --worlds 2,0", "simulate --calls 0", "simulate --losses 2",
    "simulate --losses nan", "simulate --algorithms tree", "simulate --estimators none", "simulate --budget -0.1",
    "info --device nosuch",
    "rig check --timeout 0", "rig check --smp 0", "rig check --netem-loss 150%", "rig run --memory lots -- true",
    "rig run --env FOO -- true", "rig run --netem-loss 10 -- true", "rig run --cmd-node0 true", "rig run",
]


def rig_subparser(name):
    parser = rig_cli.build_parser()
    subcommands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    return subcommands.choices[name]


def parse_in_process(command, capsys):
    """(exit status, stdout, stderr) of `python -m ud_transport COMMAND`, parsed in this process."""
    with pytest.raises(SystemExit) as stopped:
        cli.main(command.split())
    out, err = capsys.readouterr()
    return stopped.value.code, out, err


@pytest.mark.parametrize("command", BAD_VALUES)
def test_a_bad_value_is_one_line_on_stderr_and_exit_2(command, capsys):
    status, out, err = parse_in_process(command, capsys)
    subcommand = " ".join(command.split()[:2 if command.startswith("rig") else 1])
    assert status == 2 and out == "", (status, out, err)
    assert len(err.splitlines()) == 1 and err.startswith(f"python -m ud_transport {subcommand}: error: "), err


@pytest.mark.parametrize("command", ["demo --calls 0", "bench --iterations 0", "simulate --losses 2",
                                     "info --device nosuch", "rig run --env FOO -- true"])
def test_every_subcommand_rejects_a_bad_value_without_a_traceback(command):
    """The same, through the real entry point: one subprocess per subcommand."""
    result = run(*command.split(), timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.splitlines()) == 1 and ": error: " in result.stderr, result.stderr


def help_of_each_option(text):
    """{option string: its help} from --help output, where argparse wraps help onto indented lines."""
    helps, current = {}, None
    for line in text.splitlines():
        if line.startswith("  -"):
            invocation, _, first = line.strip().partition("  ")
            current = [first]
            for spelling in invocation.split(", "):
                helps[spelling.split()[0]] = current
        elif current is not None and line.startswith("    "):
            current.append(line.strip())
        else:
            current = None
    return {name: " ".join(" ".join(parts).split()) for name, parts in helps.items()}


@pytest.mark.parametrize("subcommand", SUBCOMMANDS)
def test_help_shows_the_default_of_every_option_that_has_one(subcommand, capsys):
    status, out, _ = parse_in_process(f"{subcommand} --help", capsys)
    assert status == 0 and out.startswith(f"usage: python -m ud_transport {subcommand} ")
    helps = help_of_each_option(out)
    valued = [action for action in SUBCOMMANDS[subcommand]()._actions
              if action.option_strings and action.nargs != 0 and action.default not in (None, [])]
    for action in valued:
        assert f"(default: {action.default})" in helps[action.option_strings[0]], (action.option_strings, out)
    # a flag's default is "not given": "(default: True)" for --no-gloo would say the opposite
    assert "(default: True)" not in out and "(default: False)" not in out


def test_help_texts_are_whole():
    """info's description is not cut mid-sentence; the rig names itself as the user reached it."""
    assert "what ud_transport would use." in info.build_parser().format_help()
    assert rig_cli.build_parser().prog == "python -m ud_transport rig"
    assert rig_cli.build_parser("python -m ud_transport.rig").format_usage().startswith("usage: python -m ud_transport.rig ")


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_bench_draws_no_progress_bar_off_a_terminal(capsys):
    assert not sys.stderr.isatty()  # pytest's capture, as a pipe or a log file would be
    assert bench.progress_bar(10, wanted=True) is None
    assert capsys.readouterr() == ("", "")


def test_bench_progress_bar_needs_a_terminal_and_tqdm_only_if_installed(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setitem(sys.modules, "tqdm", None)  # as if tqdm were not installed: importing it fails
    assert bench.progress_bar(10, wanted=True) is None
    monkeypatch.delitem(sys.modules, "tqdm")
    pytest.importorskip("tqdm")
    assert bench.progress_bar(10, wanted=False) is None  # --no-progress
    bar = bench.progress_bar(10, wanted=True)
    bar.update(1)
    bar.close()
    assert "allreduce" in terminal.getvalue()
