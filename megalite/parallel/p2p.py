"""Point-to-point messages between ranks: activations forward and gradients backward between
neighbouring pipeline stages, and ring attention's K/V blocks around the CP ring.

A message is one tensor from one rank to its pipeline neighbour, named by a tag that says what
it is (kind, destination chunk, micro-batch). The runner posts the messages of each exchange of
schedules.plan at once:

- gloo: separate isend / irecv, matched by tag. A rank blocks only on a receive, right before
  the action that needs it, and sends are waited for at the end of the step.
  batch_isend_irecv is avoided: it has hung on gloo (pytorch #132644).
- NCCL: one batch_isend_irecv per exchange, so its sends and receives run as one NCCL group.
  NCCL ignores tags and runs a rank's groups in order: the plan puts both ends of every
  message in the same tick's exchange, so each group can complete.
"""
import torch
import torch.distributed as dist


class Message:
    """A tensor to send (contiguous, as the wire takes it), or the shape of one to receive;
    `peer` is a global rank."""

    def __init__(self, peer: int, tag: int, tensor: torch.Tensor | None = None,
                 shape: torch.Size | None = None, dtype: torch.dtype | None = None):
        self.peer, self.tag, self.shape, self.dtype = peer, tag, shape, dtype
        self.tensor = None if tensor is None else tensor.contiguous()


class PipeComm:
    def __init__(self, device: torch.device, process_group=None):
        """process_group: the group whose communicator carries the messages (default the
        world's: pipeline stages'; ring attention's: the CP group), so that NCCL never orders
        one kind of message behind the other."""
        self.device, self.process_group = device, process_group
        # No process group at all in a single process, which never exchanges anything.
        self.batched = dist.is_initialized() and dist.get_backend() == "nccl"
        self.sends: list = []  # (work, tensor): kept alive until the step's end

    def exchange(self, sends: list[Message], recvs: list[Message]) -> list["Received"]:
        """Post `sends` and `recvs`; one handle per receive waits for its tensor."""
        buffers = [torch.empty(r.shape, dtype=r.dtype, device=self.device) for r in recvs]
        pg = self.process_group
        if self.batched:
            ops = [dist.P2POp(dist.isend, s.tensor, s.peer, pg, tag=s.tag) for s in sends] + \
                  [dist.P2POp(dist.irecv, b, r.peer, pg, tag=r.tag) for b, r in zip(buffers, recvs)]
            # NCCL runs the exchange as one group, and torch returns one work for all of it:
            # each receive, and the sends, wait for that group (one list, shared).
            group = dist.batch_isend_irecv(ops) if ops else []
            self.sends += [(group, s.tensor) for s in sends]
            return [Received(b, group, pg) for b in buffers]
        self.sends += [([dist.isend(s.tensor, s.peer, group=pg, tag=s.tag)], s.tensor) for s in sends]
        return [Received(b, [dist.irecv(b, r.peer, group=pg, tag=r.tag)], pg)
                for b, r in zip(buffers, recvs)]

    def finish(self) -> None:
        """Wait until every send of the step has left (its tensor may then be freed)."""
        for works, _ in self.sends:
            _wait(works)
        self.sends.clear()


def _wait(works: list) -> None:
    """Wait for each of `works` once: a batched exchange's list is shared by all its receives
    and sends, and a work is not waited for twice."""
    while works:
        works.pop(0).wait()


class Received:
    """A posted receive: `wait` returns its tensor once it has arrived."""

    def __init__(self, buffer: torch.Tensor, works: list, process_group=None):
        self.buffer, self.works, self.process_group = buffer, works, process_group

    def wait(self) -> torch.Tensor:
        _wait(self.works)
        return self.buffer
