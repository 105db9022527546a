"""Find the raw memory behind a numpy array or a CPU torch tensor, without
copying it, and check that the engine can work on it in place."""
import enum
import sys

from . import _native, staging


class ReduceOp(str, enum.Enum):
    """The reductions of the lossy collectives (the `op` of allreduce and reduce_scatter).

    Strings ("sum", "mean", "avg", any case) and ``torch.distributed.ReduceOp.SUM`` / ``AVG``
    are accepted wherever one is; other reductions are a ValueError.

    Attributes
    ----------
    SUM : "sum"
        The elementwise sum over ranks.
    MEAN : "mean"
        The sum divided by the world size ("avg" is the same).

    Examples
    --------
    >>> ud_transport.allreduce(gradient, op=ud_transport.ReduceOp.MEAN)  # doctest: +SKIP
    >>> ReduceOp("mean") is ReduceOp.MEAN
    True
    """
    SUM = "sum"
    MEAN = "mean"


class Estimator(str, enum.Enum):
    """How a missing contribution is treated (the `estimator` of allreduce and
    reduce_scatter; ``Options.estimator`` when None). Strings are accepted wherever one is.

    Attributes
    ----------
    UNBIASED : "unbiased"
        Scale what arrived by N / contributions, so the expected result is the exact one;
        where an owner's result did not arrive, the rank's own partial is rescaled the same
        way. The product's choice.
    ZERO_FILL : "zero_fill"
        Count what did not arrive as zero, without rescaling (a biased baseline for
        experiments).

    Examples
    --------
    >>> ud_transport.allreduce(gradient, estimator=ud_transport.Estimator.ZERO_FILL)  # doctest: +SKIP
    >>> Estimator("unbiased") is Estimator.UNBIASED
    True
    """
    UNBIASED = "unbiased"
    ZERO_FILL = "zero_fill"


DTYPE_CODES = {"float32": _native.DTYPE_FLOAT32, "float64": _native.DTYPE_FLOAT64, "float16": _native.DTYPE_FLOAT16,
               "bfloat16": _native.DTYPE_BFLOAT16, "int32": _native.DTYPE_INT32}
OP_CODES = {ReduceOp.SUM.value: _native.OP_SUM, ReduceOp.MEAN.value: _native.OP_MEAN, "avg": _native.OP_MEAN}
ESTIMATOR_CODES = {Estimator.UNBIASED.value: _native.ESTIMATOR_UNBIASED, Estimator.ZERO_FILL.value: _native.ESTIMATOR_ZERO_FILL}


class TensorView:
    """The memory a call works on, pinned for as long as the view lives (the
    engine holds a raw address with the GIL released): for numpy an exported
    buffer (a memoryview, which also keeps numpy from resizing the array), for
    torch the tensor and its storage, so neither del nor `tensor.data = other`
    in another thread frees the memory under the call. torch has no way to
    refuse resize_() or set_() during a call; `written()` detects a tensor
    moved to other memory afterwards."""
    __slots__ = ("address", "count", "dtype_name", "dtype_code", "element_bytes", "pin", "tensor")

    def __init__(self, address, count, dtype_name, element_bytes, pin=None, tensor=None):
        if dtype_name not in DTYPE_CODES:
            supported = ", ".join(DTYPE_CODES)
            raise TypeError(f"dtype {dtype_name} is not supported (supported: {supported})")
        self.address = address
        self.count = count
        self.dtype_name = dtype_name
        self.dtype_code = DTYPE_CODES[dtype_name]
        self.element_bytes = element_bytes
        self.pin = pin
        self.tensor = tensor  # a torch tensor the engine writes through its data_ptr

    def written(self):
        """The engine wrote this view's memory: tell autograd (torch counts in-place
        writes in a version counter, and a write through data_ptr is invisible to it),
        after checking the tensor still lives in that memory."""
        if self.tensor is not None:
            mark_written(self.tensor, self.address, self.count)

    @property
    def nbytes(self):
        return self.count * self.element_bytes


def refuse_read_only(array):
    """A numpy array a collective will write must be writeable."""
    if not array.flags.writeable:
        raise ValueError("collectives work in place and the array is read-only")


def _numpy_view(array):
    if not (array.flags.c_contiguous or array.flags.f_contiguous):
        raise ValueError("collectives need a contiguous array (use numpy.ascontiguousarray and copy the result back)")
    refuse_read_only(array)
    if not array.dtype.isnative:
        raise TypeError(f"dtype {array.dtype.str} is not in this machine's byte order: use array.astype(array.dtype.newbyteorder('='))")
    pin = memoryview(array)  # an exported buffer: holds the array for the whole call
    return TensorView(array.ctypes.data, array.size, array.dtype.name, array.itemsize, pin=pin)


def refuse_unsupported_torch(tensor, who="collectives", staged=False):
    """What every torch tensor of a collective must be, whoever checks it (the API here, the
    "ud" backend on its caller's thread): dense, not quantized, on the host, or on a CUDA device
    where the caller stages it through host memory (`staged`: ud_transport.staging)."""
    if tensor.device.type != "cpu":
        if not (staged and staging.on_device(tensor)):
            raise ValueError(f"{who}: CPU and CUDA tensors only, got one on {tensor.device}"
                             if staged or tensor.device.type not in staging.ON_DEVICE_TYPES else
                             f"{who}: the engine reads host memory only, got a tensor on {tensor.device} "
                             "(the collectives stage CUDA tensors through pinned host memory themselves)")
        staging.DEVICE.check(tensor)
    if tensor.is_sparse or tensor.is_quantized or str(tensor.layout) != "torch.strided":
        raise TypeError(f"{who}: dense, non-quantized tensors only, got layout {tensor.layout}, dtype {tensor.dtype}")


def _torch_view(tensor):
    refuse_unsupported_torch(tensor)
    if not tensor.is_contiguous():
        raise ValueError("collectives need a contiguous tensor (call .contiguous() and copy the result back)")
    name = str(tensor.dtype).removeprefix("torch.")
    return TensorView(tensor.data_ptr(), tensor.numel(), name, tensor.element_size(),
                      pin=(tensor, tensor.untyped_storage()), tensor=tensor)


def mark_written(tensor, address, count):
    """The engine wrote torch `tensor` (`count` elements at `address` when its call started)
    through that address: tell autograd, after checking the tensor still lives there."""
    if tensor.data_ptr() != address or tensor.numel() != count:
        raise RuntimeError("the tensor was resized or given other storage (resize_, set_, .data =) during the "
                           "collective; the result went to the memory it had when the call started")
    _increment_version(tensor)


def _increment_version(tensor):
    from torch.autograd.graph import increment_version  # O(1), unlike an in-place no-op over the data
    increment_version(tensor)


def view_of(tensor):
    """A TensorView of `tensor`, or a clear TypeError/ValueError."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(tensor, torch.Tensor):
        return _torch_view(tensor)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(tensor, numpy.ndarray):
        return _numpy_view(tensor)
    raise TypeError(f"collectives take a numpy array or a torch tensor, got {type(tensor).__name__}")


def memory_meets(first_address, first_bytes, second_address, second_bytes):
    """Whether two byte ranges of memory overlap (an empty one meets nothing)."""
    return (first_bytes > 0 and second_bytes > 0 and first_address < second_address + second_bytes
            and second_address < first_address + first_bytes)


def op_name(op):
    """The lower-case name of a reduction given as a string, a
    torch.distributed.ReduceOp, or the RedOpType inside one."""
    if type(op) is str:  # what the layers above pass on
        return op.lower()
    if isinstance(op, str):
        return str(op.value if isinstance(op, ReduceOp) else op).lower()
    op = getattr(op, "op", op)  # a ReduceOp wraps a RedOpType
    return str(getattr(op, "name", op)).rsplit(".", 1)[-1].lower()


def op_code(op):
    """"sum", "mean"/"avg", or torch.distributed.ReduceOp.SUM / AVG."""
    name = op_name(op)
    try:
        return OP_CODES[name]
    except (KeyError, TypeError):
        raise ValueError(f"op must be one of {sorted(OP_CODES)}, got {op!r}") from None


def estimator_code(estimator):
    """"unbiased" / "zero_fill" or an Estimator."""
    try:
        return ESTIMATOR_CODES[estimator.value if isinstance(estimator, Estimator) else estimator]
    except (KeyError, TypeError):
        raise ValueError(f"estimator must be one of {sorted(ESTIMATOR_CODES)}, got {estimator!r}") from None
