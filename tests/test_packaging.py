"""The package as a user gets it: `python -m build` makes an sdist holding
everything the extension needs and a wheel built from that sdist; the wheel,
installed into a clean virtual environment, runs the demo from outside the
source tree; the type stubs name exactly what the compiled modules export.
(Without libibverbs: tests/test_without_libibverbs.py.)"""
import ast
import importlib
import inspect
import os
import pathlib
import subprocess
import sys
import tarfile
import zipfile

import pytest

from conftest import skip_or_fail
from ud_transport import verbs_extension

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_sdist_and_wheel_build_and_the_installed_wheel_runs_the_demo(tmp_path):
    dist = tmp_path / "dist"
    built = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(ROOT)],
                           capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    sdist, = dist.glob("*.tar.gz")
    wheel, = dist.glob("*.whl")
    names = tarfile.open(sdist).getnames()
    prefix = names[0].split("/")[0]
    for needed in ["native/engine.h", "native/wire.h", "cython/_native.pyx", "cython/native.pxd", "cython/simulator.pxi",
                   "cython/transport_io.pxd", "cython/_verbs.pyx", "cython/verbs_native.pxd", "cython/verbs_device.pxi",
                   "native/transport_verbs.c", "native/transport_verbs.h", "native/verbs_probe.c",
                   "ud_transport/py.typed", "ud_transport/_native.pyi", "ud_transport/_verbs.pyi",
                   "ud_transport/torch/backend.py", "setup.py"]:
        assert f"{prefix}/{needed}" in names, f"sdist lacks {needed}"
    for generated in ["cython/_native.c", "cython/_verbs.c"]:
        assert f"{prefix}/{generated}" not in names, "generated C must not ship (it is rebuilt from the .pyx)"
    venv = tmp_path / "venv"
    # system site packages for torch and numpy only; ud_transport itself comes from the wheel
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    # a checkout on PYTHONPATH would shadow the wheel (and its egg-info make pip think it is installed)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True, env=env, timeout=300)
    modules = "ud_transport, ud_transport._native" + (", ud_transport._verbs" if verbs_extension.load() else "")
    where = subprocess.run([str(python), "-c", f"import {modules}; print(*(m.__file__ for m in [{modules}]))"],
                           capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120, check=True).stdout.split()
    assert all(path.startswith(str(venv)) for path in where), where
    demo = subprocess.run([str(python), "-m", "ud_transport", "demo"], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=300)
    assert demo.returncode == 0, demo.stderr[-2000:]
    assert "reduce" in demo.stdout


@pytest.mark.parametrize("module", ["_native", "_verbs"])
def test_type_stub_names_what_the_compiled_module_exports(module):
    if module == "_verbs" and verbs_extension.load() is None:
        pytest.skip(verbs_extension.problem())
    stub = ast.parse((ROOT / "ud_transport" / f"{module}.pyi").read_text())
    stubbed = set()
    for node in stub.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            stubbed.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            stubbed.add(node.target.id)
        elif isinstance(node, ast.Assign):
            stubbed.update(t.id for t in node.targets if isinstance(t, ast.Name))
    compiled = importlib.import_module(f"ud_transport.{module}")
    exported = {name for name in dir(compiled) if not name.startswith("_")}
    assert stubbed - exported == set(), f"stub names what the module lacks: {sorted(stubbed - exported)}"
    assert exported - stubbed == set(), f"module exports what the stub lacks: {sorted(exported - stubbed)}"


def stub_parameters(function):
    """(name, has a default) of a stub's parameters, in order."""
    arguments = function.args
    positional = arguments.posonlyargs + arguments.args
    defaults = [False] * (len(positional) - len(arguments.defaults)) + [True] * len(arguments.defaults)
    names = [(a.arg, d) for a, d in zip(positional, defaults)]
    names += [(a.arg, d is not None) for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults)]
    return [(name, default) for name, default in names if name not in ("self", "cls")]


def compiled_parameters(function):
    parameters = inspect.signature(function).parameters.values()
    return [(p.name, p.default is not inspect.Parameter.empty) for p in parameters if p.name not in ("self", "cls")]


@pytest.mark.parametrize("module", ["_native", "_verbs"])
def test_type_stub_signatures_match_the_compiled_module(module):
    """Every function and method the stub types takes the parameters the compiled one takes:
    the same names in the same order, with a default exactly where the compiled one has one."""
    if module == "_verbs" and verbs_extension.load() is None:
        pytest.skip(verbs_extension.problem())
    compiled = importlib.import_module(f"ud_transport.{module}")
    stub = ast.parse((ROOT / "ud_transport" / f"{module}.pyi").read_text())
    checked = 0
    for node in stub.body:
        owners = [(node.name, getattr(compiled, node.name), node.body)] if isinstance(node, ast.ClassDef) else []
        functions = [(None, compiled, [node])] if isinstance(node, ast.FunctionDef) else owners
        for owner_name, owner, body in functions:
            for function in body:
                if not isinstance(function, ast.FunctionDef) or function.name.startswith("__"):
                    continue
                target = getattr(owner, function.name)
                if isinstance(target, property) or any(getattr(d, "id", "") == "property" for d in function.decorator_list):
                    continue
                where = f"{module}.{owner_name + '.' if owner_name else ''}{function.name}"
                assert stub_parameters(function) == compiled_parameters(target), where
                checked += 1
    assert checked >= 10, f"only {checked} signatures compared"


def test_an_isolated_build_from_the_registry_makes_the_same_wheel(tmp_path):
    """`python -m build` as a user runs it: build requirements (pyproject.toml's setuptools,
    wheel, Cython) fetched from the package registry into a fresh environment, not taken from
    this one. The wheel holds the same modules as the --no-isolation build above."""
    dist = tmp_path / "dist"
    built = subprocess.run([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)],
                           capture_output=True, text=True, timeout=1200)
    output = built.stdout[-3000:] + built.stderr[-3000:]
    if built.returncode != 0 and any(sign in output for sign in ("Failed to establish a new connection",
                                                                   "No matching distribution found", "Temporary failure in name resolution")):
        skip_or_fail(f"the package registry is unreachable, so build requirements cannot be fetched: {output[-500:]}")
    assert built.returncode == 0, output
    wheel, = dist.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    compiled = {name.split("/")[-1].split(".")[0] for name in names if name.endswith(".so")}
    assert "_native" in compiled, names
    if verbs_extension.load() is not None:  # libibverbs headers here: the isolated build finds them too
        assert "_verbs" in compiled, names
    for needed in ["ud_transport/py.typed", "ud_transport/_native.pyi", "ud_transport/environment.py"]:
        assert needed in names, f"wheel lacks {needed}"
