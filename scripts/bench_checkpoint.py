"""What a checkpoint costs each rank: host memory and bytes written during a save, and bytes
read when it is loaded at another layout, measured from outside megalite by the kernel's own
counters (/proc/self/status VmHWM, reset before the save; /proc/self/io rchar and wchar; the
file-backed resident pages for reads through a memory map).

    python scripts/bench_checkpoint.py --out benchmarks/checkpoint

Saves one checkpoint at TP4 (4 processes, gloo, one real optimizer step first, so Adam's
moments exist), then loads it at TP2 x DP2 and TP1 x DP4 with each zero stage, each in fresh
processes. Writes OUT/results.json (device, date, commit, command, per-rank numbers) and
OUT/results.md. A rank's share is the state it holds once loaded: its weights' slices and the
rows of Adam's moments its engine keeps.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # bench/ beside megalite
from bench.proc_counters import io_bytes, reset_peak_rss, status_bytes  # noqa: E402
from bench.provenance import cpu_script_header  # noqa: E402

GB = 1e9


def worker(args) -> None:
    """One rank, under torchrun."""
    import torch
    import torch.distributed as dist

    from megalite.config import ParallelConfig, load_model_config
    from megalite.layout_rules import check_layout
    from megalite.model import GPT
    from megalite.parallel.state import ParallelState
    from megalite.run_config import TrainConfig
    from megalite.training.checkpoint import CheckpointWriter, load_checkpoint, read_optimizer_state
    from megalite.training.build import build_engine
    torch.set_num_threads(1)
    check_layout(None, ParallelConfig(tp=args.tp), int(os.environ["WORLD_SIZE"]))  # before any collective
    dist.init_process_group("gloo")
    ps = ParallelState.from_world(args.tp)
    cfg = load_model_config("gpt2-medium", n_layers=args.layers)
    model = GPT(cfg, ps, seed=0 if args.phase == "save" else 1)
    engine = build_engine(model, TrainConfig(precision="fp32", zero_stage=args.zero), ps,
                          ParallelConfig(tp=args.tp))
    path = Path(args.dir)
    row = {"rank": ps.rank, "tp": ps.tp_size, "dp": ps.dp_size, "zero_stage": args.zero,
           "params": sum(p.numel() for p in model.parameters()) * ps.tp_size}
    if args.phase == "save":
        ids = torch.randint(0, cfg.vocab_size, (1, 32), generator=torch.Generator().manual_seed(ps.dp_rank))
        loss = model(ids, labels=ids, loss_scale=1.0 / ids.numel()).loss
        engine.backward(loss, last=True)
        engine.step()
        dist.barrier()
        reset_peak_rss()
        before, io, start = status_bytes()["VmRSS"], io_bytes(), time.perf_counter()
        meta = {"layout": {"tp": ps.tp_size, "dp": ps.dp_size, "pp": 1}, "tokens": 0,
                "config": {"model": {}}}
        with CheckpointWriter(ps) as writer:
            writer.save(path.parent.parent, 1, model, engine, {"cpu": torch.get_rng_state()}, meta, keep=1)
            writer.finish()
        after = io_bytes()
        row.update(seconds=time.perf_counter() - start, rss_before_gb=before / GB,
                   peak_rss_gb=status_bytes()["VmHWM"] / GB,
                   written_gb=(after["wchar"] - io["wchar"]) / GB)
    else:
        io, mapped = io_bytes(), status_bytes()["RssFile"]
        start = time.perf_counter()
        load_checkpoint(path, model, ps)
        state = read_optimizer_state(path, model, engine.held_rows, engine.state_names)
        seconds = time.perf_counter() - start
        syscalls, mapped = io_bytes()["rchar"] - io["rchar"], max(0, status_bytes()["RssFile"] - mapped)
        read = syscalls + mapped
        share = sum(p.numel() * 4 for p in model.parameters()) + sum(
            t.numel() * t.element_size() for _, m in state for t in m.values())
        row.update(seconds=seconds, read_gb=read / GB, read_syscalls_gb=syscalls / GB,
                   mapped_gb=mapped / GB, share_gb=share / GB, read_per_share=read / share)
    rows = [None] * ps.world_size
    dist.all_gather_object(rows, row)
    if ps.rank == 0:
        Path(args.result).write_text(json.dumps(rows))
    dist.destroy_process_group()


def torchrun(phase: str, tp: int, zero: int, directory: Path, layers: int) -> list[dict]:
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
                        "--standalone", __file__, "--worker", "--phase", phase, "--tp",
                        str(tp), "--zero", str(zero), "--dir", str(directory), "--layers",
                        str(layers), "--result", result.name], cwd=ROOT, check=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
        return json.loads(Path(result.name).read_text())


def report(results: dict) -> str:
    save = results["save"]
    lines = [f"Checkpoint of a {save[0]['params'] / 1e6:.0f}M-parameter model (gpt2-medium "
             f"shape, {results['layers']} layers), 4 processes, gloo, {results['device']}, "
             f"commit {results['commit'][:10]}, {results['date'][:10]}.", "",
             "| save at TP4 | rank | peak RSS GB | RSS before GB | written GB | s |", "|---|---|---|---|---|---|"]
    lines += [f"| | {r['rank']} | {r['peak_rss_gb']:.2f} | {r['rss_before_gb']:.2f} | "
              f"{r['written_gb']:.3f} | {r['seconds']:.1f} |" for r in save]
    lines += ["", "| load at | zero stage | rank | share GB | read GB | read / share | s |",
              "|---|---|---|---|---|---|---|"]
    for load in results["loads"]:
        lines += [f"| TP{r['tp']} x DP{r['dp']} | {r['zero_stage']} | {r['rank']} | {r['share_gb']:.3f} | "
                  f"{r['read_gb']:.3f} | {r['read_per_share']:.2f} | {r['seconds']:.1f} |"
                  for r in load]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/checkpoint")
    parser.add_argument("--layers", type=int, default=14)
    parser.add_argument("--zero-stages", default="0,1")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("--phase", "--dir", "--result"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--zero", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stages = [int(s) for s in args.zero_stages.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "checkpoints" / "step_00000001"
        results = {**cpu_script_header(), "layers": args.layers,
                   "save": torchrun("save", 4, 0, ckpt, args.layers)}
        results["checkpoint_gb"] = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()) / GB
        results["loads"] = [torchrun("load", tp, zero, ckpt, args.layers)
                            for tp in (2, 1) for zero in stages]
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(report(results))
    print(report(results))


if __name__ == "__main__":
    main()
