"""help() documents the API (issue 11): every name in ud_transport.__all__ and
ud_transport.torch.__all__ and every public method of their classes has a docstring; the
collectives and the torch entry points have an entry for each parameter and say what they
return and raise."""
import inspect
import re

import pytest

import ud_transport

COLLECTIVES = ["allreduce", "reduce_scatter", "all_gather", "broadcast", "agree"]


def modules():
    yield ud_transport
    torch_api = pytest.importorskip("ud_transport.torch", reason="torch is not installed")
    yield torch_api


def public_members():
    for module in modules():
        yield from members_of(module)


def members_of(module):
    for name in module.__all__:
        thing = getattr(module, name)
        yield name, thing
        if inspect.isclass(thing) and not issubclass(thing, BaseException):
            for member, value in vars(thing).items():
                if not member.startswith("_") and (inspect.isfunction(value) or isinstance(value, property)):
                    yield f"{name}.{member}", value


@pytest.mark.parametrize("name,thing", list(public_members()), ids=lambda v: v if isinstance(v, str) else "")
def test_has_a_docstring(name, thing):
    assert (inspect.getdoc(thing) or "").strip(), f"{name} has no docstring"


def documented_in_full():
    import ud_transport.torch as torch_api
    return ([getattr(ud_transport, n) for n in COLLECTIVES + ["init"]] +
            [getattr(ud_transport.Communicator, n) for n in COLLECTIVES + ["shard_range"]] + [ud_transport.Communicator] +
            [torch_api.LossyHookState, torch_api.LossyHookState.step, torch_api.lossy_allreduce_hook,
             torch_api.LossTolerantOptimizer, torch_api.LossTolerantOptimizer.step, torch_api.ParameterSync,
             torch_api.replica_drift, torch_api.PhaseAwareBudget, torch_api.PhaseAwareBudget.budget,
             torch_api.BackendOptions, torch_api.ProcessGroupUD])


@pytest.mark.parametrize("function", documented_in_full(), ids=lambda f: f.__qualname__)
def test_the_api_documents_each_parameter_what_it_returns_and_raises(function):
    doc = inspect.getdoc(function)
    signature = inspect.signature(function)
    # numpydoc entries: "name : type" or "a, b : type" at the start of a line (** for **options)
    entries = {name.strip().lstrip("*") for line in doc.splitlines() if re.match(r"^[*\w][\w, *]* :", line)
               for name in line.split(" :")[0].split(",")}
    entries |= {line.strip().lstrip("*") for line in doc.splitlines() if re.match(r"^\*\*\w+$", line)}
    for parameter in signature.parameters.values():
        if parameter.name in ("self", "keywords", "args", "kwargs"):
            continue
        assert parameter.name in entries, f"{function.__qualname__}: parameter {parameter.name!r} has no entry ({entries})"
    assert "Parameters\n----------" in doc and "Examples\n--------" in doc, function.__qualname__
    if function is not ud_transport.Communicator.shard_range:
        assert "Raises\n------" in doc, function.__qualname__
    if not inspect.isclass(function):
        assert "Returns\n-------" in doc, function.__qualname__
    assert "{call_" not in doc, f"{function.__qualname__}: a shared section was not filled in"
