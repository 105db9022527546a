"""RDMA is optional: without ud_transport._verbs (not built, or libibverbs.so.1 missing) "auto"
runs on UDP, "verbs" says exactly why not, and `info` reports it and still exits 0. In-process,
by making the import fail; tests/test_without_libibverbs.py proves it on a real install."""
import ctypes
import json
import sys

import pytest

from ud_transport import _native, transports, verbs_extension
from ud_transport.errors import TransportError
from ud_transport.lab import info

NOT_BUILT = "ud_transport._verbs was not built: <infiniband/verbs.h> was missing when ud_transport was built"
CANNOT_LOAD = "libibverbs.so.1: cannot open shared object file: No such file or directory"


def forget_the_extension(monkeypatch):
    monkeypatch.setattr(verbs_extension, "_loaded", None)
    monkeypatch.setattr(verbs_extension, "_problem", None)
    monkeypatch.delenv("UD_TRANSPORT", raising=False)


@pytest.fixture
def not_built(monkeypatch):
    forget_the_extension(monkeypatch)
    monkeypatch.setitem(sys.modules, "ud_transport._verbs", None)  # import raises ModuleNotFoundError


@pytest.fixture
def cannot_load(monkeypatch):
    forget_the_extension(monkeypatch)

    def import_module(name):
        raise ImportError(CANNOT_LOAD)

    monkeypatch.setattr(verbs_extension, "import_module", import_module)


@pytest.mark.parametrize("missing, reason", [("not_built", NOT_BUILT), ("cannot_load", CANNOT_LOAD)])
def test_auto_falls_back_to_udp_and_verbs_says_why_not(missing, reason, request):
    request.getfixturevalue(missing)
    assert verbs_extension.load() is None and reason in verbs_extension.problem()
    assert transports.choose("auto") == "udp"
    with pytest.raises(TransportError, match="transport='verbs' is unavailable: ") as caught:
        transports.choose("verbs")
    assert reason in str(caught.value)
    with pytest.raises(TransportError, match="verbs transport: ") as caught:
        transports.open_verbs("127.0.0.1", None, 1)
    assert reason in str(caught.value)


def test_info_lists_the_transports_and_why_verbs_is_unavailable(not_built, capsys):
    assert info.main(["--json"]) == 0
    available = json.loads(capsys.readouterr().out)["transports"]
    assert available["udp"] == {"available": True, "problem": None}
    assert available["verbs"]["available"] is False and NOT_BUILT in available["verbs"]["problem"]
    assert info.main([]) == 0
    text = capsys.readouterr().out
    assert "udp: available" in text and f"verbs: unavailable: the RDMA extension {NOT_BUILT}" in text
    assert "transport='auto' resolves to: udp" in text


def test_the_engine_adopts_only_a_transport_capsule():
    with pytest.raises(ValueError):
        _native.Transport.adopt(object())
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype = ctypes.py_object
    new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    name = b"someone.else"  # the capsule keeps a pointer to it
    with pytest.raises(ValueError, match="incorrect name"):
        _native.Transport.adopt(new_capsule(1, name, None))
