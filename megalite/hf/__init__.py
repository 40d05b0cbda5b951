"""Hugging Face interop: GPT2LMHeadModel and LlamaForCausalLM, both directions."""
