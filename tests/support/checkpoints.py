"""Checkpoint helpers the tests share: a model's state without an optimizer, a save that waits
until the checkpoint is complete, and a checkpoint's tensors read whole."""
import errno
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.filesystem as dcp_files

from megalite.data.tokenizer import TokenizerInfo
from megalite.parallel.state import ParallelState
from megalite.training.checkpoint import CheckpointTensors, CheckpointWriter


class WeightsOnly:
    """The state of a model without an optimizer (an import, a test), as an engine gives it."""

    def held_rows(self, p: torch.nn.Parameter) -> tuple[int, int]:
        return 0, p.shape[0]

    def master(self, p: torch.nn.Parameter) -> torch.Tensor:
        return p

    def optimizer_state(self, p: torch.nn.Parameter) -> dict[str, torch.Tensor]:
        return {}



def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, engine,
                    rng_state: dict[str, torch.Tensor], meta: dict, pstate: ParallelState,
                    keep: int, tokenizer: TokenizerInfo | None = None) -> Path:
    """Save and wait until the checkpoint is complete on disk (see `CheckpointWriter.save`)."""
    with CheckpointWriter(pstate) as writer:
        path = writer.save(run_dir, step, model, engine, rng_state, meta, keep, tokenizer)
        writer.finish()
    return path



def read_whole_state(path: Path, part: str = "model") -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's `part` whole (see CheckpointTensors)."""
    tensors = CheckpointTensors(path, part)
    return {name: tensors.read(name) for name in tensors.shapes}


def fill_disk_of_rank_0(full) -> None:
    """From now on, rank 0's checkpoint writes of the tensors whose key `full(key)` fail as on
    a full disk (in DCP's writer, where the bytes go to the file)."""
    original = dcp_files._write_item

    def write_item(transforms, stream, data, item, *args):
        if dist.get_rank() == 0 and full(item.index.fqn):
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(transforms, stream, data, item, *args)
    dcp_files._write_item = write_item
