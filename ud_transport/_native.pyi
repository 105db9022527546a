# Stubs for the compiled extension (cython/_native.pyx and its verbs_*.pxi). The engine entry
# points are typed here; the verbs object bindings fall back to Any through __getattr__.
from typing import Any

HEADER_BYTES: int
WIRE_MAGIC: int
WIRE_VERSION: int
MAX_WORLD_SIZE: int
VERBS_ADDRESS_BYTES: int
STATUS_OK: int
STATUS_LOSS_BUDGET: int
STATUS_PEER_TIMEOUT: int
STATUS_INVALID_ARGUMENT: int
STATUS_TRANSPORT: int
STATUS_NO_MEMORY: int
STATUS_LAYOUT_MISMATCH: int

class Transport:
    @staticmethod
    def udp(bind_address: str, port: int, socket_buffer_bytes: int) -> Transport: ...
    def inject_loss(self, kind: int, loss: float = ..., good_to_bad: float = ..., bad_to_good: float = ...,
                    loss_in_good: float = ..., loss_in_bad: float = ..., seed: int = ...) -> None: ...
    @property
    def address(self) -> bytes: ...
    @property
    def max_datagram_bytes(self) -> int: ...

class VerbsTransport(Transport):
    @staticmethod
    def open(device: str, port: int, gid_index: int, qkey: int, *, max_datagram_bytes: int, send_depth: int,
             recv_depth: int) -> VerbsTransport: ...
    @property
    def qpn(self) -> int: ...

COLLECTIVE_ALLREDUCE: int
COLLECTIVE_REDUCE_SCATTER: int
COLLECTIVE_ALL_GATHER: int
COLLECTIVE_BROADCAST: int
COLLECTIVE_AGREE: int
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
    def run(self, collective: int, algorithm: int, input: int, output: int, count: int, dtype: int, op: int,
            estimator: int, root: int, agree_value: int, loss_budget: float,
            deadline_s: float) -> tuple[int, dict[str, Any], str]: ...
    def close(self) -> None: ...

class VerbsError(OSError): ...
class VerbsNotSupported(VerbsError): ...

def verbs_active_device_count() -> int: ...
def block_start(count: int, world_size: int, block: int) -> int: ...
def schedule(collective: int, algorithm: int, rank: int, world_size: int, root: int = ...,
             rotation: int = ...) -> tuple[dict[str, int], list[dict[str, int]]]: ...
def float_to_half_bits(value: float) -> int: ...
def half_bits_to_float(bits: int) -> float: ...
def float_to_bfloat16_bits(value: float) -> int: ...
def __getattr__(name: str) -> Any: ...
