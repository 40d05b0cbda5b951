"""Keys and values of past tokens, per layer, for incremental decoding.

Preallocated for max_len tokens; a forward writes its new keys/values at [offset, offset + n)
and attends everything up to there, as the layout's mask allows (model/layout.cached_layout).
"""
import torch


class KVCache:
    def __init__(self, shapes: dict[int, tuple[tuple[int, ...], tuple[int, ...]]],
                 device: torch.device, dtype: torch.dtype):
        """shapes: per layer, its keys' and values' [batch, heads, max_len, width] (the
        attention's: per-head K/V, or MLA's latent and rotary key)."""
        self.keys = {layer: torch.empty(k, device=device, dtype=dtype) for layer, (k, _) in shapes.items()}
        self.values = {layer: torch.empty(v, device=device, dtype=dtype) for layer, (_, v) in shapes.items()}
        self.offset = 0  # tokens already cached; advanced by the model after each forward

    def bytes_per_token(self) -> int:
        """What one more token of a sequence costs, over this rank's layers."""
        return sum(t.shape[1] * t.shape[3] * t.element_size()
                   for t in (*self.keys.values(), *self.values.values()))

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        end = self.offset + k.shape[2]
        if end > self.keys[layer].shape[2]:
            raise ValueError(f"KV cache full: {end} tokens > max_len {self.keys[layer].shape[2]}")
        self.keys[layer][:, :, self.offset:end] = k
        self.values[layer][:, :, self.offset:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]
