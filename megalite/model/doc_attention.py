"""Packed documents on a fused attention kernel: FlexAttention with a document-causal BlockMask.

A dense [batch, 1, seq, seq] mask rules out SDPA's flash kernel (and, for GQA on some builds,
drops to the fp32 math kernel). FlexAttention takes the rule itself, a `mask_mod(b, h, q, k)`,
and a BlockMask built from it once per forward: the kernel skips the blocks no query sees and
evaluates the rule only on the blocks a document boundary crosses.

Where: CUDA only (FLEX_DEVICES). On CPU torch 2.13's flex_attention refuses backward, eager or
compiled ("FlexAttention does not support backward on CPU"), and would lose anyway: eager it is
an unfused reference, slower than SDPA with the dense mask; compiled, inductor's CPU template
is slow to build and fails to lower inside a larger compiled graph. So on CPU the same rule is
materialised as a dense mask for SDPA, exactly as before FlexAttention.

On GPU both flex_attention and create_block_mask run compiled: uncompiled, flex_attention is
that unfused reference and create_block_mask materialises the whole [batch, seq, seq] mask.
Packed rows, one shape a run, compile for it (`static`: dynamic=False, as PyTorch's
FlexAttention examples do): torch.compile's default would turn sizes symbolic at the first
other shape (an evaluation's last batch), and the symbolic kernel would serve training from
then on. Widths that vary (padded rows' windows, prompts) keep the default, which goes symbolic
once rather than compiling each width until its recompile limit leaves flex uncompiled.
"""
from typing import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from megalite.compiled import compiled

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

FLEX_DEVICES = ("cuda",)
# Inductor's CUDA flex_attention kernel multiplies with Triton's tl.dot, which takes no dimension
# under 16: it refuses smaller heads (NotImplementedError), so they take the dense mask.
FLEX_MIN_HEAD_DIM = 16


def uses_flex(device: torch.device) -> bool:
    return device.type in FLEX_DEVICES


def block_mask(mask_mod: MaskMod, batch: int, seq: int, device: torch.device,
               kv_len: int | None = None, static: bool = False) -> BlockMask:
    """The BlockMask of `mask_mod` over [batch, seq, kv_len (default seq)], shared by every
    head. Any length works: the last block of one that is not a multiple of the block size
    (128) is partial."""
    # torch.compile's `dynamic`: False for one shape a run (`static`), else its default.
    return compiled(create_block_mask, False if static else None)(mask_mod, batch, None, seq,
                                                                  kv_len or seq, device=device)


def dense_mask(mask_mod: MaskMod, batch: int, seq: int, device: torch.device,
               kv_len: int | None = None) -> torch.Tensor:
    """[batch, 1, seq, kv_len (default seq)], True where query q may attend key k: the rule
    evaluated on the whole grid at once (mask_mods are elementwise tensor code, so they
    broadcast)."""
    queries, keys = torch.arange(seq, device=device), torch.arange(kv_len or seq, device=device)
    b = torch.arange(batch, device=device).view(-1, 1, 1)
    return mask_mod(b, 0, queries.view(1, -1, 1), keys.view(1, 1, -1)).unsqueeze(1)


def block_mask_as_dense(mask: BlockMask) -> torch.Tensor:
    """The dense mask of the rule `mask` was built from, for SDPA where flex cannot go."""
    seq, kv_len = mask.seq_lengths
    return dense_mask(mask.mask_mod, mask.kv_num_blocks.shape[0], seq, mask.kv_num_blocks.device, kv_len)


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask,
         enable_gqa: bool, scale: float | None = None, static: bool = False) -> torch.Tensor:
    return compiled(flex_attention, False if static else None)(q, k, v, block_mask=mask,
                                                               enable_gqa=enable_gqa, scale=scale)
