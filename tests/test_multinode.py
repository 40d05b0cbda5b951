"""Two torchrun agents on this machine form one 4-rank job (c10d rendezvous over loopback) and
train as one node does: the session's TP2 x DP2 run (conftest.py), the same layout and config
on 4 processes of one machine."""
import subprocess
import sys
from pathlib import Path

from tests.harness import free_port
from tests.test_train import LAYOUT, assert_same_training, common

ROOT = Path(__file__).resolve().parent.parent


def test_two_nodes_train_like_one_node(tmp_path, cache, tp2dp2_padded):
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
         "--node_rank", str(rank), "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint,
         "--rdzv_id", "megalite-two-nodes", "-m", "megalite.train", *LAYOUT,
         *common(cache, tmp_path / "two", "padded")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(2)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert_same_training(tp2dp2_padded, tmp_path / "two", tol=1e-6)
