"""A receiver splits its credit window among the senders it waits on in a short exchange
(native/data.c, sender_share): when a call starts, every sender of an open step gets an even share
at once, and together they are never credited more than the window. In a long one (more than
SHARED_WINDOWS windows still to come) the earliest step takes the whole window, a stream in full
send batches. Rank 0 of a world of 8 (20 for the empty steps) starts a gather, an all_to_all and a
direct allreduce over the in-memory transport (tests/native/credit_share.c, the engine as built);
its peers' endpoints read the credits it sent. Before the share, the earliest steps always took
the whole window (64 chunks each to three senders) and the other four senders got no credit until
those pieces had come."""
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import skip_or_fail

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ["pieces", "control", "output", "liveness", "data", "recent_loss", "verdict", "call", "comm", "schedule", "elementwise",
          "transport_memory"]
WINDOW = 192  # chunks, as the harness sets it
SHARED_WINDOWS = 4  # native/data.c


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    compiler = shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        skip_or_fail("no C compiler (gcc or clang) to build the credit harness")
    binary = tmp_path_factory.mktemp("credit") / "credit_share"
    build = subprocess.run([compiler, "-O1", "-g", "-std=gnu11", "-Wall", "-Werror", "-I", str(ROOT / "native"),
                            str(ROOT / "tests" / "native" / "credit_share.c"),
                            *[str(ROOT / "native" / f"{name}.c") for name in ENGINE], "-lm", "-o", str(binary)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    return binary


def first_credits(harness, collective, piece_chunks):
    """The chunks rank 0's first credit to each of its 7 peers covers."""
    run = subprocess.run([str(harness), collective, str(piece_chunks)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    *covered, label, window = run.stdout.splitlines()[0].split()
    assert label == "window" and int(window) == WINDOW, run.stdout
    return [int(chunks) for chunks in covered]


@pytest.mark.parametrize("collective", ["gather", "all_to_all", "allreduce"])
def test_every_sender_gets_an_even_share_of_the_window_at_once(harness, collective):
    piece = 64  # 7 pieces of 64 chunks: 448, at most SHARED_WINDOWS windows
    assert 7 * piece <= SHARED_WINDOWS * WINDOW
    covered = first_credits(harness, collective, piece)
    share = WINDOW // 7  # seven senders, each with a piece larger than its share
    # a direct allreduce's receive steps from each sender: its reduce-scatter step first, then its
    # all-gather step, which gets nothing while the first is open
    assert covered == [share] * 7, covered
    assert sum(covered) <= WINDOW, covered


@pytest.mark.parametrize("collective", ["gather", "all_to_all"])
def test_in_a_long_exchange_the_earliest_step_takes_the_whole_window(harness, collective):
    piece = 128  # 7 pieces of 128 chunks: 896, more than SHARED_WINDOWS windows
    assert 7 * piece > SHARED_WINDOWS * WINDOW
    covered = first_credits(harness, collective, piece)
    assert sorted(covered, reverse=True) == [piece, WINDOW - piece] + [0] * 5, covered


def test_credit_already_out_counts_against_the_window_when_the_exchange_turns_short(harness):
    """A gather of 7 pieces of 128 chunks starts long: rank 1's step takes 128 chunks of the window
    and rank 2's the other 64. Once rank 1's piece has come, 6 pieces (768 chunks) are left: a
    short exchange, with a share of 32. Rank 2 still holds its 64, which cannot be taken back, so
    the others share what is left: in all, no more than the window (at 8f13301, 224)."""
    run = subprocess.run([str(harness), "gather", "128", "arrive"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    first, after = run.stdout.splitlines()
    assert first.split()[:7] == ["128", "64", "0", "0", "0", "0", "0"], first
    words = after.split()
    assert words[0] == "outstanding" and words[4:] == ["step_closed", "1"], after
    assert int(words[1]) == int(words[3]) == WINDOW, after  # the whole window, and not a chunk more


def test_the_credit_that_reaches_a_steps_end_goes_out_at_once(harness):
    """A gather of 7 pieces of 64 chunks: each sender's share is 27, and a credit goes out once it
    grew by half a share (13). Rank 1 sends only as far as its credits reach, on a clock that never
    gets to the 2 ms refresh: the credits go 27, 40, 53, then 64, the end of its piece, though that
    last one grew by 11 only. At 0aa20fb it stopped at 53 until the refresh."""
    run = subprocess.run([str(harness), "gather", "64", "tail"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines()[1] == "sent 64 of 64", run.stdout


def test_an_empty_step_gives_no_credit_through_its_senders_uncovered_one(harness):
    """A direct allreduce at 20 ranks of 17 elements, with the window at its floor of 16 chunks:
    rank 0's reduce-scatter steps are one chunk each, and the window runs out after 16 of its 19
    senders. The last three senders' blocks are empty, so their all-gather steps to rank 0 have
    nothing to credit. A credit is a position: given to an empty step, it would let its sender send
    its earlier, uncovered step too (19 chunks held against a window of 16 when the walk did not
    skip such steps, before f2edda6)."""
    run = subprocess.run([str(harness), "allreduce", "1", "empty"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    words = run.stdout.split()
    assert words[0] == "outstanding" and words[2] == "window" and int(words[3]) == 16, run.stdout
    assert int(words[1]) == 16, run.stdout  # the whole window is out, and not a chunk more
