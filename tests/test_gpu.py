"""On a GPU: the model under NCCL (TP=1) matches the fp32 CPU model, and bf16 autocast trains.

Skipped where there is no CUDA device (CI's machines); run on a GPU machine with
`python -m pytest tests/test_gpu.py -q`.
"""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from megalite.model import GPT
from megalite.parallel.state import ParallelState
from tests.models import CONFIGS, padded_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def nccl_state():
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    yield ParallelState.from_world(1, device=torch.device("cuda", 0))
    dist.destroy_process_group()


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
@pytest.mark.parametrize("side", ["right", "left"])
def test_gpu_model_matches_cpu_in_fp32_and_trains_in_bf16(nccl_state, config_name, side):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = CONFIGS[config_name]
    ids, mask, labels = padded_batch(cfg, side)
    cpu = GPT(cfg, ParallelState(), seed=2)
    gpu = GPT(cfg, nccl_state, seed=2)
    cpu_out = cpu(ids, attention_mask=mask, labels=labels)
    cuda = [t.cuda() for t in (ids, mask, labels)]
    gpu_out = gpu(cuda[0], attention_mask=cuda[1], labels=cuda[2])
    real = mask.bool()
    assert_close(gpu.full_logits(gpu_out.logits).cpu()[real], cpu.full_logits(cpu_out.logits)[real],
                 atol=1e-4, rtol=1e-4)
    cpu_out.token_losses.sum().backward()
    gpu_out.token_losses.sum().backward()
    for (name, p), q in zip(gpu.named_parameters(), cpu.parameters()):
        assert_close(p.grad.cpu(), q.grad, atol=1e-4, rtol=1e-4, msg=name)

    with torch.autocast("cuda", dtype=torch.bfloat16):
        bf16 = gpu(cuda[0], attention_mask=cuda[1], labels=cuda[2])
    count = (labels != -100).sum()
    assert_close(bf16.token_losses.sum().cpu() / count, cpu_out.token_losses.sum().detach() / count,
                 atol=0.05, rtol=0.02)
    bf16.token_losses.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in gpu.parameters())
