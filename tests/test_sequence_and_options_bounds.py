"""Finding 12 of issue 10: end_repeats is bounded with a clear error, and the
per-call sequence number wraps at 2**32 like any other increment (0 is an
ordinary call, not "none"). busy_poll_us is bounded too, and its -1 spins only where a rank has
a core of its own."""
import pytest

import tasks
from conftest import get_cluster
from ud_transport import _native
from ud_transport import options as options_module


@pytest.mark.parametrize("value", [0, _native.MAX_END_REPEATS + 1, 10**9])
def test_end_repeats_out_of_bounds_is_refused_clearly(value):
    with pytest.raises(ValueError, match=f"end_repeats must be between 1 and {_native.MAX_END_REPEATS}"):
        options_module.build(end_repeats=value)


def test_engine_refuses_too_many_end_repeats_itself():
    transport = _native.Transport.udp("127.0.0.1", 0, 1 << 20)
    engine_options = options_module.build().engine_options(1024)
    engine_options["end_repeats"] = _native.MAX_END_REPEATS + 1
    with pytest.raises(ValueError, match="end_repeats"):
        _native.Engine(transport, 0, 2, 1, engine_options)


def test_most_end_repeats_allowed_work():
    assert options_module.build(end_repeats=_native.MAX_END_REPEATS).end_repeats == _native.MAX_END_REPEATS


@pytest.mark.parametrize("value", [-2, 1_000_001])
def test_busy_poll_out_of_bounds_is_refused_clearly(value):
    with pytest.raises(ValueError, match="busy_poll_us must be -1"):
        options_module.build(busy_poll_us=value)


def test_busy_poll_auto_spins_only_on_a_core_of_the_rank_s_own_for_each_engine():
    auto = options_module.build()
    assert auto.busy_poll_us == -1
    assert auto.engine_options(1024, core_share=1)["busy_poll_us"] == options_module.AUTO_BUSY_POLL_US > 0
    assert auto.engine_options(1024, core_share=0)["busy_poll_us"] == 0
    # stripes: each engine runs on a thread of its own, each would spin
    assert auto.engine_options(1024, core_share=4, engines=4)["busy_poll_us"] == options_module.AUTO_BUSY_POLL_US
    assert auto.engine_options(1024, core_share=1, engines=2)["busy_poll_us"] == 0
    assert options_module.build(busy_poll_us=0).engine_options(1024, core_share=8)["busy_poll_us"] == 0
    assert options_module.build(busy_poll_us=7).engine_options(1024, core_share=0)["busy_poll_us"] == 7


@pytest.mark.parametrize("algorithm", ["ring", "direct"])
def test_sequence_number_wraps_at_two_to_the_32(algorithm):
    cluster = get_cluster(3, chunk_bytes=256)
    per_rank = cluster.run(tasks.allreduces_across_wrap, 2**32 - 3, 6, algorithm)
    for sequences, exact, fractions in per_rank:
        assert sequences == [2**32 - 2, 2**32 - 1, 0, 1, 2, 3]
        assert exact and fractions == [1.0] * 6
