"""Context parallelism is the single-process model: each rank holds a zig-zag share of every
row's tokens, and the logits, the loss and every gradient (summed over CP x DP, TP shards
gathered) equal one process's, fp32 to 1e-5, on right-padded (Llama, GQA) and packed (GPT-2,
tied) rows; with TP and sequence parallelism, and with DP."""
import dataclasses
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.nn.attention.flex_attention as torch_flex
from torch.testing import assert_close

from megalite.config import ParallelConfig
from megalite.model import GPT
from megalite.parallel.context import zigzag_index, zigzag_order
from megalite.parallel.mappings import all_gather
from megalite.parallel.ring_attention import Ring, ring_attention
from megalite.parallel.sharding import shard_of
from megalite.parallel.state import ParallelState
from megalite.typed_config import replaced
from tests.support.attention import config, flex_on_cpu, packed_batch
from tests.support.harness import run_distributed
from tests.support.models import CONFIGS, full_sequence, gather_full, padded_batch

TOL = dict(atol=1e-5, rtol=1e-5)
SEQ = 16  # cuts into 2 x cp x tp = 8 chunks at CP4, and at CP2 x TP2 with SP


def attention_work(seq: int, cp: int, zigzag: bool = True) -> list[int]:
    """Causal (query, key) pairs each CP rank's queries attend, zig-zag or contiguous split:
    the attention FLOPs per rank, counted."""
    work = []
    for rank in range(cp):
        if zigzag:
            index = zigzag_index(seq, cp, rank)
        else:
            index = torch.arange(rank * seq // cp, (rank + 1) * seq // cp)
        work.append(int((index + 1).sum()))
    return work



def batch(kind: str, cfg):
    """ids, attention mask, doc ids, labels: right-padded rows or packed documents."""
    if kind == "packed":
        return packed_batch(cfg.vocab_size, SEQ)
    ids, mask, labels = padded_batch(cfg, "right", lengths=(SEQ, 7, 3, 10))
    return ids, mask, None, labels


def reference(cfg, ids, mask, docs, labels):
    model = GPT(cfg, ParallelState(), seed=3)
    out = model(ids, attention_mask=mask, doc_ids=docs, labels=labels)
    loss = out.token_losses.sum() / (labels != -100).sum()
    loss.backward()
    return model, model.full_logits(out.logits).detach(), loss.detach()


def check_cp(config_name: str, kind: str, tp: int, cp: int, sp: bool, comm: str):
    cfg = {**CONFIGS, **CONFIGS_KV1}[config_name]
    layout = ParallelConfig(tp=tp, cp=cp, cp_comm=comm, sequence_parallel=sp)
    ps = ParallelState.from_world(tp, pipeline=layout)
    ids, mask, docs, labels = batch(kind, cfg)
    ref, ref_logits, ref_loss = reference(cfg, ids, mask, docs, labels)

    model = GPT(cfg, ps, seed=3, parallel=layout)
    rows = slice(ps.dp_rank * len(ids) // ps.dp_size, (ps.dp_rank + 1) * len(ids) // ps.dp_size)
    # Right-padded rows take no mask, as training does (causal alone is exact there).
    mine = [None if t is None else t[rows] for t in (ids, mask if kind == "packed" else None, docs, labels)]
    out = model(mine[0], attention_mask=mine[1], doc_ids=mine[2], labels=mine[3])
    loss = out.token_losses.sum() / (labels != -100).sum()
    loss.backward()
    logits = full_sequence(model, model.full_logits(out.logits.detach()))
    losses = full_sequence(model, out.token_losses.detach())
    if ps.dp_size > 1:
        logits, losses = all_gather(logits, 0, ps.dp_group), all_gather(losses, 0, ps.dp_group)
    real = labels != -100
    assert_close(logits[real], ref_logits[real], **TOL)
    assert_close(losses.sum() / real.sum(), ref_loss, **TOL)
    refs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad, group=ps.grad_group)
        assert_close(gather_full(p.grad, shard_of(p), ps), refs[name].grad, **TOL,
                     msg=lambda m: f"{name}: {m}")


LAYOUTS = {"cp2": (2, 1, 2, False), "cp4": (4, 1, 4, False), "cp2xtp2-sp": (4, 2, 2, True),
           "cp2xdp2": (4, 1, 2, False)}
# One K/V head over TP2: both TP ranks keep a copy of it (n_kv_heads < tp).
CONFIGS_KV1 = {"llama-kv1": replaced(CONFIGS["llama"], "attention.n_kv_heads", 1)}


@pytest.mark.exactness
@pytest.mark.parametrize("config_name, kind", [("llama", "padded"), ("gpt2", "packed")])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("comm", ["all_gather", "p2p"])
def test_context_parallel_model_equals_single_process(config_name, kind, layout, comm):
    world, tp, cp, sp = LAYOUTS[layout]
    run_distributed(check_cp, world, config_name, kind, tp, cp, sp, comm)


@pytest.mark.exactness
@pytest.mark.parametrize("comm", ["all_gather", "p2p"])
def test_context_parallel_with_fewer_kv_heads_than_tp_ranks(comm):
    run_distributed(check_cp, 4, "llama-kv1", "padded", 2, 2, False, comm)


@pytest.mark.unit
def test_zigzag_split_covers_the_row_once_and_balances_causal_work():
    for cp in (1, 2, 4):
        assert torch.equal(zigzag_order(32, cp).sort().values, torch.arange(32))
    assert zigzag_index(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag_index(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    seq, cp = 1024, 4
    chunk = seq // (2 * cp)
    balanced, contiguous = attention_work(seq, cp), attention_work(seq, cp, zigzag=False)
    assert sum(balanced) == sum(contiguous) == seq * (seq + 1) // 2  # every causal pair once
    # Zig-zag: the same work on every rank; contiguous: the last rank's is about 2 cp - 1
    # times the first's.
    assert max(balanced) == min(balanced)
    assert abs(contiguous[-1] / contiguous[0] - (2 * cp - 1)) < 0.05


def check_flex_rule(config_name: str):
    """The CP layout's FlexAttention rule (GPU's path) gives the dense rule's logits (forward:
    CPU flex has no backward)."""
    cfg = config(config_name, SEQ)
    ps = ParallelState.from_world(1, pipeline=ParallelConfig(cp=2))
    ids, mask, docs, labels = packed_batch(cfg.vocab_size, SEQ)
    model = GPT(cfg, ps, seed=3)
    dense = full_sequence(model, model(ids, attention_mask=mask, doc_ids=docs).logits.detach())
    with flex_on_cpu() as used:
        flex = full_sequence(model, model(ids, attention_mask=mask, doc_ids=docs).logits.detach())
    assert any(fn is torch_flex.flex_attention for fn, _ in used)  # the flex path ran
    real = mask.bool()
    assert_close(flex[real], dense[real], **TOL)


@pytest.mark.exactness
def test_context_parallel_flex_rule_equals_dense():
    run_distributed(check_flex_rule, 2, "gpt2")


@pytest.mark.unit
def test_context_parallel_refuses_dropout_and_short_rows():
    from megalite.typed_config import ConfigError
    from megalite.config import ParallelConfig
    from megalite.plan import check_layout
    cfg = dataclasses.replace(CONFIGS["gpt2"], dropout=0.1)
    with pytest.raises(ConfigError, match="model.dropout=0.1"):  # the plan's check, every entry point's
        check_layout(cfg, ParallelConfig(cp=2), 2)
    model = GPT(CONFIGS["gpt2"], ParallelState(cp_size=2), seed=0)
    with pytest.raises(ValueError, match="does not cut into 4 equal chunks"):
        model(torch.zeros(1, 10, dtype=torch.long))  # before any collective
    # A later pipeline stage sizes its receive by hidden_len: it refuses too, not waiting.
    with pytest.raises(ValueError, match="does not cut into 4 equal chunks"):
        model.split.hidden_len(10)


def check_ring_mask_rows_are_built_once_per_forward(flex: bool) -> None:
    cfg = dataclasses.replace(config("gpt2", SEQ), n_layers=3)
    ring = ParallelConfig(cp=2, cp_comm="p2p")
    model = GPT(cfg, ParallelState.from_world(1, pipeline=ring), seed=3, parallel=ring)
    ids, mask, docs, labels = packed_batch(cfg.vocab_size, SEQ)
    masks = set()

    def pack(t):
        if t.dtype == torch.bool and t.dim() == 4:
            masks.add(t.untyped_storage().data_ptr())
        return t

    with flex_on_cpu() if flex else nullcontext(), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, attention_mask=mask, doc_ids=docs, labels=labels)
    assert len(masks) == 1, f"{len(masks)} mask tensors saved by {cfg.n_layers} layers"


@pytest.mark.exactness
@pytest.mark.parametrize("flex", [False, True], ids=["dense", "where-flex-runs"])
def test_ring_attention_mask_rows_are_built_once_and_shared_by_the_layers(flex):
    run_distributed(check_ring_mask_rows_are_built_once_per_forward, 2, flex)


def check_ring_math_ignores_autocast() -> None:
    ps = ParallelState.from_world(1, pipeline=ParallelConfig(cp=2, cp_comm="p2p"))
    ring, local = Ring(ps.cp_group, ps.device), SEQ // 2
    index = zigzag_index(SEQ, 2, ps.cp_rank, torch.device("cpu"))
    causal = (torch.arange(SEQ) <= index[:, None]).view(1, 1, local, SEQ)
    generator = torch.Generator().manual_seed(ps.cp_rank)
    # Scores of a few units, as in a trained model: bf16 matmuls would visibly move them.
    q, k, v = (torch.randn(2, 4, local, 16, generator=generator).mul(3).bfloat16().requires_grad_()
               for _ in range(3))
    results = []
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = ring_attention(q, k, v, causal, ring)
        results.append([out, *torch.autograd.grad(out.float().square().sum(), (q, k, v))])
    for name, plain, autocast in zip(("out", "dq", "dk", "dv"), *results):
        assert torch.equal(plain, autocast), name


@pytest.mark.exactness
def test_ring_attention_math_stays_fp32_under_bf16_autocast():
    run_distributed(check_ring_math_ignores_autocast, 2)


@pytest.mark.unit
def test_padded_micro_batches_widen_to_whole_chunks():
    import numpy as np

    from megalite.data.batches import collate
    rows = [np.arange(6), np.arange(3)]  # widths 5 and 2: the micro-batch is 5 wide
    plain, widened = collate("padded", rows, 7), collate("padded", rows, 7, width_multiple=8)
    assert plain.input_ids.shape == (2, 5) and widened.input_ids.shape == (2, 8)
    assert torch.equal(widened.input_ids[:, :5], plain.input_ids) and (widened.input_ids[:, 5:] == 7).all()
    assert torch.equal(widened.labels[:, :5], plain.labels) and (widened.labels[:, 5:] == -100).all()
    assert widened.attention_mask[:, 5:].sum() == 0
