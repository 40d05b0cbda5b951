"""FP8 training through the matmul seam (parallel/matmul.py) with torchao's float8 recipes:
recipe.py casts and multiplies, convert.py chooses the layers (train.fp8)."""
