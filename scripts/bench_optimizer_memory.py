"""What each rank holds for the optimizer, replicated (train.zero_stage=0) against ZeRO-1, for
AdamW and Muon: peak RSS measured by the kernel's own counter (/proc/self/status VmHWM), and
the bytes of each kind of tensor counted after the steps.

    python scripts/bench_optimizer_memory.py --out benchmarks/optimizer-memory

The demo's shape at hidden 512 x 16 layers (~52M parameters), fp32, TP1 x DP4 (4 processes,
gloo), 4 micro-batches of 4 x 128 tokens per rank and step, 6 optimizer steps of random token
ids. Writes OUT/results.json (device, date, commit, command, per-rank numbers) and
OUT/results.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # bench/ beside megalite
from bench.proc_counters import status_bytes  # noqa: E402
from bench.provenance import cpu_script_header  # noqa: E402

MB = 1e6
STEPS, MICRO, ROWS, SEQ = 6, 4, 4, 128


def tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:  # views of one storage (rows, slots) once
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def worker(args) -> None:
    """One rank, under torchrun."""
    import torch
    import torch.distributed as dist

    from megalite.config import ParallelConfig, load_model_config
    from megalite.data.batches import Batch
    from megalite.model import GPT
    from megalite.parallel.state import ParallelState
    from megalite.run_config import TrainConfig
    from megalite.training.build import build_engine
    from megalite.training.engine import autocast_for, train_step
    from megalite.training.host_memory import map_large_blocks
    map_large_blocks()  # as the trainer does on a CPU
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ps = ParallelState.from_world(1)
    cfg = load_model_config("tiny")
    cfg = dataclasses.replace(cfg, hidden=512, n_layers=16, n_heads=8, vocab_size=4096,
                              max_seq_len=SEQ, dropout=0.0)
    model = GPT(cfg, ps, seed=0)
    train = TrainConfig(optimizer=args.optimizer, zero_stage=args.zero, precision="fp32")
    engine = build_engine(model, train, ps, ParallelConfig())
    g = torch.Generator().manual_seed(ps.rank)
    batches = [Batch(input_ids=(ids := torch.randint(0, cfg.vocab_size, (ROWS, SEQ), generator=g)),
                     labels=ids.roll(-1, 1)) for _ in range(MICRO)]
    n_tokens = torch.tensor(float(ROWS * SEQ * MICRO * ps.dp_size))
    for _ in range(STEPS):
        engine.set_lr(1e-3)
        train_step(engine, batches, n_tokens, autocast_for(ps.device, "fp32"))
    params = list(model.parameters())
    weights = tensor_bytes(params)
    grads = [b.buffer for b in engine.grad_sync.buckets if hasattr(b, "buffer")]
    grads += [p.grad for p in params if p.grad is not None]
    state = [t for s in engine.optimizer.state.values() for t in s.values()
             if torch.is_tensor(t) and t.numel() > 1]
    row = {"rank": ps.rank, "optimizer": args.optimizer, "zero_stage": args.zero,
           "engine": type(engine).__name__, "params": sum(p.numel() for p in params),
           "weights_mb": weights / MB, "kept_gradients_mb": tensor_bytes(grads) / MB,
           "optimizer_state_mb": tensor_bytes(state) / MB,
           "peak_rss_mb": status_bytes()["VmHWM"] / MB}
    rows = [None] * ps.world_size
    dist.all_gather_object(rows, row)
    if ps.rank == 0:
        Path(args.result).write_text(json.dumps(rows))
    dist.destroy_process_group()


def torchrun(optimizer: str, zero: int) -> list[dict]:
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
                        "--standalone", __file__, "--worker", "--optimizer", optimizer,
                        "--zero", str(zero), "--result", result.name], cwd=ROOT, check=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
        return json.loads(Path(result.name).read_text())


def report(results: dict) -> str:
    lines = [f"Per-rank memory of a {results['runs'][0][0]['params'] / 1e6:.0f}M-parameter model "
             f"(the demo's shape at hidden 512 x 16 layers), fp32, TP1 x DP4 (4 processes, gloo), "
             f"{STEPS} steps of {MICRO} micro-batches, {results['device']}, commit "
             f"{results['commit'][:10]}, {results['date'][:10]}. Peak RSS is the kernel's VmHWM; "
             f"the tensor columns count storage alive after the last step (the distributed "
             f"optimizer frees its whole gradients once they are reduce-scattered).", "",
             "| optimizer | zero stage | weights MB | kept gradients MB | optimizer state MB | "
             "peak RSS MB (max over ranks) |", "|---|---|---|---|---|---|"]
    for rows in results["runs"]:
        r = rows[0]
        lines.append(f"| {r['optimizer']} | {r['zero_stage']} | {r['weights_mb']:.0f} | "
                     f"{max(x['kept_gradients_mb'] for x in rows):.0f} | "
                     f"{max(x['optimizer_state_mb'] for x in rows):.0f} | "
                     f"{max(x['peak_rss_mb'] for x in rows):.0f} |")
    lines += ["", "| optimizer | state sharded by ZeRO-1 MB | peak RSS saved MB | saved / sharded |",
              "|---|---|---|---|"]
    by = {(rows[0]["optimizer"], rows[0]["zero_stage"]): rows for rows in results["runs"]}
    for optimizer in ("adamw", "muon"):
        if (optimizer, 0) in by and (optimizer, 1) in by:
            zero0, zero1 = by[(optimizer, 0)], by[(optimizer, 1)]
            sharded = max(r["optimizer_state_mb"] for r in zero0) - max(r["optimizer_state_mb"] for r in zero1)
            saved = max(r["peak_rss_mb"] for r in zero0) - max(r["peak_rss_mb"] for r in zero1)
            lines.append(f"| {optimizer} | {sharded:.0f} | {saved:.0f} | {saved / sharded:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/optimizer-memory")
    parser.add_argument("--optimizers", default="adamw,muon")
    parser.add_argument("--zero-stages", default="0,1")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--optimizer", help=argparse.SUPPRESS)
    parser.add_argument("--zero", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {**cpu_script_header(),
               "runs": [torchrun(o, int(zero)) for o in args.optimizers.split(",")
                        for zero in args.zero_stages.split(",")]}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(report(results))
    print(report(results))


if __name__ == "__main__":
    main()
