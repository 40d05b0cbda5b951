"""Expert parallelism's token exchange (Megatron's alltoall dispatcher): the copies of tokens
routed to an expert travel to the EP rank that holds it, and their outputs travel back.

Each rank sends its copies sorted by expert, so one all-to-all (uneven splits) delivers, from
every source rank, the rows of each of this rank's experts. They are regrouped expert-major,
ordered by (source rank, source order) within an expert: an expert sees the same rows in the
same order however many ranks share the work, and a rank or an expert with no rows is an
ordinary case (empty splits). A first all-to-all of the counts sizes the second.
"""
import torch

from megalite.parallel.mappings import all_to_all, group_size


class ExpertExchange:
    """One dispatch and its combine for a micro-batch of one MoE layer.

    counts: [n_experts] copies this rank sends to each expert (its rows sorted by expert);
    every rank of `group` (the EP group) holds n_experts / ep consecutive experts."""

    def __init__(self, counts: torch.Tensor, group):
        ep = group_size(group)
        local = counts.numel() // ep
        self.group = group
        self.sent = counts.view(ep, local).sum(1).tolist()  # rows to each EP rank
        # [source rank, local expert]: one row of counts to and from each rank
        received = all_to_all(counts.view(ep, local), group, [1] * ep, [1] * ep)
        self.received = received.sum(1).tolist()  # rows from each EP rank
        self.per_expert = received.sum(0).tolist()  # rows for each local expert
        # Received rows are source-major, each source's sorted by expert; position k of the
        # expert-major order takes row order[k]: a stable sort of the rows by expert keeps
        # them by source, then in each source's order. The sizes are known on the host
        # already (output_size), so no further sync.
        expert = torch.arange(local, device=counts.device).repeat(ep)  # of each received segment
        rows_expert = torch.repeat_interleave(expert, received.flatten(), output_size=sum(self.received))
        self.order = torch.argsort(rows_expert, stable=True)

    def dispatch(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's copies sorted by expert -> its experts' rows, expert-major."""
        return all_to_all(rows, self.group, self.received, self.sent)[self.order]

    def combine(self, outputs: torch.Tensor) -> torch.Tensor:
        """The experts' outputs (expert-major) -> the outputs of this rank's copies, in the
        order they were sent."""
        back = torch.argsort(self.order)  # order's inverse permutation
        return all_to_all(outputs[back], self.group, self.sent, self.received)
