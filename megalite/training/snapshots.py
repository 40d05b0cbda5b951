"""In-memory snapshots (train.snapshot_every): every few steps each rank copies its whole state
(its part of the model, the fp32 rows and optimizer state its engine holds, RNG, step, tokens
counted: what a checkpoint holds of it) to a file in the node's shared memory, which outlives
the process. When a rank dies and the launcher starts the ranks again (torchrun
--max-restarts, Slurm's requeue), each loads its own file of the newest snapshot every rank
has, and the run goes on from there, bit for bit as it would have, without the disk.

One file per rank, written to a temporary name and renamed: a file that exists is whole, so a
rank killed while writing leaves the snapshot before it. A snapshot is complete when every
rank has its file; before writing the next, the ranks agree (a MIN over their newest written
step) on the newest complete one, and each keeps its file of that one and the one it writes,
no older: at most two per rank. Same layout only: a file holds this rank's slices; a run on
another layout or world size resumes from the disk checkpoint (which reshards).

On several nodes (WORLD_SIZE > LOCAL_WORLD_SIZE) each rank also sends its file to its partner,
the same local rank of the next node, over a gloo group of its own in the writing thread, and
keeps its source's copy (`replica.` files): a snapshot is complete when every rank's file is
whole on its node or as its partner's copy, so a node lost with its memory loses none; at the
restart each rank without its file receives the copy (fetch). Not yet: DeepSpeed's engine,
pure_bf16.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from megalite.parallel.random import restore_run_rng
from megalite.parallel.state import ParallelState

FILE = re.compile(r"(replica\.)?step_(\d{8})\.rank_(\d+)\.safetensors$")


def snapshot_dir(given: str, run_dir: Path) -> Path:
    """train.snapshot_dir ({node}: the node's number, GROUP_RANK), or a directory of the node's
    shared memory named for run.dir."""
    if given:
        return Path(given.replace("{node}", os.environ.get("GROUP_RANK", "0")))
    key = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() else Path(tempfile.gettempdir())) / "megalite-snapshots" / key


class Snapshots:
    """This rank's snapshots in `root`, and the copy of its source's: written in a background
    thread, found and loaded at start."""

    def __init__(self, root: Path, pstate: ParallelState, identity: dict):
        """identity: what must match for a file to be this run's (layout, config, data)."""
        self.root, self.pstate = root, pstate
        self.identity = json.loads(json.dumps(identity))  # as a file's header gives it back
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="snapshot")
        self._pending: tuple[Future, int] | None = None
        self._written = self._complete = 0
        root.mkdir(parents=True, exist_ok=True)
        # The same local rank of the next node keeps a copy of this rank's files: one node
        # lost loses none of them.
        world = pstate.world_size
        self.local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        self.replicated = world > self.local
        self.partner, self.source = (pstate.rank + self.local) % world, (pstate.rank - self.local) % world
        self._group = dist.new_group(backend="gloo") if self.replicated else None

    def path(self, step: int, replica: bool = False) -> Path:
        """This rank's file of `step`, or (replica) the copy it keeps of its source's."""
        rank = self.source if replica else self.pstate.rank
        return self.root / f"{'replica.' if replica else ''}step_{step:08d}.rank_{rank}.safetensors"

    def mine(self, replica: bool = False) -> list[int]:
        """The steps of this rank's whole files (replica: of the copies it keeps)."""
        rank = self.source if replica else self.pstate.rank
        steps = []
        for f in self.root.iterdir():
            m = FILE.match(f.name)
            if m and bool(m[1]) == replica and int(m[3]) == rank:
                steps.append(int(m[2]))
        return sorted(steps)

    def newest_complete(self) -> int | None:
        """The newest step of which every rank's file is whole, here or as its partner's copy
        (a collective); None: no such step."""
        own = [s for s in self.mine() if self._matches(self.path(s))]
        kept = [s for s in self.mine(True) if self._matches(self.path(s, True))] if self.replicated else []
        everyone = [(own, kept)]
        if self.pstate.world_size > 1:
            everyone = [None] * self.pstate.world_size
            dist.all_gather_object(everyone, (own, kept))
        world = len(everyone)

        def whole(rank: int, step: int) -> bool:
            return step in everyone[rank][0] or step in everyone[(rank + self.local) % world][1]
        steps = {s for mine, copies in everyone for s in mine + copies}
        complete = [s for s in steps if all(whole(r, s) for r in range(world))]
        return max(complete) if complete else None

    def fetch(self, step: int) -> None:
        """Each rank without its file of `step` (its node lost its memory) gets the copy its
        partner keeps (a collective)."""
        if not self.replicated:
            return
        lacking = [None] * self.pstate.world_size
        dist.all_gather_object(lacking, not self.path(step).exists())
        send = self.path(step, True).read_bytes() if lacking[self.source] else None
        got = self._swap(send, lacking[self.pstate.rank], to=self.source, source=self.partner)
        if got is not None:
            self._publish(self.path(step), got)

    def _swap(self, data: bytes | None, receive: bool, to: int, source: int) -> bytes | None:
        """Send `data` (if any) to rank `to` while receiving from `source` (if asked), over
        this object's own gloo group: a length, then the bytes."""
        ops = []
        size = torch.zeros(1, dtype=torch.int64)
        if data is not None:
            ops.append(dist.isend(torch.tensor([len(data)]), to, group=self._group))
        if receive:
            ops.append(dist.irecv(size, source, group=self._group))
        for op in ops:
            op.wait()
        ops, buffer = [], torch.empty(int(size), dtype=torch.uint8)
        if data is not None:
            ops.append(dist.isend(torch.frombuffer(bytearray(data), dtype=torch.uint8), to,
                                  group=self._group))
        if receive:
            ops.append(dist.irecv(buffer, source, group=self._group))
        for op in ops:
            op.wait()
        return buffer.numpy().tobytes() if receive else None

    def _matches(self, path: Path) -> bool:
        try:
            with safe_open(path, "pt") as f:
                meta = f.metadata() or {}
        except (OSError, SafetensorError):
            return False
        return json.loads(meta.get("identity", "null")) == self.identity

    def save(self, step: int, model: torch.nn.Module, engine, rng: dict, counters: dict) -> str:
        """Stage this rank's state on the host now and write it in the background; what it
        cost, in a line. A collective: the ranks first agree on the newest complete snapshot,
        and each drops its older files."""
        self.finish()
        written = torch.tensor(float(self._written), dtype=torch.float64, device=self.pstate.device)
        if self.pstate.world_size > 1:
            dist.all_reduce(written, op=dist.ReduceOp.MIN)
        self._complete = int(written.item())
        for replica in (False, True):
            for old in self.mine(replica):
                if old < self._complete:
                    self.path(old, replica).unlink(missing_ok=True)
        tensors = {f"rng/{k}": v for k, v in rng.items()}
        tensors.update({f"model/{k}": v for k, v in model.state_dict().items()})
        for name, p in model.named_parameters():
            master = engine.master(p)
            if master is not p:
                tensors[f"master/{name}"] = master.detach()
            tensors.update({f"optimizer/{name}/{k}": v for k, v in engine.optimizer_state(p).items()})
        began = time.perf_counter()
        staged = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}
        meta = {"identity": json.dumps(self.identity), "counters": json.dumps(counters)}
        self._pending = (self._pool.submit(self._write, step, staged, meta), step)
        size = sum(t.numel() * t.element_size() for t in staged.values())
        return (f"snapshot of step {step}: {size / 2**20:.1f} MiB on rank {self.pstate.rank}, "
                f"staged in {1e3 * (time.perf_counter() - began):.0f} ms (the step waits for "
                f"that), written in the background to {self.root}; at most 2 kept per rank")

    def _write(self, step: int, tensors: dict, meta: dict) -> None:
        data = save(tensors, metadata=meta)
        self._publish(self.path(step), data)
        if self.replicated:  # every rank sends its own and receives its source's
            self._publish(self.path(step, True),
                          self._swap(data, True, to=self.partner, source=self.source))

    @staticmethod
    def _publish(final: Path, data: bytes) -> None:
        """Written under a temporary name, then renamed: a file that exists is whole."""
        tmp = final.with_name(f".{final.name}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, final)

    def finish(self) -> None:
        """Wait for the write in flight (its error, a full memory say, is raised here)."""
        if self._pending is not None:
            (future, step), self._pending = self._pending, None
            future.result()
            self._written = step

    def restore_newest(self, after: int, model: torch.nn.Module, engine) -> dict | None:
        """At a restart (a collective): the newest complete snapshot, when newer than step
        `after` (the disk checkpoint's), loaded into the model, engine and RNG, fetched from
        a partner's copy where a node lost its memory; its counters and step, or None."""
        newest = self.newest_complete()
        if newest is None or newest <= after:
            return None
        self.fetch(newest)
        with safe_open(self.path(newest), "pt") as f:
            counters = json.loads(f.metadata()["counters"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        part = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("model/")}
        model.load_state_dict(part, strict=True)
        pairs = []
        for name, p in model.named_parameters():
            master = engine.master(p)
            if master is not p:
                master.data.copy_(tensors[f"master/{name}"])
            prefix = f"optimizer/{name}/"
            state = {k[len(prefix):]: v.to(master.device) for k, v in tensors.items()
                     if k.startswith(prefix)}
            if state:
                pairs.append((p, state))
        engine.load_optimizer_state(pairs, newest)
        restore_run_rng(model.rng, {k.split("/", 1)[1]: v for k, v in tensors.items()
                                    if k.startswith("rng/")})
        if self.pstate.is_main:
            print(f"resumed from the in-memory snapshot of step {newest} ({self.root})", flush=True)
        return {"step": newest, **counters}

    def clear(self) -> None:
        """This rank's files, at the end of a run (the disk checkpoint has it all)."""
        self.finish()
        for replica in (False, True):
            for step in self.mine(replica):
                self.path(step, replica).unlink(missing_ok=True)
        self._pool.shutdown()
        try:
            self.root.rmdir()  # once every rank's files are gone
        except OSError:
            pass
