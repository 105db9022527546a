"""help() documents the API (issue 11): every name in ud_transport.__all__ and
ud_transport.torch.__all__ has its own numpy-style docstring (an entry per parameter, or per
attribute of a data class, enum or error; Returns and Raises where the code returns or raises;
an example), and every public method of their classes has a docstring; the collectives and the
torch entry points document each parameter, return and raise."""
import ast
import dataclasses
import enum
import inspect
import re
import textwrap

import pytest

import ud_transport
from ud_transport import environment

COLLECTIVES = ["allreduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "agree"]


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
                if isinstance(value, (classmethod, staticmethod)):
                    value = value.__func__
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
    documented = entries(doc)
    for parameter in signature.parameters.values():
        if parameter.name in ("self", "keywords", "args", "kwargs"):
            continue
        assert parameter.name in documented, f"{function.__qualname__}: parameter {parameter.name!r} has no entry ({documented})"
    assert "Parameters\n----------" in doc and "Examples\n--------" in doc, function.__qualname__
    if function is not ud_transport.Communicator.shard_range:
        assert "Raises\n------" in doc, function.__qualname__
    if not inspect.isclass(function):
        assert "Returns\n-------" in doc, function.__qualname__
    assert "{call_" not in doc, f"{function.__qualname__}: a shared section was not filled in"


# -- every name in __all__ ----------------------------------------------------

def public_names():
    for module in modules():
        for name in module.__all__:
            yield f"{module.__name__}.{name}", getattr(module, name)


def own_docstring(thing):
    """The docstring written for `thing` itself: a class's __doc__ is never inherited, but a
    dataclass without one gets its signature ('Options(chunk_bytes: int = 0, ...)')."""
    doc = thing.__doc__ or ""
    if dataclasses.is_dataclass(thing) and doc.startswith(f"{thing.__name__}("):
        return ""
    return inspect.cleandoc(doc)


def sections(doc):
    """{numpydoc section title: its text}."""
    parts = re.split(r"^(\w[\w ]*)\n-+$", doc, flags=re.M)
    return {title: text for title, text in zip(parts[1::2], parts[2::2])}


def entries(text):
    """The names a section documents: "name : type" or "a, b : type" at the start of a line
    (** for **options), or a bare "**options" line."""
    names = {name.strip().lstrip("*") for line in text.splitlines() if re.match(r"^[*\w][\w, *]* :", line)
             for name in line.split(" :")[0].split(",")}
    return names | {line.strip().lstrip("*") for line in text.splitlines() if re.match(r"^\*\*\w+$", line)}


def is_record(cls):
    """Data classes, enums and errors document Attributes (what they hold) more than a call."""
    return dataclasses.is_dataclass(cls) or issubclass(cls, (enum.Enum, BaseException))


def parameter_names(callable_):
    try:
        signature = inspect.signature(callable_)
    except (TypeError, ValueError):  # a builtin base's __init__ (RuntimeError) has none
        return []
    return [p.name for p in signature.parameters.values() if p.name not in ("self", "keywords", "args", "kwargs")]


def attribute_names(cls):
    if dataclasses.is_dataclass(cls):
        return [field.name for field in dataclasses.fields(cls)]
    if issubclass(cls, enum.Enum):
        return [member.name for member in cls]
    # errors: what the constructor stores (beyond the message) and the class's own public data
    data = [name for name, value in vars(cls).items() if not name.startswith("_") and not callable(value)
            and not isinstance(value, (classmethod, staticmethod, property))]
    return [name for name in parameter_names(cls) if name != "message"] + data


def syntax_of(function):
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError):  # compiled or generated: nothing to read
        return None


def raises(function):
    tree = syntax_of(function)
    return tree is not None and any(isinstance(node, ast.Raise) for node in ast.walk(tree))


def returns_a_value(function):
    tree = syntax_of(function)
    return tree is not None and any(isinstance(node, ast.Return) and node.value is not None for node in ast.walk(tree))


@pytest.mark.parametrize("name,thing", list(public_names()), ids=lambda v: v if isinstance(v, str) else "")
def test_every_public_name_documents_itself_in_full(name, thing):
    doc = own_docstring(thing)
    assert doc, f"{name} has no docstring of its own"
    if inspect.ismodule(thing):
        return
    found = sections(doc)
    assert "Examples" in found and ">>>" in found["Examples"], f"{name}: no Examples section with a >>> line"
    if inspect.isclass(thing):
        constructors = [vars(thing)[n] for n in ("__init__", "__post_init__") if n in vars(thing)]
        if is_record(thing):
            # a dataclass's fields are its parameters too: either title will do for them
            titles = ("Attributes", "Parameters") if dataclasses.is_dataclass(thing) else ("Attributes",)
            required = attribute_names(thing)
        else:
            titles, required = ("Parameters",), parameter_names(thing)
        documented = set().union(*(entries(found.get(title, "")) for title in titles))
        missing = [n for n in required if n not in documented]
        assert not missing, f"{name}: no entry under {' or '.join(titles)} for {missing}"
        must_raise = any(raises(c) for c in constructors)
    else:
        missing = [n for n in parameter_names(thing) if n not in entries(found.get("Parameters", ""))]
        assert not missing, f"{name}: no entry under Parameters for {missing}"
        assert "Returns" in found or not returns_a_value(thing), f"{name} returns a value: it needs a Returns section"
        must_raise = raises(thing)
    assert "Raises" in found or not must_raise, f"{name} raises: it needs a Raises section"


def test_own_docstring_sees_through_a_dataclass_stand_in():
    @dataclasses.dataclass
    class Undocumented:
        size: int = 0

    class Documented(Undocumented):
        """Written."""

    @dataclasses.dataclass
    class Inherits(Documented):
        pass

    assert own_docstring(Undocumented) == own_docstring(Inherits) == "" and own_docstring(Documented) == "Written."


def option_entries():
    """{Options field: (its line "name : type, default X", its description)}."""
    text = sections(own_docstring(ud_transport.Options))["Attributes"]
    blocks = re.split(r"^(?=\w+ :)", text, flags=re.M)
    return {block.split(" :")[0]: (block.splitlines()[0], " ".join(block.splitlines()[1:])) for block in blocks
            if " :" in block}


@pytest.mark.parametrize("field", dataclasses.fields(ud_transport.Options), ids=lambda f: f.name)
def test_options_document_each_field_with_its_default_and_variable(field):
    heading, description = option_entries()[field.name]
    written = re.search(r", default (.+?)(?: \(.*\))?$", heading)
    assert written, f"{heading!r} gives no default"
    assert ast.literal_eval(written.group(1)) == field.default, f"{field.name}: the docstring says {written.group(0)}"
    named = set(re.findall(r"\bUD_[A-Z_]+\b", description))
    assert named <= set(environment.BY_NAME), f"{field.name} names variables that do not exist: {named}"
    variable = environment.fields_of("option").get(field.name)
    assert variable is None or variable in named, f"{field.name}: its variable {variable} is not named"
