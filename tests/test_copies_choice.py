"""copies="auto"'s chooser (ud_transport/torch/copies_choice.py) on simulated steps: each step's
lost contributions drawn binomially at the datagram loss to the power of the copies sent, as the
two-stage step of tests/torch_tasks.auto_copies measures them (a small model: 14 chunks, 4 ranks)."""
import numpy as np
import pytest

from ud_transport.torch.copies_choice import CopiesChooser

CHUNKS, WORLD, MOST = 14, 4, 4


def copies_sent(seed, loss_of_step, steps=120):
    rng = np.random.default_rng(seed)
    chooser = CopiesChooser(CHUNKS, WORLD, MOST)
    travelling = CHUNKS * (WORLD - 1)
    sent = []
    for step in range(steps):
        sent.append(chooser.copies)
        lost = rng.binomial(travelling, loss_of_step(step) ** chooser.copies)
        chooser.record(1.0 - lost / travelling * chooser.remote)
    return sent


@pytest.mark.parametrize("loss, fewest, most", [(0.0, 1, 1), (0.05, 2, 3), (0.15, 3, 4), (0.45, 4, 4)])
def test_the_copies_settle_where_the_chunk_loss_meets_its_target_for_every_seed(loss, fewest, most):
    """Over 300 seeds, steps 60-119 send the fewest copies k with loss**k <= 1.5%, or one more.
    At 15% the chooser went down to 2 copies in 4 of these seeds (a few steps without a loss just
    after a change, or a drop from 4 straight to 2): it now holds a number for a memory's worth of
    contributions before it takes fewer, and takes one fewer at a time (CI once failed on it)."""
    settled = {seed: copies_sent(seed, lambda step: loss)[60:] for seed in range(300)}
    wrong = {seed: sent for seed, sent in settled.items() if not all(fewest <= k <= most for k in sent)}
    assert not wrong, wrong


def test_fewer_copies_come_back_once_the_loss_is_gone():
    sent = copies_sent(1, lambda step: 0.15 if step < 50 else 0.0, steps=400)
    assert min(sent[40:50]) >= 3 and sent[-1] <= 2, sent
