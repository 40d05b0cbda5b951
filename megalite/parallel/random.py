"""Dropout randomness under tensor and pipeline parallelism (Megatron-LM's `random.py`).

Replicated activations (the residual stream, embeddings) must be dropped identically on every
TP rank, or the replicas diverge: they use the default generator, which
`seed_replicated_dropout` seeds the same on all TP ranks. Activations split across TP ranks
(attention probabilities of each rank's own heads; with sequence parallelism, the residual
stream and embeddings too, each rank holding a shard of the tokens) must be dropped
independently, or every rank would drop the same pattern in different heads or tokens: they use
a tracked state seeded with seed + offset + tp_rank, swapped in with `fork()`. Pipeline stages
hold different layers, so both streams are offset by the stage too, as Megatron seeds each
stage its own way: with one seed, stage 1's first layer would drop the same pattern as stage
0's first layer on every micro-batch. Activation recomputation replays both
(`recompute_contexts`), and checkpoints save and restore both (`get_state` / `set_state`).
"""
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F

_TP_SEED_OFFSET = 2718


def _device_rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_device_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def seed_replicated_dropout(seed: int, stream: int) -> None:
    """Seeds the default generator for dropout on replicated activations: the same on the TP
    ranks of a stage, its own for every DP replica (which holds other samples) and stage
    (stream: pp_rank x dp + dp_rank)."""
    torch.manual_seed(seed + stream)


class TensorParallelRNG:
    """The generator state used inside TP-split regions, distinct per TP rank and stage."""

    def __init__(self, seed: int, stream: int = 0, device: torch.device = torch.device("cpu")):
        """stream: this rank's among the TP ranks of every stage (pp_rank x tp + tp_rank)."""
        self.device = device
        self.state = torch.Generator(device=device).manual_seed(seed + _TP_SEED_OFFSET + stream).get_state()
        self.replaying = False  # inside activation checkpointing's recompute

    @contextmanager
    def fork(self):
        outside = _device_rng_state(self.device)
        _set_device_rng_state(self.device, self.state)
        try:
            yield
        finally:
            self.state = _device_rng_state(self.device)
            _set_device_rng_state(self.device, outside)

    def dropout(self, x: torch.Tensor, p: float, training: bool, split: bool) -> torch.Tensor:
        """F.dropout of replicated activations (split=False: the default generator, the same
        mask on every TP rank) or of activations split across TP ranks (the tracked stream)."""
        with self.fork() if split and training and p > 0 else nullcontext():
            return F.dropout(x, p, training)

    def recompute_contexts(self):
        """Contexts for torch.utils.checkpoint's `context_fn`: the forward records the tracked
        state, the recompute replays from it. (checkpoint itself restores only the default
        generator, so without this the recomputed attention-dropout masks would differ.)"""
        recorded = {}

        @contextmanager
        def forward():
            recorded["state"] = self.state.clone()
            yield

        @contextmanager
        def recompute():
            current, self.state = self.state, recorded["state"].clone()
            self.replaying = True
            try:
                yield
            finally:
                self.state, self.replaying = current, False

        return forward(), recompute()

    def get_state(self) -> dict[str, torch.Tensor]:
        return {"default": _device_rng_state(self.device), "tensor_parallel": self.state.clone()}

    def set_state(self, state: dict[str, torch.Tensor]) -> None:
        _set_device_rng_state(self.device, state["default"])
        self.state = state["tensor_parallel"].clone()


def run_rng_state(rng: TensorParallelRNG) -> dict[str, torch.Tensor]:
    """All of a rank's random state a resumed run continues from (checkpoints, snapshots): the
    host's generator, the device's and the tensor-parallel one."""
    return {"cpu": torch.get_rng_state(), **rng.get_state()}


def restore_run_rng(rng: TensorParallelRNG, state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    rng.set_state({k: v for k, v in state.items() if k != "cpu"})
