# Errors of the verbs bindings: every one names the verb, the errno and the object,
#   ibv_create_ah failed: EINVAL (22) [dev=rxe0 port=1 gid_index=1]
# and a missing feature (EOPNOTSUPP) has its own type.
import errno as _errno

from libc.errno cimport errno as c_errno


# names as strerrorname_np() gives them (and as the C transport prints them)
_ERRNO_NAMES = {_errno.EOPNOTSUPP: "EOPNOTSUPP", _errno.EAGAIN: "EAGAIN"}


class VerbsError(OSError):
    """A libibverbs call failed."""

    def __init__(self, verb, errno_value, obj, detail=None):
        name = _ERRNO_NAMES.get(errno_value) or _errno.errorcode.get(errno_value, "E?")
        message = f"{verb} failed: {name} ({errno_value}) [{obj}]"
        if detail:
            message += f": {detail}"
        super().__init__(errno_value, message)
        self.verb = self.call = verb  # `call` as on the engine's NativeCallError
        self.object = obj
        self.detail = detail
        self.message = message

    def __str__(self):
        return self.message

    def __reduce__(self):  # keep the fields when sent between processes
        return type(self), (self.verb, self.errno, self.object, self.detail)


class VerbsNotSupported(VerbsError):
    """The device or its driver does not implement this (EOPNOTSUPP)."""


def verbs_error(verb, int errno_value, obj, detail=None):
    """The exception for a failed verb: VerbsNotSupported for EOPNOTSUPP, else VerbsError."""
    kind = VerbsNotSupported if errno_value in (_errno.EOPNOTSUPP, _errno.ENOTSUP) else VerbsError
    return kind(verb, errno_value, obj, detail)


include "native_error.pxi"


cdef object error_from_native(const udt_error *e):
    """The exception for an error of the C transport, from its fields: a VerbsError when a call
    failed, an OSError with the transport's message when one of its own checks did."""
    message, call, errno_value, obj, detail = native_error_fields(e)
    if call:
        return verbs_error(call, errno_value, obj, detail or None)
    return OSError(message)



cdef inline int _verbs_errno(int rc) noexcept nogil:
    """libibverbs reports a failure as a positive return value or through errno."""
    if rc > 0:
        return rc
    return c_errno if c_errno != 0 else 5  # EIO
