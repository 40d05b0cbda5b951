"""The mixture-of-experts test models (Mixtral's shape; DeepSeek-V3's sigmoid router with a
shared expert) and their MoE layers."""
import dataclasses

from megalite.model import GPT
from megalite.model.moe import MoE
from tests.support.models import CONFIGS


BALANCING = dict(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
MOE = {
    # Mixtral's shape: SwiGLU experts, softmax top-2 renormalised.
    "top2": dataclasses.replace(CONFIGS["llama"], n_experts=4, moe_top_k=2, moe_ffn_hidden=24,
                                **BALANCING),
    # DeepSeek-V3's: sigmoid scores, a shared expert; Qwen2-MoE's sigmoid gate on it; every
    # other layer dense.
    "top1 sigmoid shared": dataclasses.replace(
        CONFIGS["gpt2"], n_layers=2, n_experts=4, moe_top_k=1, moe_router="sigmoid",
        moe_renormalize=False, moe_every=2, n_shared_experts=1, moe_shared_gate=True,
        moe_ffn_hidden=16, **BALANCING),
}


def moe_layers_by_name(model: GPT) -> dict[str, MoE]:
    return {name: m for name, m in model.named_modules() if isinstance(m, MoE)}


def moe_layers(model: GPT) -> list[MoE]:
    return list(moe_layers_by_name(model).values())
