"""The functions megalite compiles on CUDA in an eager model (megalite/compiled.py), compiled
here on CPU: the same values as their plain selves, which the CPU runs use. The loss chunk's
two passes over the [tokens, V/t] logits: exp(z - max) with the label's logit and the sum of
exp, and the gradient (softmax - one_hot) x weight, both in place; without TP, the whole chunk
as one function, from the matmul's product to its gradient written over it."""
import pytest
import torch

from megalite.compiled import compiled, fused
from megalite.parallel.head_loss import loss_and_grad_
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


@pytest.mark.exactness
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


@pytest.mark.unit
def test_fused_compiles_for_cuda_only():
    assert fused(shifted_exp_, torch.device("cpu")) is shifted_exp_
    assert fused(shifted_exp_, torch.device("cuda")) is compiled(shifted_exp_)


@pytest.mark.exactness
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cap", [None, 5.0])
def test_the_compiled_whole_vocabulary_chunk_equals_the_plain_one(dtype, cap):
    """Without TP the head's chunk is one function on CUDA (HeadShard.loss_and_grad): the
    matmul's product in, losses out and the product overwritten by its gradient, with vocab
    padding (the last 17 columns) and a soft cap."""
    z, _, _, _, ignored = chunk()
    labels = torch.randint(0, COLUMNS - 17, (TOKENS,), generator=torch.Generator().manual_seed(2))
    labels[ignored] = IGNORE_INDEX
    weights = torch.rand(TOKENS, generator=torch.Generator().manual_seed(1))
    product = z.to(dtype)
    plain, fast = product.clone(), product.clone()
    args = (0, COLUMNS - 17, cap, None)
    losses, grad = loss_and_grad_(plain, labels, weights, *args)
    fast_losses, fast_grad = compiled(loss_and_grad_)(fast, labels, weights, *args)
    assert grad.data_ptr() == plain.data_ptr() and fast_grad.data_ptr() == fast.data_ptr()
    torch.testing.assert_close(fast_losses, losses, rtol=1e-6, atol=1e-6)
    # bf16: the gradient rounded to bf16 from fp32 values that differ by ~1e-7, one ulp apart
    # at most where they straddle a rounding boundary.
    torch.testing.assert_close(fast_grad, grad, rtol=1e-6 if dtype == torch.float32 else 2**-8,
                               atol=1e-6)
    # What the unfused cross-entropy says, from the same (rounded) product.
    reference = product.float().requires_grad_()
    capped = reference if cap is None else torch.tanh(reference / cap) * cap
    capped = capped.masked_fill(torch.arange(COLUMNS) >= COLUMNS - 17, float("-inf"))
    expected = torch.nn.functional.cross_entropy(capped, labels, reduction="none")
    (expected * weights).sum().backward()
    torch.testing.assert_close(losses, expected.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.float(), reference.grad.to(dtype).float(), rtol=1e-5,
                               atol=1e-5 if dtype == torch.float32 else 2e-3)
    assert not grad[:, COLUMNS - 17:].any()
