"""Sampling with a KV cache: greedy, temperature, top-k and top-p, identical on every TP rank.

Prompts are left-padded into one batch. Every TP rank gathers the full logits and draws from a
generator seeded the same everywhere, so all ranks pick the same tokens and feed the same input.
With pipeline stages, each new token's forward runs through the stages in turn (each stage
caches its own layers' keys and values); the last stage picks the tokens and broadcasts them to
the others. With expert parallelism (a mixture of experts), every rank of an EP group decodes
the same prompts, its experts serving the others' tokens, and takes the tokens of the group's
first rank, so that all stop together (the all-to-alls pair every rank's forwards).

    megalite generate --ckpt CKPT --prompt "The module" --prompt "A list is" [--tp N] [--pp N] [--ep N] ...
    megalite generate --ckpt CKPT --chat '[{"role": "user", "content": "Hi!"}]' ...

--chat: a conversation (JSON: a list of {role, content}, or a record of `messages` or of a
`prompt`) rendered with the checkpoint tokenizer's chat template (or --chat-template) with the
generation prompt, so the model answers as the assistant; the answer stops at eos.
"""
import json
from contextlib import nullcontext
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from megalite.command_args import generate_parser
from megalite.data.batches import Batch
from megalite.data.chat import (ChatError, ChatTemplate, conversation_of, generation_prompt,
                                load_chat_template)
from megalite.data.tokenizer import TokenizerInfo
from megalite.inference import layout_of, loaded
from megalite.model import GPT
from megalite.pipeline.runner import forward_pipelined
from megalite.typed_config import ConfigError


@torch.no_grad()
def generate(model: GPT, prompts: list[list[int]], max_new_tokens: int, *, pad_id: int,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             eos_id: int | None = None, seed: int = 0, use_cache: bool = True) -> list[list[int]]:
    """New token ids for each prompt (stopping after eos). temperature 0 is greedy."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")
    width = max(len(p) for p in prompts)
    # Rows share one padded width: the longest prompt bounds how many tokens every row gets.
    room = min(max_new_tokens, model.cfg.max_seq_len - width)
    if room < 1:
        raise ValueError(f"the longest prompt has {width} tokens: no room to generate within "
                         f"model.max_seq_len={model.cfg.max_seq_len}")
    was_training = model.training
    model.eval()
    ps = model.pstate
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=ps.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=ps.device)
    cache = model.new_cache(len(prompts), width + room) if use_cache else None
    generator = torch.Generator().manual_seed(seed)
    new = [[] for _ in prompts]
    done = [False] * len(prompts)
    step_ids = ids
    for _ in range(room):
        # The logits of each row's last position, every vocab column; none off the last stage.
        # (Without stages, the pipelined forward is the model's forward.)
        found = []
        forward_pipelined(model, [Batch(step_ids if use_cache else ids, labels=None)], nullcontext(),
                          lambda _, out: found.append(model.full_logits(out.logits[:, -1])),
                          attention_mask=mask, cache=cache)
        tokens = (pick(found[0].float().cpu(), temperature, top_k, top_p, generator) if found
                  else torch.empty(len(prompts), dtype=torch.long))
        # The tokens the last stage picked, on every stage; with expert parallelism, those of the
        # EP group's first rank (its experts' matmuls group the ranks' rows differently, so a near
        # tie could otherwise go two ways). Alone, they stay on the CPU: no copy and sync per token.
        if ps.pp_size > 1 or ps.ep_size > 1:
            tokens = tokens.to(ps.device)  # NCCL broadcasts device tensors
        if ps.pp_size > 1:
            dist.broadcast(tokens, src=ps.stage_rank(ps.pp_size - 1), group=ps.pp_group)
        if ps.ep_size > 1:
            dist.broadcast(tokens, group=ps.ep_group, group_src=0)
        for row, token in enumerate(tokens.tolist()):
            if not done[row]:
                new[row].append(token)
                done[row] = token == eos_id
        if all(done):
            break
        step_ids = tokens.to(ps.device).unsqueeze(1)
        ids = torch.cat([ids, step_ids], dim=1)
        mask = torch.cat([mask, torch.ones_like(step_ids)], dim=1)
    model.train(was_training)
    return new


def pick(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
         generator: torch.Generator) -> torch.Tensor:
    """One token per row of [batch, vocab] logits."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        # Keep the most likely tokens whose cumulative probability first reaches top_p.
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # the most likely token is never dropped
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


def sampled(model: GPT, tokenizer: TokenizerInfo, shown: Sequence[str], prompts: Sequence[list[int]],
            max_new_tokens: int, **sampling) -> str:
    """Each prompt as shown, headed by its repr, and the tokens generated after it (`generate`'s
    sampling options): what `megalite generate` prints and a run's samples.txt holds."""
    outputs = generate(model, prompts, max_new_tokens, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id,
                       **sampling)
    return "\n".join(f"--- {p!r}\n{p}{tokenizer.decode(new)}" for p, new in zip(shown, outputs))


def main(argv: list[str]) -> int:
    args = generate_parser().parse_args(argv)
    with loaded(Path(args.ckpt), layout_of(args)) as (model, tokenizer):
        if args.chat:
            template = load_chat_template(tokenizer, args.chat_template)
            shown, prompts = zip(*(chat_prompt(template, tokenizer, c) for c in args.chat))
        else:
            shown, prompts = args.prompt, [tokenizer.encode(p) for p in args.prompt]
        text = sampled(model, tokenizer, shown, prompts, args.max_new_tokens, temperature=args.temperature,
                       top_k=args.top_k, top_p=args.top_p, seed=args.seed)
        if model.pstate.is_main:
            print(text, flush=True)
    return 0


def chat_prompt(template: ChatTemplate, tokenizer: TokenizerInfo, given: str) -> tuple[str, list[int]]:
    """--chat's conversation rendered up to the assistant's answer: its text and ids."""
    try:
        record = json.loads(given)
        messages = conversation_of(record if isinstance(record, dict) else {"messages": record},
                                   prompt_only=True)
        return generation_prompt(template, tokenizer, messages)
    except (json.JSONDecodeError, ChatError) as err:
        raise ConfigError(f"--chat {given[:60]!r}: {err}: give a JSON list of {{\"role\": ..., "
                          f"\"content\": ...}} messages") from None
