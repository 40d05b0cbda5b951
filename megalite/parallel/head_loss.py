"""The LM head and the vocab-parallel cross-entropy, fused and in chunks of tokens.

Logits z = X E_r^T for this rank's vocab rows E_r are the largest activation of the model
(tokens x V/t, 50k-128k columns): held whole in fp32 with their softmax and gradient, they
cost more memory than the rest of a small model's step. Here they exist one chunk of tokens at
a time: each chunk's logits are made, turned into the softmax statistics of vocab.py (max,
target logit, sum of exp: three all-reduces over TP of [chunk]-sized tensors, so the whole
batch moves the same elements as the unchunked loss), and dropped.

Two ways to get the gradients, both without logits-sized storage between forward and backward:

- head_loss_sum (training): the caller gives the weight of each token's loss in the total
  (1 / the global token count), so d total / d logits = (softmax - one_hot) * weight is known
  in forward: each chunk's gradients of X and of E_r are made right there from the chunk's
  logits, as in Liger-Kernel's fused linear cross-entropy. Backward only scales them. The head's
  matmul FLOPs are those of the unfused head (forward, dX, dE): nothing is recomputed.
- head_token_losses (evaluation, and any caller that weights tokens its own way): per-token
  losses, differentiable for any weights; backward recomputes each chunk's logits from X and
  E_r (one more head matmul) and the saved max and sum of exp.

Vocab padding (columns past the real vocabulary, on the last ranks) is set to -inf in each
chunk in place: no mass, no gradient, no copy. The matmuls run in the autocast dtype when
autocast is on (as F.linear would), the softmax in fp32.
"""
from typing import Callable, Iterator

import torch

from megalite.compiled import fused
from megalite.parallel.mappings import group_size
from megalite.parallel.matmul import matmul_dtype
from megalite.parallel.vocab import SoftmaxStats, label_columns, softmax_grad_, softmax_stats_


def soft_cap(z: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap x tanh(z / cap) (Gemma 2's final logit soft-capping); z itself without a cap."""
    return z if cap is None else torch.tanh(z / cap) * cap


class HeadShard:
    """This rank's vocab rows of the head: where they start, where padding starts among them
    (None: no padding here), how many tokens one chunk holds, and the logits' soft cap (None:
    none)."""

    def __init__(self, vocab_start: int, padded_from: int | None, group, chunk_tokens: int,
                 cap: float | None = None):
        self.vocab_start, self.padded_from = vocab_start, padded_from
        self.group, self.chunk_tokens, self.cap = group, chunk_tokens, cap

    def logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the tokens x [n, hidden]; x and weight already in the matmul dtype."""
        return finished_logits(torch.mm(x, weight.t()), self.padded_from, self.cap)

    def loss_and_grad(self, product: torch.Tensor, labels: torch.Tensor,
                      weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-token losses, d sum(weights x losses) / d product) of one chunk's product =
        X E_r^T in the matmul dtype; the gradient overwrites the product. Without TP (no
        collective between the passes) it is one compiled function on CUDA, llm.c's fused
        classifier: the product read, its gradient written in its place, and no fp32 logits
        in memory between kernels."""
        split = group_size(self.group) > 1
        fn = loss_and_grad_ if split else fused(loss_and_grad_, product.device)
        # Without TP no group goes in: a compiled function need not trace one.
        return fn(product, labels, weights, self.vocab_start, self.padded_from, self.cap,
                  self.group if split else None)

    def chunks(self, n: int) -> Iterator[slice]:
        return (slice(i, min(i + self.chunk_tokens, n)) for i in range(0, n, self.chunk_tokens))


def finished_logits(product: torch.Tensor, padded_from: int | None,
                    cap: float | None) -> torch.Tensor:
    """The product X E_r^T as fp32 logits: soft-capped, padding at -inf."""
    z = soft_cap(product.float(), cap)
    if padded_from is not None:
        z[:, padded_from:] = float("-inf")
    return z


def cap_slope(z: torch.Tensor, cap: float | None) -> torch.Tensor | None:
    """d capped / d uncapped of logits z (capped): 1 - (z / cap)^2, 0 at the padding; None
    without a cap."""
    return None if cap is None else torch.where(torch.isinf(z), 0.0, 1 - (z / cap).square())


def uncapped_grad_(grad_z: torch.Tensor, slope: torch.Tensor | None) -> torch.Tensor:
    """The gradient of the uncapped logits from that of the capped ones (in place)."""
    return grad_z if slope is None else grad_z.mul_(slope)


def loss_and_grad_(product: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                   vocab_start: int, padded_from: int | None, cap: float | None,
                   group) -> tuple[torch.Tensor, torch.Tensor]:
    """HeadShard.loss_and_grad on plain arguments (what `fused` compiles)."""
    z = finished_logits(product, padded_from, cap)
    slope = cap_slope(z, cap)  # before z becomes exp(z - max)
    stats = softmax_stats_(z, labels, vocab_start, group)
    grad = uncapped_grad_(softmax_grad_(z, stats, weights), slope)
    return stats.loss, product.copy_(grad)


def _chunk_grads(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, shard: HeadShard,
                 grad_of: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """(dX, dE_r in fp32) of tokens x and head rows weight, chunk by chunk of tokens:
    grad_of(rows, x_chunk, w) is the chunk's gradient of the logits (x_chunk and w in `dtype`,
    the matmuls'); dX = dZ E_r into the chunk's rows, dE_r += dZ^T X."""
    w = weight.to(dtype)
    grad_x, grad_w = torch.empty_like(x), torch.zeros(weight.shape, device=weight.device)
    for rows in shard.chunks(x.shape[0]):
        xc = x[rows].to(dtype)
        grad_z = grad_of(rows, xc, w).to(dtype)
        grad_x[rows] = torch.mm(grad_z, w)
        if grad_w.dtype == dtype:
            grad_w.addmm_(grad_z.t(), xc)
        else:
            grad_w.add_(torch.mm(grad_z.t(), xc))
        del grad_z  # before the next chunk's logits
    return grad_x, grad_w


class _HeadLossSum(torch.autograd.Function):
    """sum_t weight_t loss_t, with every gradient made in forward; also the per-token losses
    (not differentiable: the gradient already assumes `weights`)."""

    @staticmethod
    def forward(ctx, x, weight, labels, weights, shard: HeadShard):
        losses = torch.empty(x.shape[0], device=x.device)

        def grad_of(rows, xc, w):
            losses[rows], grad_z = shard.loss_and_grad(torch.mm(xc, w.t()), labels[rows],
                                                       weights[rows])
            return grad_z

        grad_x, grad_w = _chunk_grads(x, weight, matmul_dtype(x), shard, grad_of)
        ctx.save_for_backward(grad_x, grad_w.to(weight.dtype))
        ctx.mark_non_differentiable(losses)
        return (losses * weights).sum(), losses

    @staticmethod
    def backward(ctx, grad_total, _):
        grad_x, grad_w = ctx.saved_tensors
        return grad_x * grad_total, grad_w * grad_total, None, None, None


class _HeadTokenLosses(torch.autograd.Function):
    """Per-token losses [n] (0 where ignored) of tokens x [n, hidden] (already through f), head
    rows weight [V/t, hidden], labels [n] (-100: ignored), differentiable with any weights:
    backward recomputes each chunk's logits (head_token_losses(x, weight, labels, shard))."""

    @staticmethod
    def forward(ctx, x, weight, labels, shard: HeadShard):
        dtype = matmul_dtype(x)
        w = weight.to(dtype)
        z_max, sum_exp, losses = (torch.empty(x.shape[0], device=x.device) for _ in range(3))
        for rows in shard.chunks(x.shape[0]):
            stats = softmax_stats_(shard.logits(x[rows].to(dtype), w), labels[rows],
                                   shard.vocab_start, shard.group)
            z_max[rows], sum_exp[rows], losses[rows] = stats.z_max, stats.sum_exp, stats.loss
        ctx.shard, ctx.dtype = shard, dtype
        ctx.save_for_backward(x, weight, labels, z_max, sum_exp)
        return losses

    @staticmethod
    def backward(ctx, grad_loss):
        x, weight, labels, z_max, sum_exp = ctx.saved_tensors
        shard = ctx.shard

        def grad_of(rows, xc, w):
            z = shard.logits(xc, w)
            slope = cap_slope(z, shard.cap)
            z.sub_(z_max[rows].unsqueeze(-1)).exp_()
            # What softmax_grad_ reads, from the saved max and sum of exp: no collective.
            stats = SoftmaxStats(z_max[rows], sum_exp[rows], None,
                                 *label_columns(labels[rows], shard.vocab_start, z.shape[-1]))
            return uncapped_grad_(softmax_grad_(z, stats, grad_loss[rows]), slope)

        grad_x, grad_w = _chunk_grads(x, weight, ctx.dtype, shard, grad_of)
        return grad_x, grad_w.to(weight.dtype), None, None


head_token_losses = _HeadTokenLosses.apply


def head_loss_sum(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                  weights: torch.Tensor, shard: HeadShard) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum_t weights_t loss_t, per-token losses) for tokens x [n, hidden] (already through f),
    head rows weight [V/t, hidden], labels [n] (-100: ignored); weights [n] or a scalar."""
    weights = torch.as_tensor(weights, device=x.device, dtype=torch.float32).expand(x.shape[0])
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _HeadLossSum.apply(x, weight, labels, weights, shard)
    # Nothing to differentiate: the losses alone, without the gradients' matmuls.
    losses = head_token_losses(x, weight, labels, shard)
    return (losses * weights).sum(), losses

