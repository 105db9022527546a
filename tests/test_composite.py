"""ud_transport/torch/composite.py's checks of all-to-all splits, without a cluster: what one rank
can refuse alone, and how pieces of rows become the words the engine checks across ranks
(test_torch_integration runs the collectives themselves against Gloo's)."""
import pytest

torch = pytest.importorskip("torch")
from ud_transport import pieces  # noqa: E402
from ud_transport.torch import composite  # noqa: E402


def test_even_splits_are_dim_zero_shared_out():
    row, sends, receives = composite.plan_all_to_all(torch.empty(6, 2, 3), torch.empty(6, 2, 3), [], [], 3)
    assert (row, sends, receives) == (6, [2, 2, 2], [2, 2, 2])


@pytest.mark.parametrize("output, source, output_splits, input_splits, message", [
    ((5,), (5,), [], [], "input has 5 rows, not a multiple of 2 ranks"),
    ((4,), (4,), [], [1, 2], "input_split_sizes [1, 2] must be 2 counts summing to the input's 4 rows"),
    ((4,), (4,), [5, -1], [], "output_split_sizes [5, -1] must be 2 counts"),
    ((4,), (4,), [], [1, 1, 2], "input_split_sizes [1, 1, 2] must be 2 counts"),
    ((4, 3), (4, 2), [], [], "agree past dim 0"),
    ((), (4,), [], [], "at least one dimension"),
])
def test_what_one_rank_refuses_alone(output, source, output_splits, input_splits, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        composite.plan_all_to_all(torch.empty(output), torch.empty(source), output_splits, input_splits, 2)


def test_dtypes_must_match():
    with pytest.raises(ValueError, match="input torch.int64, output torch.float32"):
        composite.plan_all_to_all(torch.empty(4), torch.zeros(4, dtype=torch.int64), [], [], 2)


@pytest.mark.parametrize("row_bytes", [0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 14, 4096, 4098])
def test_two_row_counts_never_travel_as_one_word_count(row_bytes):
    """A piece travels in 32-bit words and the engine checks the ranks' word counts: a sender's and
    its receiver's row counts that differ must give word counts that differ, or the disagreement
    would pass unseen (ud_transport.pieces.words_per_piece), empty rows too."""
    words = [pieces.words_per_piece(rows, row_bytes) for rows in range(300)]
    assert len(set(words)) == len(words) and all(4 * w >= rows * row_bytes for rows, w in enumerate(words))


def test_scatter_pieces_match_the_output():
    composite.check_scatter_pieces([torch.zeros(3), torch.ones(3)], torch.empty(3), 2)
    for pieces in ([torch.zeros(3)], [torch.zeros(3), torch.zeros(2)], [torch.zeros(3), torch.zeros(3, dtype=torch.int64)]):
        with pytest.raises(ValueError, match="scatter on 'ud' needs 2 pieces of 3 torch.float32 elements"):
            composite.check_scatter_pieces(pieces, torch.empty(3), 2)
