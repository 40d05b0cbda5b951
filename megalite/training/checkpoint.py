"""Atomic, layout-independent checkpoints.

    RUN_DIR/checkpoints/step_00000012/
        model.safetensors       full (unsharded) tensors by parameter name
        optimizer.safetensors   full Adam moments, "<name>.exp_avg" / "<name>.exp_avg_sq"
        rng/rank_<r>.safetensors  every rank's generator states
        meta.json               step, layout, config; written last

Tensors are stored whole, gathered over TP one parameter at a time, so a checkpoint does not
depend on the TP x DP layout it was written with; loading reads one tensor at a time and keeps
this rank's slice. Nor does it depend on the engine (native or DeepSpeed ZeRO) that wrote
it. The directory is written under a hidden temporary name, fsynced, and renamed
into place only when complete: a crash mid-save leaves the previous checkpoints untouched, and
`latest_checkpoint` never sees the half-written one. `CheckpointWriter` writes the files in a
background thread while training continues.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from megalite.parallel.sharding import full_shape, gather_full, local_slice, shard_of
from megalite.parallel.state import ParallelState
from megalite.typed_config import ConfigError

STEP_DIR = re.compile(r"^step_(\d{8})$")
MOMENTS = ("exp_avg", "exp_avg_sq")
Moments = Callable[[torch.nn.Parameter], dict[str, torch.Tensor]]
Weight = Callable[[torch.nn.Parameter], torch.Tensor]


class CheckpointError(RuntimeError):
    """A save failed on some rank (a full disk, say); every rank raises it together."""


def _agree(error: BaseException | None, pstate: ParallelState, what: str) -> None:
    """A barrier that also tells every rank whether any rank failed its part, so that a rank
    whose disk is full does not leave the others waiting for it until the timeout."""
    failed = torch.tensor([0.0 if error is None else 1.0], device=pstate.device)
    if pstate.world_size > 1:
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if error is not None:
        raise CheckpointError(f"{what} failed on rank {pstate.rank}: {error}") from error
    if failed.item():
        raise CheckpointError(f"{what} failed on another rank; the previous checkpoints are intact")


def _attempt(action) -> BaseException | None:
    try:
        action()
    except Exception as err:  # reported to every rank by _agree, then raised
        return err
    return None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _step_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("step_*") if STEP_DIR.match(p.name))


def checkpoint_step(path: Path) -> int:
    return int(STEP_DIR.match(Path(path).name).group(1))


def latest_checkpoint(run_dir: Path) -> Path | None:
    done = [p for p in _step_dirs(Path(run_dir) / "checkpoints") if (p / "meta.json").is_file()]
    return done[-1] if done else None


def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, moments: Moments,
                    rng_state: dict[str, torch.Tensor], meta: dict, pstate: ParallelState,
                    keep: int, tokenizer: Path | None = None, weight: Weight = lambda p: p) -> Path:
    """Save and wait until the checkpoint is complete on disk (see `CheckpointWriter.save`)."""
    with CheckpointWriter(pstate) as writer:
        path = writer.save(run_dir, step, model, moments, rng_state, meta, keep, tokenizer, weight)
        writer.finish()
    return path


class CheckpointWriter:
    """Saves checkpoints while training goes on: what needs the process group or the device
    (creating the directory, the gathers over TP, the copy to host memory, each rank's RNG
    file) runs in the caller's thread, on every rank in the same order; rank 0 writes the
    tensor files, meta.json and the rename in a background thread.

    Whether every rank succeeded is agreed (a collective) by `finish`, which the next `save`
    calls first: one save is in flight at most, and a failure is raised on every rank at
    the latest one save later. Call `finish` before the process exits with its status, so the
    last checkpoint is complete and agreed. Leaving the `with` waits for the write in flight
    without agreeing (after an error, other ranks may be gone).

    The host copies (pinned on CUDA, from which the device copies asynchronously) are kept for
    the next save: on rank 0, the size of the full weights and Adam moments.
    """

    def __init__(self, pstate: ParallelState):
        self.pstate = pstate
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megalite-checkpoint")
        self._pending: tuple[Future | None, str] | None = None
        self._host: dict[str, torch.Tensor] = {}

    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown(wait=True)

    def save(self, run_dir: Path, step: int, model: torch.nn.Module, moments: Moments,
             rng_state: dict[str, torch.Tensor], meta: dict, keep: int,
             tokenizer: Path | None = None, weight: Weight = lambda p: p) -> Path:
        """Start saving; return the directory the checkpoint will have once written.

        `moments(p)`: this rank's slice of each Adam moment of p (the engine's `moments`; it
        may be a collective, so every rank asks for every parameter in the same order).
        `tokenizer`: its tokenizer.json is copied in, so the checkpoint is self-contained.
        `weight(p)`: the value saved for p (the engine's `master`: the fp32 master weight of a
        bf16 parameter under train.precision=pure_bf16, else p itself)."""
        self.finish()
        pstate = self.pstate
        root = Path(run_dir) / "checkpoints"
        final, tmp = root / f"step_{step:08d}", root / f".tmp_step_{step:08d}"
        what = f"writing checkpoint step {step}"

        def start():
            for stale in root.glob(".tmp_step_*"):  # left by a save that was killed
                shutil.rmtree(stale)
            (tmp / "rng").mkdir(parents=True)
        _agree(_attempt(start) if pstate.is_main else None, pstate, "creating the checkpoint directory")

        # Small, and every rank's own: written and agreed here, so that rank 0 can publish
        # the checkpoint from its thread without asking the other ranks again.
        def write_rng():
            rng_file = tmp / "rng" / f"rank_{pstate.rank}.safetensors"
            save_file({k: v.cpu() for k, v in rng_state.items()}, str(rng_file))
            _fsync(rng_file)
        _agree(_attempt(write_rng), pstate, what)

        # The gathers are collectives: every rank takes its part, here, in the same order.
        files = {"model": {}, "optimizer": {}}
        for file, name, tensor in _gather_full_state(model, moments, weight, pstate):
            files[file][name] = self._to_host(f"{file}/{name}", tensor)
        copied = None
        if pstate.device.type == "cuda":
            copied = torch.cuda.Event()
            copied.record()

        def write_and_publish():
            if copied is not None:
                copied.synchronize()
            for file, tensors in files.items():
                save_file(tensors, str(tmp / f"{file}.safetensors"))
                _fsync(tmp / f"{file}.safetensors")
            _publish(tmp, final, {**meta, "step": step}, keep, tokenizer)
        future = self._pool.submit(write_and_publish) if pstate.is_main else None
        self._pending = (future, what)
        return final

    def finish(self) -> None:
        """Wait for the save in flight, if any, and raise CheckpointError on every rank if it
        failed on one (a collective: every rank calls it at the same point)."""
        if self._pending is None:
            return
        (future, what), self._pending = self._pending, None
        _agree(None if future is None else future.exception(), self.pstate, what)

    def _to_host(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of `tensor` that training cannot change (a CPU parameter is updated in
        place) in a buffer kept from the previous save when it fits."""
        cuda = tensor.device.type == "cuda"
        buffer = self._host.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self._host[key] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=cuda)
        return buffer.copy_(tensor, non_blocking=cuda)


def _publish(tmp: Path, final: Path, meta: dict, keep: int, tokenizer: Path | None) -> None:
    """meta.json last, everything fsynced, then the rename; older checkpoints pruned only once
    the new one is in place."""
    root = final.parent
    if tokenizer is not None:
        shutil.copy(tokenizer, tmp / "tokenizer.json")
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    _fsync(tmp / "meta.json")
    _fsync(tmp / "rng")
    _fsync(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(root)
    # The newest `keep` by step; the run refuses to start below a later checkpoint
    # (see train.check_run_dir), so the one just written is among them.
    for old in _step_dirs(root)[:-keep]:
        shutil.rmtree(old)


def _gather_full_state(model, moments: Moments, weight: Weight,
                       pstate) -> Iterator[tuple[str, str, torch.Tensor]]:
    """("model" | "optimizer", name, full tensor) on rank 0, after every rank took its part in
    each gather. Pipeline stages hold different parameters: each stage's first rank streams its
    full tensors to rank 0, stage after stage."""
    stage = _gather_stage(model, moments, weight, pstate)
    if pstate.pp_size == 1 or pstate.pp_rank == 0:
        yield from stage
    streams = pstate.dp_rank == 0 and pstate.cp_rank == 0 and pstate.tp_rank == 0
    if pstate.pp_rank > 0 and streams:
        for item in stage:
            _send_item(item, 0, pstate)
        _send_item(None, 0, pstate)
    elif pstate.pp_rank > 0:
        for _ in stage:  # the TP gathers
            pass
    if pstate.is_main:
        for s in range(1, pstate.pp_size):
            while (item := _recv_item(pstate.stage_rank(s), pstate)) is not None:
                yield item


def _send_item(item, peer: int, pstate) -> None:
    """(file, name, tensor) to `peer`: a header, then the tensor; None ends the stream."""
    header = None if item is None else (item[0], item[1], tuple(item[2].shape), item[2].dtype)
    dist.send_object_list([header], peer, device=pstate.device)
    if item is not None:
        dist.send(item[2].contiguous(), peer)


def _recv_item(peer: int, pstate):
    header = [None]
    dist.recv_object_list(header, peer, device=pstate.device)
    if header[0] is None:
        return None
    file, name, shape, dtype = header[0]
    tensor = torch.empty(shape, dtype=dtype, device=pstate.device)
    dist.recv(tensor, peer)
    return file, name, tensor


def _gather_stage(model, moments: Moments, weight: Weight,
                  pstate) -> Iterator[tuple[str, str, torch.Tensor]]:
    """This stage's full tensors, on its rank of TP, CP and DP rank 0."""
    for name, p in model.named_parameters():
        local = moments(p)  # on every rank: it may be a collective over DP (ZeRO)
        if pstate.dp_rank != 0 or pstate.cp_rank != 0 or getattr(p, "pipeline_copy", False):
            # DP and CP replicas hold the same: one TP group gathers; a tied embedding's copy
            # on the last stage equals the first stage's.
            continue
        shard = shard_of(p)
        full = gather_full(weight(p).detach(), shard, pstate)
        gathered = {m: gather_full(t, shard, pstate) for m, t in local.items()}
        if pstate.tp_rank == 0:
            yield "model", name, full
            for m, t in gathered.items():
                yield "optimizer", f"{name}.{m}", t


def layout_of(pstate: ParallelState) -> dict[str, int]:
    """The layout a checkpoint records: its RNG files are only reloaded at the same one."""
    cp = {"cp": pstate.cp_size} if pstate.cp_size > 1 else {}  # older checkpoints have no cp
    return {"tp": pstate.tp_size, "dp": pstate.dp_size, "pp": pstate.pp_size, **cp}


def load_checkpoint(path: Path, model: torch.nn.Module,
                    pstate: ParallelState) -> tuple[dict, dict[str, torch.Tensor] | None]:
    """Load weights into this rank's slices; return (meta, this rank's RNG state, or None when
    the checkpoint was written with another layout). `read_moments` reads the optimizer state."""
    path = Path(path)
    if not (path / "meta.json").is_file():
        raise ConfigError(f"checkpoint '{path}' is incomplete or missing (no meta.json): "
                          f"use train.resume=auto to pick the latest complete one")
    meta = json.loads((path / "meta.json").read_text())
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        load_full_weights(f, model, str(path))
    rng_file = path / "rng" / f"rank_{pstate.rank}.safetensors"
    same_layout = meta.get("layout") == layout_of(pstate)
    rng = None
    if same_layout and rng_file.is_file():
        with safe_open(str(rng_file), framework="pt") as f:
            rng = {k: f.get_tensor(k) for k in f.keys()}
    return meta, rng


def load_full_weights(tensors, model: torch.nn.Module, source: str) -> None:
    """Copy this rank's slice of each full tensor into the model, one tensor at a time.
    `tensors`: a dict or an open safetensors file (read lazily, tensor by tensor)."""
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(tensors.keys()))
    if missing:
        raise ConfigError(f"'{source}' lacks parameters {missing[:4]}: it was written for "
                          f"another model config")
    with torch.no_grad():
        for name, p in params.items():
            full = tensors.get_tensor(name) if hasattr(tensors, "get_tensor") else tensors[name]
            if full.shape != full_shape(p):
                raise ConfigError(f"'{source}': {name} has shape {tuple(full.shape)}, the model "
                                  f"expects {tuple(full_shape(p))}")
            p.copy_(local_slice(full, p))


def read_moments(path: Path, model: torch.nn.Module) -> Iterator[tuple[torch.nn.Parameter, dict]]:
    """(parameter, {moment: this rank's slice}) for each parameter with stored Adam moments,
    read one tensor at a time."""
    with safe_open(str(Path(path) / "optimizer.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        for name, p in model.named_parameters():
            if f"{name}.{MOMENTS[0]}" in keys:
                yield p, {m: local_slice(f.get_tensor(f"{name}.{m}"), p).to(p.device) for m in MOMENTS}
