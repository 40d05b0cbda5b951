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

Not yet: a copy on a peer node (so that a node lost with its memory loses no snapshot), a
watchdog for a hung rank, DeepSpeed's engine, pure_bf16.
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
from safetensors.torch import load_file, save_file

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
    """This rank's snapshots in `root`: written in a background thread, found and loaded at
    start."""

    def __init__(self, root: Path, pstate: ParallelState, identity: dict):
        """identity: what must match for a file to be this run's (layout, config, data)."""
        self.root, self.pstate = root, pstate
        self.identity = json.loads(json.dumps(identity))  # as a file's header gives it back
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="snapshot")
        self._pending: tuple[Future, int] | None = None
        self._written = self._complete = 0
        root.mkdir(parents=True, exist_ok=True)

    def path(self, step: int) -> Path:
        return self.root / f"step_{step:08d}.rank_{self.pstate.rank}.safetensors"

    def mine(self) -> list[int]:
        """The steps of this rank's whole files."""
        steps = []
        for f in self.root.iterdir():
            m = FILE.match(f.name)
            if m and int(m[2]) == self.pstate.rank:
                steps.append(int(m[1]))
        return sorted(steps)

    def newest_complete(self) -> int | None:
        """The newest step every rank has a file of (a collective); None: no such step."""
        steps = [s for s in self.mine() if self._matches(s)]
        everyone = [steps]
        if self.pstate.world_size > 1:
            everyone = [None] * self.pstate.world_size
            dist.all_gather_object(everyone, steps)
        common = set(everyone[0]).intersection(*everyone[1:])
        return max(common) if common else None

    def _matches(self, step: int) -> bool:
        try:
            with open(self.path(step), "rb") as f:  # safetensors' header: 8 bytes of length, JSON
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        except (OSError, ValueError):
            return False
        return json.loads(header.get("__metadata__", {}).get("identity", "null")) == self.identity

    def save(self, step: int, model: torch.nn.Module, engine, rng: dict, counters: dict) -> str:
        """Stage this rank's state on the host now and write it in the background; what it
        cost, in a line. A collective: the ranks first agree on the newest complete snapshot,
        and each drops its older files."""
        self.finish()
        written = torch.tensor(float(self._written), dtype=torch.float64, device=self.pstate.device)
        if self.pstate.world_size > 1:
            dist.all_reduce(written, op=dist.ReduceOp.MIN)
        self._complete = int(written.item())
        for old in self.mine():
            if old < self._complete:
                self.path(old).unlink(missing_ok=True)
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
        final = self.path(step)
        tmp = final.with_name(f".{final.name}.tmp")
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, final)

    def finish(self) -> None:
        """Wait for the write in flight (its error, a full memory say, is raised here)."""
        if self._pending is not None:
            (future, step), self._pending = self._pending, None
            future.result()
            self._written = step

    def load(self, step: int, model: torch.nn.Module, engine) -> tuple[dict, dict]:
        """This rank's state of `step` into the model and engine; (rng, counters)."""
        f = self.path(step)
        tensors = load_file(f)
        with open(f, "rb") as h:
            header = json.loads(h.read(int.from_bytes(h.read(8), "little")))
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
        engine.load_optimizer_state(pairs, step)
        rng = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("rng/")}
        return rng, json.loads(header["__metadata__"]["counters"])

    def clear(self) -> None:
        """This rank's files, at the end of a run (the disk checkpoint has it all)."""
        self.finish()
        for step in self.mine():
            self.path(step).unlink(missing_ok=True)
        self._pool.shutdown()
        try:
            self.root.rmdir()  # once every rank's files are gone
        except OSError:
            pass
