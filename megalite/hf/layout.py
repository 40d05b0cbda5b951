"""Tensor re-layouts shared by the architectures.

megalite's kv_proj stores K and V interleaved per KV head, [k_0; v_0; k_1; v_1; ...], so a
contiguous TP split gives each rank whole (k, v) pairs; Hugging Face keeps K and V apart.
megalite pads the vocabulary rows to a multiple; Hugging Face has exactly vocab_size rows.
"""
from __future__ import annotations

import torch


def fuse_kv(k: torch.Tensor, v: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[kv_heads * d, ...] K and V -> megalite's [kv_heads * 2 * d, ...] interleaved per head."""
    rest = k.shape[1:]
    return torch.stack([k.reshape(kv_heads, -1, *rest), v.reshape(kv_heads, -1, *rest)], dim=1
                       ).reshape(-1, *rest)


def split_kv(kv: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    rest = kv.shape[1:]
    pairs = kv.reshape(kv_heads, 2, -1, *rest)
    return pairs[:, 0].reshape(-1, *rest), pairs[:, 1].reshape(-1, *rest)


def pad_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero rows up to `rows`: padded vocab rows get -inf logits, so their values never matter."""
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], *weight.shape[1:])])
