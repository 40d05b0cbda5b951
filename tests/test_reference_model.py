"""megalite's model equals the transformer written out by hand (tests/support/reference_model.py)."""
import dataclasses

import pytest
from torch.testing import assert_close

from megalite.model import GPT
from megalite.parallel.state import ParallelState
from megalite.typed_config import replaced
from tests.support.models import CONFIGS, sequences
from tests.support.reference_model import reference_logits

pytestmark = pytest.mark.unit

VARIANTS = {
    **CONFIGS,
    "gpt2-exact-gelu-gqa1": replaced(replaced(CONFIGS["gpt2"], "mlp.activation", "gelu"),
                                     "attention.n_kv_heads", 1),
    "llama-mha-tied": dataclasses.replace(replaced(CONFIGS["llama"], "attention.n_kv_heads", None),
                                          tie_embeddings=True),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_model_equals_the_hand_written_transformer(name):
    model = GPT(VARIANTS[name], ParallelState(), seed=9).eval()
    for ids in sequences(model.cfg):
        assert_close(model.full_logits(model(ids).logits)[0], reference_logits(model, ids),
                     atol=1e-5, rtol=1e-5)
