"""A mixture-of-experts layer in place of the dense MLP (Shazeer et al. 2017; Mixtral, DeepSeek-V3).

    experts, weights = router(x)                    top-k per token (model/router.py)
    y_t = sum_j weights_tj E_{experts_tj}(x_t)      j = 0 .. k-1, in that order
        [+ shared(x_t) [x sigmoid(g x_t)]]          shared experts: a TP-split MLP every token passes

What is split how: attention and the shared experts keep the TP split; the routed experts are
whole matrices, replicated over TP and split over the EP ranks (expert parallelism, carved out
of CP x DP): rank r of the EP group holds experts [r E/ep, (r+1) E/ep). Each rank routes its own
tokens (with sequence parallelism its shard, so TP ranks share the experts' work; without, every
TP rank repeats it), sends each chosen copy to its expert's rank (parallel/expert_dispatch.py)
and gets the outputs back. Splitting the experts over TP as well would add a TP all-reduce per
layer to matrices already small (Megatron recommends expert TP = 1). Expert gradients are summed
over the ranks holding the same experts (ParallelState.expert_grad_group) and, under sequence
parallelism, over TP (each TP rank ran its own tokens: TensorParallel.sum_grad).
"""
import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig
from megalite.model.inputs import RankInputs
from megalite.model.mlp import MLP, activate, down_init_std
from megalite.model.router import Router
from megalite.parallel.expert_dispatch import ExpertExchange
from megalite.parallel.init import new_param
from megalite.parallel.contexts import ExpertParallel, TensorParallel
from megalite.parallel.mappings import all_reduce_over
from megalite.parallel.matmul import HIGH, Splits
from megalite.parallel.random import TensorParallelRNG
from megalite.parallel.sharding import mark_expert_sharded


class Experts(nn.Module):
    """This EP rank's experts, stacked: [local experts, out, in] (nn.Linear's layout), no biases."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, ep: ExpertParallel):
        super().__init__()
        self.activation, self.tp = cfg.mlp.activation, tp
        self.matmul, self.splits = HIGH, Splits(tokens=ep.expert_tokens)

        def stacked(out: int, into: int, std: float) -> nn.Parameter:
            p = new_param(cfg.n_experts // ep.size, out, into, std=std)
            mark_expert_sharded(p, ep.rank, ep.size)
            return p

        ffn, hidden = cfg.expert_ffn, cfg.hidden
        self.gate = stacked(ffn, hidden, cfg.init_std) if cfg.gated else None
        self.up = stacked(ffn, hidden, cfg.init_std)
        self.down = stacked(hidden, ffn, down_init_std(cfg))

    def forward(self, rows: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        """rows: expert-major, per_expert[e] of them for local expert e."""
        def times(x: torch.Tensor, w: nn.Parameter) -> torch.Tensor:
            return self.matmul.grouped(x, self.tp.sum_grad(w), per_expert, self.splits)

        up = times(rows, self.up)
        gate = None if self.gate is None else times(rows, self.gate)
        return times(activate(self.activation, up, gate), self.down)


class _AuxLossGrad(torch.autograd.Function):
    """Identity on the layer's output whose backward also starts the balancing losses' (Megatron's
    MoEAuxLossAutoScaler): a loss made inside a layer reaches the gradients through the
    ordinary backward, at every pipeline stage, without the training loop knowing of it."""

    @staticmethod
    def forward(ctx, x, aux):
        ctx.aux_shape = aux.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_ones(ctx.aux_shape, dtype=torch.float32)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, ep: ExpertParallel, rng: TensorParallelRNG):
        super().__init__()
        self.cfg, self.tp, self.ep_group, self.rng = cfg, tp, ep.group, rng
        self.router = Router(cfg, tp, ep)
        self.experts = Experts(cfg, tp, ep)
        self.shared = MLP(cfg, tp, cfg.shared_ffn) if cfg.mlp.shared_experts else None
        self.shared_gate = new_param(1, cfg.hidden, std=cfg.init_std) if cfg.mlp.shared_gate else None
        self.reset_statistics()

    def reset_statistics(self) -> None:
        """Since the last reset: copies routed to each expert (the micro-batches' whole counts),
        this rank's part of the balancing losses and its copies dropped over capacity."""
        device = self.router.weight.device
        self.load = torch.zeros(self.cfg.n_experts, dtype=torch.long, device=device)
        self.step_load = torch.zeros_like(self.load)  # since the last expert-bias update
        self.aux_loss = torch.zeros((), device=device)
        self.dropped = torch.zeros((), dtype=torch.long, device=device)

    def forward(self, x: torch.Tensor, inputs: RankInputs) -> torch.Tensor:
        """x: [batch, hidden_len, hidden], this rank's tokens (sequence shard under SP)."""
        batch, seq, hidden = x.shape
        flat, k, tokens = x.reshape(-1, hidden), self.cfg.mlp.top_k, inputs.tokens
        route = self.router(flat, tokens.real.flatten(), tokens.key.flatten(), inputs.loss_scale)
        # Kept copies (token t's choice j at t*k + j), sorted by expert, then by token and choice.
        copies = route.kept.flatten().nonzero().squeeze(1)
        expert_of = route.experts.flatten()[copies]
        copies = copies[torch.sort(expert_of, stable=True).indices]
        exchange = ExpertExchange(torch.bincount(expert_of, minlength=self.cfg.n_experts), self.ep_group)
        rows = exchange.dispatch(flat[copies // k])
        out = exchange.combine(self.experts(rows, exchange.per_expert))
        outputs = out.new_zeros(flat.shape[0] * k, hidden).index_copy(0, copies, out).view(-1, k, hidden)
        weights = route.weights.to(out.dtype)
        # Choice by choice, a fixed order whatever the layout (0 + the first is exact).
        y = sum(outputs[:, j] * weights[:, j:j + 1] for j in range(k)).view(batch, seq, hidden)
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(F.linear(x, self.tp.sum_grad(self.shared_gate)))
            y = y + shared
        self._record(route, tokens.real.flatten())
        return y if route.aux_loss is None else _AuxLossGrad.apply(y, route.aux_loss)

    @torch.no_grad()
    def _record(self, route, real: torch.Tensor) -> None:
        if self.rng.replaying or not self.training:  # recomputation: counted once
            return
        self.load += route.load
        self.step_load += route.load
        self.dropped += real.sum() * self.cfg.mlp.top_k - route.kept.sum()
        if route.aux_loss is not None:
            self.aux_loss += route.aux_loss.detach()


@torch.no_grad()
def update_expert_bias(model: nn.Module, dp_group) -> None:
    """After a step, DeepSeek-V3's auxiliary-loss-free balancing: each MoE layer's expert bias
    moves by model.mlp.bias_update_rate toward balance, by the sign of (mean load - load) over
    the step's whole batch (all DP ranks), the same on every rank and layout."""
    rate = model.cfg.moe.bias_update_rate if model.cfg.moe else 0.0
    # Most runs: no walk over the modules every step. A pipeline stage may hold dense layers only.
    layers = [m for m in model.modules() if isinstance(m, MoE)] if rate else []
    if not layers:
        return
    loads = all_reduce_over(torch.stack([m.step_load for m in layers]).float(), dp_group)
    for m, load in zip(layers, loads):
        m.router.expert_bias += rate * torch.sign(load.mean() - load)
        m.step_load.zero_()
