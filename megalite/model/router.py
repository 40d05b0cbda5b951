"""The MoE router: which experts each token goes to, with what weights, and the balancing losses.

Layout-independent by construction, so that every parallel layout routes every token alike:
- logits in fp32 from the token's own hidden state (replicated weight), ties broken toward the
  lower expert index (a stable sort, not topk; DeepSeek-V3's group-limited routing ties as
  transformers' topk does);
- what counts tokens (the capacity's queue, the load-balancing loss) counts the micro-batch's
  real tokens over the ranks that share them (ExpertParallel.token_group: CP's shares, SP's shards), never
  SP's padding, and orders them by their place in the batch.

Losses are per micro-batch, weighted by its real tokens x the step's loss_scale (1 / the
step's tokens), so summing micro-batches and ranks gives the same total on every layout:
- load balancing (Switch, Fedus et al. 2021): coeff x E x sum_e f_e P_e, f_e the fraction of
  the k x T copies routed to e, P_e the mean score of e (sigmoid scores: normalised per token);
- z-loss (Zoph et al. 2022): coeff x mean over tokens of logsumexp(logits)^2.
Each rank adds the part its own tokens' scores make (counts are all-reduced, with no gradient),
so the parts add up to the micro-batch's loss.
"""
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig
from megalite.parallel.init import new_param
from megalite.parallel.contexts import ExpertParallel, TensorParallel
from megalite.parallel.mappings import all_gather, all_reduce_over, group_size


@dataclass
class Routing:
    experts: torch.Tensor  # [tokens, k] the chosen experts, best first
    weights: torch.Tensor  # [tokens, k] fp32 combine weights
    kept: torch.Tensor  # [tokens, k] the copies that run: real tokens, within capacity
    load: torch.Tensor  # [n_experts] copies routed to each expert in the micro-batch (all ranks)
    aux_loss: torch.Tensor | None  # this rank's part of the balancing losses (with loss_scale)


def best(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[tokens, k] the k best columns of each row, best first, ties to the lower index."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


def group_limited(scores: torch.Tensor, groups: int, keep: int, k: int) -> torch.Tensor:
    """DeepSeek-V3's group-limited routing, [tokens, k] best first: the experts, in `groups`
    consecutive groups, compete only within each token's `keep` groups with the best sums of
    their two best scores. Picked by torch.topk as transformers picks, so that ties go the
    same way (topk's order: a function of the scores and the device, the same on every rank)."""
    tokens, experts = scores.shape
    grouped = scores.view(tokens, groups, experts // groups)
    chosen = grouped.topk(2, dim=-1).values.sum(-1).topk(keep, dim=-1, sorted=False).indices
    inside = torch.zeros(tokens, groups, dtype=torch.bool, device=scores.device).scatter_(1, chosen, True)
    limited = grouped.masked_fill(~inside.unsqueeze(-1), float("-inf")).view(tokens, experts)
    picked = limited.topk(k, dim=-1, sorted=False).indices
    return picked.gather(1, best(limited.gather(1, picked), k))


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, ep: ExpertParallel):
        super().__init__()
        self.cfg, self.tp, self.ep = cfg, tp, ep
        self.weight = new_param(cfg.n_experts, cfg.hidden, std=cfg.init_std)
        # Added to the scores to pick experts, never to weigh them; moved by the trainer after
        # each step (update_expert_bias), not by gradients. A parameter so that checkpoints
        # hold it like every weight.
        self.expert_bias = nn.init.zeros_(new_param(cfg.n_experts))
        self.expert_bias.requires_grad_(False)

    def forward(self, x: torch.Tensor, real: torch.Tensor, key: torch.Tensor,
                loss_scale: torch.Tensor | float | None) -> Routing:
        """x: [tokens, hidden] this rank's; real, key: HiddenTokens' (flattened)."""
        cfg, group, weight = self.cfg, self.token_group, self.tp.sum_grad(self.weight)
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), weight.float())
        scores = logits.softmax(-1) if cfg.mlp.router == "softmax" else logits.sigmoid()
        k = cfg.mlp.top_k
        picking = scores.detach() + self.expert_bias.float()
        experts = (group_limited(picking, cfg.mlp.groups, cfg.mlp.topk_groups, k) if cfg.mlp.groups > 1
                   else best(picking, k))
        weights = scores.gather(1, experts)
        if cfg.mlp.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights * cfg.mlp.routed_scaling  # exact at 1.0
        chosen = F.one_hot(experts, cfg.n_experts).sum(1) * real.unsqueeze(1)  # [tokens, E]
        totals = all_reduce_over(torch.cat([chosen.sum(0), real.sum().view(1)]), group)
        load, n_tokens = totals[:-1], max(int(totals[-1]), 1)
        kept = real.unsqueeze(1).expand_as(experts)
        if cfg.mlp.capacity_factor is not None:
            capacity = math.ceil(cfg.mlp.capacity_factor * n_tokens * k / cfg.n_experts)
            kept = kept & (self._queue_position(experts, real, key) < capacity)
        aux = (self._losses(logits, scores, real, load, n_tokens) * loss_scale
               if loss_scale is not None and torch.is_grad_enabled() else None)
        return Routing(experts, weights, kept, load, aux)

    @property
    def token_group(self):
        """Decoding splits nothing: every TP rank holds the same tokens, counted once."""
        return self.ep.sharded_token_group if self.tp.sharded else self.ep.token_group

    def _queue_position(self, experts: torch.Tensor, real: torch.Tensor,
                        key: torch.Tensor) -> torch.Tensor:
        """[tokens, k] how many copies routed to the same expert come before each one in the
        micro-batch (ordered by token place, then choice rank), over the token group."""
        group, (local, k) = self.token_group, experts.shape
        mine = torch.cat([experts, real.unsqueeze(1).long(), key.unsqueeze(1)], dim=1)
        every = all_gather(mine, 0, group) if group_size(group) > 1 else mine
        everyone = every[:, :k].masked_fill(every[:, k:k + 1] == 0, self.cfg.n_experts)  # padding: nowhere
        order = torch.argsort(every[:, -1], stable=True)  # token place; choice rank is the column
        onehot = F.one_hot(everyone[order].flatten(), self.cfg.n_experts + 1)
        before = (onehot.cumsum(0) - onehot).gather(1, everyone[order].flatten().unsqueeze(1)).view(-1, k)
        position = torch.empty_like(before).index_copy_(0, order, before)  # back to the gathered order
        start = (dist.get_rank(group) if group_size(group) > 1 else 0) * local
        return position[start:start + local]

    def _losses(self, logits, scores, real, load, n_tokens) -> torch.Tensor:
        cfg, realf = self.cfg, real.unsqueeze(1).float()
        total = logits.new_zeros(())
        if cfg.mlp.aux_loss_coeff:
            probs = scores if cfg.mlp.router == "softmax" else scores / scores.sum(-1, keepdim=True)
            # n_tokens x (E / (k T^2)) sum_e load_e sum_t p_te: the micro-batch's loss x its tokens
            total = total + (cfg.mlp.aux_loss_coeff * cfg.n_experts / (cfg.mlp.top_k * n_tokens)
                             * (load.float() * (probs * realf).sum(0)).sum())
        if cfg.mlp.z_loss_coeff:
            total = total + cfg.mlp.z_loss_coeff * (logits.logsumexp(-1).square() * real).sum()
        return total
