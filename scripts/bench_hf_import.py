"""What `train.init_from=<HF dir>` costs each rank: memory and bytes read, sliced vs today's full read.

    python scripts/bench_hf_import.py --out benchmarks/hf-import

A random Llama (transformers' LlamaForCausalLM, bf16, a few hundred MB, saved in shards with
save_pretrained) is loaded at TP=--tp on --tp gloo processes, each a fresh process per path:
- "full": the load before slicing (tests/test_hf_sliced.today_read_hf, verbatim: every tensor
  of every file read whole as fp32, re-laid, then load_full_weights keeps the rank's slice);
- "sliced": hf/convert.load_pretrained (each rank reads its slices of its parameters).
Per rank, around the load only (the model is built, and randomly initialised, before):
- peak RSS growth: /proc/self/status VmHWM after the load minus VmRSS before it, the peak reset
  first (writing 5 to /proc/self/clear_refs); it counts the file pages mapped in as well;
- bytes read: /proc/self/io rchar growth (read() calls) plus the file pages this process had
  mapped in: safetensors memory-maps, so reading a tensor is touching its pages. Those are
  counted per safetensors file, as the resident size (/proc/self/smaps Rss) of its mappings
  right before the file is closed;
- the rank's share: its parameters' bytes (fp32, as megalite holds them) and the same elements
  in the file's dtype (the least a rank could read).
Then `megalite import` of the model and `megalite export` of that import, one process each:
their peak RSS growth (streamed, about the largest tensor, not the model).
Writes OUT/results.json (device, date, commit, command, per-rank numbers) and OUT/results.md.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.proc_counters import io_bytes, reset_peak_rss, status_bytes  # noqa: E402
from bench.provenance import git_commit  # noqa: E402


def mapped_bytes(path: str) -> int:
    """Resident bytes of this process's mappings of `path` (/proc/self/smaps)."""
    total, mine = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and re.match(r"^[0-9a-f]+-[0-9a-f]+$", fields[0]):
            mine = len(fields) >= 6 and fields[5] == path
        elif mine and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


FILE_PAGES = {"bytes": 0}


def measured_safe_open(real):
    """safe_open, adding the pages mapped in from each file when it is closed to FILE_PAGES."""
    class Measured:
        def __init__(self, path, framework, **kwargs):
            self.path = os.path.realpath(path)
            self.file = real(path, framework=framework, **kwargs)

        def __enter__(self):
            self.file.__enter__()
            return self

        def __exit__(self, *exc):
            FILE_PAGES["bytes"] += mapped_bytes(self.path)
            return self.file.__exit__(*exc)

        def __getattr__(self, name):
            return getattr(self.file, name)
    return Measured


def convert_worker(args) -> None:
    """`megalite import` of the model, or `megalite export` of that import (fp32 whole-tensor
    checkpoint -> bf16 shards), in this one process: its peak RSS growth."""
    import torch
    from megalite.hf.convert import export_hf, import_hf
    torch.set_num_threads(1)
    hf_dir, work = Path(args.hf_dir), Path(args.store)
    gc.collect()
    reset_peak_rss()
    before = status_bytes()
    start = time.perf_counter()
    if args.path == "import":
        import_hf(hf_dir, work / "imported")
        written = [work / "imported" / "model.safetensors"]
    else:
        export_hf(work / "imported", work / "exported", max_shard_bytes=int(args.max_shard_gb * 1e9))
        written = sorted((work / "exported").glob("*.safetensors"))
    seconds = time.perf_counter() - start
    after = status_bytes()
    Path(args.result).write_text(json.dumps({
        "path": args.path, "peak_rss_growth": after["VmHWM"] - before["VmRSS"],
        "written_bytes": sum(f.stat().st_size for f in written), "files": len(written),
        "s": round(seconds, 3)}))


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank,
                            world_size=args.tp)
    import megalite.hf.stream as stream
    import tests.test_hf_sliced as today
    from megalite.hf.convert import load_pretrained, pretrained_config
    from megalite.model import GPT
    from megalite.parallel.state import ParallelState
    from megalite.training.checkpoint import load_full_weights
    stream.safe_open = measured_safe_open(stream.safe_open)
    today.safe_open = measured_safe_open(today.safe_open)

    ps = ParallelState.from_world(args.tp)
    hf_dir = Path(args.hf_dir)
    cfg = pretrained_config(hf_dir)
    start = time.perf_counter()
    model = GPT(cfg, ps, seed=0)
    init_s = time.perf_counter() - start
    gc.collect()
    dist.barrier()
    reset_peak_rss()
    before, read_before = status_bytes(), io_bytes()["rchar"]
    start = time.perf_counter()
    if args.path == "sliced":
        load_pretrained(hf_dir, model, ps)
    else:
        _, full = today.today_read_hf(hf_dir)
        load_full_weights(full, model, str(hf_dir))
        del full
    load_s = time.perf_counter() - start
    after, read_after = status_bytes(), io_bytes()["rchar"]
    gc.collect()
    params = dict(model.named_parameters())
    file_itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}[args.file_dtype]
    padding = sum(max(0, min(model.vocab_start + p.shape[0], cfg.padded_vocab)
                      - max(model.vocab_start, cfg.vocab_size)) * p.shape[1]
                  for k, p in params.items() if k in ("embed.weight", "head.weight"))
    result = {
        "rank": args.rank, "path": args.path,
        "share_param_bytes": sum(p.numel() * p.element_size() for p in params.values()),
        "share_file_bytes": (sum(p.numel() for p in params.values()) - padding) * file_itemsize,
        "peak_rss_growth": after["VmHWM"] - before["VmRSS"],
        "rss_anon_growth_after": after["RssAnon"] - before["RssAnon"],
        "rchar": read_after - read_before,
        "file_pages_mapped": FILE_PAGES["bytes"],
        "load_s": round(load_s, 3), "init_s": round(init_s, 3),
        # The same weights either way: a checksum of this rank's parameters.
        "checksum": float(sum(p.detach().double().sum().item() * (i + 1)
                              for i, p in enumerate(params.values()))),
    }
    result["bytes_read"] = result["rchar"] + result["file_pages_mapped"]
    Path(args.result).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def make_model(directory: Path, args) -> dict:
    import torch
    import transformers

    from megalite.data.tokenizer import train_bpe
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=2048,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory, max_shard_size=args.shard)
    train_bpe(["tensor parallel training of language models " * 20], 300).save(
        str(directory / "tokenizer.json"))  # for `megalite import`
    largest = max(p.numel() for p in model.parameters())
    files = sorted(directory.glob("*.safetensors"))
    info = {"params": sum(p.numel() for p in model.parameters()), "dtype": "bfloat16",
            "files": len(files), "file_bytes": sum(f.stat().st_size for f in files),
            "largest_tensor_fp32_bytes": largest * 4,
            "config": {k: getattr(config, k) for k in (
                "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "tie_word_embeddings")}}
    del model
    gc.collect()
    return info


def run_path(path: str, hf_dir: Path, tmp: Path, args) -> list[dict]:
    store = tmp / f"store-{path}"
    procs, results = [], []
    for rank in range(args.tp):
        result = tmp / f"{path}-{rank}.json"
        results.append(result)
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--worker", "--rank", str(rank), "--tp", str(args.tp),
             "--store", str(store), "--hf-dir", str(hf_dir), "--path", path,
             "--result", str(result), "--file-dtype", "bfloat16"], cwd=ROOT))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"{path}: workers exited with {codes}")
    return [json.loads(r.read_text()) for r in results]


def run_convert(path: str, hf_dir: Path, tmp: Path, args) -> dict:
    result = tmp / f"{path}.json"
    subprocess.run([sys.executable, __file__, "--worker", "--path", path, "--store", str(tmp),
                    "--hf-dir", str(hf_dir), "--result", str(result),
                    "--max-shard-gb", str(args.max_shard_gb)], cwd=ROOT, check=True)
    return json.loads(result.read_text())


def mb(n: int) -> str:
    return f"{n / 1e6:,.0f}"


def report(out: Path, meta: dict, runs: dict[str, list[dict]], converts: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({**meta, "ranks": runs, "convert": converts},
                                                 indent=1))
    model = meta["model"]
    lines = [
        "# `train.init_from=<HF dir>`: per-rank cost of the load, sliced vs today's full read",
        "",
        f"{meta['date']}, {meta['device']}, commit {meta['commit']}.",
        f"`{meta['command']}`",
        "",
        f"Model: random LlamaForCausalLM, {model['params'] / 1e6:.0f} M parameters, bf16, "
        f"{model['files']} safetensors files of {mb(model['file_bytes'])} MB in all "
        f"({model['config']}). TP={meta['tp']} on {meta['tp']} gloo processes, each loading "
        f"into a model already built (its random init took "
        f"{max(r['init_s'] for rs in runs.values() for r in rs):.1f} s at most per rank, "
        f"not counted).",
        "",
        "MB = 10^6 bytes. Share: the rank's parameters (fp32 in megalite) / the same elements in "
        "the file's bf16. Read: rchar + file pages mapped in (safetensors memory-maps).",
        "",
        "| path | rank | share fp32 MB | share in file MB | peak RSS growth MB | "
        "anon RSS growth kept MB | read MB | read / share in file | load s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for path, ranks in runs.items():
        for r in ranks:
            lines.append(
                f"| {path} | {r['rank']} | {mb(r['share_param_bytes'])} | {mb(r['share_file_bytes'])} "
                f"| {mb(r['peak_rss_growth'])} | {mb(r['rss_anon_growth_after'])} "
                f"| {mb(r['bytes_read'])} | {r['bytes_read'] / r['share_file_bytes']:.2f} "
                f"| {r['load_s']:.2f} |")
    full, sliced = runs.get("full"), runs.get("sliced")
    if full and sliced:
        same = all(a["checksum"] == b["checksum"] for a, b in zip(full, sliced))
        peak = max(r["peak_rss_growth"] for r in full) / max(r["peak_rss_growth"] for r in sliced)
        read = max(r["bytes_read"] for r in full) / max(r["bytes_read"] for r in sliced)
        lines += ["", f"Same weights on every rank either way (checksums): {same}. "
                      f"Largest peak RSS growth: {peak:.1f}x less sliced; largest bytes read: "
                      f"{read:.1f}x less."]
    if converts:
        lines += ["", "`megalite import` and `megalite export` (of that import, bf16, "
                      f"--max-shard-gb {meta['max_shard_gb']}), one process each: streamed, "
                      f"their peak is about the largest tensor (the embedding: "
                      f"{mb(model['largest_tensor_fp32_bytes'])} MB in fp32) and its source "
                      f"pages, not the model.", "",
                  "| command | peak RSS growth MB | written MB | files | s |", "|---|---|---|---|---|"]
        lines += [f"| {c['path']} | {mb(c['peak_rss_growth'])} | {mb(c['written_bytes'])} "
                  f"| {c['files']} | {c['s']:.1f} |" for c in converts]
    lines += ["", meta["notes"], ""]
    (out / "results.md").write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/hf-import")
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--shard", default="200MB", help="save_pretrained's max_shard_size")
    parser.add_argument("--paths", default="full,sliced")
    parser.add_argument("--convert", default="import,export",
                        help="also measure these commands, one process each ('' for none)")
    parser.add_argument("--max-shard-gb", type=float, default=0.2, help="export's shard size")
    # A worker's own arguments.
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--rank", type=int)
    parser.add_argument("--store")
    parser.add_argument("--hf-dir")
    parser.add_argument("--path")
    parser.add_argument("--result")
    parser.add_argument("--file-dtype", default="bfloat16")
    args = parser.parse_args()
    if args.worker:
        convert_worker(args) if args.path in ("import", "export") else worker(args)
        return
    import torch
    commit = git_commit()[:7]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = make_model(tmp / "hf", args)
        runs = {path: run_path(path, tmp / "hf", tmp, args) for path in args.paths.split(",")}
        converts = [run_convert(c, tmp / "hf", tmp, args) for c in args.convert.split(",") if c]
    meta = {
        "device": f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                  f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, "
                  f"1 torch thread per process",
        "torch": torch.__version__,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "command": "python scripts/bench_hf_import.py " + " ".join(sys.argv[1:]),
        "tp": args.tp, "model": model, "max_shard_gb": args.max_shard_gb,
        "notes": ("Peak RSS counts the file pages a rank maps in (page cache, shared between "
                  "processes) as well as its private memory: sliced, nearly all of it is file "
                  "pages (the slices are copied from the mapping straight into the parameters); "
                  "full, most of it is private fp32 copies of every tensor. Bytes read above the "
                  "share, sliced: the row-split tensors (embedding, head, q, kv, gate, up) are "
                  "read as contiguous rows, but o_proj and down_proj are split by columns, so "
                  "each of their rows gives a short span (1 KiB and 2.75 KiB here) and every "
                  "4 KiB page holding one is mapped in whole; Linux also maps in the cached pages "
                  "around a faulting one (fault-around, 64 KiB by default). Load times are on a "
                  "shared 2-core machine, 4 processes: indicative only."),
    }
    report(Path(args.out), meta, runs, converts)
    print((Path(args.out) / "results.md").read_text())


if __name__ == "__main__":
    main()
