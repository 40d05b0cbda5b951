"""The functions megalite compiles on CUDA in an eager model (megalite/compiled.py), compiled
here on CPU: the same values as their plain selves, which the CPU runs use. The loss chunk's
two passes over the [tokens, V/t] logits: exp(z - max) with the label's logit and the sum of
exp, and the gradient (softmax - one_hot) x weight, both in place."""
import pytest
import torch

from megalite.compiled import compiled, fused
from megalite.parallel.vocab import IGNORE_INDEX, label_columns, shifted_exp_, softmax_grad_local_

TOKENS, COLUMNS, VOCAB_START = 37, 200, 200  # this rank: columns 200..399 of a split vocab


def chunk():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(TOKENS, COLUMNS, generator=g) * 4
    labels = torch.randint(0, 3 * COLUMNS, (TOKENS,), generator=g)  # here or on other ranks
    labels[::5] = IGNORE_INDEX
    local, mine, ignored = label_columns(labels, VOCAB_START, COLUMNS)
    assert mine.any() and (~mine & ~ignored).any() and ignored.any()
    return z, z.amax(dim=-1), local, mine, ignored


@pytest.mark.parametrize("tokens", [TOKENS, 8])  # a second shape: the chunk a batch's end leaves
def test_the_compiled_loss_passes_equal_the_plain_ones(tokens):
    z, z_max, local, mine, ignored = (t[:tokens] for t in chunk())
    plain, fast = z.clone(), z.clone()
    expected = shifted_exp_(plain, z_max, local, mine)
    got = compiled(shifted_exp_)(fast, z_max, local, mine)
    for a, b in zip((*expected, plain), (*got, fast)):  # the outputs and z, overwritten
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)

    weights = torch.rand(tokens, generator=torch.Generator().manual_seed(1)).masked_fill(ignored, 0.0)
    sum_exp = expected[1] * 1.5  # as if other ranks' columns added to it
    grad = softmax_grad_local_(plain, sum_exp, local, mine, weights)
    fast_grad = compiled(softmax_grad_local_)(fast, sum_exp, local, mine, weights)
    torch.testing.assert_close(fast_grad, grad, rtol=1e-6, atol=1e-6)
    assert fast_grad.data_ptr() == fast.data_ptr()  # in place: no logits-sized buffer


def test_fused_compiles_for_cuda_only():
    assert fused(shifted_exp_, torch.device("cpu")) is shifted_exp_
    assert fused(shifted_exp_, torch.device("cuda")) is compiled(shifted_exp_)
