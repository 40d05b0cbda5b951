"""A rank's share of the training state, described to torch.distributed.checkpoint (DCP).

megalite's parameters stay plain tensors; only here, at the checkpoint boundary, is each one
described as a `Piece`: a block of rows of this rank's TP slice, with the global tensor's shape
and the block's offsets in it. DCP writes every rank's pieces in parallel, records the chunks in
its metadata, and on load reads, for each piece a rank asks for, only the stored blocks that
overlap it: a checkpoint loads at any TP x CP x PP x DP layout and any zero stage.

Who writes what: each tensor of a TP slice (weight, optimizer state) is held by the slice's
replicas, the CP x DP ranks of the gradient group (MoE experts: those holding the same experts,
grads.replica_group) and, for GQA's KV heads, several TP ranks. Replica k of n writes rows
`row_range(rows, k, n)` (the rows the distributed optimizer gives it), split again between the TP ranks that hold the same slice
(a replicated tensor, GQA's KV heads), so every rank writes about its share; the last pipeline
stage's copy of a tied embedding writes nothing.
Pieces are cut into blocks of rows (`BLOCKS` per tensor at most), so that a reader wanting a
few rows of a tensor (a distributed optimizer at another DP size) reads little more than those.
"""
import dataclasses
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadPlan, SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megalite.parallel.sharding import full_shape, row_range, shard_of, split_of
from megalite.parallel.state import ParallelState
from megalite.training.grads import replica_rank
from megalite.training.optimizers.chained import ROWS
from megalite.training.optimizers.matrices import stacks_matrices
from megalite.typed_config import ConfigError

# DCP warns whenever it runs in one process, which tools and single-process runs mean to do.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")

BLOCKS = 32  # a reader of 1/8 of a tensor's rows reads at most 1/4 more than it needs
MIN_BLOCK_BYTES = 1 << 16  # smaller blocks cost more in per-item overhead than they save


@dataclass(frozen=True)
class Piece:
    """`tensor` holds the block of the global tensor `key` (of shape `shape`) at `offsets`."""
    key: str
    tensor: torch.Tensor
    shape: torch.Size
    offsets: tuple[int, ...]


def rows_piece(key: str, p: torch.Tensor, rows: torch.Tensor, first_row: int) -> Piece:
    """`rows`, which are rows `first_row`... of p's local tensor (its TP slice), placed in the
    global tensor."""
    offsets = [0] * p.dim()
    shard = split_of(p)
    if shard is not None:
        offsets[shard.dim] = shard.bounds(full_shape(p)[shard.dim])[0]
    offsets[0] += first_row
    return Piece(key, rows, full_shape(p), tuple(offsets))


def by_rows(p: torch.Tensor, split: str) -> bool:
    """Whether state of `split` for p holds p's rows along dim 0 (ROWS; MATRICES of stacked
    experts), so that a rank holds and writes the rows it steps; else it is whole."""
    return split == ROWS or stacks_matrices(p)


def state_piece(key: str, p: torch.Tensor, t: torch.Tensor, first_row: int, split: str) -> Piece:
    """Optimizer state `t` of p's rows `first_row`... (split as optimizers/chained.py says),
    placed in its global tensor: ROWS as p's rows; MATRICES, one entry per logical matrix,
    stacked experts' at their rows, other matrices whole (the same on each rank holding them:
    DCP writes one copy)."""
    rows = rows_piece(key, p, t, first_row)
    if split == ROWS:
        return rows
    if by_rows(p, split):
        return Piece(key, t, torch.Size((rows.shape[0], *t.shape[1:])), (rows.offsets[0],) + (0,) * (t.dim() - 1))
    return Piece(key, t, t.shape, (0,) * t.dim())


def written_pieces(model: torch.nn.Module, engine, pstate: ParallelState) -> Iterator[Piece]:
    """The weights and optimizer state this rank writes (see the module docstring).

    `engine.optimizer_state(p)` may be a collective (DeepSpeed's ZeRO gathers): it is asked for
    every parameter on every rank, in the same order."""
    for name, p in model.named_parameters():
        state = engine.optimizer_state(p)
        copies = pstate.tp_size // getattr(shard_of(p), "count", 1)
        held = engine.held_rows(p)
        start, stop = row_range(p.shape[0], *replica_rank(p, pstate))
        first, last = row_range(stop - start, pstate.tp_rank % copies, copies)  # TP copies split them
        start, stop = start + first, start + last
        if start == stop or getattr(p, "pipeline_copy", False):  # a tied embedding's last-stage copy
            continue
        # An engine holds all the rows, or (ZeRO-1) row_range's of its replica; a rank writing
        # rows it does not hold would save another rank's state as its own.
        if not held[0] <= start <= stop <= held[1]:
            raise RuntimeError(f"{name}: this rank writes rows {start}:{stop} but holds {held}")
        # AdamW's exp_avg..., Muon's momentum_buffer, Adafactor's factors
        splits = engine.states(p) if state else {}
        named = {f"model/{name}": (engine.master(p), ROWS),
                 **{f"optimizer/{name}.{k}": (t, splits[k]) for k, t in state.items()}}
        for key, (t, split) in named.items():
            if by_rows(p, split):
                t = t.narrow(0, start - held[0], stop - start)
            yield state_piece(key, p, t.detach(), start, split)


def blocks(piece: Piece) -> Iterator[Piece]:
    """The piece cut into blocks of whole rows."""
    row_bytes = piece.tensor[:1].numel() * piece.tensor.element_size()
    step = max(-(-piece.shape[0] // BLOCKS), -(-MIN_BLOCK_BYTES // max(row_bytes, 1)))
    for start in range(0, piece.tensor.shape[0], step):
        yield dataclasses.replace(piece, tensor=piece.tensor[start:start + step],
                                  offsets=(piece.offsets[0] + start, *piece.offsets[1:]))


def _chunk(p: Piece) -> ChunkStorageMetadata:
    """Where p's tensor sits in its global tensor, as DCP records it."""
    return ChunkStorageMetadata(offsets=torch.Size(p.offsets), sizes=p.tensor.shape)


class _SavePieces(DefaultSavePlanner):
    """DCP's default planner (global plan, deduplication, metadata, validation that the chunks
    cover every tensor), with this rank's items taken from its pieces instead of a state dict."""

    def __init__(self, pieces: list[Piece]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = {(p.key, p.offsets): p for p in pieces}

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan([WriteItem(index=MetadataIndex(p.key, p.offsets), type=WriteItemType.SHARD,
                                        tensor_data=TensorWriteData(
                                            chunk=_chunk(p), size=p.shape,
                                            properties=TensorProperties.create_from_tensor(p.tensor)))
                              for p in self.pieces.values()])
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return self.pieces[(write_item.index.fqn, tuple(write_item.index.offset))].tensor


class _LoadPieces(DefaultLoadPlanner):
    """Reads into each piece's tensor, in place, the parts of the stored chunks it overlaps."""

    def __init__(self, pieces: list[Piece]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = {p.key: p for p in pieces}

    def create_local_plan(self) -> LoadPlan:
        stored = self.metadata.state_dict_metadata
        requests = []
        for p in self.pieces.values():
            requests += create_read_items_for_chunk_list(p.key, stored[p.key], [_chunk(p)])
        self.plan = LoadPlan(requests)
        return self.plan

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.pieces[index.fqn].tensor


def read_metadata(path: Path) -> Metadata:
    """DCP's record of every stored block: it grows with the blocks of every rank, so it is
    read once per load."""
    return dcp.FileSystemReader(str(path)).read_metadata()


def save_pieces(pieces: list[Piece], path: Path, group) -> None:
    """Write this rank's pieces (CPU tensors of their own: `blocks` of pieces, copied, since a
    view would be written with its whole storage) into the DCP checkpoint at `path`: a
    collective over `group` (every rank calls it, with what it has); raises on every rank if
    any failed."""
    # The pieces are host copies already: the serial loader (no copy-ahead) makes no CUDA call.
    writer = dcp.FileSystemWriter(str(path), sync_files=True, per_thread_copy_ahead=0)
    dcp.save({}, storage_writer=writer, planner=_SavePieces(pieces), process_group=group,
             no_dist=not dist.is_initialized())


def load_pieces(pieces: list[Piece], path: Path, metadata: Metadata,
                one_process: bool = False) -> None:
    """Fill each piece's tensor from the DCP checkpoint at `path`, whose `read_metadata` is
    given: a collective when a process group exists and not `one_process` (every rank calls it,
    with what it needs). A piece the checkpoint lacks or holds in another shape is a
    ConfigError, raised before DCP (which would wrap it) on every rank alike."""
    stored = metadata.state_dict_metadata
    for p in pieces:
        md = stored.get(p.key)
        if not isinstance(md, TensorStorageMetadata):
            raise ConfigError(f"'{path}' lacks {p.key}: it was written for another model config")
        if md.size != p.shape:
            raise ConfigError(f"'{path}': {p.key} has shape {tuple(md.size)}, the model expects "
                              f"{tuple(p.shape)}")
    dcp.load({}, storage_reader=_KnownMetadata(str(path), metadata), planner=_LoadPieces(pieces),
             no_dist=one_process or not dist.is_initialized())


class _KnownMetadata(dcp.FileSystemReader):
    def __init__(self, path: str, metadata):
        super().__init__(path)
        self.known = metadata

    def read_metadata(self, *args, **kwargs):
        return self.known
