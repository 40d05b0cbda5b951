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
the same local rank of the next node, over a gloo group of its own in the writing thread; the
partner keeps it under the same name. A snapshot is complete when every rank's file is whole on
some node, so a node lost with its memory loses none; at the restart each rank without its
file receives it from a rank whose node has it (fetch). Files are found by (step, rank), not by
which node wrote them: a replaced node may take other ranks (torchrun orders its nodes anew).
Not yet: DeepSpeed's engine.
"""
import contextlib
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

FILE = re.compile(r"step_(\d{8})\.rank_(\d+)\.safetensors$")


def snapshot_dir(given: str, run_dir: Path) -> Path:
    """train.snapshot_dir, or a directory of the node's shared memory named for run.dir."""
    if given:
        return Path(given)
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
        self._written = 0
        root.mkdir(parents=True, exist_ok=True)
        # The same local rank of the next node keeps a copy of this rank's files: one node
        # lost loses none of them.
        world = pstate.world_size
        self.local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        self.replicated = world > self.local
        self.partner, self.source = (pstate.rank + self.local) % world, (pstate.rank - self.local) % world
        self._group = dist.new_group(backend="gloo") if self.replicated else None

    def path(self, step: int, rank: int | None = None) -> Path:
        """Rank `rank`'s file of `step` (this rank's by default), written here or copied."""
        return self.root / f"step_{step:08d}.rank_{self.pstate.rank if rank is None else rank}.safetensors"

    def held(self) -> list[tuple[int, int]]:
        """(step, rank) of the files here: this node's ranks' and the copies it keeps."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:  # removed by a rank of this node at the end (clear)
            return []
        return sorted((int(m[1]), int(m[2])) for m in map(FILE.match, names) if m)

    def _drop(self, which) -> None:
        """This node's files of the steps `which` picks (its ranks share the directory: any
        may drop any)."""
        for step, rank in self.held():
            if which(step):
                self.path(step, rank).unlink(missing_ok=True)

    def _holders(self) -> list[list[tuple[int, int]]]:
        """Every rank's whole files of this run, by rank (a collective)."""
        return self.pstate.gather_over_ranks([(s, r) for s, r in self.held()
                                              if self._matches(self.path(s, r))])

    def newest_complete(self, holders: list[list[tuple[int, int]]] | None = None) -> int | None:
        """The newest step of which every rank's file is whole on some node (a collective
        unless given `holders`, what _holders gathered); None: no such step."""
        files = {f for held in (self._holders() if holders is None else holders) for f in held}
        ranks = range(self.pstate.world_size)
        return max((s for s, _ in files if all((s, r) in files for r in ranks)), default=None)

    def fetch(self, step: int, holders: list[list[tuple[int, int]]]) -> None:
        """Each rank whose node lacks its file of `step` (the node lost its memory, or it
        holds other ranks since the restart) receives it from the first rank whose node has
        it, by `holders` (what _holders gathered; a collective)."""
        if not self.replicated:
            return
        sender = {r: next(q for q in range(len(holders)) if (step, r) in holders[q])
                  for r in range(len(holders)) if (step, r) not in holders[r]}
        for r, q in sender.items():  # one at a time: each pair of ranks has one transfer
            if self.pstate.rank == q:
                self._swap(self.path(step, r).read_bytes(), to=r, source=None)
            elif self.pstate.rank == r:
                publish(self.path(step), self._swap(None, to=None, source=q))

    def drop_after(self, step: int) -> None:
        """At a start: this node's files of steps after `step`, the one the run starts from (a
        collective: none is written meanwhile). They are of the run before the restart, and
        mixed with this one's they could make a snapshot complete from two histories (which
        differ wherever a kernel is not deterministic)."""
        self._drop(lambda later: later > step)
        if self.pstate.world_size > 1:
            dist.barrier(group=self._group)

    def _swap(self, data: bytes | None, to: int | None, source: int | None) -> bytes | None:
        """Send `data` (if any) to rank `to` while receiving from `source` (if asked), over
        this object's own gloo group: a length, then the bytes."""
        def exchange(sent: torch.Tensor | None, into: torch.Tensor) -> torch.Tensor:
            ops = [] if sent is None else [dist.isend(sent, to, group=self._group)]
            if source is not None:
                ops.append(dist.irecv(into, source, group=self._group))
            for op in ops:
                op.wait()
            return into

        size = exchange(None if data is None else torch.tensor([len(data)]),
                        torch.zeros(1, dtype=torch.int64))
        buffer = exchange(None if data is None else torch.frombuffer(bytearray(data), dtype=torch.uint8),
                          torch.empty(int(size), dtype=torch.uint8))
        return buffer.numpy().tobytes() if source is not None else None

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
        complete = self.pstate.reduce_over_ranks(self._written, dist.ReduceOp.MIN)
        self._drop(lambda old: old < complete)
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
        publish(self.path(step), data)
        if self.replicated:  # every rank sends its own and receives its source's
            publish(self.path(step, self.source), self._swap(data, to=self.partner, source=self.source))

    def finish(self) -> None:
        """Wait for the write in flight (its error, a full memory say, is raised here)."""
        if self._pending is not None:
            (future, step), self._pending = self._pending, None
            future.result()
            self._written = step

    def restore_newest(self, after: int, model: torch.nn.Module, engine) -> dict | None:
        """At a start (a collective): the newest complete snapshot, when newer than step
        `after` (the disk checkpoint's), loaded into the model, engine and RNG, fetched from a
        partner's copy where a node lost its memory; its counters and step, or None. Either
        way, the files of later steps are dropped (drop_after)."""
        holders = self._holders()  # read once: the drop keeps `newest`'s files
        newest = self.newest_complete(holders)
        if newest is None or newest <= after:
            self.drop_after(after)
            return None
        self.drop_after(newest)
        self.fetch(newest, holders)
        with safe_open(self.path(newest), "pt") as f:
            counters = json.loads(f.metadata()["counters"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        model.load_state_dict(_under(tensors, "model/"), strict=True)
        pairs = []
        for name, p in model.named_parameters():
            master = engine.master(p)
            if master is not p:
                master.data.copy_(tensors[f"master/{name}"])
            state = {k: v.to(master.device) for k, v in _under(tensors, f"optimizer/{name}/").items()}
            if state:
                pairs.append((p, state))
        engine.load_optimizer_state(pairs, newest)
        restore_run_rng(model.rng, _under(tensors, "rng/"))
        if self.pstate.is_main:
            print(f"resumed from the in-memory snapshot of step {newest} ({self.root})", flush=True)
        return {"step": newest, **counters}

    def clear(self) -> None:
        """Every file here, at the end of a run (the disk checkpoint has it all); a collective,
        so that no rank of the node is still writing one."""
        self.finish()
        if self.pstate.world_size > 1:
            dist.barrier(group=self._group)
        self._drop(lambda step: True)
        self._pool.shutdown()
        with contextlib.suppress(OSError):
            self.root.rmdir()  # once every rank's files are gone


def publish(final: Path, data: bytes) -> None:
    """Written under a temporary name, then renamed: a file that exists is whole."""
    tmp = final.with_name(f".{final.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, final)


def _under(tensors: dict, prefix: str) -> dict:
    """The tensors named `prefix`..., by the rest of their names."""
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
