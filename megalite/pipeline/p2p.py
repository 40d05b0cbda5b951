"""Activations forward and gradients backward between neighbouring pipeline stages.

A message is one tensor from one rank to its pipeline neighbour, named by a tag that says what
it is (kind, destination chunk, micro-batch), so no two messages of a step between two ranks can
be confused. Between two actions the runner posts, as one group, the send the last action made
and the receive the next one needs (Megatron's send_forward_recv_backward and kin):

- gloo: separate isend / irecv. Sends are never waited for until the end of the step, so a rank
  blocks only on a receive whose sender, by the schedule (schedules.dependencies), is not
  itself waiting on this rank: no deadlock. batch_isend_irecv is avoided: it has hung on gloo
  (pytorch #132644).
- NCCL: the group goes through batch_isend_irecv, so a send and a receive between the same two
  ranks run as one NCCL group rather than one after the other on their shared stream.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.parallel.state import ParallelState


class Message:
    """A tensor to send, or the shape of one to receive; `peer` is a global rank."""

    def __init__(self, peer: int, tag: int, tensor: torch.Tensor | None = None,
                 shape: torch.Size | None = None, dtype: torch.dtype | None = None):
        self.peer, self.tag, self.tensor = peer, tag, tensor
        self.shape, self.dtype = shape, dtype


class PipeComm:
    def __init__(self, pstate: ParallelState):
        self.device = pstate.device
        self.batched = dist.get_backend() == "nccl"
        self.sends: list = []  # (work, tensor): kept alive until the step's end

    def exchange(self, send: Message | None, recv: Message | None) -> "Received":
        """Post `send` and `recv`; the returned handle waits for the received tensor."""
        if send is not None:
            send.tensor = send.tensor.contiguous()
        buffer = None
        if recv is not None:
            buffer = torch.empty(recv.shape, dtype=recv.dtype, device=self.device)
        if self.batched:
            ops = ([dist.P2POp(dist.isend, send.tensor, send.peer)] if send else []) + \
                  ([dist.P2POp(dist.irecv, buffer, recv.peer)] if recv else [])
            works = dist.batch_isend_irecv(ops) if ops else []
            if send is not None:
                self.sends.append((works[0], send.tensor))
            return Received(buffer, works[-1] if recv is not None else None)
        if send is not None:
            self.sends.append((dist.isend(send.tensor, send.peer, tag=send.tag), send.tensor))
        work = dist.irecv(buffer, recv.peer, tag=recv.tag) if recv is not None else None
        return Received(buffer, work)

    def finish(self) -> None:
        """Wait until every send of the step has left (its tensor may then be freed)."""
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()


class Received:
    def __init__(self, buffer: torch.Tensor | None, work):
        self.buffer, self.work = buffer, work

    def wait(self) -> torch.Tensor | None:
        if self.work is not None:
            self.work.wait()
        return self.buffer
