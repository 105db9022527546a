"""What each collective is lives in one table (native/schedule.c); the engine, the verdict and
the Python layer read it (issue 40). And a refused call says which argument and takes nothing:
every check runs before the call's sequence number is taken."""
from types import SimpleNamespace

import numpy as np
import pytest

from ud_transport import _native, collectives
from ud_transport import options as options_module
from ud_transport.torch.policy import StepCounters

CODES = {"allreduce": _native.COLLECTIVE_ALLREDUCE, "reduce_scatter": _native.COLLECTIVE_REDUCE_SCATTER,
         "all_gather": _native.COLLECTIVE_ALL_GATHER, "broadcast": _native.COLLECTIVE_BROADCAST,
         "agree": _native.COLLECTIVE_AGREE, "all_to_all": _native.COLLECTIVE_ALL_TO_ALL,
         "scatter": _native.COLLECTIVE_SCATTER, "gather": _native.COLLECTIVE_GATHER}


def test_every_collective_has_its_facts_under_its_api_name():
    assert collectives.NAMES == {code: name for name, code in CODES.items()}
    assert {name for name in collectives.FACTS if collectives.reduces(name)} == {"allreduce", "reduce_scatter"}
    assert {name for name in collectives.FACTS if collectives.gathers(name)} == {
        "allreduce", "all_gather", "broadcast", "all_to_all", "scatter", "gather"}
    assert {name: facts["wants"] for name, facts in collectives.FACTS.items() if facts["wants"] != "all"} == {
        "scatter": "own block", "gather": "all at the root"}


def test_step_counters_count_an_all_to_alls_gather_half():
    """The Python copy of "which collectives gather" left all_to_all out: its gather fraction was
    never averaged into a step's counters."""
    counters = StepCounters()
    counters.record(SimpleNamespace(collective="all_to_all", reduce_fraction=1.0, gather_fraction=0.5))
    assert counters.to_dict()["gather_calls"] == 1 and counters.to_dict()["mean_gather_fraction"] == 0.5


def _silent_pair(chunk_bytes):
    """Rank 0 of a world of two whose peer never answers: a refused call never gets as far as waiting."""
    transport = _native.Transport.udp("127.0.0.1", 0, 1 << 20)
    own = transport.address
    engine = _native.Engine(transport, 0, 2, 7, options_module.build(join_timeout_s=0.2).engine_options(chunk_bytes, 1 << 16))
    engine.set_peers(own + own, 6)
    return engine


@pytest.fixture
def engine():
    engine = _silent_pair(64)
    yield engine
    engine.close()


GOOD = dict(collective=_native.COLLECTIVE_ALL_TO_ALL, algorithm=_native.ALGORITHM_DIRECT, count=8,
            dtype=_native.DTYPE_FLOAT32, deadline_s=1.0, loss_budget=0.1)


@pytest.mark.parametrize("change, named", [
    (dict(collective=99), "collective:"),
    (dict(algorithm=7), "algorithm:"),
    (dict(dtype=99), "dtype:"),
    (dict(op=5), "op:"),
    (dict(estimator=9), "estimator:"),
    (dict(deadline_s=0.0), "deadline_s:"),
    (dict(loss_budget=1.5), "loss_budget:"),
    (dict(loss_budget=float("nan")), "loss_budget:"),
    (dict(root=2), "root:"),
    (dict(copies=1000), "copies:"),
    (dict(input=0), "input:"),
    (dict(output=0), "output:"),
    (dict(count=7), "count: must divide by the world size"),
    (dict(chunk_mask_bytes=3), "chunk_mask_bytes:"),
    (dict(dtype=_native.DTYPE_FLOAT64, count=8), None),  # a control: 8 bytes fit a 64-byte chunk
])
def test_a_refused_call_names_its_argument_and_takes_no_sequence_number(engine, change, named):
    data, out, mask = np.zeros(16, np.float64), np.zeros(16, np.float64), np.zeros(64, np.uint8)
    args = dict(GOOD, input=data.ctypes.data, output=out.ctypes.data)
    if "chunk_mask_bytes" in change:
        args["chunk_mask"] = mask.ctypes.data
    args.update(change)
    before = engine.sequence
    status, _, error = engine.run(**args)
    if named is None:  # the peer is silent: the call runs to its join timeout, so it took a number
        assert status == _native.STATUS_PEER_TIMEOUT and engine.sequence == before + 1
        return
    assert status == _native.STATUS_INVALID_ARGUMENT, (status, error)
    assert error.message.startswith(named), error.message
    assert engine.sequence == before


def test_chunk_bytes_below_one_element_is_refused_before_the_call():
    small = _silent_pair(4)
    data = np.zeros(8, np.float64)
    try:
        status, _, error = small.run(**dict(GOOD, dtype=_native.DTYPE_FLOAT64, input=data.ctypes.data,
                                            output=data.ctypes.data))
        assert status == _native.STATUS_INVALID_ARGUMENT and error.message.startswith("chunk_bytes:"), error.message
        assert small.sequence == 0
    finally:
        small.close()
