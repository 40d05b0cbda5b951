"""configs/bench/scaling.yaml as typed dataclasses: the hardware profiles of the scaling model
(bench.scaling_model) and the published throughput rows it is checked against.

    scaling = load_scaling_file("configs/bench/scaling.yaml")
    scaling.profile("A100"), scaling.sources[0].rows
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml

from megalite.typed_config import ConfigError, from_dict


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_tflops: float  # dense bf16 per GPU
    intra_node_gbs: float  # NCCL ring all-reduce bus bandwidth between the GPUs of one node, GB/s
    inter_node_gbs: float  # network bandwidth per GPU (one NIC each), one direction, GB/s
    gpus_per_node: int = 8


@dataclass(frozen=True)
class PublishedRow:
    name: str
    layers: int
    hidden: int
    heads: int
    tp: int
    gpus: int
    global_batch: int  # sequences per optimizer step, all DP ranks together
    micro_batch: int  # sequences per forward/backward on one DP rank
    tflops_per_gpu: float  # as published, counted the source's way (see Source)
    pp: int = 1  # pipeline stages
    virtual_stages: int = 1  # model chunks per stage: interleaved 1F1B when > 1


@dataclass(frozen=True)
class Source:
    name: str
    hardware: str  # a Hardware.name
    seq_len: int
    vocab_size: int
    tie_embeddings: bool
    # Full activation recomputation: the forward runs twice, and the published FLOPs count the
    # second one (Narayanan et al. 2021, Eq. 3); else the published FLOPs are 6N + 12 L h s.
    activation_recompute: bool
    grad_bytes: Literal[2, 4]  # bytes per gradient element in the data-parallel all-reduce
    dp_overlap: bool  # whether the published runs overlapped that all-reduce with backward
    calibrate_on: str  # the row (a PublishedRow.name) that sets the hardware's efficiency
    rows: list[PublishedRow]

    def row(self, name: str) -> PublishedRow:
        return _named(self.rows, name, f"source '{self.name}': no row named '{name}' (rows: "
                                       "{names}): set calibrate_on to one of them")


@dataclass(frozen=True)
class ScalingFile:
    hardware: list[Hardware]
    sources: list[Source]

    def profile(self, name: str) -> Hardware:
        return _named(self.hardware, name, f"hardware '{name}' is not a profile of the scaling "
                                           "config (profiles: {names}): use one of them or add it")


def _named(items: list, name: str, missing: str):
    """The item called `name`, or a ConfigError: `missing` with {names} listing the choices."""
    names = [item.name for item in items]
    if name not in names:
        raise ConfigError(missing.format(names=", ".join(names)))
    return items[names.index(name)]


def load_scaling_file(path: str | Path) -> ScalingFile:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"scaling config '{path}' not found")
    scaling = from_dict(ScalingFile, yaml.safe_load(path.read_text()) or {}, "scaling.")
    for source in scaling.sources:  # a dangling name fails at load, not halfway through a table
        scaling.profile(source.hardware)
        source.row(source.calibrate_on)
    return scaling
