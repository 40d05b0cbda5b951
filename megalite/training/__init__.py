"""The pieces of the training loop: optimizer, gradient sync, checkpoints, metrics."""
