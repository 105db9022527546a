"""ud_transport on a machine without libibverbs, container-free: every step runs in a private mount
namespace (unshare -m) where empty bind mounts hide the verbs headers, every libibverbs library,
the rdma providers and the machine's editable install of ud_transport. From an sdist, pip builds
and installs the package into a fresh venv; outside the source tree it imports without
ud_transport._verbs, a 2-rank UDP allreduce (the demo) runs, and `info` exits 0 saying why verbs
is unavailable.

The venv takes torch, numpy, Cython and setuptools from the system (--system-site-packages; the
build is offline). That would also expose an editable install of ud_transport: its .pth in the
system site-packages installs a finder that resolves ud_transport._verbs from that checkout when
the venv's package lacks it. Such .pth files are hidden too, like the libraries."""
import glob
import json
import os
import shlex
import shutil
import site
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from conftest import skip_or_fail

ROOT = Path(__file__).resolve().parent.parent
HEADER_DIRS = ["/usr/include", "/usr/local/include"] + os.environ.get("CPATH", "").split(":")
LIBRARY_DIRS = ["/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib"]


def why_not_here():
    if os.geteuid() != 0:
        return "needs root to bind-mount over the libibverbs files in a private mount namespace"
    if shutil.which("unshare") is None:
        return "needs unshare (util-linux) for a private mount namespace"
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create a mount namespace here: {probe.stderr.strip()}"
    return None


@pytest.fixture(autouse=True)
def private_mount_namespace_possible():
    """Skips on a developer's machine that cannot hide libibverbs; fails in CI, which must run it."""
    problem = why_not_here()
    if problem is not None:
        skip_or_fail(problem)


def hidden_paths():
    """(directories, files) to cover with an empty directory / an empty file."""
    directories = {os.path.realpath(os.path.join(d, "infiniband")) for d in HEADER_DIRS
                   if d and os.path.isdir(os.path.join(d, "infiniband"))}
    files = set()
    for directory in LIBRARY_DIRS:
        files.update(os.path.realpath(f) for f in glob.glob(os.path.join(directory, "libibverbs.*")))
        if os.path.isdir(os.path.join(directory, "libibverbs")):  # the rdma providers (librxe-rdmav*.so, ...)
            directories.add(os.path.realpath(os.path.join(directory, "libibverbs")))
    files.update(editable_installs())
    return sorted(directories), sorted(files)


def editable_installs():
    """The .pth files through which the system Python sees a source checkout of ud_transport."""
    found = []
    for directory in site.getsitepackages() + [site.getusersitepackages()]:
        for pth in glob.glob(os.path.join(directory, "*.pth")):
            lines = Path(pth).read_text(errors="replace").splitlines()
            if any("ud_transport" in line or os.path.isfile(os.path.join(line.strip(), "ud_transport", "__init__.py"))
                   for line in lines):
                found.append(pth)
    return found


def hidden(tmp_path, *command, env=None, cwd=None, timeout=600):
    """Run command in a fresh private mount namespace with libibverbs hidden."""
    empty_dir, empty_file = tmp_path / "empty", tmp_path / "empty-file"
    empty_dir.mkdir(exist_ok=True)
    empty_file.touch()
    directories, files = hidden_paths()
    mounts = [f"mount --bind {shlex.quote(str(empty_dir))} {shlex.quote(d)}" for d in directories]
    mounts += [f"mount --bind {shlex.quote(str(empty_file))} {shlex.quote(f)}" for f in files]
    script = "set -e\n" + "\n".join(mounts) + '\nexec "$@"\n'
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *map(str, command)],
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)


def test_udp_works_from_an_sdist_installed_without_libibverbs(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "UD_TRANSPORT", "UD_BUILD_VERBS", "CPATH")}
    loads = hidden(tmp_path, sys.executable, "-c", "import ctypes; ctypes.CDLL('libibverbs.so.1')", env=env)
    assert loads.returncode != 0, "libibverbs.so.1 still loads: the masking did not take"

    dist = tmp_path / "dist"
    built = hidden(tmp_path, sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", dist, ROOT, env=env)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    sdist, = dist.glob("*.tar.gz")
    shipped = [name for name in tarfile.open(sdist).getnames() if name.endswith(".so")]
    assert shipped == [], f"the sdist carries built extensions: {shipped}"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")
    installed = hidden(tmp_path, python, "-m", "pip", "install", "-v", "--no-build-isolation", "--no-deps",
                       "--no-index", "--no-cache-dir", sdist, env=env, cwd=tmp_path, timeout=900)
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    assert "skipping the RDMA extension ud_transport._verbs (<infiniband/verbs.h> not found" in installed.stdout + installed.stderr

    def run(*arguments):
        return hidden(tmp_path, python, *arguments, env=env, cwd=tmp_path)

    check = run("-c", "import importlib.util, json, ud_transport, ud_transport._native as n\n"
                      "from ud_transport import transports\n"
                      "try:\n    transports.choose('verbs'); refusal = None\n"
                      "except Exception as e:\n    refusal = f'{type(e).__name__}: {e}'\n"
                      "print(json.dumps({'package': ud_transport.__file__, 'native': n.__file__, "
                      "'verbs_spec': str(importlib.util.find_spec('ud_transport._verbs')), "
                      "'auto': transports.choose('auto'), 'verbs': refusal}))")
    assert check.returncode == 0, check.stderr[-2000:]
    facts = json.loads(check.stdout)
    assert facts["package"].startswith(str(venv)) and facts["native"].startswith(str(venv)), facts
    assert facts["verbs_spec"] == "None", facts  # _verbs is importable from nowhere, not even a checkout
    assert facts["auto"] == "udp"
    assert facts["verbs"].startswith("TransportError: transport='verbs' is unavailable: the RDMA extension "
                                     "ud_transport._verbs was not built"), facts

    demo = run("-m", "ud_transport", "demo", "--world-size", "2", "--calls", "2", "--count", "20000", "--loss", "0")
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    assert "transport: udp" in demo.stdout
    rows = [line.split() for line in demo.stdout.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert len(rows) == 4 and all(row[2] == "100.00%" and row[-1] == "ok" for row in rows), demo.stdout

    info = run("-m", "ud_transport", "info")
    assert info.returncode == 0, info.stdout + info.stderr
    assert "udp: available" in info.stdout
    assert "verbs: unavailable: the RDMA extension ud_transport._verbs was not built: <infiniband/verbs.h> was missing" in info.stdout
    assert "transport='auto' resolves to: udp" in info.stdout
    as_json = run("-m", "ud_transport", "info", "--json")
    assert as_json.returncode == 0, as_json.stderr
    available = json.loads(as_json.stdout)["transports"]
    assert available["udp"]["available"] and not available["verbs"]["available"]
    assert "was not built" in available["verbs"]["problem"]
