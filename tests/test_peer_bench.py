"""`python -m bench peer` on CPU at a tiny shape: megalite and Hugging Face's GPT-2 train the
same shape in the same process, and the JSON says what was measured, where and how.
(The speed goal itself needs a GPU.)"""
import json

import pytest

from bench.peer import largest_micro_batch, main as peer_bench

pytestmark = pytest.mark.e2e

pytest.importorskip("transformers")


def test_peer_bench_measures_both_systems_on_the_same_run(tmp_path):
    out = tmp_path / "peer.json"
    assert peer_bench(["--model", "tiny", "--seq-len", "64", "--micro-batch", "2",
                       "--warmup", "0", "--steps", "1", "--profile", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for key in ("device", "torch", "transformers", "date", "git_commit", "command"):
        assert result[key], key
    assert result["device"].startswith("cpu") and "--model tiny" in result["command"]
    rows = {r["system"]: r for r in result["rows"]}
    assert set(rows) == {"megalite", "hf"}
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and row["tflops"] > 0 and row["step_s"] > 0
        assert row["mfu"] is None  # no CPU peak in the table: no made-up MFU
        # Both are language models at init on random tokens: about ln(vocab) = 6.9.
        assert 5.5 < row["final_loss"] < 8.5, row
        # Where the time went: every share a known class, matmuls among them, the top
        # operators classified. (Whether a matmul ranks in the top ten of a tiny CPU step
        # depends on the machine's load: a fresh-clone CI saw 2.8% matmul and none there.)
        shares, top = row["profile"]["shares"], row["profile"]["top"]
        assert set(shares) <= {"attention", "matmul", "elementwise", "optimizer", "communication",
                               "idle"}
        assert shares["matmul"] > 0 and top and all(t["class"] in shares for t in top)
        assert all(0 <= v <= 1 for v in shares.values())
    assert rows["megalite"]["speedup_over_hf"] > 0


@pytest.mark.parametrize("capacity, limit, start, expected",
                         [(37, 1024, 1, 37), (1, 1024, 1, 1), (0, 1024, 1, 0), (5000, 1024, 1, 1024),
                          (64, 64, 1, 64), (37, 1024, 16, 37), (37, 1024, 64, 37), (0, 1024, 16, 0),
                          (5000, 1024, 2048, 1024)])
def test_largest_micro_batch_search(capacity, limit, start, expected):
    tried = []

    def fits(b):
        tried.append(b)
        return b <= capacity
    assert largest_micro_batch(fits, limit, start) == expected
    assert len(tried) <= 2 * limit.bit_length() + 1
    assert all(1 <= b <= limit for b in tried)


@pytest.mark.parametrize("preset", ["tiny", "llama"])
def test_hf_gets_the_same_packed_rows_as_megalite(preset):
    """What peer-bench --batch packed gives HF (a 4D document mask, positions per document,
    shifted labels) makes HF compute megalite's logits and loss on the same weights."""
    import dataclasses

    import torch
    import transformers

    from bench.peer import hf_inputs, rows_of
    from megalite.config import Dense, GroupedQuery, Norms, Rotary
    from megalite.run_config import load_model_config
    from megalite.hf import layout
    from megalite.hf.convert import exportable_as
    from megalite.model import GPT
    from megalite.parallel.state import ParallelState
    cfg = load_model_config("tiny", vocab_size=300, max_seq_len=64)
    if preset == "llama":
        cfg = dataclasses.replace(cfg, attention=GroupedQuery(n_kv_heads=2),
                                  mlp=Dense(activation="swiglu", ffn_hidden=96),
                                  norms=Norms(kind="rmsnorm"), positions=Rotary(), bias=False,
                                  tie_embeddings=False)
    model = GPT(cfg, ParallelState(), seed=0)
    _, arch = exportable_as(cfg)
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**arch.config_to_hf(cfg, {})), attn_implementation="sdpa")
    weights = {n: p.detach() for n, p in model.named_parameters()}
    hf.load_state_dict(layout.weights_to_hf(arch.recipe(cfg), weights), strict=False)
    rows = rows_of(cfg, 48, 3, "packed", torch.device("cpu"))
    assert rows.doc_ids is not None and len(rows.doc_ids[0].unique()) > 2
    ours = model(rows.input_ids, doc_ids=rows.doc_ids, labels=rows.labels)
    theirs = hf(**hf_inputs(rows))
    torch.testing.assert_close(theirs.logits, ours.logits[..., :cfg.vocab_size], atol=1e-5, rtol=1e-5)
    # HF has no label for the last position (it shifts); the rest is megalite's mean loss.
    kept = rows.labels[:, :-1] != -100
    torch.testing.assert_close(theirs.loss, ours.token_losses[:, :-1][kept].mean(), atol=1e-5, rtol=1e-5)


def test_hf_rebuilds_its_inputs_for_new_rows_only(monkeypatch):
    """The largest-batch search passes rows of each size: HF must train on them, not on the
    first rows it saw (its inputs are cached per rows, as they do not change between steps)."""
    import torch

    from bench import peer
    from megalite.run_config import load_model_config
    cfg = load_model_config("tiny", vocab_size=300, max_seq_len=64)
    built = []
    real = peer.hf_inputs
    monkeypatch.setattr(peer, "hf_inputs", lambda batch: built.append(batch.input_ids.shape[0]) or real(batch))
    step = peer.hf_step(cfg, torch.device("cpu"), compiled=False)
    two, four = (peer.rows_of(cfg, 32, n, "full", torch.device("cpu")) for n in (2, 4))
    for rows in (two, two, four, four):
        step(rows)
    assert built == [2, 4]
