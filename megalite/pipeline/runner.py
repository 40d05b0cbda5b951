"""One pipelined step: carry out a schedule's actions, exchanging activations and gradients.

A forward of chunk c on micro-batch i takes the previous virtual stage's activation (a leaf
that requires grad) and keeps its output; the matching backward sends that leaf's gradient
back. The last virtual stage's forward is the fused head + loss, whose backward needs no
incoming gradient. Every stage reads the whole micro-batch (token ids give each stage its
positions and document mask; labels only matter on the last).
"""
from typing import Callable

import torch

from megalite.parallel.p2p import Message, PipeComm
from megalite.pipeline.objective import LanguageModel
from megalite.pipeline.schedules import Action, Exchange, message_in, message_out, plan


class PipelineRun:
    """Carries out one rank's action list for a step (training) or a forward pass (eval,
    generation)."""

    def __init__(self, model, batches: list, autocast, module=None, **forward_kwargs):
        """module: what runs the model's forward (the engine's wrapper of it, if any);
        forward_kwargs: what every forward takes besides the batch (generation: the attention
        mask and the KV cache)."""
        self.model, self.batches, self.autocast = model, batches, autocast
        self.module = model if module is None else module
        self.forward_kwargs, self.ps = forward_kwargs, model.pstate
        self.comm = PipeComm(self.ps.device)

    def _address(self, route, a: Action) -> tuple[int, int]:
        """(global rank, tag) of a's message by `route` (schedules.message_in or message_out)."""
        peer, tag = route(a, self.ps.pp_rank, self.ps.pp_size, len(self.model.chunks))
        return self.ps.stage_rank(peer), tag

    def incoming(self, a: Action) -> Message:
        """The buffer for what `a` receives before it runs: a hidden state or its gradient."""
        ids = self.batches[a.micro].input_ids
        seq = self.model.split.hidden_len(ids.shape[1], self.forward_kwargs.get("cache"))
        shape = torch.Size((ids.shape[0], seq, self.model.cfg.hidden))
        return Message(*self._address(message_in, a), shape=shape, dtype=next(self.model.parameters()).dtype)

    def run(self, steps: tuple, step) -> None:
        """Carry out a plan (schedules.plan): `step(action, received)` runs one action and
        returns the tensor it sends, if any."""
        received, made = {}, {}
        for item in steps:
            if isinstance(item, Exchange):
                sends = [Message(*self._address(message_out, a), tensor=made.pop(a)) for a in item.sends]
                handles = self.comm.exchange(sends, [self.incoming(a) for a in item.recvs])
                received.update(zip(item.recvs, handles))
            else:
                handle = received.pop(item, None)
                made[item] = step(item, None if handle is None else handle.wait())
        self.comm.finish()

    def _forward(self, a: Action, hidden: torch.Tensor | None, **kwargs):
        batch = self.batches[a.micro]
        # Training and eval batches are right-padded: causal attention alone is exact at every
        # real position (model/layout.py) and fused, so a dense model runs without their mask.
        # A mixture of experts takes it: its router counts real tokens only, so padding takes
        # no expert's capacity and no part in the balancing losses (one host sync more, to see
        # the padding is on the right, beside the router's own).
        if self.model.cfg.n_experts and batch.attention_mask is not None:
            kwargs["attention_mask"] = batch.attention_mask
        with self.autocast:
            return self.module(batch.input_ids, doc_ids=batch.doc_ids, labels=batch.labels,
                               chunk=a.chunk, hidden=hidden, **{**kwargs, **self.forward_kwargs})


def train_pipelined(engine, batches: list, n_tokens: torch.Tensor, autocast, schedule_name: str,
                    objective=LanguageModel()) -> torch.Tensor:
    """Forwards and backwards of this rank's micro-batches in the schedule's order (at pp=1 too:
    the one micro-batch loop); returns the sum of the micro-batch losses on the last stage (zero
    on the others). The last stage's output goes to the objective (pipeline/objective.py), scaled
    by 1 / its denominator over the global batch. `last` tells the engine a chunk's last backward
    (where the native engine starts that chunk's DP buckets)."""
    run = PipelineRun(engine.model, batches, autocast, engine.module)
    ps = engine.model.pstate
    steps = plan(schedule_name, ps.pp_size, ps.pp_rank, len(engine.model.chunks), len(batches))
    last_backward = {a.chunk: a for a in steps if isinstance(a, Action) and a.kind == "B"}
    held = {}  # (chunk, micro-batch) -> a forward's input and output, until its backward
    loss = torch.zeros((), device=n_tokens.device)
    scale = 1.0 / objective.denominator(batches, n_tokens, ps.dp_group)
    asked = objective.forward_kwargs(scale)

    def step(a: Action, received: torch.Tensor | None) -> torch.Tensor | None:
        if a.kind == "F":
            if received is not None:
                received.requires_grad_()
            out = run._forward(a, received, **asked)
            if out.hidden is not None:  # not the last stage
                held[a.chunk, a.micro] = received, out.hidden
                return out.hidden.detach()
            micro_loss = objective.loss(out, batches[a.micro], scale, engine.model.split.cp)
            held[a.chunk, a.micro] = received, micro_loss
            loss.add_(micro_loss.detach())
            return None
        x, out = held.pop((a.chunk, a.micro))
        engine.backward(out, last=a == last_backward[a.chunk],
                        grad=None if out.dim() == 0 else received)
        return None if x is None else x.grad

    run.run(steps, step)
    return loss


@torch.no_grad()
def forward_pipelined(model, batches: list, autocast, consume: Callable[[int, object], None],
                      **forward_kwargs) -> None:
    """The forward passes of a step, without backward (eval, generation): on the last stage,
    `consume(micro_batch, Output)` takes each micro-batch's output there."""
    run = PipelineRun(model, batches, autocast, **forward_kwargs)

    def step(a: Action, received: torch.Tensor | None) -> torch.Tensor | None:
        out = run._forward(a, received)
        if out.hidden is None:  # the last stage's
            consume(a.micro, out)
        return out.hidden

    ps = model.pstate
    run.run(plan("gpipe", ps.pp_size, ps.pp_rank, len(model.chunks), len(batches),
                 forward_only=True), step)
