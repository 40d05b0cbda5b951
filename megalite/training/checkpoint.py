"""Atomic, sharded, layout-independent checkpoints.

    RUN_DIR/checkpoints/step_00000012/
        .metadata, __<rank>_0.distcp   torch.distributed.checkpoint (DCP): "model/<name>" and
                                "optimizer/<name>.<state>" (AdamW's exp_avg and exp_avg_sq,
                                Muon's momentum_buffer), each rank's blocks
        rng/rank_<r>.safetensors  every rank's generator states
        meta.json               step, layout, config; written last

Every rank writes only its share of the state (sharded_state.py says who writes which rows),
in parallel, and reads back only the blocks its slices overlap, so a checkpoint loads at any
TP x CP x PP x DP layout, either engine, any zero stage. The directory is written under a
hidden temporary name, fsynced, and renamed into place only when complete: a crash mid-save
leaves the previous checkpoints untouched, and `latest_checkpoint` never sees the half-written
one. `CheckpointWriter` writes the files in a background thread while training continues.

Checkpoints written before this format (model.safetensors + optimizer.safetensors, whole
tensors) still load: `load_checkpoint` and `read_optimizer_state` read them as before.
"""
import errno
import json
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from safetensors import safe_open
from safetensors.torch import load_file, save

from megalite.data.tokenizer import TokenizerInfo, save_tokenizer
from megalite.parallel.sharding import full_shape, local_slice, split_of
from megalite.parallel.state import ParallelState
from megalite.failures import CheckpointError
from megalite.training.optimizers.chained import ADAMW_STATE, ROWS
from megalite.training.sharded_state import (Piece, blocks, load_pieces, read_metadata, rows_piece,
                                             save_pieces, state_piece, written_pieces, by_rows)
from megalite.training.checkpoint_dirs import _step_dirs, not_a_checkpoint
from megalite.typed_config import ConfigError


def _agree(error: BaseException | None, pstate: ParallelState, what: str, where: Path) -> None:
    """A barrier that also tells every rank which rank failed its part and why, so that a rank
    whose disk is full does not leave the others waiting for it until the timeout, and each
    says the same thing."""
    told = pstate.gather_over_ranks(_described(error, where) if error is not None else "")
    for rank, said in enumerate(told):
        if said:  # the first rank that failed
            raise CheckpointError(f"{what} into '{where}' failed on rank {rank}: {said}; the previous "
                                  f"checkpoints are intact") from error


def _described(error: BaseException, where: Path) -> str:
    """The error, and where the disk is full, that (torch's zip writer says only "unexpected
    pos" when a write falls short)."""
    text = str(error) or type(error).__name__
    existing = next((p for p in (where, *where.parents) if p.exists()), None)
    free = shutil.disk_usage(existing).free if existing is not None else None
    if (isinstance(error, OSError) and error.errno == errno.ENOSPC) or (free is not None and free < 1 << 20):
        text += (f" (the disk is full: {free / 2**20:.1f} MiB free there; free some space, or "
                 f"give a run.dir on a disk with room)")
    return text


@contextmanager
def _agreed(pstate: ParallelState, what: str, where: Path):
    """The block's error, if any, told to every rank and raised on each (`_agree`)."""
    error = None
    try:
        yield
    except Exception as err:  # reported to every rank by _agree, then raised
        error = err
    _agree(error, pstate, what, where)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointWriter:
    """Saves checkpoints while training goes on: what needs the training's process group or the
    device (creating the directory, the engine's state, the copy to host memory, each rank's RNG
    file) runs in the caller's thread, on every rank in the same order; every rank then writes
    its share (DCP, over a process group of the writer's own) in a background thread, after
    which rank 0 writes meta.json and renames the directory into place.

    Whether every rank succeeded is agreed (a collective) by `finish`, which the next `save`
    calls first: one save is in flight at most, and a failure is raised on every rank at
    the latest one save later. Call `finish` before the process exits with its status, so the
    last checkpoint is complete and agreed. Leaving the `with` waits for the write in flight
    without agreeing (after an error, other ranks may be gone).

    The host copies (pinned on CUDA, from which the device copies asynchronously) are kept for
    the next save: on each rank, the size of the share it writes.
    """

    def __init__(self, pstate: ParallelState):
        self.pstate = pstate
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megalite-checkpoint")
        self._pending: tuple[Future | None, str] | None = None
        self._host: dict[tuple, torch.Tensor] = {}
        # DCP's collectives run in the writing thread while training runs collectives of its
        # own: they get a group of their own, on gloo (DCP exchanges Python objects).
        self._group = (dist.new_group(backend="gloo", timeout=pstate.timeout)
                       if dist.is_initialized() else None)

    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown(wait=True)

    def save(self, run_dir: Path, step: int, model: torch.nn.Module, engine,
             rng_state: dict[str, torch.Tensor], meta: dict, keep: int,
             tokenizer: TokenizerInfo | None = None) -> Path:
        """Start saving; return the directory the checkpoint will have once written.

        `engine`: the weights and optimizer state (`held_rows`, `master`, `optimizer_state`:
        see training/engine.py). `engine.optimizer_state` may be a
        collective (DeepSpeed's ZeRO), so every rank saves every parameter in the same order.
        `tokenizer`: stored in (with its special tokens named), so the checkpoint is self-contained."""
        self.finish()
        pstate = self.pstate
        root = Path(run_dir) / "checkpoints"
        final, tmp = root / f"step_{step:08d}", root / f".tmp_step_{step:08d}"
        what = f"writing checkpoint step {step}"

        with _agreed(pstate, "creating the checkpoint directory", tmp):
            if pstate.is_main:
                for stale in root.glob(".tmp_step_*"):  # left by a save that was killed
                    shutil.rmtree(stale)
                (tmp / "rng").mkdir(parents=True)

        # Small, and every rank's own: written and agreed here, so that rank 0 can publish
        # the checkpoint from its thread without asking the other ranks again.
        with _agreed(pstate, what, tmp):
            rng_file = tmp / "rng" / f"rank_{pstate.rank}.safetensors"
            # Not safetensors' save_file: it creates the file 0600, unreadable to colleagues.
            rng_file.write_bytes(save({k: v.cpu() for k, v in rng_state.items()}))
            _fsync(rng_file)

        with _agreed(pstate, what, tmp):
            pieces = [Piece(b.key, self._to_host((b.key, b.offsets), b.tensor), b.shape, b.offsets)
                      for piece in written_pieces(model, engine, pstate) for b in blocks(piece)]
        copied = torch.cuda.current_stream().record_event() if pstate.device.type == "cuda" else None

        def write_and_publish():
            if copied is not None:
                torch.cuda.set_device(pstate.device)  # per thread: else DCP's calls go to GPU 0
                copied.synchronize()
            try:
                save_pieces(pieces, tmp, self._group)
            except CheckpointException as err:  # raised by DCP on every rank
                own = err.failures.get(pstate.rank)
                if own is None:
                    return  # another rank's: `finish` agrees on it
                raise own[0] if isinstance(own, tuple) else own
            if pstate.is_main:  # every rank's share is written once DCP's save returns
                _publish(tmp, final, {**meta, "step": step}, keep, tokenizer)
        self._pending = (self._pool.submit(write_and_publish), what, tmp)
        return final

    def finish(self) -> None:
        """Wait for the save in flight, if any, and raise CheckpointError on every rank if it
        failed on one (a collective: every rank calls it at the same point)."""
        if self._pending is None:
            return
        (future, what, where), self._pending = self._pending, None
        _agree(future.exception(), self.pstate, what, where)

    def _to_host(self, key: tuple, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of `tensor` that training cannot change (a CPU parameter is updated in
        place) in a buffer kept from the previous save when it fits."""
        cuda = tensor.device.type == "cuda"
        buffer = self._host.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self._host[key] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=cuda)
        return buffer.copy_(tensor, non_blocking=cuda)


def _publish(tmp: Path, final: Path, meta: dict, keep: int, tokenizer: TokenizerInfo | None) -> None:
    """meta.json last, everything fsynced, then the rename; older checkpoints pruned only once
    the new one is in place."""
    if tokenizer is not None:
        save_tokenizer(tokenizer, tmp)
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    for written in (tmp / "meta.json", tmp / "rng", tmp):
        _fsync(written)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(final.parent)
    # The newest `keep` by step; the run refuses to start below a later checkpoint
    # (run_setup.find_resume), so the one just written is among them.
    for old in _step_dirs(final.parent)[:-keep]:
        shutil.rmtree(old)


def layout_of(pstate: ParallelState) -> dict[str, int]:
    """The layout a checkpoint records: its RNG files are only reloaded at the same one."""
    cp = {"cp": pstate.cp_size} if pstate.cp_size > 1 else {}  # older checkpoints have no cp
    return {"tp": pstate.tp_size, "dp": pstate.dp_size, "pp": pstate.pp_size, **cp}


def _whole_tensors(path: Path) -> bool:
    """Written before sharded checkpoints: whole tensors in model.safetensors."""
    return (path / "model.safetensors").is_file()


def load_checkpoint(path: Path, model: torch.nn.Module,
                    pstate: ParallelState) -> tuple[dict, dict[str, torch.Tensor] | None]:
    """Load weights into this rank's slices (a collective: every rank calls it); return (meta,
    this rank's RNG state, or None when the checkpoint was written with another layout).
    `read_optimizer_state` reads the optimizer state."""
    path = Path(path)
    if wrong := not_a_checkpoint(path):
        raise ConfigError(wrong)
    meta = json.loads((path / "meta.json").read_text())
    if _whole_tensors(path):
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            load_full_weights(f, model, str(path))
    else:
        with torch.no_grad():
            # Each parameter's whole TP slice, loaded in place.
            load_pieces([rows_piece(f"model/{name}", p, p.data, 0) for name, p in model.named_parameters()],
                        path, read_metadata(path))
    rng_file = path / "rng" / f"rank_{pstate.rank}.safetensors"
    same_layout = meta.get("layout") == layout_of(pstate)
    return meta, (load_file(rng_file) if same_layout and rng_file.is_file() else None)


class CheckpointTensors:
    """A checkpoint's weights (part="model", by parameter name) or optimizer state
    ("optimizer", by "<name>.exp_avg"...), whole, one tensor at a time, in this one process: for
    tools (export), tests and a resume from the whole-tensor format. The sharded format through
    DCP, its metadata read once; the whole-tensor one through safetensors, opened for each
    tensor (a tensor is a view of the file's mapping, whose pages leave this process's memory
    with it)."""

    def __init__(self, path: Path, part: str = "model"):
        self.path, self.part = Path(path), part
        self.dcp = None if _whole_tensors(self.path) else read_metadata(self.path)  # its DCP metadata
        if self.dcp is None:
            with self._open() as f:
                self.shapes = {k: torch.Size(f.get_slice(k).get_shape()) for k in f.keys()}
        else:
            self.shapes = {k.removeprefix(f"{part}/"): md.size
                           for k, md in self.dcp.state_dict_metadata.items() if k.startswith(f"{part}/")}

    def _open(self):
        return safe_open(str(self.path / f"{self.part}.safetensors"), framework="pt")

    def shape(self, name: str) -> torch.Size:
        if name not in self.shapes:
            raise ConfigError(f"'{self.path}' lacks {name}: it does not hold the model its "
                              f"meta.json describes")
        return self.shapes[name]

    def read(self, name: str) -> torch.Tensor:
        if self.dcp is None:
            with self._open() as f:
                return f.get_tensor(name)
        key = f"{self.part}/{name}"
        md = self.dcp.state_dict_metadata[key]
        whole = Piece(key, torch.empty(md.size, dtype=md.properties.dtype), md.size, (0,) * len(md.size))
        load_pieces([whole], self.path, self.dcp, one_process=True)  # no process group's
        return whole.tensor


def load_full_weights(tensors, model: torch.nn.Module, source: str) -> None:
    """Copy this rank's slice of each full tensor into the model, one tensor at a time.
    `tensors`: a dict of full tensors, or anything with `keys()` and `get_slice(name)` as an open
    safetensors file has (or hf/layout.MegaliteView): then only this rank's slice is read."""
    params = dict(model.named_parameters())
    if missing := sorted(set(params) - set(tensors.keys())):
        raise ConfigError(f"'{source}' lacks parameters {missing[:4]}: it was written for "
                          f"another model config")
    sliced = hasattr(tensors, "get_slice")
    with torch.no_grad():
        for name, p in params.items():
            full = tensors.get_slice(name) if sliced else tensors[name]
            shape = torch.Size(full.get_shape()) if sliced else full.shape
            if shape != full_shape(p):
                raise ConfigError(f"'{source}': {name} has shape {tuple(shape)}, the model "
                                  f"expects {tuple(full_shape(p))}")
            # A tensor's and a safetensors slice's indexing alike: only the slice is read.
            index = [slice(None)] * len(shape)
            shard = split_of(p)
            if shard is not None:
                index[shard.dim] = slice(*shard.bounds(shape[shard.dim]))
            p.copy_(full[tuple(index)])


def read_optimizer_state(path: Path, model: torch.nn.Module, held_rows: Callable,
                         states: Callable) -> list[tuple[torch.nn.Parameter, dict]]:
    """(parameter, {name: this rank's part, as `states(p)` splits it: ROWS, rows `held_rows(p)`
    of this rank's slice}) for each parameter with stored optimizer state (none in an imported
    checkpoint), whose names must be those of `states(p)`; a collective, as `load_checkpoint`."""
    path = Path(path)
    if _whole_tensors(path):
        return list(_read_whole_state(path, model, held_rows, states))
    metadata = read_metadata(path)
    saved: dict[str, set[str]] = {}  # the state names stored for each parameter
    for key in metadata.state_dict_metadata:
        if key.startswith("optimizer/"):
            name, _, state = key.removeprefix("optimizer/").rpartition(".")
            saved.setdefault(name, set()).add(state)
    # Zeroed fp32 tensors of this rank's part, filled in place; state of other names (another
    # optimizer's) is a ConfigError.
    wanted = []
    for name, p in model.named_parameters():
        if name in saved:
            check_state_names(str(path), name, saved[name], states(p))
            start, stop = held_rows(p)
            pieces = {}
            for m, split in states(p).items():
                key = f"optimizer/{name}.{m}"
                stored = metadata.state_dict_metadata[key].size
                rows = (stop - start, *(p.shape if split == ROWS else stored)[1:])
                shape = rows if by_rows(p, split) else stored
                zeros = torch.zeros(shape, dtype=torch.float32, device=p.device)
                pieces[m] = state_piece(key, p, zeros, start, split)
            wanted.append((p, pieces))
    load_pieces([piece for _, pieces in wanted for piece in pieces.values()], path, metadata)
    return [(p, {m: piece.tensor for m, piece in pieces.items()}) for p, pieces in wanted]


def check_state_names(source: str, name: str, saved: set[str], names: tuple[str, ...]) -> None:
    """The state a checkpoint holds for parameter `name` is the state this run's optimizer keeps
    for it, or a ConfigError naming both."""
    if saved != set(names):
        raise ConfigError(
            f"'{source}' holds optimizer state {sorted(saved)} for {name}, where this run's "
            f"optimizer keeps {list(names)}: it was saved by another train.optimizer. Resume with "
            f"that optimizer, or set train.load_optimizer=false to load the weights alone")


def _read_whole_state(path: Path, model, held_rows: Callable, states: Callable) -> Iterator[tuple]:
    """The format before sharded checkpoints, written by AdamW alone."""
    stored = CheckpointTensors(path, "optimizer")
    for name, p in model.named_parameters():
        if f"{name}.exp_avg" in stored.shapes:
            check_state_names(str(path), name, set(ADAMW_STATE), states(p))
            start, stop = held_rows(p)
            # A copy: a view would keep the whole tensor alive in the optimizer's state.
            yield p, {m: local_slice(stored.read(f"{name}.{m}"), p)[start:stop].to(p.device, copy=True)
                      for m in states(p)}
