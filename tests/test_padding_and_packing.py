"""Padded and packed batches give, at every real position, the logits of each sequence run alone."""
import pytest
import torch
from torch.testing import assert_close

from megalite.model import GPT
from megalite.model.layout import sequence_layout
from megalite.parallel.state import ParallelState
from tests.support.models import CONFIGS, PAD_ID, padded_batch, sequences

pytestmark = pytest.mark.unit

TOL = dict(atol=1e-5, rtol=1e-5)


def alone(model: GPT, seqs) -> list[torch.Tensor]:
    return [model(s).logits[0] for s in seqs]


@pytest.fixture(params=sorted(CONFIGS))
def model(request):
    return GPT(CONFIGS[request.param], ParallelState(), seed=11).eval()


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_equals_each_sequence_alone(model, side):
    ids, mask, _ = padded_batch(model.cfg, side)
    logits = model(ids, attention_mask=mask).logits
    for row, (expected, m) in enumerate(zip(alone(model, sequences(model.cfg)), mask.bool())):
        assert_close(logits[row][m], expected, **TOL)


def test_right_padding_takes_the_plain_causal_path_and_needs_no_mask(model):
    """Real tokens form a prefix, so causal attention alone never lets them see a pad."""
    ids, mask, _ = padded_batch(model.cfg, "right")
    assert sequence_layout(ids, mask).mask is None
    with_mask = model(ids, attention_mask=mask).logits
    without = model(ids).logits
    real = mask.bool()
    assert torch.equal(with_mask[real], without[real])
    for row, expected in enumerate(alone(model, sequences(model.cfg))):
        assert_close(without[row][real[row]], expected, **TOL)


def test_left_padding_needs_and_gets_an_explicit_mask(model):
    ids, mask, _ = padded_batch(model.cfg, "left")
    layout = sequence_layout(ids, mask)
    assert layout.mask is not None
    assert layout.positions[2].tolist()[-3:] == [0, 1, 2]  # counted from the first real token
    # Without the mask the real tokens would attend the pads before them.
    real = mask.bool()
    assert not torch.allclose(model(ids).logits[real], model(ids, attention_mask=mask).logits[real])


@pytest.mark.parametrize("trailing_pad", [0, 3])
def test_packed_batch_equals_each_document_alone(model, trailing_pad):
    docs = sequences(model.cfg, lengths=(5, 1, 8, 4), seed=2)
    ids = torch.cat(docs + [torch.full((1, trailing_pad), PAD_ID)], dim=1)
    doc_ids = torch.cat([torch.full((1, d.shape[1]), i) for i, d in enumerate(docs)]
                        + [torch.full((1, trailing_pad), len(docs))], dim=1)
    mask = (torch.arange(ids.shape[1]) < ids.shape[1] - trailing_pad).long().unsqueeze(0)
    layout = sequence_layout(ids, mask, doc_ids)
    assert layout.positions[0, :18].tolist() == [*range(5), 0, *range(8), *range(4)]
    logits = model(ids, attention_mask=mask, doc_ids=doc_ids).logits[0]
    start = 0
    for doc, expected in zip(docs, alone(model, docs)):
        assert_close(logits[start:start + doc.shape[1]], expected, **TOL)
        start += doc.shape[1]
    assert torch.isfinite(logits[:, : model.cfg.vocab_size]).all()


def test_packed_row_with_left_padding_counts_positions_from_the_first_real_token(model):
    """Pads that share the first document's id must not shift its positions (learned
    positions see absolute positions; rotary ones would hide the error)."""
    docs = sequences(model.cfg, lengths=(4, 3), seed=5)
    ids = torch.cat([torch.full((1, 2), PAD_ID)] + docs, dim=1)
    doc_ids = torch.tensor([[0, 0, 0, 0, 0, 0, 1, 1, 1]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1]])
    assert sequence_layout(ids, mask, doc_ids).positions[0, 2:].tolist() == [0, 1, 2, 3, 0, 1, 2]
    logits = model(ids, attention_mask=mask, doc_ids=doc_ids).logits[0]
    expected = alone(model, docs)
    assert_close(logits[2:6], expected[0], **TOL)
    assert_close(logits[6:], expected[1], **TOL)


def test_a_fully_padded_row_stays_finite(model):
    ids, mask, labels = padded_batch(model.cfg, "left", lengths=(6, 0))
    out = model.train()(ids, attention_mask=mask, labels=labels)
    out.token_losses.sum().backward()
    assert torch.isfinite(out.logits[..., : model.cfg.vocab_size]).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
