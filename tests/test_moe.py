"""Mixture of experts: every expert-parallel layout is the single-process model.

- routing: ties go to the lower expert index; capacity drops the later copies (by place in the
  batch) and counts only real tokens;
- one step (logits, loss with the balancing losses, every gradient, the experts' loads) equals
  one process in fp32 to 1e-5 at EP2 (with activation checkpointing), EP4, EP2 x TP2 with SP,
  EP2 x CP2, and EP2 x PP2 through the pipeline schedule and the engine's gradient sync; top-1
  and top-2, softmax and sigmoid routers, shared experts, dropless and with a capacity factor;
  a batch where one EP rank and two experts receive no token at all (the all-to-alls' bytes per
  MoE layer: tests/test_tools_comm.py);
- a layout expert parallelism cannot split is refused before any collective.
"""

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch.testing import assert_close

from megalite.config import ParallelConfig
from megalite.plan import check_layout
from megalite.data.batches import Batch
from megalite.model import GPT
from megalite.model.moe import MoE
from megalite.parallel.mappings import all_gather, group_size
from megalite.parallel.sharding import expert_shard_of, shard_of
from megalite.parallel.state import ParallelState
from megalite.pipeline.runner import forward_pipelined, train_pipelined
from megalite.run_config import TrainConfig, load_config
from megalite.training.engine import NativeEngine
from megalite.training.grads import sum_embedding_copies
from megalite.typed_config import ConfigError, replaced
from tests.support.harness import run_distributed
from tests.support.models import CONFIGS, full_sequence, gather_full, padded_batch, with_changes
from tests.support.moe import MOE, moe_layers, moe_layers_by_name

TOL = dict(atol=1e-5, rtol=1e-5)
LENGTHS = (12, 7, 3, 10, 8, 12, 5, 1)


def force_routing(model: GPT, scores: list[float]) -> None:
    """Every token's router logits become `scores`: the MoE layers' norms output one vector v
    (weight 0, bias v) and the router's rows are scores_e v / |v|^2."""
    v = torch.linspace(-1.0, 1.0, model.cfg.hidden)
    with torch.no_grad():
        for name, block in model.blocks.items():
            if isinstance(block.mlp, MoE):
                block.mlp_norm.weight.zero_()
                block.mlp_norm.bias.copy_(v)
                block.mlp.router.weight.copy_(torch.tensor(scores).unsqueeze(1) * v / v.square().sum())


def step(model: GPT, chunks: list, scale: torch.Tensor, ps: ParallelState) -> tuple:
    """This rank's micro-batches through forward and backward (loss_scale: the global batch's
    1 / tokens, as training does): their logits (whole: TP's vocab, CP's shares), their loss and
    this rank's part of the balancing losses."""
    logits, loss = [], torch.zeros(())
    for ids, mask, labels in chunks:
        out = model(ids, attention_mask=mask, labels=labels, loss_scale=scale)
        out.loss.backward()
        loss += out.loss.detach()
        full = model.full_logits(out.logits.detach())
        logits.append(full_sequence(model, full) if ps.cp_size > 1 else full)
    aux = sum((m.aux_loss for m in moe_layers(model)), torch.zeros(()))
    return logits, loss, aux


def whole_grads(model: GPT, ps: ParallelState, summed: bool = False) -> dict:
    """Every parameter's gradient summed over its replicas (unless `summed` already, by the
    engine), each whole (TP's and EP's slices)."""
    grads = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:  # the expert bias
            continue
        grad = p.grad.clone()
        expert = expert_shard_of(p) is not None
        replicas = ps.expert_grad_group if expert else ps.grad_group
        if not summed and group_size(replicas) > 1:
            dist.all_reduce(grad, group=replicas)
        if expert:
            grads[name] = all_gather(grad, 0, ps.ep_group) if ps.ep_size > 1 else grad
        else:
            grads[name] = gather_full(grad, shard_of(p), ps)
    return grads


def total(x: torch.Tensor, *groups) -> torch.Tensor:
    for group in groups:
        if group_size(group) > 1:
            dist.all_reduce(x, group=group)
    return x


def check_moe_step(config: str, parallel: ParallelConfig, side: str, overrides: dict,
                   scores: list[float] | None = None, recompute: bool = False):
    cfg = with_changes(MOE[config], overrides)
    ps = ParallelState.from_world(parallel.tp, pipeline=parallel)
    ids, mask, labels = padded_batch(cfg, side, lengths=LENGTHS)
    scale = 1.0 / (labels != -100).sum()
    rows = len(ids) // ps.dp_size
    chunk = lambda d: tuple(t[d * rows:(d + 1) * rows] for t in (ids, mask, labels))  # noqa: E731
    single = GPT(cfg, ParallelState(), seed=3)
    model = GPT(cfg, ps, seed=3, activation_checkpointing=recompute, parallel=parallel)
    if scores is not None:
        force_routing(single, scores)
        force_routing(model, scores)
    ref_logits, ref_loss, ref_aux = step(single, [chunk(d) for d in range(ps.dp_size)], scale, ParallelState())
    # The whole forward replayed (torch stops a recompute early, once backward has what it needs)
    with torch.utils.checkpoint.set_checkpoint_early_stop(not recompute):
        logits, loss, aux = step(model, [chunk(ps.dp_rank)], scale, ps)
    assert_close(logits[0], ref_logits[ps.dp_rank], **TOL)
    if group_size(ps.grad_group) > 1:
        dist.all_reduce(loss, group=ps.grad_group)
        dist.all_reduce(aux, group=ps.grad_group)
    if parallel.sequence_parallel and ps.tp_size > 1:  # each TP rank routed its own shard
        dist.all_reduce(aux, group=ps.tp_group)
    assert_close(loss, ref_loss, **TOL)
    assert_close(aux, ref_aux, **TOL)
    assert ref_aux > 0
    ref_grads = {n: p.grad for n, p in single.named_parameters() if p.requires_grad}
    for name, grad in whole_grads(model, ps).items():
        assert_close(grad, ref_grads[name], **TOL, msg=lambda m: f"{name}: {m}")
    loads = [layer.load for layer in moe_layers(single)]
    for layer, load in zip(moe_layers(model), loads):  # counted once, recomputed or not
        if group_size(ps.dp_group) > 1:
            dist.all_reduce(layer.load, group=ps.dp_group)
        assert layer.load.tolist() == load.tolist()
    return [load.tolist() for load in loads]


def check_moe_pipelined(config: str, capacity: float | None) -> None:
    """EP2 x PP2 (x DP2): one step through the 1F1B schedule, two micro-batches per rank, the
    engine summing the gradients (dense over DP, experts over their replicas). Right-padded
    rows with their mask, as training gives an MoE model (its padding goes to no expert)."""
    cfg = replaced(MOE[config], "mlp.capacity_factor", capacity)
    ps = ParallelState.from_world(1, pipeline=ParallelConfig(pp=2, ep=2))
    ids, mask, labels = padded_batch(cfg, "right", lengths=LENGTHS)
    micro = [Batch(ids[r:r + 2], labels[r:r + 2], attention_mask=mask[r:r + 2]) for r in range(0, 8, 2)]
    n_tokens = (labels != -100).sum()
    single = GPT(cfg, ParallelState(), seed=3)
    ref_logits, ref_loss, ref_aux = step(single, [(b.input_ids, b.attention_mask, b.labels) for b in micro],
                                         1.0 / n_tokens, ParallelState())
    mine = micro[2 * ps.dp_rank: 2 * ps.dp_rank + 2]
    fp32 = torch.autocast("cpu", enabled=False)

    logits = {}
    forward_pipelined(GPT(cfg, ps, seed=3), mine, fp32, lambda i, out: logits.update({i: out.logits}))
    assert len(logits) == (2 if ps.pp_rank == 1 else 0)
    for i, got in logits.items():
        assert_close(single.full_logits(got), ref_logits[2 * ps.dp_rank + i], **TOL)

    model = GPT(cfg, ps, seed=3)
    engine = NativeEngine(model, TrainConfig(precision="fp32"), ps)
    loss = train_pipelined(engine, mine, n_tokens.float(), fp32, "1f1b")
    engine.grad_sync.wait()
    sum_embedding_copies(model, engine.master, ps)
    assert_close(total(loss, ps.dp_group, ps.pp_group), ref_loss, **TOL)
    layers, ref_layers = moe_layers_by_name(model), moe_layers_by_name(single)
    aux = total(sum((m.aux_loss for m in layers.values()), torch.zeros(())), ps.dp_group, ps.pp_group)
    assert_close(aux, ref_aux, **TOL)
    for name, layer in layers.items():
        assert total(layer.load, ps.dp_group).tolist() == ref_layers[name].load.tolist(), name
    ref_grads = dict(single.named_parameters())
    for name, grad in whole_grads(model, ps, summed=True).items():
        assert_close(grad, ref_grads[name].grad, **TOL, msg=lambda m: f"{name}: {m}")


# name: (world, layout, activation checkpointing)
LAYOUTS = {
    "EP2, recomputed": (2, ParallelConfig(ep=2), True),
    "EP4": (4, ParallelConfig(ep=4), False),
    "EP2 x TP2, SP": (4, ParallelConfig(tp=2, ep=2, sequence_parallel=True), False),
    "EP2 x CP2": (2, ParallelConfig(cp=2, ep=2), False),
}


@pytest.mark.exactness
@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_step_equals_one_process(layout):
    world, parallel, recompute = LAYOUTS[layout]
    side = "right" if parallel.cp > 1 else "left"
    for config, capacity in (("top2", None), ("top1 sigmoid shared", 1.0)):
        run_distributed(check_moe_step, world, config, parallel, side,
                        {"mlp.capacity_factor": capacity}, None, recompute)


@pytest.mark.exactness
def test_one_step_through_the_pipeline_equals_one_process():
    for config, capacity in (("top2", None), ("top1 sigmoid shared", 1.0)):
        run_distributed(check_moe_pipelined, 4, config, capacity)


@pytest.mark.exactness
def test_a_rank_and_experts_with_no_tokens():
    """Every token picks experts 0 and 1 (top-2; the tie of experts 1, 2 and 3 goes to the
    lower index): EP rank 1 (experts 2 and 3) receives nothing."""
    loads = run_distributed(check_moe_step, 2, "top1 sigmoid shared", ParallelConfig(ep=2), "left",
                            {"mlp.top_k": 2}, [2.0, 1.0, 1.0, 1.0])
    assert loads[0][0][2:] == [0, 0] and min(loads[0][0][:2]) > 0


@pytest.mark.unit
def test_capacity_drops_by_place_in_the_batch():
    """Capacity 1 / 4 of the copies per expert, every token routed to expert 0 first: the
    first quarter of the real tokens keep their first choice, in batch order."""
    cfg = with_changes(MOE["top1 sigmoid shared"], {"mlp.top_k": 2, "mlp.capacity_factor": 0.5})
    model = GPT(cfg, ParallelState(), seed=3)
    force_routing(model, [3.0, 2.0, 1.0, 0.0])
    ids, mask, _ = padded_batch(cfg, "left", lengths=(12, 7, 3, 10))
    real, key = mask.bool().flatten(), torch.arange(ids.numel())
    x = torch.linspace(-1.0, 1.0, cfg.hidden).expand(ids.numel(), -1)  # what force_routing's norm gives
    route = moe_layers(model)[0].router(x, real, key, loss_scale=None)
    n_real = int(real.sum())  # 32 tokens, 2 copies each, 4 experts: capacity 8 per expert
    assert route.experts.tolist() == [[0, 1]] * len(x)
    kept_rows = route.kept[:, 0].nonzero().squeeze(1)
    assert kept_rows.tolist() == real.nonzero().squeeze(1)[:8].tolist()
    assert route.load.tolist() == [n_real, n_real, 0, 0]


@pytest.mark.unit
def test_expert_parallel_layout_is_checked():
    cfg = MOE["top2"]
    with pytest.raises(ConfigError, match=r"parallel.ep=3 must divide model.mlp.experts=4"):
        check_layout(cfg, ParallelConfig(ep=3), 3)
    with pytest.raises(ConfigError, match=r"parallel.ep=4 must divide the CP x DP ranks \(2"):
        check_layout(cfg, ParallelConfig(tp=2, ep=4), 4)
    with pytest.raises(ConfigError, match=r"model.mlp.kind=dense"):
        check_layout(CONFIGS["gpt2"], ParallelConfig(ep=2), 2)
    # A mixture of experts' settings on a dense model: not a model at all, the loader refuses it.
    for setting in ("model.mlp.capacity_factor=1.0", "model.mlp.shared_experts=1"):
        key = setting.split("=")[0]
        with pytest.raises(ConfigError, match=rf"^{key} is a key of model.mlp.kind=moe, and "
                                              rf"model.mlp.kind=dense: set model.mlp.kind=moe"):
            load_config(None, ["model=tiny", setting])


def decoded_logits(model: GPT) -> torch.Tensor:
    """A prompt's forward, then three greedy steps off the KV cache: every step's whole logits."""
    ids = torch.randint(0, model.cfg.vocab_size, (4, 8), generator=torch.Generator().manual_seed(1))
    cache, steps = model.eval().new_cache(4, 12), []
    with torch.no_grad():
        for _ in range(4):
            steps.append(model.full_logits(model(ids, cache=cache).logits))
            ids = steps[-1][:, -1:].argmax(-1)
    return torch.cat([s.flatten(1) for s in steps], 1)


def capacity_limited():
    return with_changes(MOE["top2"], {"mlp.capacity_factor": 0.6})


def check_capacity_while_decoding(parallel: ParallelConfig) -> torch.Tensor:
    return decoded_logits(GPT(capacity_limited(), ParallelState.from_world(parallel.tp, pipeline=parallel), seed=3,
                              parallel=parallel))


@pytest.mark.exactness
def test_decoding_under_sequence_parallelism_counts_each_token_once():
    """Decoding splits no sequence: the TP ranks hold the same tokens, and the capacity's queue
    counts them once (counted over TP, the copies past capacity were dropped differently)."""
    single = decoded_logits(GPT(capacity_limited(), ParallelState(), seed=3))
    for logits in run_distributed(check_capacity_while_decoding, 2,
                                  ParallelConfig(tp=2, sequence_parallel=True)):
        assert_close(logits, single, **TOL)
