"""help() documents the core API (issue 11): every name in ud_transport.__all__ and every
public method of its classes has a docstring; the collectives (module functions and
Communicator methods) name each of their parameters and say what they return and raise.
The torch integration (ud_transport.torch) is not held to this yet."""
import inspect
import re

import pytest

import ud_transport

COLLECTIVES = ["allreduce", "reduce_scatter", "all_gather", "broadcast", "agree"]


def public_members():
    for name in ud_transport.__all__:
        thing = getattr(ud_transport, name)
        yield name, thing
        if inspect.isclass(thing) and not issubclass(thing, BaseException):
            for member, value in vars(thing).items():
                if not member.startswith("_") and (inspect.isfunction(value) or isinstance(value, property)):
                    yield f"{name}.{member}", value


@pytest.mark.parametrize("name,thing", list(public_members()), ids=lambda v: v if isinstance(v, str) else "")
def test_has_a_docstring(name, thing):
    assert (inspect.getdoc(thing) or "").strip(), f"{name} has no docstring"


@pytest.mark.parametrize("function", [getattr(ud_transport, n) for n in COLLECTIVES + ["init"]] +
                         [getattr(ud_transport.Communicator, n) for n in COLLECTIVES + ["shard_range"]] +
                         [ud_transport.Communicator], ids=lambda f: f.__qualname__)
def test_the_api_documents_each_parameter_what_it_returns_and_raises(function):
    doc = inspect.getdoc(function)
    signature = inspect.signature(function)
    # numpydoc entries: "name : type" or "a, b : type" at the start of a line (** for **options)
    entries = {name.strip().lstrip("*") for line in doc.splitlines() if re.match(r"^[*\w][\w, *]* :", line)
               for name in line.split(" :")[0].split(",")}
    entries |= {line.strip().lstrip("*") for line in doc.splitlines() if re.match(r"^\*\*\w+$", line)}
    for parameter in signature.parameters.values():
        if parameter.name in ("self", "keywords"):
            continue
        assert parameter.name in entries, f"{function.__qualname__}: parameter {parameter.name!r} has no entry ({entries})"
    assert "Parameters\n----------" in doc and "Examples\n--------" in doc, function.__qualname__
    if function is not ud_transport.Communicator.shard_range:
        assert "Raises\n------" in doc, function.__qualname__
    if not inspect.isclass(function):
        assert "Returns\n-------" in doc, function.__qualname__
    assert "{call_" not in doc, f"{function.__qualname__}: a shared section was not filled in"
