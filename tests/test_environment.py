"""One home for the environment: every UD_* variable the library reads is in
ud_transport.environment.VARIABLES, each sets what the table says, and the table in
docs/configuration.md is that table."""
import dataclasses
import pathlib
import re

import pytest

from ud_transport import environment
from ud_transport import options as options_module

ROOT = pathlib.Path(__file__).resolve().parent.parent
# the ways a variable is read: os.environ.get / [], getenv in C, the C transport's switch, environment.read
READ = re.compile(r"""(?:environ(?:\.get)?\(?\[?|getenv\(|env_disabled\(|environment\.read\()\s*["'](UD_[A-Z0-9_]+)["']""")


def names_read_in_sources():
    sources = [*ROOT.glob("ud_transport/**/*.py"), *ROOT.glob("native/*.c"), ROOT / "setup.py"]
    return {name: path.relative_to(ROOT) for path in sources for name in READ.findall(path.read_text())}


def test_every_variable_read_is_in_the_table():
    found = names_read_in_sources()
    assert {"UD_TRANSPORT", "UD_UDP_GSO", "UD_BUILD_VERBS", "UD_LOG", "UD_INJECT"} <= set(found)  # the scan sees reads
    missing = {name: str(path) for name, path in found.items() if name not in environment.BY_NAME}
    assert not missing, f"read but not in ud_transport.environment.VARIABLES: {missing}"


def test_every_variable_in_the_table_is_read_somewhere():
    unread = set(environment.BY_NAME) - set(names_read_in_sources()) - set(environment.fields_of("option").values()) \
        - set(environment.fields_of("backend").values())
    assert not unread, f"listed but never read: {sorted(unread)}"


def test_an_unlisted_name_is_refused():
    with pytest.raises(KeyError, match="UD_NO_SUCH"):
        environment.read("UD_NO_SUCH")


def test_the_documented_table_is_this_table():
    documented = (ROOT / "docs" / "configuration.md").read_text()
    assert environment.markdown_table() in documented


def as_text(value):
    return ",".join(value) if isinstance(value, tuple) else str(value)


def backend_options():
    backend = pytest.importorskip("ud_transport.torch.backend", reason="torch is not installed")
    return backend.BackendOptions


@pytest.mark.parametrize("target", ["option", "backend"])
def test_defaults_in_the_table_are_the_real_defaults(target):
    cls = options_module.Options if target == "option" else backend_options()
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    for field, name in environment.fields_of(target).items():
        assert environment.BY_NAME[name].default == as_text(defaults[field]), name


OPTION_VALUES = {"chunk_bytes": "1024", "window_bytes": "1048576", "socket_buffer_bytes": "2097152",
                 "bind_address": "127.0.0.2", "deadline_cap_s": "7.5", "default_loss_budget": "0.25",
                 "join_timeout_s": "12.0", "store_timeout_s": "9.0", "algorithm": "ring", "copies": "2",
                 "stripes": "3", "in_place_min_bytes": "4096", "busy_poll_us": "25"}


def test_each_option_variable_sets_its_option(monkeypatch):
    assert set(OPTION_VALUES) == set(environment.fields_of("option"))
    for field, name in environment.fields_of("option").items():
        monkeypatch.setenv(name, OPTION_VALUES[field])
    built = options_module.build()
    for field, text in OPTION_VALUES.items():
        assert as_text(getattr(built, field)) == text, field
    assert options_module.build(algorithm="direct").algorithm == "direct"  # a keyword wins


def test_each_backend_variable_sets_its_field(monkeypatch):
    cls = backend_options()
    values = {"loss_budget": "0.3", "on_budget_miss": "skip", "lossy": "allreduce", "transport": "udp"}
    assert set(values) == set(environment.fields_of("backend"))
    for field, name in environment.fields_of("backend").items():
        monkeypatch.setenv(name, values[field])
    built = cls.from_environment()
    for field, text in values.items():
        assert as_text(getattr(built, field)) == text, field


def test_an_empty_variable_is_as_if_unset(monkeypatch):
    # `UD_WINDOW_BYTES= python ...` in a shell: the default, not "invalid literal for int()"
    for name in environment.fields_of("option").values():
        monkeypatch.setenv(name, "")
    assert options_module.build() == options_module.Options().validate()
    monkeypatch.setenv("UD_LOSS_BUDGET", " ")
    monkeypatch.setenv("UD_ON_BUDGET_MISS", "")
    assert backend_options().from_environment() == backend_options()().validate()


@pytest.mark.parametrize("name, text, expected", [("UD_WINDOW_BYTES", "8M", "UD_WINDOW_BYTES must be an integer, got '8M'"),
                                                  ("UD_DEADLINE_CAP", "soon", "UD_DEADLINE_CAP must be a number, got 'soon'"),
                                                  ("UD_STRIPES", "many", "UD_STRIPES must be \"auto\" or an integer")])
def test_a_malformed_value_names_its_variable(monkeypatch, name, text, expected):
    monkeypatch.setenv(name, text)
    with pytest.raises(ValueError, match=re.escape(expected)):
        options_module.build()


def test_a_malformed_loss_budget_names_its_variable_for_the_backend_too(monkeypatch):
    monkeypatch.setenv("UD_LOSS_BUDGET", "ten percent")
    with pytest.raises(ValueError, match=re.escape("UD_LOSS_BUDGET must be a number, got 'ten percent'")):
        backend_options().from_environment()
