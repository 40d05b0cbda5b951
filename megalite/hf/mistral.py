"""megalite <-> Hugging Face MistralForCausalLM: Llama's tensors and names, a head width of its
own (Mistral-Nemo: 128 at hidden 5120 with 32 heads) and a sliding window on every layer where
its config sets one (v0.1: 4096; null later)."""
from megalite.config import ModelConfig
from megalite.hf import llama

NAME = "MistralForCausalLM"
NEEDS, FREE = llama.NEEDS, llama.FREE | {"attention.sliding_window"}


def config_to_hf(cfg: ModelConfig, special: dict[str, int]) -> dict:
    return {**llama.config_to_hf(cfg, special, NAME, "mistral"),
            "sliding_window": cfg.attention.sliding_window}


def config_from_hf(hf: dict) -> ModelConfig:
    return llama.config_from_hf(hf, "Mistral", attention=llama.one_window(hf))


recipe = llama.recipe  # Llama's tensors and names
