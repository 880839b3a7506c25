"""The graphed step's greedy choice in one Triton launch (`kernels/greedy_triton.py`) against the
reference (`lucebox.sampling.greedy_choices`): first index of the largest logit, -1 in a row
with a logit that is not finite, ties across the kernel's blocks resolved as torch.argmax does."""

import pytest
import torch

from lucebox.sampling import greedy_choices


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_greedy_choices_match_the_reference(dtype):
    from lucebox.kernels.greedy_triton import greedy_choices as triton_greedy_choices

    V = 5000  # two blocks of 4096
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[1, 4100] = logits[1, 10] = 50.0  # a tie across blocks: the first index wins
    logits[2, 4999] = 60.0  # the last column of the ragged block
    logits[3, 7] = float("nan")
    logits[4, 4500] = float("-inf")
    expected = greedy_choices(logits)
    assert expected.tolist()[1:] == [10, 4999, -1, -1]
    assert torch.equal(triton_greedy_choices(logits), expected)
    assert torch.equal(triton_greedy_choices(logits[:1]), expected[:1])
