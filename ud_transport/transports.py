"""Open the datagram transport a communicator will use."""
import logging

from . import _native, environment, verbs_extension
from .errors import TransportError
from .loss_models import rank_seed
from .options import credit_window_bytes

log = logging.getLogger("ud_transport")

TRANSPORTS = ("auto", "udp", "verbs")

# Posted receives beyond the engine's window: credits, END markers, stragglers of a closed step.
RECEIVE_SLACK = 256
SEND_DEPTH = 512


# ---- UDP: a credit window that fits the receive buffer the kernel granted ----------------------
# Datagrams queued on a UDP socket are charged their skb truesize against SO_RCVBUF, not their
# length. Charged per datagram without GRO (Linux 6.18, loopback; scripts/bench_wire.py --fill
# gives the same on veth): 288 B -> 1280, 1472 -> 2305, 4000 -> 8456, 8972 -> 16644,
# 16000 -> 16644, 32000 -> 33026, 65507 -> 66576. So a 1500-MTU datagram's payload is 0.62 of
# its charge, a 9000-MTU one's 0.54. A GRO train is charged about its length, but only the
# receiving path decides whether datagrams arrive coalesced, so the window assumes they do not.
TRUESIZE_LINEAR_OVERHEAD = 384  # IP/UDP headers, link header room, skb_shared_info
TRUESIZE_SKB = 320  # struct sk_buff and its alignment
TRUESIZE_LARGEST_KMALLOC = 32768  # beyond this the data lies in page fragments
# What the window may take of the granted buffer; the rest is for credits, END markers and
# verdict messages (small datagrams, each charged over 1 KB) and duplicates.
WINDOW_SHARE_OF_BUFFER = 0.75

_buffer_warning_given = False


def datagram_truesize(datagram_bytes):
    """What the kernel charges a receive buffer for one queued datagram of this size (no GRO)."""
    linear = datagram_bytes + TRUESIZE_LINEAR_OVERHEAD
    if linear <= TRUESIZE_LARGEST_KMALLOC:
        data = 1 << (linear - 1).bit_length()  # kmalloc rounds up to a power of two
    else:
        data = -(-linear // 4096) * 4096
    return data + TRUESIZE_SKB


def window_that_fits(granted, datagram_bytes, asked):
    """The credit window (payload bytes) whose datagrams fit WINDOW_SHARE_OF_BUFFER of `granted`,
    at most `asked`; never below the engine's floor of 16 chunks."""
    payload = datagram_bytes - _native.HEADER_BYTES
    chunks = int(granted * WINDOW_SHARE_OF_BUFFER) // datagram_truesize(datagram_bytes)
    return min(asked, max(chunks, 16) * payload)


def fit_window(window_bytes, granted, asked_buffer, forced, datagram_bytes):
    """window_bytes, lowered to fit the granted receive buffer. The first time a process lowers
    it, one warning says what would give the socket enough."""
    global _buffer_warning_given
    fitted = window_that_fits(granted, datagram_bytes, window_bytes)
    if fitted >= window_bytes or _buffer_warning_given:
        return fitted
    _buffer_warning_given = True
    payload = datagram_bytes - _native.HEADER_BYTES
    needed = -(-window_bytes // payload) * datagram_truesize(datagram_bytes) / WINDOW_SHARE_OF_BUFFER
    needed_setting = -(-int(needed) // 2)  # the kernel grants twice what is asked
    if forced or 2 * asked_buffer < needed:
        advice = (f"raise socket_buffer_bytes (UD_SOCKET_BUFFER_BYTES) to at least {needed_setting}"
                  + ("" if forced else f" and `sysctl -w net.core.rmem_max={max(needed_setting, asked_buffer)}`"))
    else:
        advice = f"`sysctl -w net.core.rmem_max={asked_buffer}` would let the socket have the {asked_buffer} bytes it asks for"
    log.warning("udp: the kernel granted a receive buffer of %d bytes (asked %d%s); the credit window is lowered "
                "from %d to %d bytes so that no datagram overflows it (%d-byte datagrams), which slows large "
                "collectives; %s", granted, asked_buffer,
                "" if forced else ", capped by net.core.rmem_max without CAP_NET_ADMIN", window_bytes, fitted,
                datagram_bytes, advice)
    return fitted


def rdma_available():
    """True when the RDMA extension loads and libibverbs sees a device with an ACTIVE port."""
    verbs = verbs_extension.load()
    return verbs is not None and verbs.verbs_active_device_count() > 0


def choose(requested):
    """Resolve "auto" (and the UD_TRANSPORT override) to a concrete transport:
    verbs when an RDMA device has an active port, UDP otherwise (also when the
    RDMA extension is not built or libibverbs cannot be loaded)."""
    requested = environment.read("UD_TRANSPORT", requested) or "auto"
    if requested not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {requested!r}")
    if requested == "verbs":
        if verbs_extension.load() is None:
            raise TransportError(f"transport='verbs' is unavailable: {verbs_extension.problem()}; "
                                 "use transport='udp' or 'auto', or see `python -m ud_transport info`")
        if not rdma_available():
            raise TransportError("transport='verbs' needs an RDMA device with an active port and there is none here "
                                 f"({why_no_rdma()}); use transport='udp' or 'auto', "
                                 "or see `python -m ud_transport info`")
        return "verbs"
    if requested == "auto":
        return "verbs" if rdma_available() else "udp"
    return requested


def why_no_rdma():
    """Why no RDMA device with an active port is usable here (the extension's absence included)."""
    verbs = verbs_extension.load()
    if verbs is None:
        return verbs_extension.problem()
    try:
        names = verbs.device_names()
        if not names:
            verbs.Context()  # raises with the reason (e.g. ENOSYS: no RDMA in this kernel)
        return f"devices {', '.join(names)} have no active port"
    except OSError as error:
        return str(error)


def verbs_settings(options):
    """(device, port, gid_index) asked for: keyword options win over UD_DEVICE, UD_PORT,
    UD_GID_INDEX; None / 0 / -1 mean "choose"."""
    device = getattr(options, "device", "") or environment.read("UD_DEVICE") or None
    port = getattr(options, "port", 0) or int(environment.read("UD_PORT", "0") or 0)
    gid_index = getattr(options, "gid_index", -1)
    if gid_index is None or gid_index < 0:
        gid_index = int(environment.read("UD_GID_INDEX", "-1") or -1)
    return device, port, gid_index


def receive_depth(options, datagram_bytes, device_limit):
    """Receives to keep posted: the engine's whole window of chunks, plus slack. An unposted
    receive drops a UD datagram silently, so this is what keeps a healthy link lossless."""
    asked = getattr(options, "receive_depth", 0)
    if asked:
        return min(asked, device_limit)
    chunk = options.chunk_bytes or (datagram_bytes - _native.HEADER_BYTES)
    chunk -= chunk % 8 if chunk >= 8 else 0
    window = credit_window_bytes(options.window_bytes, chunk, "verbs")
    window_chunks = max(window // max(chunk, 1), 16)
    depth = window_chunks + RECEIVE_SLACK
    if depth > device_limit:
        log.warning("window_bytes=%d needs %d posted receives but the device allows %d: datagrams beyond that "
                    "would be dropped on arrival; lower window_bytes (UD_WINDOW_BYTES)",
                    window, depth, device_limit)
        depth = device_limit
    return depth


def open_verbs(bind_address, options, session_id):
    """A verbs UD transport (opened by _verbs, owned by a _native.Transport): device/port/GID
    chosen (or as given), Q_Key from the session."""
    verbs = verbs_extension.load()
    if verbs is None:
        raise TransportError(f"verbs transport: {verbs_extension.problem()}")
    device, port, gid_index = verbs_settings(options)
    prefer = bind_address if bind_address and not bind_address.startswith("127.") else None
    try:
        endpoint = verbs.choose_endpoint(device, port, gid_index, prefer)
        mtu = endpoint["active_mtu"]
        # With a small chunk_bytes, small receive buffers: the window then costs little memory.
        datagram = min(mtu, options.chunk_bytes + _native.HEADER_BYTES) if options.chunk_bytes else mtu
        depth = receive_depth(options, datagram, endpoint["max_queue_depth"])
        qkey = verbs.qkey_for_session(session_id)
        transport = verbs.VerbsTransport.open(endpoint["device"], endpoint["port"], endpoint["gid_index"], qkey,
                                                max_datagram_bytes=datagram,
                                                send_depth=min(SEND_DEPTH, endpoint["max_queue_depth"]),
                                                recv_depth=depth)
    except OSError as error:
        raise TransportError.caused_by(f"verbs transport: {error}", error) from error
    log.info("verbs: %s port %d gid_index %d (%s %s), qpn 0x%x, qkey 0x%x, datagrams of %d bytes (active MTU %d), "
             "%d receives posted", endpoint["device"], endpoint["port"], endpoint["gid_index"], endpoint["gid_type"],
             verbs.format_gid(endpoint["gid"]), transport.qpn, qkey, datagram, mtu, depth)
    return _native.Transport.adopt(transport.detach())


def open_transport(name, bind_address, options, rank, session_id, stripe=0):
    """A native Transport for this rank; session_id seeds per-session settings (verbs: the Q_Key).
    `stripe` > 0 opens another of the rank's sockets (Options.stripes), with its own loss stream."""
    if name == "verbs":
        transport = open_verbs(bind_address, options, session_id)
    elif name == "udp":
        try:
            transport = _native.Transport.udp(bind_address, 0, options.socket_buffer_bytes)
        except OSError as error:
            raise TransportError.caused_by(str(error), error) from error
    else:
        raise TransportError(f"unknown transport {name!r}")
    if options.inject is not None:
        transport.inject_loss(seed=rank_seed(options.inject.seed, rank + stripe * _native.MAX_WORLD_SIZE), **options.inject.native_parameters())
    return transport
