"""megalite <-> Hugging Face Qwen3ForCausalLM: Llama with an RMSNorm over each head's q and k
before rotary (`q_norm`, `k_norm`, of head_dim), a head width free of hidden / heads (128 at
hidden 1024 with 16 heads), no biases; small models tie the head."""
from megalite.config import ModelConfig
from megalite.hf import llama

NAME = "Qwen3ForCausalLM"
NEEDS, FREE = {**llama.NEEDS, "attention.qk_norm": True}, llama.FREE | llama.SLIDING


def config_to_hf(cfg: ModelConfig, special: dict[str, int]) -> dict:
    return {**llama.config_to_hf(cfg, special, NAME, "qwen3"), **llama.sliding_to_hf(cfg)}


def config_from_hf(hf: dict) -> ModelConfig:
    return llama.qwen_from_hf(hf, "Qwen3", qk_norm=True)


recipe = llama.recipe  # Llama's tensors and names
