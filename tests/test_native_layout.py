"""The C engine's house rules (issue 40), checked from the sources: rooms of one concern that
depend only on the rooms before them (no circle: the verdict never calls into the call's
lifecycle, the data phase never into the verdict), no file over ~700 lines, and only the schedule
asks which collective a call is."""
import pathlib
import re

NATIVE = pathlib.Path(__file__).resolve().parent.parent / "native"
# in dependency order, as native/engine_internal.h lists them
ROOMS = ["pieces", "recent_loss", "control", "output", "liveness", "data", "verdict", "call", "comm"]
MAX_LINES = 720


def _code(path):
    """The file without comments and string literals."""
    text = re.sub(r"/\*.*?\*/", "", path.read_text(), flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', text)


def _defined(code):
    """Names of the functions a file defines (at the start of a line, followed by a body)."""
    return set(re.findall(r"^[A-Za-z_][\w \*]*?\b(udt_\w+)\s*\([^;{]*\)\s*\{", code, flags=re.M))


def _room_graph():
    codes = {room: _code(NATIVE / f"{room}.c") for room in ROOMS}
    owner = {name: room for room, code in codes.items() for name in _defined(code)}
    calls = {room: {owner[name] for name in re.findall(r"\b(udt_\w+)\s*\(", code) if owner.get(name, room) != room}
             for room, code in codes.items()}
    return calls, owner


def test_every_room_calls_only_rooms_listed_before_it():
    calls, owner = _room_graph()
    assert len(owner) > 30, "the parser found too few definitions to judge"
    later = {room: sorted(callee for callee in callees if ROOMS.index(callee) > ROOMS.index(room))
             for room, callees in calls.items()}
    assert not any(later.values()), f"rooms calling rooms after them (a circle in the making): {later}"


def test_the_rule_catches_a_circle():
    """The check above can fail: a verdict that called into the call's lifecycle would be seen."""
    code = _code(NATIVE / "verdict.c") + "\nstatic void x(void) { udt_call_progress(0, 0, 0); }\n"
    owner = {name: room for room in ROOMS for name in _defined(_code(NATIVE / f"{room}.c"))}
    called = {owner[name] for name in re.findall(r"\b(udt_\w+)\s*\(", code) if name in owner}
    assert "call" in called


def test_no_file_of_the_engine_is_over_the_bound():
    sizes = {path.name: len(path.read_text().splitlines()) for path in NATIVE.glob("*.[ch]")}
    assert not {name: lines for name, lines in sizes.items() if lines > MAX_LINES}, sizes


def test_only_the_schedule_asks_which_collective_a_call_is():
    askers = [path.name for path in NATIVE.glob("*.c") if path.name != "schedule.c"
              and re.search(r"collective\s*[!=]=|case UDT_(ALLREDUCE|REDUCE_SCATTER|ALL_GATHER|BROADCAST|AGREE|ALL_TO_ALL)\b",
                            _code(path))]
    assert not askers, f"files that test which collective a call is instead of reading its facts: {askers}"
