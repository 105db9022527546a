# Stubs for the compiled engine extension (cython/_native.pyx; no RDMA: the verbs bindings are in
# _verbs.pyi). tests/test_packaging.py checks that the names match the module's exports.
from typing import Any, NamedTuple

HEADER_BYTES: int
WIRE_MAGIC: int
WIRE_VERSION: int
MAX_WORLD_SIZE: int
MAX_END_REPEATS: int
MAX_COPIES: int
MAX_STRIPES: int
STATUS_OK: int
STATUS_LOSS_BUDGET: int
STATUS_PEER_TIMEOUT: int
STATUS_INVALID_ARGUMENT: int
STATUS_TRANSPORT: int
STATUS_NO_MEMORY: int
STATUS_LAYOUT_MISMATCH: int
STATUS_INTERRUPTED: int
OP_SUM: int
OP_MEAN: int
ESTIMATOR_UNBIASED: int
ESTIMATOR_ZERO_FILL: int
DTYPE_FLOAT32: int
DTYPE_FLOAT64: int
DTYPE_FLOAT16: int
DTYPE_BFLOAT16: int
DTYPE_INT32: int
LOSS_NONE: int
LOSS_BERNOULLI: int
LOSS_GILBERT_ELLIOTT: int
UDP_GSO: int
UDP_GRO: int
UDP_RCVBUF_FORCED: int
UDP_GSO_REFUSED: int
UDP_DROPS_COUNTED: int
UDP_PORTS_WATCHED: int
UDP_PATH_MTU_IGNORED: int

class NativeError(NamedTuple):  # an error of the C layer as values (native/error.h)
    message: str
    call: str  # "" when a check of the library failed
    errno: int  # 0 when none applies
    object: str
    detail: str

class NativeCallError(OSError):
    call: str
    object: str
    detail: str
    message: str
    def __init__(self, call: str, errno_value: int, obj: str, detail: str, message: str) -> None: ...

class Transport:
    @staticmethod
    def udp(bind_address: str, port: int, socket_buffer_bytes: int) -> Transport: ...
    @staticmethod
    def adopt(capsule: Any) -> Transport: ...  # from ud_transport._verbs.VerbsTransport.detach()
    def close(self) -> None: ...
    def inject_loss(self, kind: int, loss: float = ..., good_to_bad: float = ..., bad_to_good: float = ...,
                    loss_in_good: float = ..., loss_in_bad: float = ..., seed: int = ...) -> None: ...
    @property
    def address(self) -> bytes: ...
    @property
    def max_datagram_bytes(self) -> int: ...
    # UDP only: 0 / "" on other transports (disable and udp_counters raise ValueError)
    @property
    def udp_features(self) -> int: ...
    @property
    def receive_buffer_bytes(self) -> int: ...
    @property
    def send_buffer_bytes(self) -> int: ...
    def describe(self) -> str: ...
    def disable(self, features: int) -> None: ...
    def udp_counters(self) -> dict[str, int]: ...

COLLECTIVE_ALLREDUCE: int
COLLECTIVE_REDUCE_SCATTER: int
COLLECTIVE_ALL_GATHER: int
COLLECTIVE_BROADCAST: int
COLLECTIVE_AGREE: int
COLLECTIVE_ALL_TO_ALL: int
COLLECTIVE_SCATTER: int
COLLECTIVE_GATHER: int
ALGORITHM_RING: int
ALGORITHM_DIRECT: int
ENGINE_OPTION_NAMES: tuple[str, ...]

class Engine:
    rank: int
    world_size: int
    chunk_bytes: int
    def __init__(self, transport: Transport, rank: int, world_size: int, session_id: int,
                 options: dict[str, int]) -> None: ...
    def set_peers(self, addresses: bytes, address_bytes: int) -> None: ...
    def set_sequence(self, sequence: int) -> None: ...
    def run(self, *, collective: int, algorithm: int, deadline_s: float, input: int = ..., output: int = ...,
            count: int = ..., dtype: int = ..., op: int = ..., estimator: int = ..., root: int = ...,
            agree_value: int = ..., loss_budget: float = ..., chunk_mask: int = ..., chunk_mask_bytes: int = ...,
            copies: int = ..., direct_output: int = ..., layout_salt: int = ...,
            write_on_budget_miss: int = ..., reduce_in_rank_order: int = ..., piece_counts: int = ...,
            signals: bool = ...) -> tuple[int, dict[str, Any], NativeError | None]: ...
    def close(self) -> None: ...
    def interrupt(self) -> None: ...
    def udp_counters(self) -> dict[str, int]: ...  # {} on other transports

def run_striped(engines: list[Engine], inputs: list[int], outputs: list[int], counts: list[int], weights: list[float], *,
                collective: int, algorithm: int, dtype: int, op: int, estimator: int, root: int, loss_budget: float,
                deadline_s: float, copies: int = ...,
                write_on_budget_miss: int = ..., signals: bool = ...) -> tuple[int, dict[str, Any], int, NativeError | None]: ...
def chunk_mask_bytes(collective: int, algorithm: int, count: int, dtype: int, rank: int, world_size: int,
                     chunk_bytes: int) -> int: ...
COLLECTIVE_FACTS: dict[int, dict[str, Any]]
def budget_missed(reduce_fraction: float, gather_fraction: float, loss_budget: float) -> bool: ...
def wire_element_bytes(dtype: int) -> int: ...
def block_start(count: int, world_size: int, block: int) -> int: ...
def schedule(collective: int, algorithm: int, rank: int, world_size: int, root: int = ...,
             rotation: int = ...) -> tuple[dict[str, int], list[dict[str, int]]]: ...
def float_to_half_bits(value: float) -> int: ...
def half_bits_to_float(bits: int) -> float: ...
def float_to_bfloat16_bits(value: float) -> int: ...
def copy_uncached(dst: Any, src: Any) -> None: ...  # writable and readable contiguous byte buffers (numpy uint8, memoryview)

def simulate(world_size: int, collective: int, algorithm: int, count: int, chunk_bytes: int, calls: int, *,
             estimator: int = ..., loss_budget: float = ..., write_on_budget_miss: int = ..., deadline_s: float = ...,
             noise: float = ..., seed: int = ...,
             loss_kind: int = ..., loss: float = ..., good_to_bad: float = ..., bad_to_good: float = ...,
             loss_in_good: float = ..., loss_in_bad: float = ..., send_ns_per_datagram: int = ..., late_rank: int = ...,
             late_start_s: float = ..., delay_ns: int = ...) -> list[list[tuple[int, dict[str, Any], float, float]]]: ...
