"""The public API on its own: argument checking, errors that lose nothing,
lifetime, options, loss models, the adaptive deadline. In-process, with a
world of one rank (rendezvous through an in-memory torch Store)."""
import numpy as np
import pytest
import torch
import torch.distributed as dist

import ud_transport
from ud_transport import _native, loss_models, options
from ud_transport.deadline import DeadlineEstimator


@pytest.fixture
def solo():
    with ud_transport.init(0, 1, store=dist.HashStore(), transport="udp", bind_address="127.0.0.1") as comm:
        yield comm


def test_world_of_one_is_the_identity(solo):
    for op in ("sum", "mean", "avg"):
        values = np.arange(10, dtype=np.float32)
        stats = solo.allreduce(values, op=op)
        assert np.array_equal(values, np.arange(10)) and stats.delivered_fraction == 1.0


@pytest.mark.parametrize("bad,error", [
    (np.arange(10, dtype=np.int64), TypeError),
    (np.zeros(10, dtype=np.bool_), TypeError),
    (np.arange(20, dtype=np.float32)[::2], ValueError),
    ([1.0, 2.0], TypeError),
    (torch.arange(10, dtype=torch.float32)[::2], ValueError),
    (torch.zeros(4, dtype=torch.complex64), TypeError),
])
def test_unsupported_inputs_are_refused_clearly(solo, bad, error):
    before = bad.copy() if hasattr(bad, "copy") else (bad.clone() if hasattr(bad, "clone") else list(bad))
    with pytest.raises(error):
        solo.allreduce(bad)
    if isinstance(bad, np.ndarray):
        assert np.array_equal(bad, before)


def test_read_only_array_is_refused(solo):
    values = np.ones(4, dtype=np.float32)
    values.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        solo.allreduce(values)


@pytest.mark.parametrize("kwargs", [dict(op="max"), dict(loss_budget=1.5), dict(loss_budget=-0.1), dict(deadline=0),
                                    dict(deadline=-1), dict(estimator="guess"), dict(loss_budget=float("nan")),
                                    # finding 9: inf once became an undefined integer and timed out at once
                                    dict(deadline=float("inf")), dict(deadline=float("nan")), dict(deadline=1e7)])
def test_bad_arguments(solo, kwargs):
    values = np.ones(4, dtype=np.float32)
    with pytest.raises(ValueError):
        solo.allreduce(values, **kwargs)
    assert np.all(values == 1)


@pytest.mark.parametrize("field", ["deadline_cap_s", "deadline_floor_s", "deadline_multiplier", "join_timeout_s",
                                   "default_loss_budget"])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), -1.0])
def test_options_refuse_deadlines_and_budgets_that_are_not_finite(field, value):
    with pytest.raises(ValueError, match=field):
        options.build(**{field: value})


def test_close_is_idempotent_and_blocks_further_use():
    comm = ud_transport.init(0, 1, store=dist.HashStore(), bind_address="127.0.0.1")
    assert ud_transport.get_default() is comm
    ud_transport.allreduce(np.ones(3, dtype=np.float32))
    comm.close()
    comm.close()
    assert comm.closed and "closed" in repr(comm)
    with pytest.raises(ud_transport.TransportError):
        comm.allreduce(np.ones(3, dtype=np.float32))
    with pytest.raises(ud_transport.TransportError):
        ud_transport.allreduce(np.ones(3, dtype=np.float32))
    ud_transport.close()


def test_init_reads_torchrun_environment(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with ud_transport.init(store=dist.HashStore(), bind_address="127.0.0.1") as comm:
        assert (comm.rank, comm.world_size) == (0, 1)
    ud_transport.close()


def test_init_without_rank_or_store_explains(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="RANK"):
        ud_transport.init()
    with pytest.raises(ud_transport.TransportError, match="MASTER_ADDR"):
        ud_transport.init(0, 2)


def test_transport_choice(monkeypatch):
    with pytest.raises(ValueError):
        ud_transport.init(0, 1, store=dist.HashStore(), transport="carrier-pigeon")
    monkeypatch.setenv("UD_TRANSPORT", "udp")
    with ud_transport.init(0, 1, store=dist.HashStore(), transport="auto", bind_address="127.0.0.1") as comm:
        assert comm.transport_name == "udp"
    ud_transport.close()


def test_options_from_environment_and_keywords(monkeypatch):
    monkeypatch.setenv("UD_CHUNK_BYTES", "1024")
    monkeypatch.setenv("UD_LOSS_BUDGET", "0.25")
    built = options.build(window_bytes=1 << 20)
    assert (built.chunk_bytes, built.default_loss_budget, built.window_bytes) == (1024, 0.25, 1 << 20)
    assert options.build(chunk_bytes=512).chunk_bytes == 512  # keywords win
    with pytest.raises(TypeError, match="unknown"):
        options.build(chunk_size=5)
    with pytest.raises(ValueError):
        options.build(default_loss_budget=2)


def test_loss_models():
    assert loss_models.from_string("none") is None
    bernoulli = loss_models.from_string("bernoulli:0.1", seed=3)
    assert bernoulli == ud_transport.Bernoulli(0.1, seed=3) and bernoulli.mean_loss == 0.1
    bursts = loss_models.from_string("gilbert_elliott:0.01,0.09,0.0,0.8")
    assert bursts.mean_loss == pytest.approx(0.1 * 0.8)
    for text in ("bernoulli:2", "bernoulli:0.1,0.2", "gilbert_elliott:0.1", "pareto:0.1"):
        with pytest.raises(ValueError):
            loss_models.from_string(text)
    assert loss_models.rank_seed(1, 0) != loss_models.rank_seed(1, 1)


def test_adaptive_deadline():
    estimator = DeadlineEstimator(multiplier=4, floor_s=0.5, cap_s=30)
    assert estimator.deadline_s(1 << 20) == 30  # no history: the cap
    for _ in range(10):
        estimator.record(64 << 20, 0.5)  # 64 MiB in 0.5 s
    assert estimator.deadline_s(64 << 20) == pytest.approx(2.0)
    assert estimator.deadline_s(128 << 20) == pytest.approx(4.0)  # scales with size
    assert estimator.deadline_s(1024) == 0.5  # latency-bound sizes: the floor
    assert DeadlineEstimator(4, 0.5, 1.0).deadline_s(1) == 1.0


def test_the_adaptive_deadline_follows_the_median_of_the_recent_calls():
    """The estimate is the median over the last `history` calls (kept in order as calls come and
    go, not sorted per call): checked against statistics.median over the same window."""
    import random
    import statistics

    generator = random.Random(7)
    estimator = DeadlineEstimator(multiplier=1, floor_s=0.0, cap_s=1e9, history=8)
    window = []
    for call in range(100):
        nbytes, elapsed = generator.choice([1 << 10, 1 << 20, 64 << 20]), generator.uniform(0.001, 2.0)
        estimator.record(nbytes, elapsed)
        window = (window + [elapsed / max(nbytes, 256 * 1024)])[-8:]
        assert estimator.expected_s(64 << 20) == pytest.approx(statistics.median(window) * (64 << 20), rel=1e-12), call


def test_errors_survive_pickling():
    import pickle

    error = pickle.loads(pickle.dumps(ud_transport.PeerTimeout("late", 3, None)))
    assert error.rank == 3 and str(error) == "late"
    error = pickle.loads(pickle.dumps(ud_transport.LossBudgetExceeded("lossy", None)))
    assert str(error) == "lossy" and error.stats is None


def test_ops_and_estimators_are_enums_with_the_c_codes_and_strings_still_work(solo):
    from ud_transport.tensors import estimator_code, op_code
    assert [op_code(op) for op in (ud_transport.ReduceOp.SUM, "sum", "SUM", dist.ReduceOp.SUM)] == [_native.OP_SUM] * 4
    assert [op_code(op) for op in (ud_transport.ReduceOp.MEAN, "mean", "avg", dist.ReduceOp.AVG)] == [_native.OP_MEAN] * 4
    assert estimator_code(ud_transport.Estimator.UNBIASED) == estimator_code("unbiased") == _native.ESTIMATOR_UNBIASED
    assert estimator_code(ud_transport.Estimator.ZERO_FILL) == estimator_code("zero_fill") == _native.ESTIMATOR_ZERO_FILL
    values = np.arange(6, dtype=np.float32)
    for op in ud_transport.ReduceOp:
        solo.allreduce(values, op=op, estimator=ud_transport.Estimator.ZERO_FILL)
    assert np.array_equal(values, np.arange(6))
    with pytest.raises(ValueError, match="estimator must be one of"):
        solo.allreduce(values, estimator="mostly")
    with pytest.raises(ValueError, match="op must be one of"):
        solo.allreduce(values, op=dist.ReduceOp.MAX)
    assert np.array_equal(values, np.arange(6))


def test_chunk_masks_are_checked_before_anything_is_sent(solo):
    values = np.ones(1000, dtype=np.float32)
    shard = np.zeros(1000, dtype=np.float32)
    mask = solo.chunk_mask("reduce_scatter", values)
    assert mask.shape == (1, len(solo.chunk_ranges(1000, "float32", block=0)))
    solo.reduce_scatter(values, shard, chunk_mask=mask)
    assert mask.all()  # a world of one: its own contribution is everything
    for bad, error in ((np.zeros(mask.size + 1, dtype=np.uint8), ValueError), (mask.astype(np.int32), TypeError),
                       (mask.tolist(), TypeError)):
        with pytest.raises(error, match="chunk_mask"):
            solo.reduce_scatter(values, shard, chunk_mask=bad)
    with pytest.raises(ValueError, match="chunk masks are offered"):
        solo.chunk_mask("allreduce", values)
