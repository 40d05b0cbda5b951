"""Context parallelism: each sample's sequence split over the `cp` ranks of a CP group.

The zig-zag (head-tail) split: a row of S tokens is cut into 2 x cp chunks of S / (2 cp) and
rank r holds chunks r and 2 cp - 1 - r. Under the causal mask, a query at position i attends
i + 1 keys, so chunk j costs about j + 1/2 chunk-pairs of work: the pair (r, 2 cp - 1 - r)
costs 2 cp of them on every rank, where the contiguous split (rank r: chunks 2r, 2r + 1) gives
the last rank about 2 cp - 1 times the first's work (tests/test_context_parallel.py counts both).

Everything position-dependent (positions, padding and document masks, labels) is computed on
the whole row first and then taken at `zigzag_index`: a rank's tokens are the same tokens the
single process has, with the same positions, and attention gives its queries the same keys.

all_gather (parallel.cp_comm): each rank computes K/V of its own tokens, and the whole
sequence's are gathered for its queries, as Llama 3 does (simplest with document masks and
GQA, whose K/V are small). In Megatron's mapping style:

| primitive                            | forward                          | backward                      |
|--------------------------------------|----------------------------------|-------------------------------|
| gather_from_context_parallel_region  | all-gather seq, zig-zag to order | order to zig-zag, reduce-scatter |

Parameters are replicated over CP, and each rank's loss covers its tokens: their gradients are
summed over CP with DP's (ParallelState.grad_group).
"""
import torch

from megalite.parallel.mappings import all_gather, along, group_size, primitive, reduce_scatter

KV_SEQ_DIM = 2  # keys and values are [batch, heads, seq, head_dim]


def context_chunks(cp: int, tp: int, sequence_parallel: bool) -> int:
    """The equal chunks a row is cut into: 2 x cp zig-zag chunks, each split over TP again with
    sequence parallelism; 1 without context parallelism (rows are not cut)."""
    return 2 * cp * (tp if sequence_parallel else 1) if cp > 1 else 1


def zigzag_index(seq: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The positions of a row of `seq` tokens that CP rank `rank` of `cp` holds, in its order:
    chunk rank, then chunk 2 cp - 1 - rank."""
    chunk = seq // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    return torch.cat([first, first + (2 * cp - 1 - 2 * rank) * chunk])


def zigzag_order(seq: int, cp: int, device: torch.device | None = None) -> torch.Tensor:
    """Every rank's zigzag_index, rank after rank: what an all-gather of per-rank shards holds."""
    return torch.cat([zigzag_index(seq, cp, r, device) for r in range(cp)])


def gather_sequence(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every CP rank's zig-zag shard of x along `dim`, gathered and put in sequence order
    (no autograd): whole-sequence logits or losses, for tests and reports."""
    cp = group_size(group)
    if cp == 1:
        return x
    gathered = all_gather(x, dim, group)
    order = zigzag_order(gathered.shape[dim], cp, x.device)
    return gathered.index_select(dim, torch.argsort(order))


def _scatter_kv_grads(grad: torch.Tensor, group) -> torch.Tensor:
    """The adjoint of gathering K/V (gather_sequence): the whole sequence's gradient in zig-zag order (rank after
    rank), then each rank's shard summed over the ranks whose queries used it."""
    order = zigzag_order(grad.shape[KV_SEQ_DIM], group_size(group), grad.device)
    return reduce_scatter(grad.index_select(KV_SEQ_DIM, order), KV_SEQ_DIM, group)


# name                                      forward                            backward
gather_from_context_parallel_region = primitive(
    "gather_from_context_parallel_region",  along(gather_sequence, KV_SEQ_DIM), _scatter_kv_grads)
