"""Keys and values of past tokens, per layer, for incremental decoding.

Preallocated for max_len tokens; a forward writes its new keys/values at [offset, offset + n)
and attends everything up to there, as the layout's mask allows (model/layout.cached_layout).
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, n_layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype):
        shape = (batch, kv_heads, max_len, head_dim)
        self.keys = [torch.empty(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.values = [torch.empty(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.offset = 0  # tokens already cached; advanced by the model after each forward

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        end = self.offset + k.shape[2]
        if end > self.keys[layer].shape[2]:
            raise ValueError(f"KV cache full: {end} tokens > max_len {self.keys[layer].shape[2]}")
        self.keys[layer][:, :, self.offset:end] = k
        self.values[layer][:, :, self.offset:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]
