"""Count and time every collective of a training step, by process group.

    with CommLog(pstate) as log:
        train_step(...)
    log.totals()   # {(op, group): {"calls", "elements", "bytes", "wire_bytes", "seconds"}}

For the length of the block, the torch.distributed collectives that megalite uses are
wrapped (DeepSpeed binds some of its own, ZeRO's parameter all-gather among them, when it
starts: with train.engine=deepspeed the counts are partial): each call is recorded and made synchronous,
with the device synchronised before and after, so its wall time is its own. The step under a
CommLog therefore runs with no communication overlapped: it measures how much there is, not how
well it hides; time the step without one.

Pipeline stages' point-to-point messages are posted as usual (made synchronous one by one,
they could wait on each other); each receive is recorded when its action waits for it (op
`recv`, group `pp`), timed with the device synchronised before and after: the time a stage sits
waiting for its neighbour, the pipeline bubble plus the transfer. Ring attention's K/V blocks
(parallel.cp_comm=p2p) are receives of group `cp`.

`bytes` is the payload of one rank's call: the reduced tensor of an all-reduce, the gathered
(full) tensor of an all-gather, the input of a reduce-scatter. `wire_bytes` is what a ring
algorithm sends per rank for it: 2(n-1)/n of the payload for an all-reduce, (n-1)/n for an
all-gather or reduce-scatter (n: the group's size); an all-to-all's input, of which it sends
what is not its own split (MoE's token exchange over the EP group: uneven splits).
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch
import torch.distributed as dist

from bench.timing import synchronize
from megalite.parallel.state import ParallelState
from megalite.parallel.p2p import Received

# name -> (position and keyword of the payload argument, ring traffic in units of (n-1)/n)
WRAPPED = {"all_reduce": (0, "tensor", 2), "broadcast": (0, "tensor", 1),
           "all_gather": (0, "tensor_list", 1), "all_gather_into_tensor": (0, "output_tensor", 1),
           "reduce_scatter": (1, "input_list", 1), "reduce_scatter_tensor": (1, "input", 1),
           "all_to_all_single": (1, "input", 1)}


def _payload(name: str, args, kwargs) -> torch.Tensor | list:
    position, keyword, _ = WRAPPED[name]
    return args[position] if len(args) > position else kwargs[keyword]


def _numel_and_bytes(payload) -> tuple[int, int]:
    tensors = payload if isinstance(payload, (list, tuple)) else [payload]
    return (sum(t.numel() for t in tensors), sum(t.numel() * t.element_size() for t in tensors))


class CommLog:
    def __init__(self, pstate: ParallelState):
        self.ps = pstate
        self.records: list[dict] = []
        self._originals: dict = {}

    # ParallelState's groups by the names the records use: cp_dp sums the gradients over the CP
    # and DP ranks, embedding ties the first and last pipeline stage, ep carries MoE's tokens,
    # expert_dp the gradients of the ranks holding the same experts.
    # ("dp" before "cp_dp": without CP the gradients' group is the DP group.)
    GROUPS = {"tp": "tp_group", "dp": "dp_group", "pp": "pp_group", "cp": "cp_group",
              "cp_dp": "grad_group", "embedding": "embedding_group", "ep": "ep_group",
              "expert_dp": "expert_grad_group"}

    def group_name(self, group) -> str:
        if group is None or group is dist.group.WORLD:
            return "world"
        return next((name for name, attr in self.GROUPS.items() if group is getattr(self.ps, attr)),
                    f"tp-sub{dist.get_world_size(group)}")  # GQA's KV-head copies

    def __enter__(self) -> "CommLog":
        for name in WRAPPED:
            self._originals[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name, self._originals[name]))
        self._originals["recv"] = Received.wait
        Received.wait = self._wrap_receive(Received.wait)
        return self

    def __exit__(self, *exc) -> None:
        Received.wait = self._originals.pop("recv")
        for name, original in self._originals.items():
            setattr(dist, name, original)

    def _timed(self, call):
        """call()'s result and its wall time, the device synchronised before and after."""
        synchronize(self.ps.device)
        start = time.perf_counter()
        result = call()
        synchronize(self.ps.device)
        return result, time.perf_counter() - start

    def _wrap_receive(self, wait):
        def recorded(received: Received) -> torch.Tensor:
            tensor, seconds = self._timed(lambda: wait(received))
            nbytes = tensor.numel() * tensor.element_size()
            # Pipeline stages' messages travel on the world's communicator, the CP ring's on its own.
            group = "pp" if received.process_group is None else self.group_name(received.process_group)
            self.records.append({"op": "recv", "group": group, "ranks": 2, "elements": tensor.numel(),
                                 "bytes": nbytes, "wire_bytes": nbytes, "seconds": seconds})
            return tensor
        return recorded

    def _wrap(self, name: str, collective):
        def recorded(*args, **kwargs):
            group = kwargs.get("group")
            # list all_gather / reduce_scatter: the payload is the list of the n parts
            numel, nbytes = _numel_and_bytes(_payload(name, args, kwargs))
            n = dist.get_world_size(group)

            def call():
                work = collective(*args, **kwargs)
                if work is not None:
                    work.wait()
                return work

            work, seconds = self._timed(call)
            wire = nbytes * WRAPPED[name][2] * (n - 1) / n
            splits = kwargs.get("input_split_sizes", args[3] if len(args) > 3 else None)
            if name == "all_to_all_single" and splits:  # all but this rank's own split
                wire = nbytes * (1 - splits[dist.get_rank(group)] / max(1, sum(splits)))
            self.records.append({"op": name, "group": self.group_name(group), "ranks": n,
                                 "elements": numel, "bytes": nbytes, "wire_bytes": wire,
                                 "seconds": seconds})
            return work
        return recorded

    def totals(self) -> dict[tuple[str, str], dict[str, float]]:
        out: dict = defaultdict(lambda: {"calls": 0, "elements": 0, "bytes": 0, "wire_bytes": 0.0,
                                         "seconds": 0.0})
        for r in self.records:
            entry = out[(r["op"], r["group"])]
            entry["calls"] += 1
            for key in ("elements", "bytes", "wire_bytes", "seconds"):
                entry[key] += r[key]
        return dict(out)

    @property
    def seconds(self) -> float:
        return sum(r["seconds"] for r in self.records)

    @property
    def receive_seconds(self) -> float:
        """The time spent waiting for pipeline neighbours."""
        return sum(r["seconds"] for r in self.records if r["op"] == "recv" and r["group"] == "pp")
