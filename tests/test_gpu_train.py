"""On a GPU: the trainer end to end on one device, and its pinned-memory prefetch.

- prefetch: each step's micro-batches are collated in the prefetch thread into pinned host
  memory, reach the device, and equal the batches the unpinned path collates; a run that loads
  each step in turn without pinning trains bit for bit the same;
- resume: `torchrun --nproc_per_node 1 -m megalite.train --config configs/demo.yaml` (NCCL,
  world size 1, packed rows through FlexAttention, bf16 autocast) for 30 steps; the same run
  killed (SIGKILL) after step 15 with its step-10 checkpoint on disk, then resumed, continues
  the uninterrupted run exactly: every logged loss, learning rate, gradient norm, token count,
  validation loss, the final weights and the samples. Both runs up to the kill are compared
  first, so that a GPU run that is not deterministic fails as that, not as a bad resume.

Skipped where there is no CUDA device; on a GPU machine `python -m pytest -o addopts=
tests/test_gpu_train.py -q` (one process: no pytest-xdist needed). The checks are functions of the device: on a CPU they run the
same trainer on gloo.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from megalite import train as train_module
from megalite.data.batches import Batch, BatchOrder, Prefetcher
from megalite.training.checkpoint_dirs import latest_checkpoint
from tests.support.checkpoints import read_whole_state
from tests.support.launch import kill_every_process_of
from tests.support.runs import InOrder, losses, run_train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.device("cuda", 0)
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def demo_args(cache, run_dir: Path, steps: int, *extra: str) -> list[str]:
    """configs/demo.yaml on one process: the tiny model (4 layers, hidden 64: head dim 16, as
    FlexAttention needs), packed rows of 128 tokens, 4 micro-batches of 4 per step."""
    return ["--config", str(ROOT / "configs" / "demo.yaml"), "parallel.tp=1",
            f"train.max_steps={steps}", f"data.cache_dir={cache}", f"run.dir={run_dir}",
            "train.eval_tokens=2048", "sample.prompts=[The]", "sample.max_new_tokens=8", *extra]


def skip_plot_without_matplotlib(monkeypatch) -> None:
    """The loss plot at the very end of a run is the trainer's only use of matplotlib, which a
    bare GPU image may lack: without it, skip the plot (nothing else reads it)."""
    if not HAS_MATPLOTLIB:
        monkeypatch.setattr(train_module, "plot_losses", lambda *args: None)


# ---------------------------------------------------------------------------------------------
# Prefetch with pinned memory.

PREFETCH_STEPS = 4


def check_prefetch(device: torch.device, cache, tmp_path: Path, monkeypatch) -> None:
    loaded, moved, run = {}, {}, {}

    class Recording(Prefetcher):
        """The trainer's prefetcher, keeping what each step's load returned, and where."""

        def __init__(self, load, steps):
            def record(step):
                batches = load(step)
                loaded[step] = (threading.current_thread().name, batches)
                return batches
            super().__init__(record, steps)

    real_to, real_train = Batch.to, train_module.train

    def recording_to(self, to_device):
        out = real_to(self, to_device)
        # Cloned on the current stream, so after the (asynchronous) copy: what the step reads.
        moved[id(self)] = out._map(torch.clone)
        return out

    def capturing_train(cfg, ps, data, train_set, *args):
        run.update(cfg=cfg, train_set=train_set, device=ps.device)
        return real_train(cfg, ps, data, train_set, *args)

    skip_plot_without_matplotlib(monkeypatch)
    monkeypatch.setattr(train_module, "Prefetcher", Recording)
    monkeypatch.setattr(train_module, "train", capturing_train)
    monkeypatch.setattr(Batch, "to", recording_to)
    pinned_dir, unpinned_dir = tmp_path / "pinned", tmp_path / "unpinned"
    assert run_train(demo_args(cache, pinned_dir, PREFETCH_STEPS)) == 0
    assert run["device"].type == device.type

    # The unpinned path: the same rows collated in this thread, left in pageable memory.
    cfg, train_set = run["cfg"], run["train_set"]
    order = BatchOrder(train_set.sizes, train_set.weights, cfg.train.global_batch_size, cfg.run.seed)
    assert sorted(loaded) == list(range(PREFETCH_STEPS))
    for step, (thread, batches) in loaded.items():
        assert thread.startswith("megalite-prefetch"), thread
        expected = [train_set.collate(rows)
                    for rows in order.micro_batches(step, 0, 1, cfg.train.micro_batch_size)]
        assert len(batches) == len(expected) == 4
        for i, (got, want) in enumerate(zip(batches, expected)):
            on_device = moved[id(got)]  # every prefetched batch was moved, as it was
            for field in dataclasses.fields(Batch):
                what = f"step {step}, micro-batch {i}, {field.name}"
                g, w, d = (getattr(b, field.name) for b in (got, want, on_device))
                assert (g is None) == (w is None) == (d is None), what
                if w is None:
                    continue
                assert g.device.type == "cpu" and g.is_pinned() == (device.type == "cuda"), what
                assert torch.equal(g, w), what
                assert d.device == run["device"] and torch.equal(d.cpu(), w), what
        assert expected[0].doc_ids is not None  # packed rows: doc ids travel too

    # Loaded when the loop reaches each step, never pinned: the same training, bit for bit.
    monkeypatch.setattr(Batch, "to", real_to)
    monkeypatch.setattr(train_module, "Prefetcher", InOrder)
    monkeypatch.setattr(Batch, "pinned", lambda self: self)
    assert run_train(demo_args(cache, unpinned_dir, PREFETCH_STEPS)) == 0
    for key in ("loss", "grad_norm", "tokens", "val_loss"):
        got, expected = losses(unpinned_dir, key), losses(pinned_dir, key)
        assert got == expected and expected, (key, "pinned, prefetched:", expected, "not:", got)


@pytest.mark.exactness
def test_prefetched_batches_arrive_pinned_and_equal_the_unpinned_path(cache, tmp_path, monkeypatch):
    check_prefetch(CUDA, cache, tmp_path, monkeypatch)


# ---------------------------------------------------------------------------------------------
# Kill and resume under torchrun.

STEPS, EVERY, KILL_AFTER = 30, 10, 15

# megalite.train's entry point (as `python -m megalite.train` runs it) with three additions:
# it records the process group's backend and the device each rank trains on (probe.jsonl in
# the run directory); without matplotlib it skips the final loss plot; and with
# MEGALITE_TEST_KILL=K:C in the environment it SIGKILLs itself before step K + 1, once
# checkpoint C is complete on disk (the background writer may still be at it at step K).
RUNNER = r'''
import importlib.util, json, os, signal, sys, time
from pathlib import Path

import torch
import torch.distributed as dist

import megalite.train as train
from megalite.cli import run_reporting_errors
from megalite.training.checkpoint_dirs import latest_checkpoint

run_dir = Path(next(a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("run.dir=")))
real_train, real_lr_at = train.train, train.lr_at


def probed_train(cfg, ps, *args):
    run_dir.mkdir(parents=True, exist_ok=True)
    probe = {"backend": dist.get_backend() if dist.is_initialized() else None,
             "world_size": dist.get_world_size() if dist.is_initialized() else 1,
             "device": str(ps.device), "cuda_available": torch.cuda.is_available()}
    with open(run_dir / "probe.jsonl", "a") as f:
        f.write(json.dumps(probe) + "\n")
    return real_train(cfg, ps, *args)


def lr_at(step, t):
    kill = os.environ.get("MEGALITE_TEST_KILL")
    if kill and step == int(kill.split(":")[0]):
        saved = f"step_{int(kill.split(':')[1]):08d}"
        deadline = time.monotonic() + 120
        while getattr(latest_checkpoint(run_dir), "name", None) != saved:
            if time.monotonic() > deadline:
                sys.exit(f"checkpoint {saved} never appeared")
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)  # as when a node dies
    return real_lr_at(step, t)


train.train, train.lr_at = probed_train, lr_at
if importlib.util.find_spec("matplotlib") is None:
    train.plot_losses = lambda *args: None
sys.exit(run_reporting_errors(train.main, sys.argv[1:]))
'''


def torchrun(*args: str) -> list[str]:
    # --standalone: a rendezvous on a free local port, so two runs can share the machine.
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
            *args]


def start(cmd: list[str], log: Path, **env: str) -> subprocess.Popen:
    full_env = {**os.environ,
                # Where the tree is not installed (a copied checkout), the runner script and
                # the workers still import it.
                "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                # cuBLAS's reproducible workspace choice (the documented setting for run-to-run
                # identical results); the runs are compared bit for bit.
                "CUBLAS_WORKSPACE_CONFIG": ":4096:8", **env}
    with open(log, "w") as out:  # the child has its own copy of the descriptor
        return subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, log: Path, run_dir: Path,
           timeout: float = 300) -> tuple[int, str]:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_every_process_of(run_dir)  # torchrun's agent and its worker
        proc.wait(timeout=60)
        raise AssertionError(f"timed out after {timeout} s:\n{log.read_text()[-4000:]}")
    return proc.returncode, log.read_text()


def ended_ok(code: int, out: str) -> None:
    """Exit status 0; or, where matplotlib is missing, the plain `-m megalite.train` run's
    failure to import it for the loss plot, the last thing a run does (after the final
    checkpoint, evaluation and samples)."""
    if code != 0 and not HAS_MATPLOTLIB and "No module named 'matplotlib'" in out:
        return
    assert code == 0, out[-4000:]


def check_probe(run_dir: Path, device: torch.device, runs: int) -> None:
    probes = [json.loads(line) for line in (run_dir / "probe.jsonl").read_text().splitlines()]
    backend = "nccl" if device.type == "cuda" else "gloo"
    assert probes == [{"backend": backend, "world_size": 1, "device": str(device),
                       "cuda_available": device.type == "cuda"}] * runs, probes


KEYS = ("loss", "lr", "grad_norm", "tokens", "val_loss")


def check_kill_and_resume(device: torch.device, cache, tmp_path: Path) -> None:
    runner = tmp_path / "megalite_train_probed.py"
    runner.write_text(RUNNER)
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    every = [f"train.checkpoint_every={EVERY}", f"train.eval_every={EVERY}"]
    # Both from step 0 at once (on one GPU: small models): the uninterrupted run, and the one
    # killed after step KILL_AFTER with its step-EVERY checkpoint on disk.
    runs = [start(torchrun("-m", "megalite.train", *demo_args(cache, whole, STEPS, *every)),
                  tmp_path / "whole.log"),
            start(torchrun(str(runner), *demo_args(cache, killed, STEPS, *every)),
                  tmp_path / "killed.log", MEGALITE_TEST_KILL=f"{KILL_AFTER}:{EVERY}")]
    (whole_code, whole_out), (killed_code, killed_out) = (
        finish(p, tmp_path / f"{d.name}.log", d) for p, d in zip(runs, (whole, killed)))
    ended_ok(whole_code, whole_out)
    assert killed_code != 0 and "SIGKILL" in killed_out, killed_out[-4000:]  # torchrun's report
    assert latest_checkpoint(killed).name == f"step_{EVERY:08d}"
    assert sorted(losses(whole)) == list(range(1, STEPS + 1))
    assert sorted(losses(whole, "val_loss")) == [EVERY, 2 * EVERY, STEPS]
    assert losses(whole)[STEPS] < losses(whole)[1] - 1.0  # it learns (8.3 -> 6.7 on a CPU)
    # Up to the kill both runs are the same computation: equal bit for bit, or the GPU run
    # itself is not deterministic (which would make the resume comparison meaningless).
    for key in KEYS:
        before_kill = losses(killed, key)
        assert max(before_kill) == (KILL_AFTER if key != "val_loss" else EVERY), (key, before_kill)
        whole_then = {s: v for s, v in losses(whole, key).items() if s <= max(before_kill)}
        assert before_kill == whole_then, f"two identical runs differ at {key}: not deterministic"

    code, out = finish(start(torchrun(str(runner), *demo_args(cache, killed, STEPS, *every)),
                             tmp_path / "resumed.log"), tmp_path / "resumed.log", killed)
    assert code == 0, out[-4000:]
    assert f"step_{EVERY:08d} at step {EVERY}" in out, out[-4000:]  # "resumed from ... at step 10"
    for key in KEYS:  # the resumed run's records replace the killed run's after step EVERY
        expected, got = losses(whole, key), losses(killed, key)
        assert sorted(got) == sorted(expected), key
        for step in expected:
            assert got[step] == expected[step], (key, step, got[step], expected[step])
    final = f"checkpoints/step_{STEPS:08d}"
    a, b = read_whole_state(whole / final), read_whole_state(killed / final)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert (killed / "samples.txt").read_text() == (whole / "samples.txt").read_text()
    # The killed and the resumed run trained on NCCL, world size 1, the GPU (and the whole
    # run, equal to them bit for bit, did too).
    check_probe(killed, device, 2)


@pytest.mark.e2e
def test_kill_and_resume_under_torchrun_continues_exactly(cache, tmp_path):
    check_kill_and_resume(CUDA, cache, tmp_path)
