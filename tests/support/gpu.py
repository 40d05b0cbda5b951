"""On a GPU: the device, and bf16 results compared as whole tensors."""
from __future__ import annotations

import torch


CUDA = torch.device("cuda", 0)


def assert_relative_norm(got: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    """|got - expected| <= tol |expected| in the Euclidean norm of the whole tensor: bf16 results
    are compared as a whole, since single elements round by up to 2^-8 relative each and a few
    of them (small sums of cancelling terms) by much more."""
    got, expected = got.detach().double().cpu(), expected.detach().double().cpu()
    err, scale = float((got - expected).norm()), float(expected.norm())
    assert err <= tol * scale, (f"{what}: |got - expected| / |expected| = "
                                f"{err / max(scale, 1e-300):.3g} > {tol:.3g}")
