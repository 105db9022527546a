# cython: language_level=3, boundscheck=False, wraparound=False
"""The optional RDMA extension: what ud_transport calls of libibverbs (device discovery and
queries, the choice of device, port and GID; verbs errors as values, pyverbs style) and the
verbs UD transport. setup.py builds it only where <infiniband/verbs.h> is
found; ud_transport imports it lazily (ud_transport/verbs_extension.py), so UDP works
without it. Its transports run on the engine in ud_transport._native via
VerbsTransport.detach() -> _native.Transport.adopt()."""
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libc.string cimport memset

from transport_io cimport *
from verbs_native cimport *


def verbs_active_device_count():
    """Number of RDMA devices with an active port (0 without kernel RDMA)."""
    with nogil:
        count = udt_verbs_active_device_count()
    return count


include "verbs_base.pxi"
include "verbs_device.pxi"
include "verbs_transport.pxi"
