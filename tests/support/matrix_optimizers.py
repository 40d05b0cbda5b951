"""What the matrix optimizers' one-process tests share: a small MoE model with GQA's fused K/V
weight, its logical matrices as Hugging Face holds them, and a config refused before the run."""
import pytest
import torch

from megalite.config import Experts, GroupedQuery, ModelConfig, Norms, Rotary
from megalite.plan import validate
from megalite.run_config import load_config
from megalite.typed_config import ConfigError

CFG = ModelConfig(n_layers=2, hidden=32, n_heads=4, vocab_size=64, max_seq_len=16,
                  attention=GroupedQuery(n_kv_heads=2), positions=Rotary(), norms=Norms(kind="rmsnorm"),
                  mlp=Experts(activation="swiglu", experts=4, top_k=2, expert_ffn_hidden=24,
                              dense_layers=(0,)))


def logical_matrices(name: str, p: torch.Tensor) -> dict[str, callable]:
    """How Hugging Face's model holds p: as K and V, as experts, or whole."""
    if p.dim() == 3:
        return {f"{name}[{e}]": (lambda w, e=e: w[e]) for e in range(p.shape[0])}
    if name.endswith("kv_proj.weight"):
        size = CFG.hidden // CFG.n_heads
        return {f"{name}:{j}": (lambda w, j=j: w.view(-1, 2, size, w.shape[-1])[:, j].reshape(-1, w.shape[-1]))
                for j in range(2)}
    return {name: lambda w: w}


def refused(optimizer: str, *overrides: str) -> str:
    """The ConfigError's message for train.optimizer=`optimizer` with `overrides`, at 4 ranks."""
    with pytest.raises(ConfigError) as err:
        validate(load_config(None, [f"train.optimizer={optimizer}", *overrides]), 4)
    return str(err.value)
