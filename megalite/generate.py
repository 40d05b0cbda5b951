"""Sampling with a KV cache: greedy, temperature and top-k, identical on every TP rank.

Every TP rank gathers the full logits and draws from a generator seeded the same everywhere,
so all ranks pick the same token and feed the same next input.
"""
from __future__ import annotations

import torch

from megalite.model import GPT


@torch.no_grad()
def generate(model: GPT, prompt: list[int], max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int = 0, eos_id: int | None = None, seed: int = 0,
             use_cache: bool = True) -> list[int]:
    """Prompt ids -> prompt + new ids. temperature 0 is greedy."""
    was_training = model.training
    model.eval()
    device = model.pstate.device
    ids = list(prompt)
    room = min(max_new_tokens, model.cfg.max_seq_len - len(ids))
    cache = model.new_cache(1, len(ids) + room) if use_cache else None
    generator = torch.Generator().manual_seed(seed)
    step_input = ids
    for _ in range(room):
        context = step_input if use_cache else ids
        logits = model(torch.tensor([context], device=device), cache=cache).logits[:, -1]
        logits = model.full_logits(logits)[0].float().cpu()
        token = _pick(logits, temperature, top_k, generator)
        ids.append(token)
        step_input = [token]
        if token == eos_id:
            break
    model.train(was_training)
    return ids


def _pick(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits / temperature
    if 0 < top_k < logits.numel():
        kth = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))
