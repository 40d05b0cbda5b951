"""The failures a new user meets first (issue 49's list), each one line naming the value and
the fix, found before any process group exists where the input is at fault: a number an
optimizer would take in a transformed form, a run.dir that cannot be written, a tp that does
not split the world or the model; and the cost of each evaluation, bounded and said."""
import re
import subprocess

import numpy as np
import pytest

from megalite.cli import USAGE, main as cli_main
from megalite.data.batches import Mixture, Samples
from megalite.data.docs import ArrayShard, DocSet, TokenStore
from megalite.run_config import load_config
from megalite.plan import validate
from megalite.training.evaluation import eval_plan
from megalite.typed_config import ConfigError


@pytest.mark.unit
@pytest.mark.parametrize("setting, message", [
    ("train.lr=-1", r"^train\.lr=-1\.0 must be >= 0$"),
    ("train.min_lr=-1e-5", r"^train\.min_lr=-1e-05 must be >= 0$"),
    ("train.beta1=1", r"^train\.beta1=1\.0 must be in \[0, 1\), e\.g\. 0\.9$"),
    ("train.beta2=-0.5", r"^train\.beta2=-0\.5 must be in \[0, 1\), e\.g\. 0\.95$"),
    ("train.weight_decay=-0.1", r"^train\.weight_decay=-0\.1 must be >= 0$"),
    ("train.grad_clip=-1", r"^train\.grad_clip=-1\.0 must be >= 0 \(0: no clipping\)$"),
    ("train.warmup_steps=-3", r"^train\.warmup_steps=-3 must be >= 0 \(0: no warmup\)$"),
    ("train.epochs=.nan", r"^train\.epochs=nan must be >= 0 \(0: train\.max_steps\)$"),
    ("train.checkpoint_every=-1", r"^train\.checkpoint_every=-1 must be >= 0 \(0: at the end\)$"),
    ("train.eval_every=-5", r"^train\.eval_every=-5 must be >= 0 \(0: at the end\)$"),
    ("train.snapshot_every=-2", r"^train\.snapshot_every=-2 must be >= 0 \(0: none\)$"),
])
def test_a_number_out_of_range_is_named_as_typed(setting, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(None, ["model=tiny", setting]), 1)


@pytest.mark.unit
def test_snapshots_are_refused_where_not_written_yet():
    with pytest.raises(ConfigError, match=r"train\.snapshot_every=5 with train\.engine=deepspeed: "
                                          r"in-memory snapshots are not written for it yet"):
        validate(load_config(None, ["model=tiny", "train.snapshot_every=5",
                                    "train.engine=deepspeed"]), 1)


@pytest.mark.e2e
@pytest.mark.parametrize("where", ["file", "sys"])
def test_a_run_dir_that_cannot_be_written_is_one_line_before_any_work(tmp_path, capsys, where):
    """A path through a regular file, and one the filesystem refuses (standing in for a
    read-only one, which root could not be shown here): exit status 2, one line."""
    (tmp_path / "a_file").write_text("")
    run_dir = tmp_path / "a_file" / "run" if where == "file" else "/sys/megalite-run"
    assert cli_main(["train", "model=tiny", f"run.dir={run_dir}",
                     f"data.cache_dir={tmp_path / 'cache'}"]) == USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"megalite: error: run.dir '{run_dir}' cannot be "
                                               f"written ("), err
    assert "give a run.dir on a writable filesystem" in err[0]
    assert not (tmp_path / "cache").exists()  # nothing read or prepared before


@pytest.mark.unit
def test_a_tp_that_does_not_split_names_the_world_size():
    with pytest.raises(ConfigError) as err:
        validate(load_config(None, ["model=tiny", "parallel.tp=3", "train.global_batch_size=12",
                                    "train.micro_batch_size=4"]), 3)
    assert str(err.value).count("\n") == 0
    assert "use parallel.tp among [1] (the divisors of the world size 3 that split the model)" \
        in str(err.value)


@pytest.mark.unit
def test_each_evaluation_is_bounded_by_default_and_said_at_start():
    """Not the whole held-out set (on a large corpus, as much as many training steps): the
    first 2^20 tokens' rows, a fixed set; how many is printed before the first."""
    cfg = load_config(None, ["data.seq_len=4", "train.eval_every=50"])
    assert cfg.train.eval_tokens == 1 << 20
    lengths = np.full(1 << 19, 3)  # documents of 3 tokens: 1.5 M tokens held out
    shard = ArrayShard(np.zeros(lengths.sum(), dtype=np.int64), np.concatenate([[0], np.cumsum(lengths)]))
    val = Mixture([Samples(DocSet.whole(TokenStore([shard])), "packed", 4, pad_id=0)], [1.0])
    assert eval_plan(cfg, val) == ("eval: 262,144 of 393,215 held-out samples (rows of "
                                   "data.seq_len=4: up to 1,048,576 tokens) every 50 steps and at "
                                   "the end; train.eval_tokens=1048576 (0: all)")
    whole = load_config(None, ["data.seq_len=4", "train.eval_tokens=0"])
    assert eval_plan(whole, val).startswith("eval: 393,215 of 393,215 held-out samples")


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB filesystem (a tmpfs: mounting needs root, as CI runs)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)],
                      capture_output=True, timeout=60).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    yield disk
    subprocess.run(["umount", str(disk)], check=True, timeout=60)


@pytest.mark.e2e
def test_a_disk_filling_during_a_save_is_one_line_and_keeps_the_last_checkpoint(tiny_disk, cache,
                                                                                 capsys):
    """torch's zip writer says only "unexpected pos" when a write falls short: the line names
    the full disk, the path and the rank; the checkpoint before is whole and loads."""
    from megalite.training.checkpoint_dirs import latest_checkpoint
    from tests.support.checkpoints import read_whole_state
    from tests.support.runs import common
    run_dir = tiny_disk / "run"
    assert cli_main(["train", *common(cache, run_dir, "packed"), "train.checkpoint_every=2"]) == 1
    printed = capsys.readouterr().err
    err = [line for line in printed.splitlines() if line.startswith("megalite:")]
    assert "Traceback" not in printed and len(err) == 1 and re.match(
        r"megalite: error: writing checkpoint step (\d+) into '.*/run/checkpoints/\.tmp_step_\d+' "
        r"failed on rank 0: .* \(the disk is full: 0\.\d MiB free there; free some space, or give "
        r"a run\.dir on a disk with room\); the previous checkpoints are intact$", err[0]), err
    latest = latest_checkpoint(run_dir)
    assert latest is not None and read_whole_state(latest)


@pytest.mark.unit
@pytest.mark.parametrize("shared, nodes, refused", [("True", "2", True), ("False", "2", False),
                                                    ("True", "1", False)])
def test_restarts_across_nodes_with_torchruns_shared_store_are_refused(monkeypatch, shared, nodes,
                                                                         refused):
    """The nodes' restarted ranks would hang in that store (tests/test_node_loss.py restarts
    with it unshared, as `megalite torchrun` launches)."""
    from megalite.parallel.state import check_restartable
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("GROUP_WORLD_SIZE", nodes)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", shared)
    if not refused:
        check_restartable()
        return
    with pytest.raises(ConfigError, match=r"^torchrun --max-restarts 3 on 2 nodes cannot restart "
                       r".*export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun, or "
                       r"launch with `megalite torchrun`, which sets it$"):
        check_restartable()
