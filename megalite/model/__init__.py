"""A decoder-only transformer built from megalite's tensor-parallel layers."""
from megalite.model.gpt import GPT, Output

__all__ = ["GPT", "Output"]
