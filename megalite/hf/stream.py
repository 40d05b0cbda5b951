"""A safetensors file written one tensor at a time, and the Hugging Face files read lazily.

The safetensors format: an 8-byte little-endian header length, a JSON header
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}} (padded
with spaces to a multiple of 8 bytes), then the tensors' bytes back to back. The header needs
only the shapes and dtypes, so it is written first and each tensor's bytes follow as soon as the
tensor is made: a file of any size is written holding one tensor at a time.
"""
import json
import math
import os
import struct
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open

from megalite.typed_config import ConfigError

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
          torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
          torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


class SafetensorsWriter(AbstractContextManager):
    """`with SafetensorsWriter(path, {name: (shape, dtype)}, metadata) as writer:`, then
    `writer.write(name, tensor)` for each, in that order; the file is closed (synced to disk, and
    checked complete, when no error is on its way) when the block ends."""

    def __init__(self, path: Path, specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 metadata: dict[str, str] | None = None):
        header, offset = {}, 0
        for name, (shape, dtype) in specs.items():
            size = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            offset += size
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        self.path, self.specs, self.written = Path(path), list(specs.items()), 0
        self.file = open(self.path, "wb")
        self.file.write(struct.pack("<Q", len(encoded)) + encoded)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = self.specs[self.written][0] if self.written < len(self.specs) else None
        if name != expected:
            raise ValueError(f"{self.path}: wrote {name}, expected {expected or 'nothing'}")
        shape, dtype = self.specs[self.written][1]
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise ValueError(f"{self.path}: {name} is {tuple(tensor.shape)} {tensor.dtype}, its "
                             f"header says {tuple(shape)} {dtype}")
        flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # empty: no bytes
        self.file.write(memoryview(flat.numpy()))
        self.written += 1

    def __exit__(self, kind, *exc) -> None:
        if kind is None:
            self.file.flush()
            os.fsync(self.file.fileno())
        self.file.close()
        if kind is None and self.written != len(self.specs):
            raise ValueError(f"{self.path}: {self.written} of {len(self.specs)} tensors written")


class HFFiles(ExitStack):
    """The tensors of a Hugging Face directory's safetensors files (model.safetensors, or the
    shards that model.safetensors.index.json lists), by their names in a recipe
    (`canonical(stored name)`). Files are opened (memory-mapped) at once, so that a cut-off or
    corrupt one is a ConfigError before anything is read, and closed on exit or `release()` (a
    later read opens them again); `read` takes a rectangle through safetensors' `get_slice`, a
    view of the mapping, so only the pages it covers are read, when it is copied. What
    `layout.MegaliteView` reads (`in`, `shape`, `read`), and the ExitStack of the open files."""

    def __init__(self, hf_dir: Path, canonical: Callable[[str], str]):
        super().__init__()
        self.dir, self._open = Path(hf_dir), {}
        index = self.dir / "model.safetensors.index.json"
        weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else None
        files = ["model.safetensors"] if weight_map is None else sorted(set(weight_map.values()))
        for file in files:
            if not (self.dir / file).is_file():
                raise ConfigError(f"'{self.dir / file}' is missing: megalite reads safetensors "
                                  f"weights")
            self._file(file)
        if weight_map is None:
            weight_map = {k: files[0] for k in self._file(files[0]).keys()}
        self.where = {canonical(k): (file, k) for k, file in weight_map.items()}

    def _file(self, file: str):
        if file not in self._open:
            try:
                opened = safe_open(str(self.dir / file), framework="pt")
            except SafetensorError as err:  # its header, or the data it promises, cut off
                reason = str(err).removeprefix("Error while deserializing header: ")
                raise ConfigError(f"'{self.dir / file}' is not a whole safetensors file "
                                  f"({reason}): download or export it again") from None
            self._open[file] = self.enter_context(opened)
        return self._open[file]

    def _slice(self, name: str):
        file, stored = self.where[name]
        return self._file(file).get_slice(stored)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        return self._slice(name)[index]

    def release(self) -> None:
        """Close the files: their pages leave this process's memory once the tensors read from
        them (views of the mapping) are gone; a later read opens them again."""
        self.close()
        self._open.clear()
