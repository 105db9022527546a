"""Run PyTorch's own distributed test suite against the c10d backend "ud", and against Gloo, and
compare them test by test.

The suite is torch/testing/_internal/distributed/distributed_test.py from the installed torch
wheel, driven as torch's test/distributed/test_distributed_spawn.py drives it: one unittest class
TestDistBackend + DistributedTest._DistTestBase whose setUp spawns WORLD_SIZE rank processes
(multiprocessing "spawn"), each of which calls init_process_group(BACKEND, file:// init) and runs
the one test.

    python3 scripts/torch_suite.py --backend ud --world-size 2           # every test, on "ud"
    python3 scripts/torch_suite.py --backend gloo --world-size 4
    python3 scripts/torch_suite.py --compare                             # both; what Gloo passes and ud does not
    python3 scripts/torch_suite.py --compare -k all_gather -k broadcast  # tests whose name has either
    python3 scripts/torch_suite.py --compare --tests test_barrier,test_send_recv
    python3 scripts/torch_suite.py --compare --out DIR --resume          # go on where a run in DIR stopped
    python3 scripts/torch_suite.py --list                                # the selection and the exclusions

Writes, under --out (default /tmp/torch_suite/ws<N>): <backend>-ws<N>.jsonl (one record per test,
written as it ends), summary.md (the table: test, gloo outcome, ud outcome, reason) and
summary.json. Prints the table's counts and, with --compare, every test Gloo passes that ud does
not, with the first line of its error.

How "ud" is let in (the suite reads BACKEND from the environment when it is imported, and
evaluates its skip decorators then):
  - "ud" is registered (import ud_transport.torch) before the suite is imported, in the driver and
    in every spawned rank (they re-import this file as __mp_main__);
  - it is added to DistTestCases.backend_feature["plugin"] (the suite's own hook for a backend
    registered from outside: require_backend_is_available accepts it), ["subgroup"] (new_group
    and new_subgroups work on "ud") and ["ddp"] (DistributedDataParallel on CPU runs over it).
    It is not added to "gpu"/"cuda": "ud" is a CPU backend, and those tests need a GPU anyway.
  - nothing else of the suite is changed; tests that the suite gates on the backend's name
    (`BACKEND != "gloo"`, `require_backend_is_available({"gloo", "nccl", "ucc"})`, ...) skip on
    "ud" with the suite's own reason. --compare then runs each test that Gloo passed and "ud"
    skipped once more on "ud" as if it were Gloo: the suite's BACKEND reads "gloo" (its skip
    decorators and the branches its test bodies take on the name), and each process group the
    suite makes with backend="gloo" through init_process_group is made on "ud" instead
    (dist.get_backend() then says "ud"). That is the column "ud under Gloo's gates". A test
    counts as passed on "ud" only where it ran on "ud" and passed.

Environment the suite needs, set here: BACKEND, WORLD_SIZE, TEMP_DIR (a folder with barrier/ and
test_dir/; TestDistBackend.setUp makes a fresh one per test), INIT_METHOD (env://, the suite's
default and torch CI's NoInitFile variant, or --init-method file: file://TEMP_DIR/ as torch CI's
other variant; only test_barrier_timeout_global and the DDP tests' save/load step read it, the
default group of every test starts from a file:// init file of its own, as in torch), DISTRIBUTED_TESTS_DEFAULT_TIMEOUT (per test, --timeout), and
expecttest installed (torch.testing._internal.common_utils imports it; pip install expecttest).

Exclusions: none by default. Tests that need CUDA, NCCL, MPI or UCC skip themselves with the
suite's reason and are reported as skipped, not left out (EXCLUDED below stays empty unless a
test cannot apply to a CPU backend and does not skip itself).

The time: on a 2-core machine a test costs ~5-10 s (WORLD_SIZE fresh Python processes that import
torch) plus what it does; the whole suite is about an hour per backend at world size 2.
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Tests left out of the selection, with why. Only tests that cannot apply to a CPU backend and do
# not skip themselves belong here; none do in torch 2.13 (every CUDA/NCCL test skips itself).
EXCLUDED = {}

# The environment variable that makes this file define the suite's test class on import: set for
# the runner process and inherited by the rank processes it spawns.
ROLE_VARIABLE = "UD_TORCH_SUITE_ROLE"
GATES_VARIABLE = "UD_TORCH_SUITE_GATES"  # the backend name the suite's skip decorators see
FEATURES_CLAIMED = ("plugin", "subgroup", "ddp")

OUTCOMES = ("passed", "failed", "skipped", "xfail", "xpass", "crashed", "not run")


# -- inside the runner and its rank processes -------------------------------------------------------

def _suite_class():
    """The test class of test_distributed_spawn.py for $BACKEND, with the suite imported while
    BACKEND reads $UD_TORCH_SUITE_GATES (default: $BACKEND itself)."""
    backend = os.environ["BACKEND"]
    gates = os.environ.get(GATES_VARIABLE) or backend
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    if backend == "ud" or gates == "ud":
        import ud_transport.torch  # noqa: F401  registers backend "ud"
    from torch.testing._internal.common_distributed import DistTestCases
    if backend == "ud":
        for feature in FEATURES_CLAIMED:
            DistTestCases.backend_feature[feature].add("ud")
    os.environ["BACKEND"] = gates
    try:
        from torch.testing._internal.distributed import distributed_test as suite
    finally:
        os.environ["BACKEND"] = backend
    if gates != backend:
        # The suite's module keeps BACKEND = gates (its test bodies branch on the name too: Gloo's
        # CPU paths), and every process group it makes with that name is made on `backend`
        # instead: the default group of each test, and those a test makes again after
        # destroy_process_group (they all pass backend=BACKEND).
        import torch.distributed as dist
        real_init = dist.init_process_group

        def init_process_group(*args, **kwargs):
            if kwargs.get("backend") == gates:
                kwargs["backend"] = backend
            return real_init(*args, **kwargs)
        dist.init_process_group = init_process_group

    class TestDistBackendWithSpawn(suite.TestDistBackend, suite.DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            self._spawn_processes()
            torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

    name = "TestDistBackendWithSpawn" + backend.upper() + ("GatesOf" + gates.upper() if gates != backend else "")
    TestDistBackendWithSpawn.__name__ = TestDistBackendWithSpawn.__qualname__ = name
    globals()[name] = TestDistBackendWithSpawn
    return TestDistBackendWithSpawn


if os.environ.get(ROLE_VARIABLE) == "runner":
    SUITE_CLASS = _suite_class()


def _short_error(text, limit=400):
    """The exception line of each rank's traceback in c10d's 'Process N exited with error code'
    message (or the message's last line), deduplicated, cut to `limit` characters."""
    chunks = re.split(r"Process \d+ exited with error code \d+ and exception:\n", text)
    if len(chunks) > 1:
        chunks = chunks[1:]  # the first is the test process's own traceback, ending "RuntimeError: "
    lines = []
    for chunk in chunks:
        chunk = chunk.split("To execute this test, run")[0]  # the repro line the suite appends
        body = [line for line in chunk.strip().splitlines()
                if line.strip() and not line.startswith("This message can be suppressed")]
        if not body:
            continue
        # the exception line: the last line that starts a 'SomeError: ...' statement
        picked = None
        for index in range(len(body) - 1, -1, -1):
            if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Mismatch|Timeout|Exceeded|Failure)\b", body[index]):
                picked = " ".join(part.strip() for part in body[index:index + 3])
                break
        picked = picked or body[-1].strip()
        if picked not in lines:
            lines.append(picked)
    message = " | ".join(lines) or text.strip()[:limit]
    return message if len(message) <= limit else message[:limit - 3] + "..."


def _run_tests(names, results_path, log):
    """Run `names` of SUITE_CLASS one at a time; append one JSON record per test to results_path
    (a "start" record before each, so a driver can tell which test a dead runner was in)."""
    import unittest

    class Recorder(unittest.TestResult):
        def __init__(self):
            super().__init__()
            self.record = None

        def addSuccess(self, test):
            self.record = ("passed", "")

        def addError(self, test, err):
            super().addError(test, err)
            self.record = ("failed", _short_error(self.errors[-1][1]))

        def addFailure(self, test, err):
            super().addFailure(test, err)
            self.record = ("failed", _short_error(self.failures[-1][1]))

        def addSkip(self, test, reason):
            self.record = ("skipped", str(reason).strip().splitlines()[0] if str(reason).strip() else "")

        def addExpectedFailure(self, test, err):
            self.record = ("xfail", "")

        def addUnexpectedSuccess(self, test):
            self.record = ("xpass", "")

    with open(results_path, "a") as out:
        for name in names:
            out.write(json.dumps({"test": name, "event": "start"}) + "\n")
            out.flush()
            started = time.monotonic()
            result = Recorder()
            SUITE_CLASS(name).run(result)
            outcome, reason = result.record or ("failed", "the test reported no outcome")
            seconds = round(time.monotonic() - started, 1)
            out.write(json.dumps({"test": name, "outcome": outcome, "reason": reason, "seconds": seconds}) + "\n")
            out.flush()
            print(f"[{os.environ['BACKEND']}] {name}: {outcome} ({seconds} s) {reason}", file=log, flush=True)


def _runner_main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--names")
    parser.add_argument("--results")
    args = parser.parse_args(argv)
    if args.list:
        import unittest
        print("\n".join(unittest.TestLoader().getTestCaseNames(SUITE_CLASS)))
        return 0
    with open(args.names) as f:
        names = [line.strip() for line in f if line.strip()]
    _run_tests(names, args.results, sys.stdout)
    return 0


# -- the driver ------------------------------------------------------------------------------------

def _environment(backend, world_size, gates, timeout, temp_dir, init_method="env"):
    env = dict(os.environ)
    env.update({
        ROLE_VARIABLE: "runner",
        "BACKEND": backend,
        GATES_VARIABLE: gates or backend,
        "WORLD_SIZE": str(world_size),
        "TEMP_DIR": temp_dir,
        # torch CI runs the spawn suite both ways: env:// and, for test_distributed_spawn, file://TEMP_DIR/
        "INIT_METHOD": "env://" if init_method == "env" else f"file://{temp_dir}/",
        "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": str(timeout),
        "PYTHONPATH": ROOT + os.pathsep + env.get("PYTHONPATH", ""),
        "PYTHONUNBUFFERED": "1",
    })
    for folder in ("barrier", "test_dir"):
        os.makedirs(os.path.join(temp_dir, folder), exist_ok=True)
    return env


def list_tests(world_size=2):
    """Every test of the suite's class (the names are the same for every backend)."""
    with tempfile.TemporaryDirectory() as temp_dir:
        output = subprocess.run([sys.executable, os.path.abspath(__file__), "--_runner", "--list"],
                                env=_environment("gloo", world_size, None, 300, temp_dir), cwd=ROOT,
                                check=True, capture_output=True, text=True).stdout
    return [line.strip() for line in output.splitlines() if line.strip().startswith("test")]


def select(names, patterns=(), explicit=()):
    """(selected, excluded-with-reasons): explicit names if given, else those matching any of the
    -k substrings (all if none), less EXCLUDED."""
    if explicit:
        unknown = sorted(set(explicit) - set(names))
        if unknown:
            raise SystemExit(f"not tests of the suite: {', '.join(unknown)}")
        chosen = [n for n in names if n in set(explicit)]
    else:
        chosen = [n for n in names if not patterns or any(p in n for p in patterns)]
    return [n for n in chosen if n not in EXCLUDED], {n: EXCLUDED[n] for n in chosen if n in EXCLUDED}


def read_results(path):
    """{test: record} from a results file; a test with a start record and no outcome is "crashed"
    (its runner died in it)."""
    records, started = {}, []
    if not os.path.exists(path):
        return records
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut by a kill
            if record.get("event") == "start":
                started.append(record["test"])
            else:
                records[record["test"]] = record
    for name in started:
        if name not in records:
            records[name] = {"test": name, "outcome": "crashed", "reason": "the runner died during this test",
                             "seconds": None}
    return records


def run_backend(backend, names, world_size, out_dir, timeout, gates=None, resume=False, label=None, log=None,
                init_method="env"):
    """Run `names` on `backend` (skip decorators as for `gates`), in runner processes restarted past
    any test one dies in; returns {test: record}."""
    label = label or (f"{backend}-ws{world_size}" + (f"-gates-{gates}" if gates and gates != backend else "")
                      + ("-file" if init_method == "file" else ""))
    results_path = os.path.join(out_dir, label + ".jsonl")
    if not resume and os.path.exists(results_path):
        os.remove(results_path)
    log = log or sys.stdout
    while True:
        done = read_results(results_path)
        remaining = [n for n in names if n not in done]
        if not remaining:
            break
        with tempfile.TemporaryDirectory(prefix="torch_suite_") as temp_dir:
            names_path = os.path.join(temp_dir, "names.txt")
            with open(names_path, "w") as f:
                f.write("\n".join(remaining) + "\n")
            with open(os.path.join(out_dir, label + ".log"), "a") as runner_log:
                print(f"== {label}: {len(remaining)} tests", file=log, flush=True)
                process = subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "--_runner", "--names", names_path,
                     "--results", results_path],
                    env=_environment(backend, world_size, gates, timeout, temp_dir, init_method), cwd=ROOT,
                    stdout=subprocess.PIPE, stderr=runner_log, text=True, start_new_session=True)
                try:
                    for line in process.stdout:
                        print(line, end="", file=log, flush=True)
                        runner_log.write(line)
                    process.wait()
                except BaseException:
                    os.killpg(process.pid, signal.SIGKILL)  # the runner's session: it and its ranks
                    raise
        after = read_results(results_path)
        if len(after) == len(done):  # a runner that ran nothing: do not loop on it
            for name in remaining:
                after.setdefault(name, {"test": name, "outcome": "not run",
                                        "reason": f"the runner exited {process.returncode} before it",
                                        "seconds": None})
            with open(results_path, "a") as f:
                for name in remaining:
                    f.write(json.dumps(after[name]) + "\n")
            break
    results = read_results(results_path)
    return {n: results[n] for n in names if n in results}


def _cell(record):
    if record is None:
        return "—"
    return record["outcome"]


def _reason(gloo, ud, ud_gates):
    parts = []
    for label, record in (("gloo", gloo), ("ud", ud), ("ud under Gloo's gates", ud_gates)):
        if record and record.get("reason"):
            parts.append(f"{label}: {record['reason']}")
    # one reason where both backends skipped for the same one
    if gloo and ud and gloo.get("reason") and gloo.get("reason") == ud.get("reason") and not ud_gates:
        parts = [gloo["reason"]]
    return " / ".join(parts).replace("|", "\\|").replace("\n", " ")


def summarize(names, excluded, by_backend, gates_rerun, world_size, out_dir, meta):
    """Write summary.md and summary.json; returns (rows, gaps) where gaps are the tests Gloo
    passes and ud does not pass."""
    gloo, ud = by_backend.get("gloo"), by_backend.get("ud")
    rows, gaps = [], []
    for name in names:
        g = gloo.get(name) if gloo is not None else None
        u = ud.get(name) if ud is not None else None
        ug = gates_rerun.get(name)
        rows.append({"test": name, "gloo": _cell(g) if gloo is not None else None,
                     "ud": _cell(u) if ud is not None else None,
                     "ud_gloo_gates": ug["outcome"] if ug else None,
                     "reason": _reason(g, u, ug),
                     "seconds": {k: r.get("seconds") for k, r in (("gloo", g), ("ud", u), ("ud_gloo_gates", ug)) if r}})
        if g and u and g["outcome"] == "passed" and u["outcome"] != "passed":
            gaps.append({"test": name, "ud": u["outcome"], "ud_reason": u.get("reason", ""),
                         "ud_gloo_gates": ug["outcome"] if ug else None,
                         "ud_gloo_gates_reason": ug.get("reason", "") if ug else ""})
    columns = [c for c in ("gloo", "ud") if by_backend.get(c) is not None]
    with_gates = bool(gates_rerun)
    lines = [f"# torch distributed_test.py, world size {world_size}", "",
             f"{meta}", ""]
    for column in columns:
        counts = {}
        for row in rows:
            counts[row[column]] = counts.get(row[column], 0) + 1
        spent = sum((by_backend[column].get(name) or {}).get("seconds") or 0 for name in names)
        lines.append(f"- {column}: " + ", ".join(f"{counts[o]} {o}" for o in OUTCOMES if o in counts)
                     + f" ({spent / 60:.0f} min of test time)")
    if gloo is not None and ud is not None:
        skipped = [g for g in gaps if g["ud"] == "skipped"]
        lines.append(f"- Gloo passes, ud does not: {len(gaps)} ({len(gaps) - len(skipped)} ran on ud and did not "
                     f"pass, {len(skipped)} skipped on ud by the suite"
                     + (f"; of those, {sum(1 for g in skipped if g['ud_gloo_gates'] == 'passed')} pass on ud under "
                        f"Gloo's gates, {sum(1 for g in skipped if g['ud_gloo_gates'] not in (None, 'passed'))} "
                        "do not" if with_gates else "") + ")")
    if excluded:
        lines.append(f"- excluded: {len(excluded)}")
    lines.append("")
    header = ["test"] + columns + (["ud under Gloo's gates"] if with_gates else []) + ["reason"]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    for row in rows:
        cells = [row["test"]] + [row[c] for c in columns]
        if with_gates:
            cells.append(row["ud_gloo_gates"] or "")
        cells.append(row["reason"])
        lines.append("| " + " | ".join(cells) + " |")
    for name, why in excluded.items():
        lines.append(f"| {name} | " + " | ".join("excluded" for _ in columns) + (" | " if with_gates else "")
                     + f" | {why} |")
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump({"world_size": world_size, "meta": meta, "rows": rows, "gaps": gaps,
                   "excluded": excluded}, f, indent=1)
    return rows, gaps


def _commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("ud", "gloo"), default="ud")
    parser.add_argument("--compare", action="store_true",
                        help="run gloo, then ud, then ud under Gloo's gates for what Gloo passed and ud skipped")
    # torch 2.13's skip_if_small_worldsize skips below 8 ranks (23 tests); 8 ranks on 2 cores is slow
    parser.add_argument("--world-size", type=int, default=2, choices=(2, 3, 4, 8))
    parser.add_argument("-k", dest="patterns", action="append", default=[],
                        help="run the tests whose name contains this (repeatable: any of them)")
    parser.add_argument("--tests", default="", help="comma-separated test names (instead of -k)")
    parser.add_argument("--init-method", choices=("env", "file"), default="env",
                        help="INIT_METHOD for the few tests that read it: env:// (default) or file://TEMP_DIR/, "
                             "torch CI's two variants")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test (torch's default: 300)")
    parser.add_argument("--out", help="folder for results (default /tmp/torch_suite/ws<N>)")
    parser.add_argument("--resume", action="store_true", help="keep the results already in --out, run the rest")
    parser.add_argument("--no-gates-rerun", action="store_true",
                        help="with --compare: do not rerun Gloo-passed, ud-skipped tests under Gloo's gates")
    parser.add_argument("--list", action="store_true", help="print the selection and the exclusions, run nothing")
    args = parser.parse_args(argv)

    names = list_tests(args.world_size)
    explicit = [t.strip() for t in args.tests.split(",") if t.strip()]
    selected, excluded = select(names, args.patterns, explicit)
    if args.list:
        print("\n".join(selected))
        for name, why in excluded.items():
            print(f"excluded {name}: {why}")
        print(f"{len(selected)} selected, {len(excluded)} excluded, {len(names)} in the suite", file=sys.stderr)
        return 0
    if not selected:
        raise SystemExit("no test selected")
    out_dir = args.out or os.path.join(tempfile.gettempdir(), "torch_suite", f"ws{args.world_size}-{args.init_method}")
    os.makedirs(out_dir, exist_ok=True)

    started = time.monotonic()
    backends = ("gloo", "ud") if args.compare else (args.backend,)
    by_backend = {}
    for backend in backends:
        by_backend[backend] = run_backend(backend, selected, args.world_size, out_dir, args.timeout,
                                          resume=args.resume, init_method=args.init_method)
    gates_rerun = {}
    if args.compare and not args.no_gates_rerun:
        rerun = [n for n in selected if by_backend["gloo"].get(n, {}).get("outcome") == "passed"
                 and by_backend["ud"].get(n, {}).get("outcome") == "skipped"]
        if rerun:
            gates_rerun = run_backend("ud", rerun, args.world_size, out_dir, args.timeout, gates="gloo",
                                      resume=args.resume, init_method=args.init_method)
    import torch
    meta = (f"torch {torch.__version__}, ud_transport at {_commit()}, INIT_METHOD {args.init_method}://, "
            f"{len(selected)} tests ({len(excluded)} excluded), {time.strftime('%Y-%m-%d')}, "
            f"{round(time.monotonic() - started)} s in this invocation" + (" (--resume)" if args.resume else ""))
    rows, gaps = summarize(selected, excluded, by_backend, gates_rerun, args.world_size, out_dir, meta)
    with open(os.path.join(out_dir, "summary.md")) as f:
        head = [line for line in f.read().splitlines() if line.startswith("- ")]
    print("\n".join(head))
    if args.compare:
        print(f"\nGloo passes, ud does not ({len(gaps)}):")
        for gap in gaps:
            extra = (f"; under Gloo's gates: {gap['ud_gloo_gates']} {gap['ud_gloo_gates_reason']}".rstrip()
                     if gap["ud_gloo_gates"] else "")
            print(f"  {gap['test']}: {gap['ud']} {gap['ud_reason']}{extra}")
    print(f"\ntable: {os.path.join(out_dir, 'summary.md')}")
    return 1 if args.compare and gaps else 0


def _interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")  # run_backend then kills the runner and its ranks


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--_runner":
        sys.exit(_runner_main(sys.argv[2:]))
    signal.signal(signal.SIGTERM, _interrupted)
    sys.exit(main())
