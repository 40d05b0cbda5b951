"""megalite <-> Hugging Face Qwen2ForCausalLM (Qwen2, Qwen2.5): Llama with biases on q, k and v
(o_proj without), sliding-window layers where its config turns them on."""
from megalite.config import ModelConfig
from megalite.hf import llama

NAME = "Qwen2ForCausalLM"
NEEDS, FREE = {**llama.NEEDS, "attention.qkv_bias": True}, llama.FREE | llama.SLIDING


def config_to_hf(cfg: ModelConfig, special: dict[str, int]) -> dict:
    out = {**llama.config_to_hf(cfg, special, NAME, "qwen2"), **llama.sliding_to_hf(cfg)}
    del out["attention_bias"], out["mlp_bias"]  # Qwen2's biases are fixed: on q, k and v
    return out


def config_from_hf(hf: dict) -> ModelConfig:
    return llama.qwen_from_hf(hf, "Qwen2", qkv_bias=True)


recipe = llama.recipe  # Llama's tensors and names
