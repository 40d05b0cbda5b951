"""Sequence parallelism (parallel.sequence_parallel): the same model as without it (its
collectives, counted: tests/test_tools_comm.py; its smaller activations, measured:
tests/test_tools_activation_memory.py).

- exact: at TP=2, TP=4 and TP=2 x DP=2, SP on gives SP off's logits, loss and every gradient,
  and the single-process model's, in fp32 to 1e-5, for both test configs, on right-, left-padded
  and packed batches, with a length that does not divide by TP (padded inside the model);
- dropout: each rank drops its own shard with its own mask, replicated parameters stay
  identical across TP ranks over training steps, recomputation replays the masks exactly;
- generation (KV cache: SP off; no cache: SP on) equals TP=1; DeepSpeed ZeRO-2 trains the same;
- a max_seq_len that TP does not divide is refused before any collective.
"""
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from megalite.config import ModelConfig, ParallelConfig
from megalite.plan import check_layout
from megalite.model import GPT
from megalite.parallel.mappings import all_gather
from megalite.parallel.sharding import shard_of
from megalite.parallel.state import ParallelState, init_parallel
from megalite.run_config import TrainConfig
from megalite.training.engine import NativeEngine
from megalite.typed_config import ConfigError
from tests.support.generation import check_cache_and_batching
from tests.support.harness import run_distributed
from tests.support.models import CONFIGS, gather_full, padded_batch, same_on_all_ranks

TOL = dict(atol=1e-5, rtol=1e-5)


def batches(cfg: ModelConfig) -> dict:
    """name -> (ids, attention mask, doc ids, labels); lengths 12 and 11 (11: padded to shards)."""
    right, left = padded_batch(cfg, "right"), padded_batch(cfg, "left")
    odd = padded_batch(cfg, "left", lengths=(11, 6, 3, 9), seed=1)
    ids = torch.randint(0, cfg.vocab_size, (4, 11), generator=torch.Generator().manual_seed(2))
    docs = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]).expand(4, -1)
    labels = ids.roll(-1, dims=1).masked_fill(docs != docs.roll(-1, dims=1), -100)
    return {"right": (right[0], None, None, right[2]), "left": (left[0], left[1], None, left[2]),
            "left, length 11": (odd[0], odd[1], None, odd[2]), "packed, length 11": (ids, None, docs, labels)}


def logits_loss_grads(model: GPT, batch, ps: ParallelState) -> tuple:
    """Whole logits, the loss (mean over the global batch's real tokens) and whole gradients of
    `model` run on this DP rank's rows of `batch`."""
    ids, mask, docs, labels = batch
    rows = slice(ps.dp_rank * len(ids) // ps.dp_size, (ps.dp_rank + 1) * len(ids) // ps.dp_size)
    pick = lambda t: None if t is None else t[rows]  # noqa: E731
    out = model(ids[rows], attention_mask=pick(mask), doc_ids=pick(docs), labels=labels[rows])
    loss = out.token_losses.sum() / (labels != -100).sum()
    loss.backward()
    logits, loss = model.full_logits(out.logits.detach()), loss.detach()
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad
        if ps.dp_size > 1:
            dist.all_reduce(grad, group=ps.dp_group)
        grads[name] = gather_full(grad, shard_of(p), ps)
    if ps.dp_size > 1:
        dist.all_reduce(loss, group=ps.dp_group)
        logits = all_gather(logits, 0, ps.dp_group)
    return logits, loss, grads


def check_sequence_parallel_is_exact(config_name: str, tp: int, seed: int = 3):
    cfg = CONFIGS[config_name]
    layouts = {"single process": ParallelState(), "SP off": ParallelState.from_world(tp)}
    sp, on = ParallelState.from_world(tp), ParallelConfig(tp=tp, sequence_parallel=True)
    for batch_name, batch in batches(cfg).items():
        logits, loss, grads = logits_loss_grads(GPT(cfg, sp, seed=seed, parallel=on), batch, sp)
        real = batch[3] != -100
        for ref_name, ps in layouts.items():
            ref_logits, ref_loss, ref_grads = logits_loss_grads(GPT(cfg, ps, seed=seed), batch, ps)
            where = f"{batch_name}, SP against {ref_name}"
            assert_close(logits[real], ref_logits[real], **TOL, msg=lambda m: f"{where}, logits: {m}")
            assert_close(loss, ref_loss, **TOL, msg=lambda m: f"{where}, loss: {m}")
            assert grads.keys() == ref_grads.keys()
            for name, grad in grads.items():
                assert_close(grad, ref_grads[name], **TOL, msg=lambda m: f"{where}, {name}: {m}")


# Both configs at TP=2; TP=4 on the Llama config (GQA with fewer KV heads than ranks), DP on
# the GPT-2 one (learned positions, biases): each path covered once, in CI time.
@pytest.mark.exactness
@pytest.mark.parametrize("config_name,tp,world", [("gpt2", 2, 2), ("llama", 2, 2), ("llama", 4, 4),
                                                  ("gpt2", 2, 4)],
                         ids=["tp2-gpt2", "tp2-llama", "tp4-llama", "tp2xdp2-gpt2"])
def test_sequence_parallel_equals_tensor_parallel_and_one_process(config_name, tp, world):
    run_distributed(check_sequence_parallel_is_exact, world, config_name, tp)


def check_dropout_on_shards():
    ps = ParallelState.from_world(2)
    cfg = dataclasses.replace(CONFIGS["llama"], dropout=0.5)  # rotary: no position table
    model = GPT(cfg, ps, seed=4, parallel=ParallelConfig(tp=2, sequence_parallel=True)).train()
    entering = []
    model.blocks[0].register_forward_pre_hook(lambda module, args: entering.append(args[0].detach()))
    # Both shards hold the same tokens, so they are equal up to the embedding's dropout.
    ids = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0)).repeat(1, 2)
    torch.manual_seed(1)
    model(ids, labels=ids).token_losses.sum().backward()
    model.eval()(ids)
    dropped, plain = (all_gather(x.unsqueeze(0), 0, ps.tp_group) for x in entering)
    assert torch.equal(plain[0], plain[1])
    assert not torch.equal(dropped[0], dropped[1])
    # Each rank's replicated parameters got the gradient summed over every shard.
    for name, p in model.named_parameters():
        if shard_of(p) is None:
            assert same_on_all_ranks(p.grad, ps.tp_group), name


@pytest.mark.exactness
def test_each_rank_drops_its_shard_with_its_own_mask():
    run_distributed(check_dropout_on_shards, 2)


def check_recompute_replays_sequence_parallel_dropout(config_name: str):
    ps, sp = ParallelState.from_world(2), ParallelConfig(tp=2, sequence_parallel=True)
    cfg = dataclasses.replace(CONFIGS[config_name], dropout=0.2)
    for name, (ids, mask, docs, labels) in batches(cfg).items():
        grads = []
        for recompute in (False, True):
            torch.manual_seed(1)
            model = GPT(cfg, ps, seed=4, activation_checkpointing=recompute, parallel=sp).train()
            model(ids, attention_mask=mask, doc_ids=docs, labels=labels).token_losses.sum().backward()
            grads.append({n: p.grad for n, p in model.named_parameters()})
        for param, grad in grads[0].items():
            assert torch.equal(grad, grads[1][param]), (name, param)

    # A few steps of training with dropout and recomputation: the replicated parameters stay
    # identical on both TP ranks (their gradients are whole on each), and the loss goes down.
    torch.manual_seed(1)
    model = GPT(cfg, ps, seed=4, activation_checkpointing=True, parallel=sp).train()
    engine = NativeEngine(model, TrainConfig(lr=3e-3, warmup_steps=0), ps)
    ids, mask, _, labels = batches(cfg)["left, length 11"]
    losses = []
    for _ in range(6):
        loss = engine.module(ids, attention_mask=mask, labels=labels).token_losses.sum() / (labels != -100).sum()
        engine.backward(loss, last=True)
        engine.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    for name, p in model.named_parameters():
        if shard_of(p) is None:
            assert same_on_all_ranks(p.detach(), ps.tp_group), name


@pytest.mark.exactness
@pytest.mark.parametrize("config_name", sorted(CONFIGS))
def test_recomputation_replays_sequence_parallel_dropout_and_training_runs(config_name):
    run_distributed(check_recompute_replays_sequence_parallel_dropout, 2, config_name)


@pytest.mark.exactness
def test_generation_with_sequence_parallel_equals_tp1():
    single = check_cache_and_batching(1)
    assert run_distributed(check_cache_and_batching, 2, 2, True) == [single, single]


def check_bf16_autocast(config_name: str):
    """Under autocast the gathered shard is cast first: it runs and matches SP off to bf16."""
    cfg = CONFIGS[config_name]
    ids, mask, _, labels = batches(cfg)["left, length 11"]
    results = []
    for sp in (False, True):
        model = GPT(cfg, ParallelState.from_world(2), seed=3,
                    parallel=ParallelConfig(tp=2, sequence_parallel=sp))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, attention_mask=mask, labels=labels).token_losses.sum()
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        assert all(g.dtype == torch.float32 for g in grads)
        results.append((loss.detach(), grads))
    assert_close(results[1][0], results[0][0], atol=0.05, rtol=0.02)
    for a, b in zip(results[1][1], results[0][1]):
        assert_close(a, b, atol=0.05, rtol=0.1)


@pytest.mark.exactness
@pytest.mark.parametrize("config_name", sorted(CONFIGS))
def test_bf16_autocast(config_name):
    run_distributed(check_bf16_autocast, 2, config_name)


def check_deepspeed_zero2_with_sequence_parallel():
    """ZeRO-2 with SP at TP2 x DP2 trains as the native engine without SP: the replicated
    parameters' gradients are summed over TP inside backward, before ZeRO partitions them."""
    from megalite.training.build import build_engine
    sp = ParallelConfig(tp=2, sequence_parallel=True)
    ps = init_parallel(sp)
    cfg = CONFIGS["gpt2"]
    train = TrainConfig(global_batch_size=4, micro_batch_size=1, grad_clip=0.05, warmup_steps=0)
    engines = [NativeEngine(GPT(cfg, ps, seed=0), train, ps),
               build_engine(GPT(cfg, ps, seed=0, parallel=sp),
                            dataclasses.replace(train, engine="deepspeed", zero_stage=2), ps)]
    assert engines[1].model.tp.sharded and not engines[0].model.tp.sharded
    norms = [[], []]
    for step in range(3):
        for last in (False, True):
            data = torch.Generator().manual_seed(100 * step + 10 * ps.dp_rank + last)
            ids = torch.randint(0, cfg.vocab_size, (1, 11), generator=data)
            for engine in engines:
                engine.backward(engine.module(ids, labels=ids).token_losses.sum() / 40, last=last)
        for engine, norm in zip(engines, norms):
            norm.append(float(engine.step()))
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)
    assert min(norms[0]) > 0.05  # clipping acted
    for (name, a), b in zip(engines[0].model.named_parameters(), engines[1].model.parameters()):
        assert_close(b.detach(), a.detach(), **TOL, msg=name)


@pytest.mark.exactness
@pytest.mark.deepspeed
def test_deepspeed_zero2_with_sequence_parallel_trains_like_native():
    run_distributed(check_deepspeed_zero2_with_sequence_parallel, 4, torchrun_env=True)


@pytest.mark.e2e
def test_max_seq_len_not_divisible_by_tp_is_refused_before_any_collective(monkeypatch):
    cfg = ModelConfig(n_heads=4, hidden=32, max_seq_len=30)
    message = (r"parallel\.sequence_parallel=true splits every sequence into parallel\.tp=4 "
               r"shards, so model\.max_seq_len=30 must be a multiple of 4: use "
               r"max_seq_len=32, or parallel\.sequence_parallel=false")
    with pytest.raises(ConfigError, match=message):
        check_layout(cfg, ParallelConfig(tp=4, sequence_parallel=True), 8)
    check_layout(cfg, ParallelConfig(tp=4), 8)
    check_layout(cfg, ParallelConfig(tp=2, sequence_parallel=True), 8)
    # the entry point checks before init_process_group, on every rank
    from megalite.train import main
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match=message):
        main(["parallel.tp=4", "parallel.sequence_parallel=true", "model.n_heads=4",
              "model.hidden=32", "model.max_seq_len=30", "data.seq_len=30"])
    assert not dist.is_initialized()
