"""Communicator options: keyword arguments to init(), or environment variables
for scripts. Keyword arguments win over the environment."""
import os
from dataclasses import dataclass, field, fields, replace

from . import _native, environment

MIB = 1 << 20

# option name -> environment variable (the table is ud_transport.environment)
ENVIRONMENT = environment.fields_of("option")

ALGORITHMS = ("auto", "ring", "direct")


@dataclass(frozen=True)
class Options:
    chunk_bytes: int = 0  # payload per datagram; 0 = the largest the path MTU allows
    window_bytes: int = 16 * MIB  # data all senders together may have in flight to us (direct needs ~2 steps of it)
    socket_buffer_bytes: int = 64 * MIB
    end_repeats: int = 3  # copies of each end-of-step marker (they can be lost too)
    credit_refresh_us: int = 2000
    reorder_grace_us: int = 200
    busy_poll_us: int = 0  # spin this long for the next datagram before sleeping (hurts when ranks share cores)
    idle_close_us: int = 20000  # a step with a gap stops waiting after this long without arrivals
    deadline_cap_s: float = 30.0  # the adaptive default deadline never exceeds this
    deadline_floor_s: float = 1.0
    deadline_multiplier: float = 4.0  # default deadline = multiplier x recent typical time
    default_loss_budget: float = 0.1
    estimator: str = "unbiased"  # or "zero_fill", a biased baseline for experiments
    algorithm: str = "auto"  # "ring", "direct", or "auto" (see README: chosen by world size)
    agree_resend_us: int = 1000  # first resend interval of verdict-round messages (doubles up to 16x)
    join_timeout_s: float = 300.0  # how long a call waits for every rank to join it (the deadline counts from then)
    bind_address: str = ""  # "" = the address that reaches MASTER_ADDR
    store_timeout_s: float = 60.0  # rendezvous: every failure (store unreachable, a rank missing or disagreeing) raises within it
    inject: object = field(default=None)  # a loss model from ud_transport.loss_models
    # verbs (RDMA UD) only; unset = UD_DEVICE / UD_PORT / UD_GID_INDEX, else chosen (see `python -m ud_transport info`)
    device: str = ""  # e.g. "mlx5_0", "rxe0"
    port: int = 0  # 1-based
    gid_index: int = -1  # RoCE: the RoCEv2 GID of the interface that reaches the other ranks
    receive_depth: int = 0  # receives kept posted; 0 = enough for window_bytes

    def validate(self):
        """Returns self, or raises ValueError naming the first field out of range."""
        if self.chunk_bytes < 0:
            raise ValueError("chunk_bytes must be >= 0")
        if self.window_bytes <= 0 or self.socket_buffer_bytes <= 0:
            raise ValueError("window_bytes and socket_buffer_bytes must be positive")
        if not 0 <= self.default_loss_budget <= 1:
            raise ValueError(f"default_loss_budget must be in [0, 1], got {self.default_loss_budget!r}")
        for name in ("deadline_cap_s", "deadline_floor_s", "deadline_multiplier"):
            value = getattr(self, name)
            if not 0 < value <= 1e6:  # also refuses inf and nan, which the engine cannot turn into a time
                raise ValueError(f"{name} must be a positive number of at most 1e6, got {value!r}")
        if not 0.001 <= self.join_timeout_s <= 4e6:
            raise ValueError(f"join_timeout_s must be between 0.001 and 4e6 seconds, got {self.join_timeout_s!r}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        if not 1 <= self.end_repeats <= _native.MAX_END_REPEATS:
            raise ValueError(f"end_repeats must be between 1 and {_native.MAX_END_REPEATS}, got {self.end_repeats!r}")
        return self

    def engine_options(self, chunk_bytes, window_bytes=None):
        """The options the C engine takes, by field name (window_bytes: as fitted to the transport's buffers)."""
        return {"chunk_bytes": chunk_bytes, "window_bytes": window_bytes or self.window_bytes, "end_repeats": self.end_repeats,
                "credit_refresh_us": self.credit_refresh_us, "reorder_grace_us": self.reorder_grace_us,
                "busy_poll_us": self.busy_poll_us, "idle_close_us": self.idle_close_us,
                "agree_resend_us": self.agree_resend_us, "join_timeout_ms": round(self.join_timeout_s * 1000)}


def build(**overrides):
    """Options from the environment, then `overrides` (unknown names are an error)."""
    known = {f.name: f for f in fields(Options)}
    unknown = set(overrides) - set(known)
    if unknown:
        raise TypeError(f"unknown ud_transport option(s): {', '.join(sorted(unknown))}")
    values = {}
    for name, variable in ENVIRONMENT.items():
        if variable in os.environ:
            default = getattr(Options, name)
            values[name] = type(default)(environment.read(variable))
    values.update({k: v for k, v in overrides.items() if v is not None})
    return replace(Options(), **values).validate()
