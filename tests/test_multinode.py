"""Two torchrun agents on this machine form one 4-rank job (c10d rendezvous over loopback)."""
import subprocess
import sys
from pathlib import Path

from tests.harness import free_port
from tests.test_train import assert_same_training, common

ROOT = Path(__file__).resolve().parent.parent



def test_two_nodes_train_like_one_node(tmp_path):
    cache = str(tmp_path / "cache")
    train = ["-m", "megalite.train", "parallel.tp=2", "train.micro_batch_size=2"]
    one_node = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", *train,
         *common(cache, tmp_path / "one", "packed")], cwd=ROOT, capture_output=True, text=True,
        timeout=300)
    assert one_node.returncode == 0, one_node.stderr[-3000:]

    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
         "--node_rank", str(rank), "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint,
         "--rdzv_id", "megalite-two-nodes", *train, *common(cache, tmp_path / "two", "packed")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(2)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert_same_training(tmp_path / "one", tmp_path / "two", tol=1e-6)
