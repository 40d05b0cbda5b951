"""One pipelined step: carry out a schedule's actions, exchanging activations and gradients.

A forward of chunk c on micro-batch i takes the previous virtual stage's activation (a leaf
that requires grad) and keeps its output; the matching backward sends that leaf's gradient
back. The last virtual stage's forward is the fused head + loss, whose backward needs no
incoming gradient. Every stage reads the whole micro-batch (token ids give each stage its
positions and document mask; labels only matter on the last).
"""
from __future__ import annotations

from typing import Callable

import torch

from megalite.pipeline.p2p import Message, PipeComm
from megalite.pipeline.schedules import Action, gpipe, schedule


def _tag(kind: str, chunk: int, micro: int, virtual: int) -> int:
    """Unique per message of a step between two ranks: what it is and where it goes."""
    return (micro * virtual + chunk) * 2 + (kind == "B")


class PipelineRun:
    """Carries out one rank's action list for a step (training) or a forward pass (eval)."""

    def __init__(self, model, batches: list, autocast):
        self.model, self.batches, self.autocast = model, batches, autocast
        ps = model.pstate
        self.ps, self.pp, self.virtual = ps, ps.pp_size, ps.virtual_stages
        self.last_stage = self.pp * self.virtual - 1
        self.comm = PipeComm(ps)

    def _stage(self, a: Action) -> int:
        return a.chunk * self.pp + self.ps.pp_rank

    def _hidden(self, micro: int) -> tuple[torch.Size, torch.dtype]:
        ids, ps = self.batches[micro].input_ids, self.ps
        seq = ids.shape[1]
        if self.model.sequence_parallel:
            seq = -(-seq // ps.tp_size)  # this rank's shard of the sequence padded to shards
        dtype = next(self.model.parameters()).dtype
        return torch.Size((ids.shape[0], seq, self.model.cfg.hidden)), dtype

    def incoming(self, a: Action | None) -> Message | None:
        """What `a` must receive before it runs: the previous stage's activation (F) or the
        next stage's gradient (B); None at either end of the model."""
        if a is None:
            return None
        stage = self._stage(a)
        if (a.kind == "F" and stage == 0) or (a.kind == "B" and stage == self.last_stage):
            return None
        peer = self.ps.pp_rank - 1 if a.kind == "F" else self.ps.pp_rank + 1
        shape, dtype = self._hidden(a.micro)
        return Message(self.ps.stage_rank(peer), _tag(a.kind, a.chunk, a.micro, self.virtual),
                       shape=shape, dtype=dtype)

    def outgoing(self, a: Action, tensor: torch.Tensor | None) -> Message | None:
        stage = self._stage(a)
        if tensor is None:
            return None
        target = stage + 1 if a.kind == "F" else stage - 1
        peer = self.ps.pp_rank + (1 if a.kind == "F" else -1)
        return Message(self.ps.stage_rank(peer),
                       _tag(a.kind, target // self.pp, a.micro, self.virtual), tensor=tensor)

    def run(self, actions: list[Action], step) -> None:
        """`step(action, received)` carries out one action and returns the tensor it sends."""
        pending = self.comm.exchange(None, self.incoming(actions[0]) if actions else None)
        for k, a in enumerate(actions):
            sent = step(a, pending.wait())
            following = actions[k + 1] if k + 1 < len(actions) else None
            pending = self.comm.exchange(self.outgoing(a, sent), self.incoming(following))
        self.comm.finish()

    def _forward(self, a: Action, hidden: torch.Tensor | None, **kwargs):
        batch = self.batches[a.micro]
        with self.autocast:
            return self.model(batch.input_ids, doc_ids=batch.doc_ids, labels=batch.labels,
                              chunk=a.chunk, hidden=hidden, **kwargs)


def train_pipelined(engine, batches: list, n_tokens: torch.Tensor, autocast,
                    schedule_name: str) -> torch.Tensor:
    """Forwards and backwards of this rank's micro-batches in the schedule's order; returns the
    sum of the micro-batch losses on the last stage (zero on the others). The DP gradient sync
    of each chunk starts on its last backward."""
    model = engine.model
    run = PipelineRun(model, batches, autocast)
    ps = model.pstate
    actions = schedule(schedule_name, ps.pp_size, ps.pp_rank, ps.virtual_stages, len(batches))
    last_backward = {a.chunk: k for k, a in enumerate(actions) if a.kind == "B"}
    position = {a: k for k, a in enumerate(actions)}
    inputs, outputs = {}, {}
    loss = torch.zeros((), device=n_tokens.device)

    def step(a: Action, received: torch.Tensor | None) -> torch.Tensor | None:
        nonlocal loss
        key = (a.chunk, a.micro)
        if a.kind == "F":
            if received is not None:
                received.requires_grad_()
            out = run._forward(a, received, loss_scale=1.0 / n_tokens)
            inputs[key] = received
            if out.loss is not None:
                outputs[key] = out.loss
                loss += out.loss.detach()
                return None
            outputs[key] = out.hidden
            return out.hidden.detach()
        x, out = inputs.pop(key), outputs.pop(key)
        engine.backward(out, last=position[a] == last_backward[a.chunk],
                        grad=None if out.dim() == 0 else received)
        return None if x is None else x.grad

    run.run(actions, step)
    return loss


@torch.no_grad()
def forward_pipelined(model, batches: list, autocast, consume: Callable[[int, object], None]) -> None:
    """The forward passes of a step, without backward (eval): on the last stage,
    `consume(micro_batch, Output)` takes each micro-batch's output there."""
    run = PipelineRun(model, batches, autocast)

    def step(a: Action, received: torch.Tensor | None) -> torch.Tensor | None:
        out = run._forward(a, received)
        if out.hidden is not None:
            return out.hidden
        consume(a.micro, out)
        return None

    run.run([a for a in gpipe(model.pstate.virtual_stages, len(batches)) if a.kind == "F"], step)
