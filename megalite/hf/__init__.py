"""Hugging Face interop, both directions: one recipe per architecture (convert.ARCHITECTURES)."""
