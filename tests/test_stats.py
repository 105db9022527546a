"""CollectiveStats reads well (issue 11): repr() is one short line naming the key values,
to_dict() gives back every field, and stats still compare with == and pickle (they travel
between processes inside errors and task results)."""
import dataclasses
import pickle

import numpy as np
import pytest
import torch.distributed as dist

import ud_transport
from ud_transport import CollectiveStats
from ud_transport.stats import NOTABLE_DROPS


def distinct_stats(**changes):
    """Stats whose fields all differ from each other (so a field swapped or dropped shows)."""
    values = {}
    for number, field in enumerate(dataclasses.fields(CollectiveStats), start=1):
        values[field.name] = {float: number / 1000, int: 1000 + number, bool: False, str: f"label{number}"}[field.type]
    values.update(collective="allreduce", algorithm="direct", transport="udp", silent_rank=-1, mismatched_rank=-1)
    values.update({name: 0 for name in NOTABLE_DROPS})
    values.update(reduce_fraction=0.99812, gather_fraction=1.0, chunks_lost=3, chunks_total=1536, elapsed_s=0.004123)
    values.update(changes)
    return CollectiveStats(**values)


def test_repr_is_one_short_line_with_the_key_values():
    text = repr(distinct_stats())
    assert text == ("CollectiveStats(allreduce direct udp, reduce_fraction=0.99812, gather_fraction=1, "
                    "chunks_lost=3/1536, elapsed=4.12 ms)")
    assert "\n" not in text and len(text) < 120


def test_repr_names_what_went_wrong_only_when_something_did():
    text = repr(distinct_stats(injected_drops=5, receive_overflow_drops=2, deadline_expired=True, silent_rank=3))
    assert text.endswith("elapsed=4.12 ms, deadline_expired, silent_rank=3, injected_drops=5, "
                         "receive_overflow_drops=2)")
    quiet = repr(distinct_stats())
    assert not any(name in quiet for name in NOTABLE_DROPS + ("deadline_expired", "silent_rank", "mismatched_rank"))


def test_to_dict_gives_every_field_and_rebuilds_an_equal_stats():
    stats = distinct_stats(injected_drops=5)
    values = stats.to_dict()
    assert list(values) == [field.name for field in dataclasses.fields(CollectiveStats)]
    assert all(values[field.name] == getattr(stats, field.name) for field in dataclasses.fields(CollectiveStats))
    assert CollectiveStats(**values) == stats


def test_equality_and_pickling_hold():
    stats = distinct_stats()
    assert stats == distinct_stats() and stats != distinct_stats(chunks_lost=4)
    assert pickle.loads(pickle.dumps(stats)) == stats
    error = pickle.loads(pickle.dumps(ud_transport.LossBudgetExceeded("lossy", stats)))
    assert error.stats == stats


def test_a_real_call_returns_stats_that_read_and_travel():
    with ud_transport.init(0, 1, store=dist.HashStore(), transport="udp", bind_address="127.0.0.1") as comm:
        stats = comm.allreduce(np.ones(100, dtype=np.float32))
    ud_transport.close()
    assert repr(stats).startswith("CollectiveStats(allreduce ring udp, reduce_fraction=1, gather_fraction=1, ")
    assert pickle.loads(pickle.dumps(stats)) == stats == CollectiveStats(**stats.to_dict())
    assert ud_transport.AllreduceStats is CollectiveStats



def test_stats_from_the_engine_equal_the_same_stats_made_by_the_constructor():
    """from_native sets the fields without the dataclass's __init__ (a small call's cost): what it
    makes must be the same object in every way a caller can tell, and a field the engine did not
    give must still fail as the constructor fails."""
    made = distinct_stats(deadline_expired=False, in_place=True, budget_missed=False)
    labels = {"collective": made.collective, "algorithm": made.algorithm, "transport": made.transport}
    raw = {name: value for name, value in made.to_dict().items() if name not in labels}
    raw.update(deadline_expired=0, in_place=1, budget_missed=0, an_extra_key_the_engine_sends=7)
    built = CollectiveStats.from_native(raw, **labels)
    assert built == made and hash(built) == hash(made) and repr(built) == repr(made)
    assert built.to_dict() == made.to_dict() and list(built.to_dict()) == list(made.to_dict())
    assert pickle.loads(pickle.dumps(built)) == made
    assert type(built.in_place) is bool and type(built.deadline_expired) is bool
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.chunks_lost = 0
    del raw["steps"]
    with pytest.raises(TypeError, match="steps"):
        CollectiveStats.from_native(raw, **labels)
