"""Benchmark data preparation: `megalite prepare-data` against raw `tokenizers` encode_batch,
its peak memory at two corpus sizes, and the loader's collate time against a training step.

    python scripts/bench_data.py --out benchmarks/data-prep [--sizes-mb 100 1000] [--work DIR]

1. A byte-level BPE of --vocab-size tokens is trained on the embedded corpus's documents.
2. For each size, a jsonl corpus is written by streaming the embedded documents again and again
   (each repetition's documents prefixed with its number, so no two are byte-identical) until
   the size is reached; then
   - `python -m megalite prepare-data --input C --tokenizer T --out D --workers N` runs as a
     subprocess, its process tree (the main process, its workers, multiprocessing's helper)
     sampled every --interval s: peak RSS is the max over samples of the RSS summed over the
     tree (PSS likewise, which counts shared pages once; and the sum of each process's own
     high-water mark, VmHWM, an upper bound the sampling cannot miss);
   - the same tokenizer's `Tokenizer.encode_batch` (Rust threads on every core) encodes the
     same documents read from the same file, --batch-docs at a time; only the encode calls are
     timed, on the first --raw-limit-mb MB of a larger corpus. `encode_batch_fast` (what the
     pipeline calls) is timed likewise, in a second pass with a fresh tokenizer, for reference.
3. The demo config's data (configs/demo.yaml at TP=1) is built as megalite/train.py builds it,
   and the collate of all micro-batches of a step at DP=1 (train.py's `host_batches`) is timed
   over --collate-steps steps; a one-process trainer run of --trainer-steps steps gives the
   step time from its metrics.jsonl (real tokens of a step / tokens_per_s, first
   --trainer-warmup records dropped). The collate is also timed on the largest prepared corpus
   (padded and packed, seq 1024, global batch 32, micro-batch 4): memory-mapped shards.

Writes OUT/results.json (device, date, commit, commands, every number), OUT/results.csv,
OUT/data_prep.png and OUT/README.md. The corpora and prepared data live in --work (default: a
temporary directory, deleted afterwards; a given --work is kept and its corpora reused).
Timings on a shared machine depend on what else runs: each measurement first waits (up to
--quiet-timeout s) until the rest of the machine uses under --quiet-threshold cores, records the
cores it used meanwhile (`others_cores`), and is run again (--retries) if that was over the
threshold; the least disturbed attempt is reported, every attempt listed.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent  # this repository (git, the script)
sys.path.append(str(ROOT))  # bench/, after a snapshot's megalite on PYTHONPATH
from bench.data_prep_report import MB, disturbance_notes, goals, write_outputs  # noqa: E402
from bench.process_tree import PSS_INTERVAL, CpuWindow, measured, run_sampled  # noqa: E402
from bench.provenance import extract_commit, git  # noqa: E402
from bench.tokenizer_speed import raw_encode  # noqa: E402

CODE = ROOT  # the tree whose megalite is measured: a snapshot of a commit (see --code) or ROOT


# ------------------------------------------------------------------------ machine and commit

def device_info() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor() or "unknown")
    import numpy
    import tokenizers
    import torch
    return {"cpu_model": model, "logical_cores": os.cpu_count(),
            "physical_cores": psutil.cpu_count(logical=False),
            "memory_bytes": psutil.virtual_memory().total, "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "tokenizers": tokenizers.__version__, "numpy": numpy.__version__,
            "psutil": psutil.__version__}


def git_info(snapshot_of: str | None) -> dict:
    """The commit measured. Others may edit the tree meanwhile: by default (--code HEAD) a
    snapshot of the commit is measured, and the working tree's changes are listed as not
    measured; with --code current they are what is measured, so they are listed as such."""
    changes = git("status", "--porcelain", "--untracked-files=no").splitlines()
    if snapshot_of:
        return {"commit": snapshot_of, "measured": f"git archive of {snapshot_of} (megalite/, configs/)",
                "working_tree_changes_not_measured": changes}
    return {"commit": git("rev-parse", "HEAD"), "measured": "the working tree",
            "uncommitted_changes": changes,
            "megalite_diff_sha256": hashlib.sha256(
                git("diff", "HEAD", "--", "megalite").encode()).hexdigest()}


def snapshot(commit: str, root: Path) -> tuple[str, Path]:
    """megalite/ and configs/ of `commit` extracted under `root` (once): (full sha, directory)."""
    return extract_commit(commit, root, ("megalite", "configs"))


# ------------------------------------------------------------------------ corpus, tokenizer

def make_corpus(path: Path, target_bytes: int) -> dict:
    """A jsonl of at least target_bytes: the embedded documents, repetition r's prefixed with
    "[r] ", written by streaming (nothing but a line held); an existing one is reused."""
    from megalite.data.sources import EMBEDDED, documents
    info_path = path.with_name(path.name + ".info.json")
    if path.is_file() and info_path.is_file():
        info = json.loads(info_path.read_text())
        if info["target_bytes"] == target_bytes and info["bytes"] == path.stat().st_size:
            return {**info, "reused": True}
    tmp = path.with_name(f".{path.name}.tmp")
    written = docs = reps = 0
    start = time.perf_counter()
    with open(tmp, "wb") as f:
        while written < target_bytes:
            for text in documents(EMBEDDED):
                line = (json.dumps({"text": f"[{reps}] {text}"}, ensure_ascii=False) + "\n").encode()
                f.write(line)
                written += len(line)
                docs += 1
                if written >= target_bytes:
                    break
            reps += 1
    os.replace(tmp, path)
    info = {"path": str(path), "target_bytes": target_bytes, "bytes": path.stat().st_size,
            "documents": docs, "repetitions": reps, "seconds": time.perf_counter() - start}
    info_path.write_text(json.dumps(info, indent=1))
    return {**info, "reused": False}


def train_tokenizer(path: Path, vocab_size: int) -> dict:
    """megalite's byte-level BPE trained on the embedded documents, saved as `path`."""
    from megalite.data.sources import EMBEDDED, documents
    from megalite.data.tokenizer import load_tokenizer, train_bpe
    start = time.perf_counter()
    train_bpe(list(documents(EMBEDDED)), vocab_size).save(str(path))
    return {"path": str(path), "requested_vocab_size": vocab_size,
            "vocab_size": load_tokenizer(path).vocab_size, "train_seconds": time.perf_counter() - start,
            "trained_on": "the embedded corpus (megalite/data/corpus/python-docs.jsonl.xz)"}


# ---------------------------------------------------------------------------- prepare-data

def run_prepare(corpus: Path, tokenizer: Path, out: Path, workers: int, interval: float) -> dict:
    """`megalite prepare-data` into a fresh `out`, measured."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "megalite", "prepare-data", "--input", str(corpus),
           "--tokenizer", str(tokenizer), "--out", str(out), "--workers", str(workers)]
    result = run_sampled(cmd, CODE, out.with_name(out.name + ".log"), interval)
    size = corpus.stat().st_size
    result.update(input_bytes=size, workers=workers)
    meta_path = out / "meta.json"
    if result["returncode"] == 0 and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        result.update(meta={k: v for k, v in meta.items() if k != "shards"},
                      tokens=meta["tokens"], documents=meta["documents"],
                      mb_per_s=size / MB / result["wall_s"],
                      tokens_per_s=meta["tokens"] / result["wall_s"],
                      output_bytes=sum(p.stat().st_size for p in out.iterdir() if p.is_file()))
    return result


# ------------------------------------------------------------------ collate and train step

def collate_bench(overrides: list[str], steps: int, config: str = "configs/demo.yaml") -> dict:
    """train.py's data (prepare_data, sample_sets, BatchOrder) and its `host_batches` at DP=1
    (every micro-batch of a step collated, no pinning on CPU), timed per step."""
    from megalite.data.batches import BatchOrder
    from megalite.data.prepare import prepare_data
    from megalite.run_config import load_config
    from megalite.train import sample_sets
    cfg = load_config(CODE / config, overrides)
    t0 = time.perf_counter()
    data = prepare_data(cfg.data)
    train_set = sample_sets(data.train, cfg, data)
    order = BatchOrder(train_set.sizes, train_set.weights, cfg.train.global_batch_size, cfg.run.seed)
    setup_s = time.perf_counter() - t0
    t = cfg.train

    def host_batches(step: int) -> list:
        return [train_set.collate(r) for r in order.micro_batches(step, 0, 1, t.micro_batch_size)]

    times, targets, cells = [], [], 0
    window, cpu = CpuWindow(), time.process_time()
    for step in range(steps):
        t0 = time.perf_counter()
        batches = host_batches(step)
        times.append(time.perf_counter() - t0)
        targets.append(int(sum(b.target_count() for b in batches)))
        cells = sum(b.input_ids.numel() for b in batches)
    usage = window.result(time.process_time() - cpu, bench_is_own=True)
    rest = times[1:] or times
    return {"config": config, "cpu": usage, "overrides": overrides, "mode": cfg.data.mode,
            "seq_len": cfg.data.seq_len, "global_batch": t.global_batch_size,
            "micro_batch": t.micro_batch_size, "micro_batches_per_step": t.global_batch_size // t.micro_batch_size,
            "train_samples": sum(train_set.sizes), "train_tokens": data.meta["train_tokens"],
            "setup_s": setup_s, "steps": steps, "first_step_s": times[0] if times else None,
            "median_step_s": statistics.median(rest) if rest else None,
            "mean_step_s": statistics.fmean(rest) if rest else None,
            "p95_step_s": sorted(rest)[int(0.95 * (len(rest) - 1))] if rest else None,
            "max_step_s": max(rest) if rest else None,
            "mean_target_tokens_per_step": statistics.fmean(targets) if targets else None,
            "last_step_cells": cells}


def step_times(metrics: Path, warmup: int) -> list[float]:
    """Seconds per step from a metrics.jsonl (log_every=1): the step's real tokens divided by
    its tokens_per_s; the first `warmup` step records are dropped."""
    records = [r for r in map(json.loads, metrics.read_text().splitlines()) if "tokens_per_s" in r]
    seconds, previous = [], 0
    for r in records:
        seconds.append((r["tokens"] - previous) / r["tokens_per_s"])
        previous = r["tokens"]
    return seconds[warmup:]


def trainer_bench(work: Path, steps: int, warmup: int, cache_dir: Path, interval: float) -> dict:
    run_dir = work / "train-run"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "megalite.train", "--config", "configs/demo.yaml", "parallel.tp=1",
           f"train.max_steps={steps}", f"run.dir={run_dir}", f"data.cache_dir={cache_dir}"]
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    result = run_sampled(cmd, CODE, work / "train-run.log", interval, env)
    metrics = run_dir / "metrics.jsonl"
    if result["returncode"] == 0 and metrics.is_file():
        seconds = step_times(metrics, warmup)
        records = [json.loads(x) for x in metrics.read_text().splitlines()]
        times = [r["time"] for r in records if "tokens_per_s" in r]
        wall_steps = [b - a for a, b in zip(times, times[1:])][max(warmup - 1, 0):]
        result.update(warmup_records_dropped=warmup, step_s=seconds,
                      median_step_s=statistics.median(seconds), mean_step_s=statistics.fmean(seconds),
                      median_step_s_from_time_field=statistics.median(wall_steps) if wall_steps else None)
    return result


# ------------------------------------------------------------------------------------- main

def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="where results.json, results.csv, the plot and README.md go")
    p.add_argument("--work", help="corpora and prepared data (kept; default: a temporary directory)")
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[100, 1000])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--interval", type=float, default=0.05, help="seconds between memory samples")
    p.add_argument("--batch-docs", type=int, default=1000, help="documents per encode_batch call")
    p.add_argument("--raw-limit-mb", type=float, default=200,
                   help="raw encode_batch on at most the first this many MB of a corpus")
    p.add_argument("--no-raw-fast", action="store_true", help="skip the encode_batch_fast reference")
    p.add_argument("--collate-steps", type=int, default=50)
    p.add_argument("--big-collate-steps", type=int, default=50,
                   help="steps of collate on the largest prepared corpus (0: skip)")
    p.add_argument("--trainer-steps", type=int, default=20, help="0: skip the demo (collate and trainer)")
    p.add_argument("--trainer-warmup", type=int, default=5)
    p.add_argument("--quiet-threshold", type=float, default=0.3,
                   help="a phase waits until the rest of the machine uses under this many cores, "
                        "and is run again if it used more meanwhile")
    p.add_argument("--quiet-timeout", type=float, default=600,
                   help="seconds to wait for a quiet machine before a phase (0: never wait)")
    p.add_argument("--retries", type=int, default=1, help="runs again of a disturbed phase")
    p.add_argument("--code", default="HEAD",
                   help="the megalite measured: a commit (default HEAD), extracted into the work dir, "
                        "so that edits to the tree during the run cannot mix in; 'current': the "
                        "megalite that imports here (the working tree, uncommitted changes included)")
    p.add_argument("--snapshot-of", help=argparse.SUPPRESS)  # set when re-run inside a snapshot
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    global CODE
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    out = Path(args.out).resolve()
    temporary = args.work is None
    work = Path(tempfile.mkdtemp(prefix="bench-data-")) if temporary else Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if args.code != "current" and not args.snapshot_of:
        # Run again in a process whose megalite is the commit's (PYTHONPATH first on the path;
        # the working directory of every `python -m megalite` is the snapshot too).
        try:
            sha, code = snapshot(args.code, work)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH")]))}
            again = ["--snapshot-of", sha, "--work", str(work), *argv]  # 4 first: see `shown`
            return subprocess.run([sys.executable, str(Path(__file__).resolve()), *again], env=env).returncode
        finally:
            if temporary:
                shutil.rmtree(work, ignore_errors=True)
    import megalite
    CODE = Path(megalite.__file__).resolve().parent.parent
    if args.snapshot_of and CODE != (work / f"code-{args.snapshot_of[:12]}").resolve():
        raise SystemExit(f"megalite imports from {CODE}, not from the snapshot of {args.snapshot_of}")
    started = time.perf_counter()
    shown = [a if not a.startswith(str(ROOT) + "/") else os.path.relpath(a, ROOT) for a in argv]
    if args.snapshot_of:
        shown = shown[4:]  # the user's arguments, not the re-run's
    results: dict = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                     "device": device_info(), "git": git_info(args.snapshot_of),
                     "code_dir": str(CODE), "commands_cwd": str(CODE),
                     "invocation": shlex.join(["python", "scripts/bench_data.py", *shown]),
                     "reproduce": "python scripts/bench_data.py --out benchmarks/data-prep",
                     "settings": {k: v for k, v in vars(args).items() if k not in ("out", "work", "snapshot_of")}
                     | {"interval_s": args.interval, "pss_interval_s": PSS_INTERVAL, "work": str(work)},
                     "commands": [], "sizes": [], "notes": []}
    results["settings"].pop("interval")
    try:
        tok_path = work / f"bpe-{args.vocab_size}.json"
        results["tokenizer"] = train_tokenizer(tok_path, args.vocab_size)
        print(f"tokenizer: {results['tokenizer']['vocab_size']} tokens", flush=True)
        limit = int(args.raw_limit_mb * MB)
        quiet = {"threshold": args.quiet_threshold, "timeout": args.quiet_timeout, "retries": args.retries}
        for size_mb in args.sizes_mb:
            corpus = make_corpus(work / f"corpus-{size_mb:g}mb.jsonl", int(size_mb * MB))
            print(f"corpus {size_mb:g} MB: {corpus['bytes']:,} bytes, {corpus['documents']:,} docs", flush=True)
            prep = measured(lambda: run_prepare(Path(corpus["path"]), tok_path,
                                                work / f"prepared-{size_mb:g}mb", args.workers, args.interval),
                            lambda r: r["cpu"]["others_cores"], quiet)
            results["commands"].append(prep["command"])
            print(f"  prepare: rc {prep['returncode']}, {prep['wall_s']:.1f} s, "
                  f"{prep.get('mb_per_s', 0):.2f} MB/s, peak RSS {prep['peak_rss_bytes'] / 1e6:,.0f} MB", flush=True)
            if prep["returncode"] != 0:
                results["notes"].append(f"prepare-data failed at {size_mb:g} MB (exit {prep['returncode']}): "
                                        f"{prep['log_tail'][-500:]}")
            raw = measured(lambda: raw_encode(Path(corpus["path"]), tok_path, args.batch_docs,
                                              limit if corpus["bytes"] > limit else None, not args.no_raw_fast),
                           lambda r: max(r[k]["others_cores"] for k in ("encode_batch", "encode_batch_fast") if k in r),
                           quiet)
            print(f"  raw encode_batch: {raw['encode_batch']['mb_per_s']:.2f} MB/s on "
                  f"{raw['measured_bytes'] / MB:,.0f} MB", flush=True)
            entry = {"size_mb": size_mb, "corpus": corpus, "prepare": prep, "raw": raw}
            if prep.get("mb_per_s"):
                entry["prepare_over_raw_mb_s"] = prep["mb_per_s"] / raw["encode_batch"]["mb_per_s"]
                if "encode_batch_fast" in raw:
                    entry["prepare_over_raw_fast_mb_s"] = prep["mb_per_s"] / raw["encode_batch_fast"]["mb_per_s"]
                if raw["whole_corpus"]:
                    # Each stored document is its tokens, then eos.
                    entry["tokens_check"] = {"raw_tokens_plus_eos": raw["encode_batch"]["tokens"] + raw["documents"],
                                             "prepared_tokens": prep["tokens"],
                                             "equal": raw["encode_batch"]["tokens"] + raw["documents"] == prep["tokens"]}
            if not raw["whole_corpus"]:
                results["notes"].append(
                    f"raw encode_batch at {size_mb:g} MB was measured on the first "
                    f"{raw['measured_bytes'] / MB:,.0f} MB of the corpus only (--raw-limit-mb {args.raw_limit_mb:g}); "
                    f"prepare-data ran on all of it.")
            results["sizes"].append(entry)
        results["goals"] = goals(results["sizes"])
        if len(results["sizes"]) > 1:
            a, b = results["sizes"][0]["prepare"], results["sizes"][-1]["prepare"]
            if a.get("peak_rss_bytes") and b.get("peak_rss_bytes"):
                results["peak_rss_ratio_largest_over_smallest"] = b["peak_rss_bytes"] / a["peak_rss_bytes"]
        results["collate"] = {}
        if args.trainer_steps:
            cache = work / "demo-cache"
            demo = ["parallel.tp=1", f"data.cache_dir={cache}"]
            results["collate"]["demo"] = measured(lambda: collate_bench(demo, args.collate_steps),
                                                  lambda r: r["cpu"]["others_cores"], quiet)
            print(f"demo collate: {results['collate']['demo']['median_step_s'] * 1e3:.2f} ms/step", flush=True)
            trainer = measured(lambda: trainer_bench(work, args.trainer_steps, args.trainer_warmup, cache,
                                                     args.interval),
                               lambda r: r["cpu"]["others_cores"], quiet)
            results["commands"].append(trainer["command"])
            results["trainer"] = trainer
            if trainer.get("median_step_s"):
                print(f"trainer step: {trainer['median_step_s']:.3f} s", flush=True)
                results["collate_over_step"] = results["collate"]["demo"]["median_step_s"] / trainer["median_step_s"]
            else:
                results["notes"].append(f"the trainer run failed (exit {trainer['returncode']}): {trainer['log_tail'][-500:]}")
        largest = next((s for s in reversed(results["sizes"]) if s["prepare"].get("mb_per_s")), None)
        if args.big_collate_steps and largest is not None:
            prepared = work / f"prepared-{largest['size_mb']:g}mb"
            for mode in ("padded", "packed"):
                big = [f"data.path={prepared}", f"data.mode={mode}", "data.seq_len=1024",
                       "model.max_seq_len=1024", "train.global_batch_size=32", "train.micro_batch_size=4",
                       f"data.cache_dir={work / 'demo-cache'}"]
                name = f"{largest['size_mb']:g}MB prepared, {mode}"
                results["collate"][name] = measured(lambda: collate_bench(big, args.big_collate_steps),
                                                    lambda r: r["cpu"]["others_cores"], quiet)
                print(f"{name} collate: {results['collate'][name]['median_step_s'] * 1e3:.2f} ms/step", flush=True)
            results["notes"].append("The collate on prepared data reads shards just written, so mostly "
                                    "from the page cache (warm), not from disk.")
    finally:
        results["total_wall_s"] = time.perf_counter() - started
        results["notes"] += disturbance_notes(results, args.quiet_threshold)
        results.setdefault("goals", goals(results["sizes"]))
        write_outputs(results, out)
        if temporary:
            shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {out} in {results['total_wall_s']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
