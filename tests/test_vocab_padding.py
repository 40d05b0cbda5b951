"""Padded vocab columns get no probability mass and no gradient, whatever the padded rows hold.

(That the padding does not depend on TP is what the TP parity tests show: the TP=2 and TP=4
models equal the TP=1 model, padded vocabulary included.)"""
import pytest
import torch
from torch.testing import assert_close

from megalite.model import GPT
from megalite.parallel.state import ParallelState
from tests.support.models import CONFIGS, padded_batch

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
def test_padded_columns_get_no_mass_and_do_not_change_the_loss(config_name):
    cfg = CONFIGS[config_name]
    model = GPT(cfg, ParallelState(), seed=0)
    ids, mask, labels = padded_batch(cfg, "right")
    out = model(ids, labels=labels)
    assert bool((out.logits[..., cfg.vocab_size:] == float("-inf")).all())
    out.token_losses.sum().backward()
    rows = model.head.rows  # its own, or the tied embedding's
    assert bool((rows.grad[cfg.vocab_size:] == 0).all())

    with torch.no_grad():
        rows[cfg.vocab_size:] = 100.0  # whatever the padded rows hold
    changed = model(ids, labels=labels)
    assert_close(changed.logits[..., : cfg.vocab_size], out.logits[..., : cfg.vocab_size])
    assert_close(changed.token_losses, out.token_losses)
