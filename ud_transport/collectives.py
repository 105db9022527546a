"""What each collective is — whether it reduces, gathers, takes a shard — as the C engine's one
table says (native/schedule.c, `udt_collective_facts`). Python reads these; it keeps no copy."""
from . import _native

FACTS = {facts["name"]: facts for facts in _native.COLLECTIVE_FACTS.values()}
NAMES = {code: facts["name"] for code, facts in _native.COLLECTIVE_FACTS.items()}


def reduces(name):
    """Whether the collective called `name` has a reduce half (a reduce_fraction to report)."""
    return FACTS[name]["reduces"]


def gathers(name):
    """Whether the collective called `name` has a gather half (a gather_fraction to report)."""
    return FACTS[name]["gathers"]
