"""FP8 through the matmul seam: one process computes what torchao's own Float8Linear computes,
bit for bit; a column- and row-parallel pair at TP2 (with and without sequence parallelism)
equals the pair in one process (emulated: rowwise's torch._scaled_mm writes bf16, so at fp32
each rank's partial product would be rounded before the sum), because each amax is reduced
over the TP group where TP splits its tensor, and fails to when it is not; train.fp8's layer
choice and refusals."""
import pytest
import torch
import torch.nn.functional as F

from megalite.fp8.convert import convert_to_fp8
from megalite.fp8.recipe import RECIPES, Float8Matmul, float8_config
from megalite.parallel import matmul
from megalite.parallel.contexts import WHOLE
from megalite.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megalite.parallel.mappings import SEQ_DIM
from megalite.parallel.state import ParallelState
from megalite.run_config import Fp8Config
from megalite.typed_config import ConfigError
from tests.support.harness import run_distributed
from tests.support.layers import SINGLE, build, randn


def fp8(recipe: str, emulate: bool = True) -> Float8Matmul:
    return Float8Matmul(float8_config(recipe, emulate))


@pytest.mark.unit
@pytest.mark.parametrize("emulate", [False, True], ids=["scaled_mm", "emulated"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_one_process_is_torchao_float8_linear(recipe, emulate):
    from torchao.float8.float8_linear import Float8Linear
    for cls, args in ((ColumnParallelLinear, (64, 48)), (RowParallelLinear, (64, 48))):
        layer = build(cls, SINGLE, *args, bias=True, init_std=0.5)
        layer.matmul = fp8(recipe, emulate)
        linear = torch.nn.Linear(64, 48)
        linear.load_state_dict(layer.state_dict())
        ref = Float8Linear.from_float(linear, config=float8_config(recipe, emulate))
        x, grad = randn(2, 8, 64, seed=1), randn(2, 8, 48, seed=2)
        outs = []
        for module in (layer, ref):
            xi = x.clone().requires_grad_()
            y = module(xi)
            y.backward(grad)
            outs.append((y, xi.grad, module.weight.grad, module.bias.grad))
        for mine, theirs in zip(*outs):
            assert torch.equal(mine, theirs), (cls.__name__, recipe)


def pair(ps, recipe, sp=False):
    up = build(ColumnParallelLinear, ps, 64, 96, bias=False, init_std=0.5, sequence_parallel=sp)
    down = build(RowParallelLinear, ps, 96, 64, bias=True, init_std=0.5, sequence_parallel=sp)
    up.matmul = down.matmul = fp8(recipe)
    return up, down


def run_pair(ps, recipe, x, grad, sp):
    up, down = pair(ps, recipe, sp)
    x = x.clone().requires_grad_()
    y = down(F.gelu(up(x)))
    y.backward(grad)
    return y.detach(), x.grad, up, down


def check_pair(recipe: str, sp: bool, reduce: bool):
    """On each TP2 rank: the largest difference to the one-process pair, relative to the
    largest value, over the output, the input gradient and both weights' gradients (this rank's
    slices)."""
    if not reduce:
        matmul.Splits.of = lambda self, dims: ()
    ps = ParallelState.from_world(2)
    r = ps.tp_rank
    x, grad = randn(2, 16, 64, seed=1) * 3, randn(2, 16, 64, seed=2)
    ref = run_pair(SINGLE, recipe, x, grad, False)
    shard = (lambda t: t.chunk(2, SEQ_DIM)[r]) if sp else (lambda t: t)
    mine = run_pair(ps, recipe, shard(x), shard(grad), sp)
    pairs = [(mine[0], shard(ref[0])), (mine[1], shard(ref[1])),
             (mine[2].weight.grad, ref[2].weight.grad.chunk(2, 0)[r]),
             (mine[3].weight.grad, ref[3].weight.grad.chunk(2, 1)[r])]
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in pairs)


@pytest.mark.exactness
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_a_tp2_pair_scales_as_one_process(recipe, sp):
    assert max(run_distributed(check_pair, 2, recipe, sp, True)) < 1e-6
    if recipe == "tensorwise":
        # Each rank scaling by the amax of its own slice: not one process's numbers. (Rowwise
        # scales are powers of 2, and floats scale by those exactly: a wrong amax shows only
        # where values reach FP8's subnormals or its maximum.)
        assert max(run_distributed(check_pair, 2, recipe, sp, False)) > 1e-3


@pytest.mark.unit
def test_layers_auto_keeps_small_layers_in_high_precision():
    from megalite.model.mlp import MLP
    from megalite.config import Dense, ModelConfig
    cfg = ModelConfig(hidden=64, n_heads=4, mlp=Dense(ffn_hidden=128))
    assert convert_to_fp8(MLP(cfg, WHOLE), Fp8Config(recipe="rowwise"), SINGLE) == []
    chosen = convert_to_fp8(MLP(cfg, WHOLE), Fp8Config(recipe="rowwise", layers="all",
                                                         exclude=("down",)), SINGLE)
    assert chosen == ["up"]


def check_partial_gradients_refused():
    """At TP2: a KV slice held by both ranks (n_kv_heads=1), and latent attention's replicated
    down-projections, are refused with the layer named and the fix."""
    from megalite.config import GroupedQuery, Latent, ModelConfig, Rotary
    from megalite.model.attention import Attention
    from megalite.model.latent_attention import LatentAttention
    from megalite.parallel.contexts import Contexts
    from megalite.parallel.random import TensorParallelRNG
    ps = ParallelState.from_world(2)
    rng, parallel = TensorParallelRNG(0, ps.tp_rank), Contexts.of(ps, False, "all_gather")
    fp8 = Fp8Config(recipe="tensorwise", layers="all")
    gqa = ModelConfig(hidden=64, n_heads=4, attention=GroupedQuery(n_kv_heads=1), positions=Rotary(), bias=False)
    with pytest.raises(ConfigError, match=r"on kv_proj: its slice is held by 2 TP ranks.*"
                                          r"'kv_proj' to train.fp8.exclude"):
        convert_to_fp8(Attention(gqa, parallel.tp, parallel.cp, rng, layer=0), fp8, ps)
    mla = ModelConfig(hidden=64, n_heads=4, positions=Rotary(), bias=False,
                      attention=Latent(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=8,
                                       qk_rope_head_dim=16, v_head_dim=8))
    with pytest.raises(ConfigError, match=r"on q_down: its slice is held by 2 TP ranks"):
        convert_to_fp8(LatentAttention(mla, parallel.tp, parallel.cp, rng, layer=0), fp8, ps)
    chosen = convert_to_fp8(LatentAttention(mla, parallel.tp, parallel.cp, rng, layer=0),
                            Fp8Config(recipe="tensorwise", layers="all", exclude=("down",)), ps)
    return chosen


@pytest.mark.exactness
def test_a_slice_held_by_several_ranks_is_refused():
    assert run_distributed(check_partial_gradients_refused, 2) == [["q_up", "kv_up", "out_proj"]] * 2


@pytest.mark.unit
@pytest.mark.parametrize("settings, named", [
    (["data.mode=padded", "parallel.cp=2"], "parallel.cp=2: rows are padded"),
    (["data.mode=padded", "parallel.tp=2", "parallel.sequence_parallel=true"], "sequence parallelism"),
    (["data.seq_len=33", "parallel.tp=2", "parallel.sequence_parallel=true"], "data.seq_len=33"),
    (["parallel.cp=2", "parallel.ep=3", "model.mlp.kind=moe", "model.mlp.experts=6"], "parallel.ep=3 and parallel.cp=2"),
])
def test_layouts_whose_scales_could_not_be_one_process_are_refused(settings, named):
    from megalite.fp8.convert import fp8_problems
    from megalite.plan import raise_problems
    from megalite.run_config import load_config
    cfg = load_config(None, ["model=tiny", "data.seq_len=64", "train.fp8.recipe=tensorwise", *settings])
    with pytest.raises(ConfigError, match=named):
        raise_problems(fp8_problems(cfg))
    assert fp8_problems(load_config(None, ["model=tiny", *settings])) == []  # without FP8: fine
