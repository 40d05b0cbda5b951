"""torchrun agents on this machine, each standing for a node (`megalite torchrun`, one c10d
rendezvous over loopback), for the tests and benchmark of recovery: the first hosts the
rendezvous, each has a snapshot directory of its own (the node's memory), and a node is
killed with its agent, its workers and its directory."""
from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil


ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Nodes:
    def __init__(self, tmp: Path, train_args: list[str], max_restarts: int, nodes: int = 2,
                 per_node: int = 2):
        self.tmp, self.train_args, self.nodes, self.per_node = tmp, train_args, nodes, per_node
        self.max_restarts, self.endpoint = max_restarts, f"127.0.0.1:{free_port()}"
        self.agents: dict[str, subprocess.Popen] = {}

    def memory(self, name: str) -> Path:
        return self.tmp / "shm" / name

    def log(self, name: str) -> Path:
        return self.tmp / f"node-{name}.log"

    def start(self, name: str) -> None:
        # Dead nodes are dropped from the rendezvous after 2 missed heartbeats of 1 s
        # (torchrun's defaults: 3 of 5 s).
        conf = f"is_host={int(not self.agents)},keep_alive_interval=1,keep_alive_max_attempt=2"
        cmd = [sys.executable, "-m", "megalite", "torchrun", "--nnodes", str(self.nodes),
               "--nproc_per_node", str(self.per_node), "--max-restarts", str(self.max_restarts),
               "--rdzv_backend", "c10d", "--rdzv_endpoint", self.endpoint, "--rdzv_id", "nodes",
               "--rdzv-conf", conf, "-m", "megalite.train", *self.train_args,
               f"train.snapshot_dir={self.memory(name)}"]
        with open(self.log(name), "w") as log:
            self.agents[name] = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

    def running(self) -> bool:
        return all(agent.poll() is None for agent in self.agents.values())

    def workers(self) -> dict[int, psutil.Process]:
        """The live workers by global rank."""
        found = {}
        for agent in self.agents.values():
            try:
                children = psutil.Process(agent.pid).children()
            except psutil.Error:  # the agent is gone
                continue
            for p in children:
                try:
                    if p.status() != psutil.STATUS_ZOMBIE:  # a worker of an earlier round
                        found[int(p.environ()["RANK"])] = p
                except (psutil.Error, KeyError):  # gone, or not yet a worker
                    pass
        return found

    def kill(self, name: str) -> None:
        """The node is gone: its agent, its workers and its memory."""
        agent = psutil.Process(self.agents[name].pid)
        for p in [agent, *agent.children(recursive=True)]:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        self.agents.pop(name).wait()
        shutil.rmtree(self.memory(name), ignore_errors=True)

    def wait(self, timeout: float = 300) -> str:
        """Every agent's exit; their output, after checking that all ended well."""
        codes = {name: agent.wait(timeout=timeout) for name, agent in self.agents.items()}
        out = "".join(f"--- node {name}\n{self.log(name).read_text()}" for name in self.agents)
        assert set(codes.values()) == {0}, (codes, out[-6000:])
        return out
