"""Who is who in a TP x CP x PP x DP layout: ranks, sizes and process groups, in one explicit object.

Global rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank: TP groups are blocks of
consecutive ranks, so with one process per GPU a TP group stays inside a node (NVLink); the CP
ranks of a TP rank are the next blocks (inside the node where tp x cp fits: their K/V traffic
is every layer's), pipeline neighbours come after, and DP groups span the rest. Parameters are
replicated over CP as over DP: their gradients are summed over both (`grad_group`).
The mesh holds who is who and nothing of the strategy (sequence parallelism, CP's K/V
exchange, the pipeline's stages): the model reads those from its ParallelConfig.
"""
import math
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from megalite.config import ParallelConfig
from megalite.typed_config import ConfigError


@dataclass
class ParallelState:
    tp_size: int = 1
    tp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    tp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    timeout: timedelta = timedelta(minutes=10)
    pp_size: int = 1
    pp_rank: int = 0
    pp_group: dist.ProcessGroup | None = None
    # The first and last stage's ranks of this rank's pipeline, when it has more than one
    # stage: tied embeddings sum their two copies' gradients over it.
    embedding_group: dist.ProcessGroup | None = None
    cp_size: int = 1
    cp_rank: int = 0
    cp_group: dist.ProcessGroup | None = None
    # The CP x DP ranks of this TP rank and stage, over which gradients are summed (the DP
    # group when cp = 1).
    grad_group: dist.ProcessGroup | None = None
    # Expert parallelism: blocks of ep consecutive ranks of grad_group each hold a share of
    # every MoE layer's experts (ep_group, tokens all-to-all); the ranks holding the same share
    # sum the experts' gradients (expert_grad_group: the CP x DP ranks / ep of them, and
    # grad_group when ep = 1).
    ep_size: int = 1
    ep_rank: int = 0
    ep_group: dist.ProcessGroup | None = None
    expert_grad_group: dist.ProcessGroup | None = None
    _blocks: dict = field(default_factory=dict, repr=False)

    @property
    def rank(self) -> int:
        return self.stage_rank(self.pp_rank)

    @property
    def world_size(self) -> int:
        return self.dp_size * self.pp_size * self.cp_size * self.tp_size

    @property
    def grad_size(self) -> int:
        return self.dp_size * self.cp_size

    @property
    def grad_rank(self) -> int:
        """This rank's index in `grad_group` (DP-major, CP-minor, as the group lists its ranks)."""
        return self.dp_rank * self.cp_size + self.cp_rank

    def stage_rank(self, pp_rank: int) -> int:
        """The global rank that holds pipeline stage pp_rank (modulo pp) for this TP, CP and DP rank."""
        stage = self.dp_rank * self.pp_size + pp_rank % self.pp_size
        return (stage * self.cp_size + self.cp_rank) * self.tp_size + self.tp_rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_world(cls, tp: int, timeout: timedelta = timedelta(minutes=10),
                   device: torch.device | None = None,
                   pipeline: ParallelConfig | None = None) -> "ParallelState":
        """Build the TP, DP and (pipeline's pp > 1) PP and (cp > 1) CP groups of an initialised
        torch.distributed world, on a layout the plan has checked (plan.py).

        Every rank creates every group, in the same order, as new_group requires.
        """
        world, rank = dist.get_world_size(), dist.get_rank()
        pipeline = pipeline or ParallelConfig()  # its defaults: one stage, no CP, no EP
        pp, cp, ep = pipeline.pp, pipeline.cp, pipeline.ep
        dp = world // (tp * cp * pp)
        # grid[d, s, c, t]: the global rank of DP rank d, stage s, CP rank c and TP rank t.
        grid = torch.arange(world).view(dp, pp, cp, tp)
        dp_rank, pp_rank, cp_rank, tp_rank = (int(i) for i in torch.unravel_index(
            torch.tensor(rank), grid.shape))

        def groups(ranks: torch.Tensor, size: int):
            """One group per `size` ranks of `ranks` (its last dims, flattened), in order (every
            rank creates each); the one holding this rank."""
            return dist.new_subgroups_by_enumeration(ranks.reshape(-1, size).tolist(), timeout=timeout)[0]

        def over(*dims: int):
            """The groups of the ranks that differ only in `dims` (the first dim major)."""
            rest = [d for d in range(4) if d not in dims]
            return groups(grid.permute(*rest, *dims), math.prod(grid.shape[d] for d in dims))

        tp_group, dp_group = over(3), over(0)
        pp_group = embedding_group = cp_group = None
        grad_group = dp_group
        if pp > 1:
            pp_group = over(1)
            embedding_group = groups(grid.permute(0, 2, 3, 1)[..., [0, -1]], 2)
        if cp > 1:
            cp_group, grad_group = over(2), over(0, 2)
        ep_group, expert_grad_group = None, grad_group
        if ep > 1:
            # [stage, TP rank, block, EP rank]: the grad_group ranks (DP-major, CP-minor) in
            # blocks of ep.
            blocks = grid.permute(1, 3, 0, 2).reshape(pp, tp, -1, ep)
            ep_group = groups(blocks, ep)
            expert_grad_group = groups(blocks.transpose(2, 3), dp * cp // ep) if dp * cp > ep else None
        if device is None:
            nccl = dist.get_backend() == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        return cls(tp_size=tp, tp_rank=tp_rank, dp_size=dp, dp_rank=dp_rank,
                   tp_group=tp_group, dp_group=dp_group, timeout=timeout, device=device,
                   pp_size=pp, pp_rank=pp_rank, pp_group=pp_group, embedding_group=embedding_group,
                   cp_size=cp, cp_rank=cp_rank, cp_group=cp_group, grad_group=grad_group,
                   ep_size=ep, ep_rank=(dp_rank * cp + cp_rank) % ep, ep_group=ep_group,
                   expert_grad_group=expert_grad_group)

    def reduce_over_ranks(self, value: float, op=dist.ReduceOp.MAX) -> float:
        """The largest (or by `op`, say MIN) of every rank's value (a collective over all ranks,
        when there are several): the slowest rank sets a step's time, the fullest device its
        memory."""
        x = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        if dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(x, op=op)
        return x.item()

    def gather_over_ranks(self, value) -> list:
        """Every rank's `value` (any picklable object), by rank (a collective over all ranks,
        when there are several)."""
        if not (dist.is_initialized() and self.world_size > 1):
            return [value]
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, value)
        return everyone

    def block_group(self, size: int) -> dist.ProcessGroup | None:
        """The group of `size` consecutive ranks that contains this rank (size dividing the TP
        size, or a multiple of it).

        GQA with fewer KV heads than TP ranks gives such a block of a TP group the same KV
        head, and sums their weight gradients over it; DeepSpeed's model-parallel group is the
        block of a DP replica's tp x pp ranks. Created on first use, by every rank: every rank
        builds the model and the engine identically, so every rank asks for the same sizes in
        the same order.
        """
        if size == 1:
            return None
        if size == self.tp_size:
            return self.tp_group
        if size not in self._blocks:
            blocks = torch.arange(self.world_size).view(-1, size).tolist()
            self._blocks[size] = dist.new_subgroups_by_enumeration(blocks, timeout=self.timeout)[0]
        return self._blocks[size]


def init_parallel(parallel: ParallelConfig) -> ParallelState:
    """Initialise torch.distributed from torchrun's environment and build the layout, which the
    entry point has checked (plan.py) on every rank before this first collective.

    Without torchrun (no WORLD_SIZE in the environment) this is a plain single process,
    TP=1 x DP=1, with no process group at all.
    """
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda and local_rank >= torch.cuda.device_count():
        raise ConfigError(f"LOCAL_RANK={local_rank} but this node has {torch.cuda.device_count()} "
                          f"visible GPU(s): launch one process per GPU (torchrun "
                          f"--nproc_per_node {torch.cuda.device_count()}), or hide the GPUs "
                          f"(CUDA_VISIBLE_DEVICES=) to run every process on the CPU")
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    timeout = timedelta(minutes=parallel.timeout_minutes)
    if "WORLD_SIZE" not in os.environ:
        return ParallelState(device=device, timeout=timeout)
    if not dist.is_initialized():
        check_restartable()
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout,
                                device_id=device if use_cuda else None, **_attempt_store(timeout))
    return ParallelState.from_world(parallel.tp, timeout, device, parallel)


# torchrun's agents share one store with their workers unless this is set (torch 2.4+).
UNSHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def check_restartable() -> None:
    """Across nodes, torchrun --max-restarts with the agents' shared store (the default) cannot
    restart: only the node whose rank failed counts a restart, so the nodes' new workers
    meet under different names in that store (and hang until the timeout), and a node that
    replaces a lost one waits for keys the others never write. Refused before any collective."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    if restarts and nodes > 1 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise ConfigError(f"torchrun --max-restarts {restarts} on {nodes} nodes cannot restart "
                          f"with torchrun's shared store (the restarted ranks would hang): "
                          f"export {UNSHARED_STORE}=1 before torchrun, or launch with "
                          f"`megalite torchrun`, which sets it")


def _attempt_store(timeout: timedelta) -> dict:
    """On one node, torchrun's agent keeps its shared store across restarts (--max-restarts),
    and a process group made in a restarted round could read the keys of the round before:
    the addresses of ranks that are gone ("Connection refused"). So the ranks use the agent's
    store under a prefix of the round (TORCHELASTIC_RESTART_COUNT, which one agent counts);
    elsewhere torch's own rendezvous ({} here). Across nodes: check_restartable."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt in (None, "0") or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return {"store": dist.PrefixStore(f"megalite/attempt_{attempt}/", store),
            "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}
