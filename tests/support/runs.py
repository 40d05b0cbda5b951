"""The trainer's test runs: the settings most trainer tests share (common), a run in this
process or on forked ranks given torchrun's environment (run_train, train_run), what a run
logged (losses) and saved (final_weights), the check that two runs trained the same model
(assert_same_training), the memoised single-process run a layout is compared with
(one_process_runs), the Llama and DeepSeek-V3 settings, and a docs page's training command
run at its layout and on one process."""
from pathlib import Path
from typing import Callable, Hashable

import torch

from megalite import train as train_module
from megalite.training.metrics import read_records
from tests.support.checkpoints import read_whole_state
from tests.support.harness import run_distributed
from tests.support.launch import ROOT


STEPS = 10
LAYOUT = ["parallel.tp=2", "train.micro_batch_size=2"]  # with a global batch of 8: DP=2, 2 micro-batches


def common(cache: str, run_dir, mode: str) -> list[str]:
    # Padded rows of 160 tokens: about one document in 12 of the embedded corpus is shorter, so
    # about half the steps have padded rows and the DP ranks' real tokens differ (at 32 tokens
    # no document is short enough to pad).
    rows = ["data.seq_len=160", "model.max_seq_len=160"] if mode == "padded" else ["data.seq_len=32"]
    return ["model=tiny", "model.hidden=32", "model.dropout=0.0", f"data.mode={mode}", *rows,
            "data.bpe_vocab_size=512", f"data.cache_dir={cache}",
            f"train.max_steps={STEPS}", "train.global_batch_size=8", "train.warmup_steps=3",
            # padded: the whole held-out set; packed: its first 8 samples of 32.
            f"train.eval_tokens={0 if mode == 'padded' else 256}",
            "sample.prompts=[The]", "sample.max_new_tokens=4",
            # Below the gradient norm (~0.3 to 0.6), so clipping acts at every step.
            "train.grad_clip=0.1",
            f"run.dir={run_dir}"]


def run_train(argv: list[str]) -> int:
    """The trainer in this process, on one thread as each torchrun rank has; the thread count
    is put back after, since later tests in this process have numerics that depend on it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train_module.main(argv)
    finally:
        torch.set_num_threads(threads)


def train_run(world: int, argv: list[str]) -> None:
    if world == 1:
        assert run_train(argv) == 0
    else:
        assert run_distributed(run_train, world, argv, torchrun_env=True) == [0] * world


def losses(run_dir, key: str = "loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in read_records(run_dir / "metrics.jsonl") if key in r}


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    return read_whole_state(run_dir / "checkpoints" / f"step_{STEPS:08d}")


def assert_same_training(a, b, tol=1e-5, learns=True, weights_tol=None):
    """learns=False: data with nothing to learn (random ids), where only agreement is asked.
    weights_tol: the final weights' tolerance, where not tol."""
    la, lb = losses(a), losses(b)
    assert sorted(la) == list(range(1, STEPS + 1)) and sorted(lb) == sorted(la)
    for step in la:
        assert abs(la[step] - lb[step]) <= tol * max(1.0, abs(la[step])), (step, la[step], lb[step])
    assert la[STEPS] < la[1] - 0.1 or not learns
    na, nb = losses(a, "grad_norm"), losses(b, "grad_norm")
    assert min(na.values()) > 0.1  # clipping was active
    for step in na:
        assert abs(na[step] - nb[step]) <= tol * max(1.0, na[step]), (step, na[step], nb[step])
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=weights_tol or tol,
                                   rtol=weights_tol or tol, msg=name)


# Llama's shape, at the learning rate of the other Llama-shaped trainer tests.
LLAMA = ["model.positions.kind=rotary", "model.attention.n_kv_heads=2", "model.mlp.activation=swiglu",
         "model.norms.kind=rmsnorm", "model.bias=false", "model.tie_embeddings=false", "train.lr=5e-3"]
# Llama's shape but its KV heads (a key latent attention does not have).
DEEPSEEK = [s for s in LLAMA if not s.startswith("model.attention.n_kv_heads=")] + [
    "model.attention.kind=mla", "model.attention.q_lora_rank=24", "model.attention.kv_lora_rank=16",
    "model.attention.qk_nope_head_dim=8", "model.attention.qk_rope_head_dim=4", "model.attention.v_head_dim=12",
    "model.mlp.kind=moe", "model.mlp.experts=4", "model.mlp.top_k=2", "model.mlp.expert_ffn_hidden=16",
    "model.mlp.shared_experts=1", "model.mlp.router=sigmoid", "model.mlp.groups=2", "model.mlp.topk_groups=1",
    "model.mlp.routed_scaling=2.5", "model.mlp.dense_layers=[0]", "model.mlp.bias_update_rate=0.01",
    "model.n_layers=3", "parallel.pp_layers=null"]


class InOrder:
    """The loop without a prefetch thread: each step loaded when the loop reaches it."""

    def __init__(self, load, steps):
        self.load, self.steps = load, steps

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def __iter__(self):
        return ((step, self.load(step)) for step in self.steps)


def small_args(tmp_path, data_path, *extra) -> list[str]:
    return common(str(tmp_path / "cache"), tmp_path / "run", "padded") + [
        f"data.path={data_path}", "data.val_fraction=0.0", "train.max_steps=2",
        "train.global_batch_size=2", "train.micro_batch_size=2", *extra]


def assert_docs_command_trains_like_one_process(tmp_path, cache, page: str, section: str,
                                                config: str, moe_load: bool = False) -> None:
    """The torchrun command of a docs page's section (4 processes, EP2 x TP2), a few steps,
    smaller and on the tokenizer the other training tests share, gives one process's losses
    (and MoE loads)."""
    docs = (ROOT / "docs" / page).read_text().split(section)[1]
    command = docs.split("```bash")[1].split("```")[0].split()
    assert command[:3] == ["torchrun", "--nproc_per_node", "4"]
    argv = command[command.index("--config"):]
    assert argv[1] == config and {"parallel.ep=2", "parallel.tp=2"} <= set(argv)
    short = [f"data.cache_dir={cache}", "data.bpe_vocab_size=512", "train.max_steps=3",
             "train.global_batch_size=8", "train.micro_batch_size=2", "data.seq_len=64",
             "train.eval_every=0", "train.eval_tokens=64", "sample.max_new_tokens=2"]
    argv = [a.replace("configs/", f"{ROOT}/configs/") for a in argv]
    train_run(4, argv + short + [f"run.dir={tmp_path / 'ep2'}"])
    train_run(1, argv + short + [f"run.dir={tmp_path / 'one'}", "parallel.ep=1", "parallel.tp=1"])
    one, ep2 = losses(tmp_path / "one"), losses(tmp_path / "ep2")
    assert sorted(ep2) == [1, 2, 3] and sorted(one) == sorted(ep2)
    for step in one:
        assert abs(one[step] - ep2[step]) <= 1e-5, (step, one[step], ep2[step])
    if moe_load:
        assert losses(tmp_path / "ep2", "moe_load") == losses(tmp_path / "one", "moe_load")


def one_process_runs(tmp_path_factory) -> Callable[..., Path]:
    """The memoised single-process run: `run(key, argv_of, name)` trains `argv_of(run_dir)` on
    one process in a new directory, tmp_path_factory.mktemp(name), the first time `key` is asked
    for, and returns that directory; later calls with that key return it. A module's `single`
    fixture (module-scoped) makes one and says what each key trains."""
    runs: dict[Hashable, Path] = {}

    def run(key: Hashable, argv_of: Callable[[Path], list[str]], name: str = "single") -> Path:
        if key not in runs:
            runs[key] = tmp_path_factory.mktemp(name)
            train_run(1, argv_of(runs[key]))
        return runs[key]
    return run
