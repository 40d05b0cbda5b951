"""Q and K/V (and gate and up) as one matmul whose parts' gradients backward takes part by part
(parallel/linear_parts.py) = plain autograd over the same matmul, split and unbound: outputs
and weight gradients bit for bit; dX and the bias gradients, sums over the parts (over the
tokens) in another order, to 1e-6 of their norm in fp32, and under bf16 autocast dX to bf16's
rounding (each part's product is rounded before the sum). And backward joins no
activation-sized gradient: no cat or stack of the output gradients, as plain autograd does,
eager or in the backward graph a compiled model hands inductor."""
from contextlib import nullcontext
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

from megalite.model import GPT
from megalite.parallel import layers
from megalite.parallel.linear_parts import LinearParts
from megalite.parallel.state import ParallelState
from tests.support.models import CONFIGS, padded_batch

pytestmark = pytest.mark.unit

BATCH, SEQ, HIDDEN = 3, 40, 16  # 120 tokens: more rows than any weight has
HEADS, KV_HEADS, HEAD = 4, 2, 8


def inputs(bias: bool):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=g)
    rows = (HEADS * HEAD, 2 * KV_HEADS * HEAD)  # Q; K/V interleaved per KV head
    params = [torch.randn(n, HIDDEN, generator=g) for n in rows]
    params += [torch.randn(n, generator=g) for n in rows] if bias else [None, None]
    return x, params


LAYOUTS = [(HEADS * HEAD, None), (2 * KV_HEADS * HEAD, (2, HEAD))]


def plain(x, wq, wkv, bq, bkv):
    """Today's attention input before the parts: one F.linear, split, K/V viewed and unbound."""
    bias = None if bq is None else torch.cat((bq, bkv))
    q, kv = F.linear(x, torch.cat((wq, wkv)), bias).split([wq.shape[0], wkv.shape[0]], -1)
    k, v = kv.view(*x.shape[:2], KV_HEADS, 2, HEAD).unbind(3)
    return q, k, v


def parts(x, wq, wkv, bq, bkv):
    return LinearParts.apply(x, None, LAYOUTS, wq, wkv, bq, bkv)


def run(fn, x, params, autocast: bool):
    leaves = [t.clone().requires_grad_() for t in (x, *params) if t is not None]
    args = leaves + [None] * (5 - len(leaves))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        outs = fn(*args)
    # Each output's gradient as attention hands it back: [b, heads, s, d] laid out contiguous.
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(o.shape, generator=g).to(o.dtype) for o in outs]
    torch.autograd.backward(outs, grads)
    return [o.detach() for o in outs], [t.grad for t in leaves]


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_the_parts_equal_plain_autograd(bias, autocast):
    x, params = inputs(bias)
    outs, grads = run(plain, x, params, autocast)
    got_outs, got_grads = run(parts, x, params, autocast)
    for got, expected in zip(got_outs, outs):
        assert got.shape == expected.shape and got.dtype == expected.dtype
        assert torch.equal(got, expected)
    (grad_x, *grad_params), (got_x, *got_params) = grads, got_grads
    for got, expected in zip(got_params, grad_params):
        assert got.dtype == expected.dtype
        if got.dim() == 2:
            assert torch.equal(got, expected)  # dA_i = dY_i^T X: the same dot products
        else:
            assert_close(got, expected, rtol=1e-6, atol=1e-5)
    assert got_x.dtype == grad_x.dtype
    error = float((got_x - grad_x).norm() / grad_x.norm())
    assert error <= (2**-7 if autocast else 1e-6), error


class Joins(TorchDispatchMode):
    """The cat and stack calls made, with their outputs' sizes."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.cat, torch.ops.aten.stack):
            self.sizes.append(out.numel())
        return out


@pytest.mark.parametrize("fn, joins_gradients", [(plain, True), (parts, False)],
                         ids=["plain", "parts"])
def test_backward_joins_no_output_gradient(fn, joins_gradients):
    """The output gradient is tokens x 64 columns; the weights' joins (forward's cat of
    [A_q A_kv], backward's interleaved K/V rows) are 16 x 64 or less. Plain autograd fails
    this, which shows the test can."""
    x, params = inputs(bias=False)
    outs = fn(x, *(p.requires_grad_() for p in params[:2]), None, None)
    with Joins() as joins:
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    tokens = BATCH * SEQ
    assert any(size >= tokens * KV_HEADS * HEAD for size in joins.sizes) == joins_gradients


def backward_joins(plain: bool) -> list[tuple[str, tuple]]:
    """The joins (cat, stack, a slice's backward: zeros with the slice copied in) of activation
    size in the backward graph of the compiled GPT-2 style model at TP=1, as inductor would
    get it; `plain`: with the parts turned off (the one-matmul backward FP8 keeps)."""
    torch._dynamo.reset()
    cfg = CONFIGS["gpt2"]
    graphs = []
    backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm),
                           bw_compiler=lambda gm, _: graphs.append(gm) or make_boxed_func(gm))
    model = GPT(cfg, ParallelState(), seed=0)
    model.compile(backend=backend)
    ids, _, labels = padded_batch(cfg, "right")
    with mock.patch.object(layers, "HIGH", object()) if plain else nullcontext():
        model(ids, labels=labels, loss_scale=0.1).loss.backward()
    assert graphs
    joins = (torch.ops.aten.cat, torch.ops.aten.stack, torch.ops.aten.slice_backward)
    found = [(str(node.target), tuple(node.meta["val"].shape)) for gm in graphs
             for node in gm.graph.nodes if getattr(node.target, "overloadpacket", None) in joins]
    # Activations lead with [batch, seq] or [tokens]; the weights' joins (K/V's rows) do not.
    return [(op, shape) for op, shape in found
            if shape[:2] == tuple(ids.shape) or shape[0] == ids.numel()]


def test_the_compiled_backward_joins_no_output_gradient():
    """What inductor is given: with the parts, no activation-sized join at all in backward
    (GPT-2 style: no rotary, whose rotate-half is a cat of its own); without them, Q/K/V's."""
    assert backward_joins(plain=False) == []
    assert backward_joins(plain=True)
