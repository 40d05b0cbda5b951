"""Each megalite tensor described in terms of Hugging Face tensors: one recipe per architecture,
read in both directions, whole or by slices.

A recipe maps a megalite parameter name to its `Rows`, top to bottom: the megalite tensor is
those rows of Hugging Face tensors stacked along dim 0. The layouts this covers:
- vocabulary padding: megalite pads the embedding/head rows to a multiple; the padding rows are
  zeros (`Rows(None, ...)`), never exported;
- MoE experts: megalite stacks them, [experts, out, in]; Hugging Face keeps one tensor each;
- K and V: megalite's kv_proj interleaves them per KV head, [k_0; v_0; k_1; v_1; ...], so that a
  contiguous TP split gives each rank whole (k, v) pairs; Hugging Face keeps K and V apart, or
  (GPT-2) fuses Q, K and V side by side: each head's K (V) is a range of rows (columns) there;
- GPT-2's Conv1D stores [in, out], the transpose of nn.Linear: megalite's rows are its columns.

`MegaliteView` reads megalite tensors out of Hugging Face tensors, any rectangle of one
(a TP slice) reading only the parts of the Hugging Face tensors it covers; `HFPlan` writes Hugging
Face tensors from whole megalite tensors. Both follow the same recipe.
"""
from dataclasses import dataclass
from typing import Callable

import torch

from megalite.hf.stream import HFFiles
from megalite.typed_config import ConfigError


@dataclass(frozen=True)
class Rows:
    """Rows start:stop of Hugging Face tensor `name` (its columns when `transposed`: megalite's
    [out, in] stored as [in, out]); `name` None: stop - start rows of zeros. `stacked`: the
    whole tensor is one row of megalite's (an expert's matrix in a stack of experts; 0:1)."""
    name: str | None
    start: int
    stop: int
    transposed: bool = False
    stacked: bool = False

    @property
    def count(self) -> int:
        return self.stop - self.start


Recipe = dict[str, tuple[Rows, ...]]


def whole(name: str, rows: int, transposed: bool = False) -> tuple[Rows, ...]:
    return (Rows(name, 0, rows, transposed),)


def padded(name: str, rows: int, padded_rows: int) -> tuple[Rows, ...]:
    """Zero rows up to `padded_rows`: padded vocab rows get -inf logits, so their values never
    matter."""
    return (Rows(name, 0, rows),) + ((Rows(None, rows, padded_rows),) if padded_rows > rows else ())


def kv_interleaved(k: str, v: str, kv_heads: int, head_dim: int, k_start: int = 0,
                   v_start: int = 0, transposed: bool = False) -> tuple[Rows, ...]:
    """megalite's [k_0; v_0; k_1; v_1; ...] from K at rows k_start... of `k` and V at rows
    v_start... of `v` (the same tensor, at other offsets, for GPT-2's c_attn)."""
    return tuple(Rows(name, start + h * head_dim, start + (h + 1) * head_dim, transposed)
                 for h in range(kv_heads) for name, start in ((k, k_start), (v, v_start)))


def hf_extents(recipe: Recipe) -> dict[str, tuple[int, int]]:
    """(axis, length along it) of each Hugging Face tensor that the recipe reads (none for a
    stacked one: all of it): the axis its rows run along, 1 where they are transposed."""
    out: dict[str, tuple[int, int]] = {}
    for parts in recipe.values():
        for part in parts:
            if part.name is not None and not part.stacked:
                axis, length = out.get(part.name, (int(part.transposed), 0))
                out[part.name] = (axis, max(length, part.stop))
    return out


class MegaliteView:
    """The megalite tensors of a recipe over Hugging Face files, read lazily. It looks like an open
    safetensors file to `training.checkpoint.load_full_weights`: `keys()` (the parameters whose
    Hugging Face tensors are all there) and `get_slice(name)`, whose `get_shape()` is the whole
    tensor's and whose `[index]` reads only that rectangle's parts of the Hugging Face tensors,
    as `dtype` (fp32: what megalite imports) or, dtype None, as stored (a load, which copies
    them into the parameters, converting there: bf16 and fp16 convert to fp32 exactly)."""

    def __init__(self, recipe: Recipe, source: HFFiles, dtype: torch.dtype | None = torch.float32):
        self.recipe, self.source, self.where, self.dtype = recipe, source, str(source.dir), dtype
        self.extents = hf_extents(recipe)

    def keys(self) -> list[str]:
        return [name for name, parts in self.recipe.items()
                if all(p.name is None or p.name in self.source for p in parts)]

    def get_slice(self, name: str) -> "_Lazy":
        return _Lazy(self, name)

    def shape(self, name: str) -> torch.Size:
        """The whole megalite tensor's shape; a ConfigError if the Hugging Face tensors do not
        have the shapes the config gives them."""
        rest = None
        for part in (p for p in self.recipe[name] if p.name is not None):  # zeros have no shape
            stored = self.source.shape(part.name)
            if part.stacked:
                other, fits = tuple(stored), True
            else:
                axis, length = self.extents[part.name]
                other, fits = tuple(stored[:axis] + stored[axis + 1:]), stored[axis] == length
            if not fits or (rest is not None and other != rest):
                raise ConfigError(f"'{self.where}': {part.name} has shape {tuple(stored)}, which "
                                  f"does not fit the model config ({name})")
            rest = other
        # Zeros alone (an expert bias the architecture lacks): a vector.
        return torch.Size((sum(p.count for p in self.recipe[name]), *(rest or ())))

    def read(self, name: str, index) -> torch.Tensor:
        shape = self.shape(name)
        index = index if isinstance(index, tuple) else (index,)
        if any(not isinstance(s, slice) or s.step not in (None, 1) for s in index):
            raise TypeError(f"{name}: only contiguous slices can be read, not {index}")
        index = index + (slice(None),) * (len(shape) - len(index))
        first, last = index[0].indices(shape[0])[:2]
        rest = index[1:]
        rest_shape = [len(range(*s.indices(n))) for s, n in zip(rest, shape[1:])]
        pieces, offset = [], 0
        for part in self.recipe[name]:
            # The overlap of rows first:last with this part's rows offset:offset + count.
            lo, hi = max(first, offset), min(last, offset + part.count)
            if lo < hi:
                start, stop = part.start + lo - offset, part.start + hi - offset
                if part.name is None:  # zeros: after the stored rows (vocab padding), or alone
                    pieces.append(torch.zeros(hi - lo, *rest_shape))
                elif part.stacked:
                    pieces.append(self.source.read(part.name, rest).unsqueeze(0))
                elif part.transposed:
                    pieces.append(self.source.read(part.name, (*rest, slice(start, stop))).T)
                else:
                    pieces.append(self.source.read(part.name, (slice(start, stop), *rest)))
            offset += part.count
        if not pieces:  # no rows: an empty tensor of the rectangle's shape
            pieces.append(torch.zeros(0, *rest_shape))
        # as stored (dtype None): as the stored rows are, which come first
        pieces = [p.to(self.dtype or pieces[0].dtype) for p in pieces]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


@dataclass(frozen=True)
class _Lazy:
    view: MegaliteView
    name: str

    def get_shape(self) -> list[int]:
        return list(self.view.shape(self.name))

    def __getitem__(self, index) -> torch.Tensor:
        return self.view.read(self.name, index)


class HFPlan:
    """The Hugging Face tensors of a recipe, made from whole megalite tensors: `shapes` first
    (from the megalite tensors' shapes), then `make(name, dtype)` one at a time, reading the
    whole megalite tensors it needs with `read(name)` on demand."""

    def __init__(self, recipe: Recipe, megalite_shape: Callable[[str], torch.Size],
                 read: Callable[[str], torch.Tensor]):
        self.extents, self.read, self.last = hf_extents(recipe), read, (None, None)
        # Each Hugging Face tensor's sources: (megalite name, row offset there, rows), in the
        # order the recipe first mentions them.
        self.sources: dict[str, list[tuple[str, int, Rows]]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for name, parts in recipe.items():
            offset, rest = 0, tuple(megalite_shape(name))[1:]
            for part in parts:
                if part.name is not None:
                    self.sources.setdefault(part.name, []).append((name, offset, part))
                    if part.stacked:
                        self.shapes[part.name] = rest
                    else:
                        axis, length = self.extents[part.name]
                        self.shapes[part.name] = ((*rest, length) if axis else (length, *rest))
                offset += part.count

    def megalite(self, name: str) -> torch.Tensor:
        """A whole megalite tensor, keeping only the last one read: `make` asks for the same
        one several times in a row (K then V of one kv_proj)."""
        if self.last[0] != name:
            self.last = (None, None)  # freed before the next read
            self.last = (name, self.read(name))
        return self.last[1]

    def make(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(self.shapes[name], dtype=dtype)
        covered = 0
        for source, offset, part in self.sources[name]:
            rows = self.megalite(source)[offset:offset + part.count]
            if part.stacked:
                return rows[0].to(dtype)
            (out.T if part.transposed else out)[part.start:part.stop] = rows  # columns, transposed
            covered += part.count
        if covered != self.extents[name][1]:
            raise AssertionError(f"the recipe covers {covered} of {name}'s "
                                 f"{self.extents[name][1]} rows")
        return out


def weights_to_hf(recipe: Recipe, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face tensors (fp32) from whole megalite tensors in memory."""
    plan = HFPlan(recipe, lambda name: w[name].shape, w.__getitem__)
    return {name: plan.make(name, torch.float32) for name in plan.sources}
