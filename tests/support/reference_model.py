"""The transformer written out with plain tensor ops, as an independent reference.

It reads megalite's TP=1 weights by name and recomputes the logits of one unpadded sequence
head by head, so a mistake that megalite makes the same way at every TP size (the rotary
convention, the GeLU variant, the GQA head grouping, the KV layout, the norms) still shows.
"""
import math

import torch

from megalite.model import GPT


def reference_logits(model: GPT, ids: torch.Tensor) -> torch.Tensor:
    """[seq, vocab_size] logits of the single sequence ids [1, seq]."""
    cfg = model.cfg
    w = {name: p.detach() for name, p in model.named_parameters()}
    seq, heads, kv_heads, d = ids.shape[1], cfg.n_heads, cfg.kv_heads, cfg.head_size

    def linear(x, name):
        y = x @ w[f"{name}.weight"].T
        return y + w[f"{name}.bias"] if f"{name}.bias" in w else y

    def norm(x, name):
        if cfg.norms.kind == "rmsnorm":
            return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.norms.eps) * w[f"{name}.weight"]
        centred = x - x.mean(-1, keepdim=True)
        y = centred / torch.sqrt((centred * centred).mean(-1, keepdim=True) + cfg.norms.eps)
        y = y * w[f"{name}.weight"]
        return y + w[f"{name}.bias"] if f"{name}.bias" in w else y

    def rotate(x):  # x: [seq, d]; pairs (i, i + d/2) rotated by pos * theta^(-2i/d)
        half = d // 2
        freq = cfg.positions.theta ** (-torch.arange(half, dtype=torch.float32) * 2 / d)
        angle = torch.arange(seq, dtype=torch.float32)[:, None] * freq[None, :]
        a, b = x[:, :half], x[:, half:]
        return torch.cat([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()], -1)

    def gelu_tanh(x):
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))

    x = w["embed.weight"][ids[0]]
    if cfg.positions.kind == "learned":
        x = x + w["positions.weight"][:seq]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    for layer in range(cfg.n_layers):
        p = f"blocks.{layer}"
        h = norm(x, f"{p}.attn_norm")
        q = linear(h, f"{p}.attn.q_proj").view(seq, heads, d)
        kv = linear(h, f"{p}.attn.kv_proj").view(seq, kv_heads, 2, d)
        outputs = []
        for head in range(heads):
            group = head // (heads // kv_heads)
            qh, kh, vh = q[:, head], kv[:, group, 0], kv[:, group, 1]
            if cfg.positions.kind == "rotary":
                qh, kh = rotate(qh), rotate(kh)
            scores = (qh @ kh.T / math.sqrt(d)).masked_fill(~causal, float("-inf"))
            outputs.append(torch.softmax(scores, -1) @ vh)
        x = x + linear(torch.cat(outputs, -1), f"{p}.attn.out_proj")
        h = norm(x, f"{p}.mlp_norm")
        if cfg.mlp.activation == "swiglu":
            up = torch.nn.functional.silu(linear(h, f"{p}.mlp.gate")) * linear(h, f"{p}.mlp.up")
        elif cfg.mlp.activation == "gelu_tanh":
            up = gelu_tanh(linear(h, f"{p}.mlp.up"))
        else:
            up = 0.5 * linear(h, f"{p}.mlp.up") * (1 + torch.erf(linear(h, f"{p}.mlp.up") / math.sqrt(2)))
        x = x + linear(up, f"{p}.mlp.down")
    x = norm(x, "norm")
    head = w["head.weight"] if "head.weight" in w else w["embed.weight"]
    return (x @ head.T)[:, : cfg.vocab_size]
