"""The mixture-of-experts test models (Mixtral's shape; DeepSeek-V3's sigmoid router with a
shared expert) and their MoE layers."""
import dataclasses

from megalite.config import Experts, ModelConfig
from megalite.model import GPT
from megalite.model.moe import MoE
from tests.support.models import CONFIGS


BALANCING = dict(aux_loss_coeff=0.01, z_loss_coeff=0.001)


def with_experts(cfg: ModelConfig, **experts) -> ModelConfig:
    """`cfg` as a mixture of experts: its dense MLP's width and activation kept (the dense
    layers' and the experts')."""
    return dataclasses.replace(cfg, mlp=Experts(ffn_hidden=cfg.mlp.ffn_hidden,
                                                activation=cfg.mlp.activation, **experts))


MOE = {
    # Mixtral's shape: SwiGLU experts, softmax top-2 renormalised.
    "top2": with_experts(CONFIGS["llama"], experts=4, top_k=2, expert_ffn_hidden=24, **BALANCING),
    # DeepSeek-V3's: sigmoid scores, a shared expert; Qwen2-MoE's sigmoid gate on it; every
    # other layer dense.
    "top1 sigmoid shared": dataclasses.replace(with_experts(
        CONFIGS["gpt2"], experts=4, top_k=1, router="sigmoid", renormalize=False, every=2,
        shared_experts=1, shared_gate=True, expert_ffn_hidden=16, **BALANCING), n_layers=2),
}


def moe_layers_by_name(model: GPT) -> dict[str, MoE]:
    return {name: m for name, m in model.named_modules() if isinstance(m, MoE)}


def moe_layers(model: GPT) -> list[MoE]:
    return list(moe_layers_by_name(model).values())
