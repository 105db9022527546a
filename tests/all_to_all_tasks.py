"""What the ranks of the all_to_all tests run (importable by the cluster's workers)."""
import numpy as np
import torch

from ud_transport import exact
from tasks import as_numpy


def piece_values(sender, receiver, block, dtype, call=0):
    """What `sender` sends `receiver` in call `call`: in one call no two pairs of ranks (up to 8)
    send the same value at any position, and small integers are exact in every dtype (bfloat16's
    up to 256)."""
    values = (sender * 8 + receiver) * 4 + np.arange(block) % 4 - 128 + 256 * call
    return torch.tensor(values, dtype=torch.bfloat16) if dtype == "bfloat16" else values.astype(dtype)


def sent_by(rank, world, block, dtype, call=0):
    pieces = [piece_values(rank, receiver, block, dtype, call) for receiver in range(world)]
    return torch.cat(pieces) if dtype == "bfloat16" else np.concatenate(pieces)


def exchange(comm, block, dtype, in_place):
    """One lossless all_to_all: (what this rank's output holds, its stats, its input unchanged)."""
    tensor = sent_by(comm.rank, comm.world_size, block, dtype)
    before = as_numpy(tensor).copy()
    output = tensor if in_place else (torch.full_like(tensor, -1) if dtype == "bfloat16" else np.full_like(tensor, -1))
    stats = comm.all_to_all(tensor, output, loss_budget=0.0, deadline=10.0)
    return as_numpy(output).copy(), stats, in_place or np.array_equal(as_numpy(tensor), before)


def lossy_exchanges(comm, block, calls, direct_output):
    """all_to_all under loss into an output holding a known old value: per call what it left
    there, its chunk mask and stats.chunks_stale."""
    rows = []
    for call in range(calls):
        tensor = sent_by(comm.rank, comm.world_size, block, "float32", call)
        output = np.full(tensor.size, -1000.0 - call, dtype=np.float32)
        mask = comm.chunk_mask("all_to_all", output)
        stats = comm.all_to_all(tensor, output, loss_budget=1.0, deadline=10.0, chunk_mask=mask,
                                direct_output=direct_output)
        rows.append((output, mask, stats.chunks_stale, stats.own_gather_fraction))
    return rows


def chunk_ranges_of(comm, count):
    return comm.chunk_ranges(count, "float32")


def exact_exchanges(comm, nbytes, dtype_name, calls, in_place):
    """exact.all_to_all of `nbytes` per rank, `calls` times: per call whether the output is what
    the others sent, and the chunks each of its engine calls expected (the first, then repairs).
    `in_place`: True, False, or "scratch" (an output apart, passed as scratch_output: the pieces
    land in it directly where its blocks are whole words)."""
    dtype = getattr(torch, dtype_name)
    n = comm.world_size
    count = nbytes // dtype.itemsize
    outcome = []
    for call in range(calls):
        def sent(rank):
            generator = torch.Generator().manual_seed(1000 * call + rank)
            return torch.randint(-100, 100, (count,), generator=generator).to(dtype)
        tensor = sent(comm.rank)
        output = tensor if in_place is True else torch.full((count,), 7).to(dtype)
        stats = exact.all_to_all(comm, tensor, output, scratch_output=in_place == "scratch")
        block = count // n
        want = torch.cat([sent(p)[comm.rank * block:(comm.rank + 1) * block] for p in range(n)])
        outcome.append((bool(torch.equal(output, want)), [call.chunks_total for call in stats]))
    return outcome


def expecting(wrong):
    """expect(exception, call, text): call() must raise `exception` saying `text`; what did not
    goes into `wrong`."""
    def expect(exception, call, text):
        try:
            call()
            wrong.append(f"{text}: no error")
        except exception as error:
            if text not in str(error):
                wrong.append(f"{text}: {error}")
        except Exception as error:  # noqa: BLE001  (the test reports it)
            wrong.append(f"{text}: {type(error).__name__}: {error}")
    return expect


def argument_errors(comm):
    """Each bad all_to_all must raise the named exception and send nothing; returns what did not."""
    wrong = []
    n = comm.world_size
    expect = expecting(wrong)
    good = np.zeros(4 * n, dtype=np.float32)
    expect(ValueError, lambda: comm.all_to_all(np.zeros(4 * n + 1, dtype=np.float32), np.zeros(4 * n + 1, dtype=np.float32)),
           "do not divide")
    expect(TypeError, lambda: comm.all_to_all(good, np.zeros(4 * n, dtype=np.float64)), "dtype")
    expect(ValueError, lambda: comm.all_to_all(good, np.zeros(4 * n + n, dtype=np.float32)), "elements")
    expect(ValueError, lambda: comm.all_to_all(good, good, direct_output=True), "apart")
    expect(ValueError, lambda: comm.all_to_all(good, np.zeros_like(good), chunk_mask=np.zeros(1000, dtype=np.uint8)),
           "chunk_mask")
    expect(ValueError, lambda: exact.all_to_all(comm, torch.zeros(4 * n), torch.zeros(4 * n + 1)), "size")
    # nothing above reached the wire: a good call after them still pairs with the other ranks'
    output = np.zeros_like(good)
    comm.all_to_all(np.full(4 * n, comm.rank, dtype=np.float32), output, loss_budget=0.0, deadline=10.0)
    if not np.array_equal(output, np.repeat(np.arange(n, dtype=np.float32), 4)):
        wrong.append(f"the good call after the bad ones gave {output}")
    return wrong


def empty_calls_with_masks(comm):
    """all_gather and all_to_all of no elements, each with the (empty) mask chunk_mask gives."""
    empty = np.zeros(0, dtype=np.float32)
    done = []
    for name, call in (("all_gather", lambda mask: comm.all_gather(empty, empty, chunk_mask=mask)),
                       ("all_to_all", lambda mask: comm.all_to_all(empty, empty, chunk_mask=mask))):
        stats = call(comm.chunk_mask(name, empty))
        done.append((name, stats.gather_fraction))
    return done


def bytes_sent_by_payload(comm, nbytes, payload_bytes_choices, after_a_miss):
    """One exact.all_to_all of `nbytes` per rank for each `payload_bytes` in the list: (output
    right, payload bytes this rank sent, every copy) for each. `after_a_miss`: the communicator's
    first calls are set as a first call in one copy that missed leaves them (white-box: the state
    exact._FirstCallCopies.note writes), so that small ones go in SMALL_CALL_COPIES for a while."""
    if after_a_miss:
        exact._first_call_copies(comm).note(1, 4, missed=True)
    n = comm.world_size
    tensor = torch.arange(nbytes // 4, dtype=torch.int32) + 1000 * comm.rank
    block = tensor.numel() // n
    want = torch.cat([(torch.arange(nbytes // 4, dtype=torch.int32) + 1000 * p)[comm.rank * block:(comm.rank + 1) * block]
                      for p in range(n)])
    outcome = []
    for payload_bytes in payload_bytes_choices:
        output = torch.zeros_like(tensor)
        stats = exact.all_to_all(comm, tensor, output, payload_bytes=payload_bytes)
        outcome.append((bool(torch.equal(output, want)), sum(call.payload_bytes_sent for call in stats)))
    return outcome


def payload_claims_differ(comm):
    """Rank 0 counts the whole tensor as its payload, rank 1 only 4 KiB of it: the name of the
    exception each raised, and whether its output kept its old values."""
    from ud_transport.errors import LayoutMismatch

    tensor = torch.arange(4096, dtype=torch.int32)
    output = torch.full_like(tensor, -5)
    try:
        exact.all_to_all(comm, tensor, output, payload_bytes=None if comm.rank == 0 else 4096)
    except LayoutMismatch as error:
        return type(error).__name__, bool((output == -5).all())
    return None, bool((output == -5).all())


def agreed_values(comm, values):
    """Communicator.all_to_all with this rank's `values[rank]` as agree_value: the agreed value,
    whether the pieces came, and what an agree_value out of range raises."""
    n = comm.world_size
    tensor = np.arange(4 * n, dtype=np.float32) + 100 * comm.rank
    output = np.zeros_like(tensor)
    stats = comm.all_to_all(tensor, output, loss_budget=0.0, deadline=10.0, agree_value=values[comm.rank])
    want = np.concatenate([np.arange(4 * n, dtype=np.float32)[4 * comm.rank:4 * comm.rank + 4] + 100 * p
                           for p in range(n)])
    errors = []
    for wrong in (-1, 2**32, 0.5):
        try:
            comm.all_to_all(tensor, output, agree_value=wrong)
        except ValueError as error:
            errors.append(str(error))
    return stats.agreed_value, bool(np.array_equal(output, want)), errors


def declined_then_exchanged(comm, decliner, nbytes):
    """exact.all_to_all in which rank `decliner` alone passes agree_value 1: (what it returned on
    this rank, the output kept its old values), then a plain one right after: its output right."""
    n = comm.world_size
    tensor = torch.arange(nbytes // 4, dtype=torch.int32) + 1000 * comm.rank
    output = torch.full_like(tensor, -5)
    returned = exact.all_to_all(comm, tensor, output, agree_value=int(comm.rank == decliner))
    kept = bool((output == -5).all())
    exact.all_to_all(comm, tensor, output)
    block = tensor.numel() // n
    want = torch.cat([(torch.arange(nbytes // 4, dtype=torch.int32) + 1000 * p)[comm.rank * block:(comm.rank + 1) * block]
                      for p in range(n)])
    return returned, kept, bool(torch.equal(output, want))


def agree_value_refused_on_one_rank(comm):
    """Rank 0 passes an agree_value out of range to exact.all_to_all, the others 0: the name of
    what each raised (the others' call must meet rank 0's refusal, not wait for it)."""
    tensor = torch.arange(4 * comm.world_size, dtype=torch.int32)
    try:
        exact.all_to_all(comm, tensor, torch.empty_like(tensor), deadline=10.0,
                         agree_value=-1 if comm.rank == 0 else 0)
    except Exception as error:  # noqa: BLE001 (the test reads what it was)
        return type(error).__name__
    return None


def small_exchanges(comm, nbytes, calls):
    """`calls` small exact.all_to_all calls: per call (output right, the engine calls it made,
    the payload bytes this rank sent in its first one)."""
    n = comm.world_size
    outcome = []
    for call in range(calls):
        tensor = torch.arange(nbytes // 4, dtype=torch.int32) + 1000 * comm.rank + 100000 * call
        block = tensor.numel() // n
        want = torch.cat([(torch.arange(nbytes // 4, dtype=torch.int32) + 1000 * p + 100000 * call)
                          [comm.rank * block:(comm.rank + 1) * block] for p in range(n)])
        output = torch.zeros_like(tensor)
        stats = exact.all_to_all(comm, tensor, output)
        outcome.append((bool(torch.equal(output, want)), len(stats), stats[0].payload_bytes_sent))
    return outcome


def piece_sizes(sender, receiver, world, call=0):
    """What `sender` sends `receiver` in call `call` of the sized tests: from 0 to 2 * world + 2
    elements, drawn from a seed every rank shares, so each rank knows its sends and its takes."""
    sizes = np.random.default_rng(1000 + call).integers(0, 2 * world + 3, size=(world, world))
    return int(sizes[sender, receiver])


def pieces_of(rank, world, scale, call=0):
    """(sends, takes) of `rank`: every size times `scale` (0 keeps them all empty but one pair)."""
    sends = [piece_sizes(rank, q, world, call) * scale for q in range(world)]
    takes = [piece_sizes(p, rank, world, call) * scale for p in range(world)]
    takes[rank] = sends[rank]
    return sends, takes


def sized_input(rank, world, sends, dtype, call=0):
    return np.concatenate([piece_values(rank, q, sends[q], dtype, call) for q in range(world)] +
                          [np.zeros(0, dtype=dtype)])


def sized_exchange(comm, scale, dtype, calls=1, skew=None, loss_budget=0.0):
    """all_to_all_pieces, `calls` calls: per call (output, mask, stats, input unchanged), or the
    error's type name and message. `skew`: (sender, receiver) whose receiver takes one element
    more than its sender sends (a disagreement)."""
    rows = []
    for call in range(calls):
        sends, takes = pieces_of(comm.rank, comm.world_size, scale, call)
        sends[comm.rank] = takes[comm.rank]  # own piece from the takes' draw
        if skew is not None and comm.rank == skew[1]:
            takes[skew[0]] += 1
        tensor = sized_input(comm.rank, comm.world_size, sends, dtype, call)
        before = tensor.copy()
        output = np.full(sum(takes), -1, dtype=dtype)
        mask = comm.chunk_mask("all_to_all", output, takes=takes)
        try:
            stats = comm.all_to_all_pieces(tensor, output, sends, takes, loss_budget=loss_budget, deadline=10.0,
                                           chunk_mask=mask)
        except Exception as error:  # the same on every rank, the test checks
            rows.append((type(error).__name__, str(error).split(": ", 1)[-1], output.copy()))
            continue
        rows.append((output.copy(), mask.copy(), stats, np.array_equal(tensor, before)))
    return rows


def exact_sized_exchanges(comm, scale, calls, row_bytes=4):
    """ud_transport.pieces.all_to_all of rows of `row_bytes` bytes (the pieces of sized_exchange,
    as rows): per call (what the output holds, the engine calls it took, the input unchanged)."""
    from ud_transport import pieces

    rows_out = []
    for call in range(calls):
        sends, takes = pieces_of(comm.rank, comm.world_size, scale, call)
        sends[comm.rank] = takes[comm.rank]
        payload = [np.random.default_rng([comm.rank, q, call]).integers(0, 256, size=sends[q] * row_bytes, dtype=np.uint8)
                   for q in range(comm.world_size)]
        source = torch.from_numpy(np.concatenate(payload + [np.zeros(0, np.uint8)]))
        before = source.clone()
        output = torch.full((sum(takes) * row_bytes,), 7, dtype=torch.uint8)
        stats = pieces.all_to_all(comm, source, output, sends, takes, row_bytes, deadline=20.0)
        rows_out.append((output.numpy().copy(), len(stats), torch.equal(source, before)))
    return rows_out


def expected_sized_output(rank, world, scale, call, row_bytes):
    """What exact_sized_exchanges' output holds at `rank`: each sender's bytes for it, in rank order."""
    parts = []
    for p in range(world):
        sends, _ = pieces_of(p, world, scale, call)
        _, takes_p = pieces_of(p, world, scale, call)
        sends[p] = takes_p[p]
        parts.append(np.random.default_rng([p, rank, call]).integers(0, 256, size=sends[rank] * row_bytes, dtype=np.uint8))
    return np.concatenate(parts + [np.zeros(0, np.uint8)])


def sized_refusals(comm):
    """What all_to_all_pieces refuses on this rank alone: the error's type and message, and
    whether the output kept its values. A world of one that takes from itself another size than it
    sends (no verdict round would find it), and an output over the input (its own piece sits
    elsewhere in each)."""
    out = {}
    n = comm.world_size
    if n == 1:
        output = np.full(6, -1.0, dtype=np.float32)
        try:
            comm.all_to_all_pieces(np.arange(5, dtype=np.float32), output, [5], [6], loss_budget=0.0)
            out["takes more than it sends"] = "no error"
        except Exception as error:  # noqa: BLE001
            out["takes more than it sends"] = (type(error).__name__, str(error), bool((output == -1).all()))
    tensor = np.arange(2 * n, dtype=np.float32)
    try:
        comm.all_to_all_pieces(tensor, tensor, [2] * n, [2] * n, loss_budget=0.0)
        out["in place"] = "no error"
    except Exception as error:  # noqa: BLE001
        out["in place"] = (type(error).__name__, str(error), bool((tensor == np.arange(2 * n)).all()))
    return out
