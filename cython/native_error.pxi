# An error of the C layer as values (native/error.h), included by both extensions.

cdef tuple native_error_fields(const udt_error *e):
    """(message, call, errno, object, detail): call is "" and errno 0 when a check of the
    library failed rather than a system or libibverbs call."""
    return (e.message.decode(errors="replace"), e.call.decode(errors="replace"), e.errno_value,
            e.object.decode(errors="replace"), e.detail.decode(errors="replace"))
