"""Training ranks only read prepared data: a run on raw files, its cache empty, trains with the
preparation room (megalite.prep) made unimportable in every rank and every file lock refused
there; the ranks' preparation (`megalite prepare-data`, a process of each rank's own) builds it.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
RANK = """
import fcntl, sys

class NoPrep:
    def find_spec(self, name, path=None, target=None):
        if name == "megalite.prep" or name.startswith("megalite.prep."):
            raise ImportError(f"a training rank imported {name}")

def refused(*args, **kwargs):
    raise AssertionError("a training rank took a file lock")

sys.meta_path.insert(0, NoPrep())
fcntl.flock = fcntl.lockf = refused
from megalite.cli import main
sys.exit(main(["train", *sys.argv[1:]]))
"""


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_raw_data_run_trains_with_preparation_unimportable_in_its_ranks(tmp_path, ranks):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"Ranks read; a preparation writes {i}. " * 8}) + "\n"
                              for i in range(60)))
    rank = tmp_path / "rank.py"
    rank.write_text(RANK)
    args = ["model=tiny", "model.hidden=32", f"data.path={corpus}", "data.bpe_vocab_size=300",
            "data.seq_len=32", f"data.cache_dir={tmp_path / 'cache'}", "train.max_steps=2",
            "train.global_batch_size=4", "train.micro_batch_size=2", "sample.prompts=[]",
            f"run.dir={tmp_path / 'run'}"]
    launch = [sys.executable, str(rank)] if ranks == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), str(rank)]
    done = subprocess.run(launch + args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "a training rank" not in done.stderr
    assert done.stderr.count(f"prepares data path '{corpus}'") == 1, done.stderr  # built once
    built = [p for p in (tmp_path / "cache").iterdir() if (p / "meta.json").is_file()]
    assert len(built) == 1 and (tmp_path / "run" / "checkpoints" / "step_00000002").is_dir()
