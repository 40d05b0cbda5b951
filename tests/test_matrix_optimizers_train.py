"""The optimizers of whole matrices, train.optimizer=muon and adafactor, train at every layout
as one process does: losses, gradient norms (clipping active) and final weights after 10
steps, to 1e-5 (fp32, Newton-Schulz in fp32: train.muon.ns_dtype=fp32). Each layout takes the
matrices apart differently: TP slices by rows and by columns (and a KV head held by two TP
ranks), ZeRO-1 rows over the replicas, pipeline stages, experts over EP, CP ranks as replicas.
A checkpoint of either written at TP2 x DP2 (ZeRO-1) resumes at TP1 x DP4 and at PP2 with the
original's losses (Adafactor's factors, one per logical matrix, are read whole at any layout);
an AdamW checkpoint is refused by a Muon run naming both optimizers, and loads its weights
alone when asked."""
import pytest

from megalite.typed_config import ConfigError
from tests.support.runs import (STEPS, assert_same_training, common, losses, one_process_runs,
                                run_train, train_run)

pytestmark = pytest.mark.exactness

MUON = ["train.optimizer=muon", "train.muon.ns_dtype=fp32", "train.muon.lr=0.02",
        "train.checkpoint_every=5"]
# A rate at which its steps move the weights (its default 1e-2 is a relative step, of ~1e-2 x
# the weights' RMS).
ADAFACTOR = ["train.optimizer=adafactor", "train.adafactor.lr=0.1", "train.adafactor.weight_decay=0.01",
             "train.checkpoint_every=5"]
OPTIMIZERS = {"muon": MUON, "adafactor": ADAFACTOR}
LLAMA = ["model.positions.kind=rotary", "model.attention.n_kv_heads=1", "model.mlp.activation=swiglu",
         "model.norms.kind=rmsnorm", "model.bias=false", "model.tie_embeddings=false", "train.lr=5e-3"]
MOE = LLAMA[:1] + ["model.attention.n_kv_heads=2"] + LLAMA[2:] + [
    "model.mlp.kind=moe", "model.mlp.experts=4", "model.mlp.top_k=2", "model.mlp.expert_ffn_hidden=24"]
MODELS = {"llama": LLAMA, "moe": MOE}
LAYOUTS = {  # name -> (model, layout settings)
    "tp2-dp2-zero1": ("llama", ["parallel.tp=2", "train.zero_stage=1"]),
    "tp2-sp-dp2-replicated": ("llama", ["parallel.tp=2", "parallel.sequence_parallel=true",
                                        "train.zero_stage=0"]),
    "pp2-dp2-zero1": ("llama", ["parallel.pp=2", "model.n_layers=4"]),
    "ep2-dp2-zero1": ("moe", ["parallel.ep=2"]),
    "cp2-dp2-zero1": ("llama", ["parallel.cp=2"]),
}
SAVED_AT = 5


@pytest.fixture(scope="module")
def single(tmp_path_factory, cache):
    """The one-process run of each optimizer and model, made once a module."""
    runs = one_process_runs(tmp_path_factory)

    def run(optimizer: str, model: str, extra: tuple[str, ...] = ()):
        return runs((optimizer, model, *extra), lambda run_dir: common(cache, run_dir, "packed")
                    + MODELS[model] + OPTIMIZERS[optimizer] + list(extra)
                    + ["parallel.tp=1", "train.micro_batch_size=8"], f"single-{optimizer}-{model}")
    return run


@pytest.fixture(scope="module")
def tp2_dp2(tmp_path_factory, cache):
    """Each optimizer's TP2 x DP2 (ZeRO-1) run, made once a module."""
    made = {}

    def run(optimizer: str):
        if optimizer not in made:
            made[optimizer] = tmp_path_factory.mktemp(f"tp2-dp2-zero1-{optimizer}")
            model, layout = LAYOUTS["tp2-dp2-zero1"]
            train_run(4, common(cache, made[optimizer], "packed") + MODELS[model] + OPTIMIZERS[optimizer]
                      + layout + ["train.micro_batch_size=2"])
        return made[optimizer]
    return run


def layout_extra(layout: str) -> tuple[str, ...]:
    """Settings that change the model, which the one-process run takes too."""
    return tuple(s for s in LAYOUTS[layout][1] if s.startswith("model."))


# Adafactor at the layouts its issue names (TP + SP replicated is Muon's alone: its rows are
# the same gathers as TP2 x DP2's).
RUNS = [("muon", layout) for layout in LAYOUTS] + [
    ("adafactor", layout) for layout in ("tp2-dp2-zero1", "pp2-dp2-zero1", "ep2-dp2-zero1", "cp2-dp2-zero1")]


@pytest.mark.parametrize("optimizer,layout", RUNS)
def test_a_matrix_optimizer_trains_like_one_process(tmp_path, cache, single, tp2_dp2, optimizer, layout):
    model, settings = LAYOUTS[layout]
    if layout == "tp2-dp2-zero1":
        run_dir = tp2_dp2(optimizer)
    else:
        run_dir = tmp_path / layout
        train_run(4, common(cache, run_dir, "packed") + MODELS[model] + OPTIMIZERS[optimizer] + settings
                  + ["train.micro_batch_size=2"])
    assert_same_training(single(optimizer, model, layout_extra(layout)), run_dir)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("layout", [["parallel.tp=1"], ["parallel.pp=2"]])
def test_a_checkpoint_resumes_at_another_layout(tmp_path, cache, tp2_dp2, optimizer, layout):
    saved = tp2_dp2(optimizer)
    checkpoint = saved / "checkpoints" / f"step_{SAVED_AT:08d}"
    resumed = tmp_path / "resumed"
    train_run(4, common(cache, resumed, "packed") + LLAMA + OPTIMIZERS[optimizer] + layout
              + ["train.micro_batch_size=2", f"train.resume={checkpoint}"])
    expected, got = losses(saved), losses(resumed)
    assert sorted(got) == list(range(SAVED_AT + 1, STEPS + 1))
    for step in got:
        assert abs(got[step] - expected[step]) <= 1e-5, (layout, step, got[step], expected[step])


def test_an_adamw_checkpoint_is_refused_by_a_muon_run_or_gives_its_weights_alone(
        tmp_path, cache, tp2dp2_padded):
    """conftest.py's AdamW run (TP2 x DP2, checkpointed at step 5)."""
    checkpoint = tp2dp2_padded / "checkpoints" / f"step_{SAVED_AT:08d}"
    argv = common(cache, tmp_path / "muon", "padded") + [
        "parallel.tp=1", "train.micro_batch_size=8", "train.optimizer=muon",
        f"train.resume={checkpoint}"]
    with pytest.raises(ConfigError, match=r"train\.optimizer=adamw, this run's is "
                                          r"train\.optimizer=muon.*train\.load_optimizer=false"):
        run_train(argv)
    train_run(1, argv + ["train.load_optimizer=false"])
    adamw, muon = losses(tp2dp2_padded), losses(tmp_path / "muon")
    assert sorted(muon) == list(range(SAVED_AT + 1, STEPS + 1))
    # Step 6's loss is of the loaded weights; Muon's first update then parts the runs.
    assert abs(muon[SAVED_AT + 1] - adamw[SAVED_AT + 1]) <= 1e-5
    assert abs(muon[STEPS] - adamw[STEPS]) > 1e-3
