"""Open the datagram transport a communicator will use."""
import logging
import os

from . import _native
from .errors import TransportError
from .loss_models import rank_seed

log = logging.getLogger("ud_transport")

TRANSPORTS = ("auto", "udp", "verbs")


def choose(requested):
    """Resolve "auto" (and the UD_TRANSPORT override) to a concrete transport."""
    requested = os.environ.get("UD_TRANSPORT", requested) or "auto"
    if requested not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {requested!r}")
    if requested == "verbs":
        raise TransportError("the verbs (RDMA UD) transport is not available in this build yet; use transport='udp'")
    if requested == "auto":
        if _native.verbs_active_device_count() > 0:
            log.warning("an active RDMA device exists but the verbs transport is not available yet; using UDP")
        return "udp"
    return requested


def open_transport(name, bind_address, options, rank, session_id):
    """A native Transport for this rank; session_id seeds per-session settings (verbs: the Q_Key)."""
    if name != "udp":  # pragma: no cover - choose() only returns udp for now
        raise TransportError(f"unknown transport {name!r}")
    try:
        transport = _native.Transport.udp(bind_address, 0, options.socket_buffer_bytes)
    except OSError as error:
        raise TransportError(str(error)) from error
    if options.inject is not None:
        transport.inject_loss(seed=rank_seed(options.inject.seed, rank), **options.inject.native_parameters())
    return transport
