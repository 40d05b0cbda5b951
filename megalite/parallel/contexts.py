"""What each parallel part is built with: the narrow view of the mesh (parallel/state.py) it
uses, made once per model (`Contexts.of`) and bound into the parts at construction (picotron's
one grid object, torchtitan's per-module plans), so that no forward takes a flag for it.

TensorParallel: a TP-split part's group, and how the tokens it reads are laid out. `sharded` says
whether this call's activations between the TP regions are this rank's sequence shard
(sequence parallelism, Korthikanti et al. 2022) or replicated; the model sets it per call
(`splitting`): decoding with a KV cache appends a token or a few and splits nothing.
ContextParallel: attention's CP group and how K/V travel. ExpertParallel: an MoE layer's.
"""
from contextlib import contextmanager
from dataclasses import dataclass

from megalite.parallel.mappings import (copy_to_tensor_parallel_region, group_size,
                                        reduce_from_tensor_parallel_region,
                                        reduce_scatter_to_sequence_parallel_region)


class TensorParallel:
    def __init__(self, group=None, size: int = 1, rank: int = 0, sequence_parallel: bool = False,
                 token_groups: tuple = (), blocks=None):
        """token_groups: the groups over which the rows one process would multiply are spread
        (token_groups below). blocks(n): the group of n consecutive ranks holding
        this rank (ParallelState.block_group): a slice held by n ranks."""
        self.group, self.size, self.rank = group, size, rank
        # At tp=1 there is nothing to split: the same model, on the default generator.
        self.sequence_parallel = sequence_parallel and self.size > 1
        self.sharded = self.sequence_parallel
        self.token_groups, self.blocks = token_groups, blocks

    def split_heads(self) -> "TensorParallel":
        """For replicated weights applied to this rank's heads only (q/k norms, MLA's latent
        norms): their gradient is always this rank's part, summed over TP."""
        return TensorParallel(self.group, self.size, self.rank, True, self.token_groups, self.blocks)

    @contextmanager
    def splitting(self, sharded: bool):
        """The parts' calls inside run on sequence shards (sharded, under sequence parallelism)
        or on whole rows."""
        before, self.sharded = self.sharded, sharded and self.sequence_parallel
        try:
            yield
        finally:
            self.sharded = before

    def sum_grad(self, param):
        """A replicated parameter (norm weight, row-parallel bias, position table) as applied to
        this rank's activations. With sequence parallelism they are one shard of the tokens, so its
        gradient here is only that shard's part: f on the parameter (identity forward, all-reduce
        backward) sums the parts over TP, and every rank holds the whole gradient once backward
        is done, whatever engine or accumulation follows (Megatron-LM all-reduces these gradients
        once per step after backward instead: fewer, larger messages, but every engine must call
        it, and ZeRO-2 has already partitioned the gradients by then)."""
        return copy_to_tensor_parallel_region(param, self.group) if self.sharded else param

    def reduce(self, x):
        """The sum over TP ranks of their partial results (row-parallel products, vocab-split
        embedding rows). Into the replicated residual stream: g (all-reduce forward, identity
        backward). With sequence parallelism, into this rank's sequence shard of it: the SP paper's
        g-bar (reduce-scatter forward, all-gather backward), the same bytes on the wire as the
        all-reduce it replaces (an all-reduce is a reduce-scatter then an all-gather)."""
        return (reduce_scatter_to_sequence_parallel_region(x, self.group) if self.sharded
                else reduce_from_tensor_parallel_region(x, self.group))


WHOLE = TensorParallel()  # one process, or a part outside any TP split


@dataclass(frozen=True)
class ContextParallel:
    group: object = None
    size: int = 1
    rank: int = 0
    ring: bool = False  # parallel.cp_comm=p2p: K/V blocks pass around the ring


@dataclass(frozen=True)
class ExpertParallel:
    group: object = None
    size: int = 1
    rank: int = 0
    # The ranks holding parts of the same rows' tokens between the TP regions, over which the
    # router counts tokens: CP's shares (token_group), and with SP's shards too when the call is
    # sharded (sharded_token_group).
    token_group: object = None
    sharded_token_group: object = None
    expert_tokens: tuple = ()  # expert_token_groups


@dataclass(frozen=True)
class Contexts:
    tp: TensorParallel
    cp: ContextParallel
    ep: ExpertParallel

    @classmethod
    def of(cls, ps, sequence_parallel: bool, cp_comm: str, moe: bool = False) -> "Contexts":
        """The model's contexts on mesh `ps` (moe: the model has MoE layers, on any stage)."""
        tp = TensorParallel(ps.tp_group, ps.tp_size, ps.tp_rank, sequence_parallel, token_groups(ps),
                            ps.block_group)
        # Without CP, tp x 1 consecutive ranks: block_group gives the TP group. Made by every rank
        # of a model with experts, once, here: not for a dense model (an unused communicator).
        sharded = ps.block_group(ps.tp_size * ps.cp_size) if tp.sequence_parallel and moe else ps.cp_group
        ep = ExpertParallel(ps.ep_group, ps.ep_size, ps.ep_rank, ps.cp_group, sharded,
                            expert_token_groups(ps, sequence_parallel))
        return cls(tp, ContextParallel(ps.cp_group, ps.cp_size, ps.cp_rank,
                                       ps.cp_size > 1 and cp_comm == "p2p"), ep)


def token_groups(ps) -> tuple:
    """The group over which the rows of one process's micro-batch are spread at a matmul: CP's
    sequence chunks, and EP's ranks, whose micro-batches the experts take as one batch (one
    process with EP x the micro-batch equals the EP run). EP's ranks hold whole CP groups, or
    lie inside one (fp8/convert.check_fp8_layout refuses the rest): the larger group is the union."""
    if group_size(ps.ep_group) > 1 and ps.ep_size % ps.cp_size == 0:
        return (ps.ep_group,)
    return (ps.cp_group,) if group_size(ps.cp_group) > 1 else ()


def expert_token_groups(ps, sequence_parallel: bool) -> tuple:
    """The groups over which an expert's rows, as one process would multiply them, are spread:
    TP's sequence shards under SP, and CP's chunks unless EP's dispatch already brings every CP
    rank's rows to the expert (an EP group of whole CP groups)."""
    shards = (ps.tp_group,) if sequence_parallel else ()
    return shards + ((ps.cp_group,) if ps.ep_size == 1 else ())
