"""Does the trainer's data path stay flat in corpus size? Start-up time, per-rank peak memory and
per-rank CPU seconds of a one-step training run at 4 ranks (TP2 x DP2, gloo), on synthetic
Megatron corpora of 1e6, 1e7 and 1e8 documents, packed and padded, each with a fresh
data.cache_dir (first: any index build included) and again with the same one (second: cached);
and a 2,000-shard corpus trained under `ulimit -n 1024`.

    python scripts/bench_data_scale.py --label after --out benchmarks/data-scale/results.json
    git worktree add /tmp/base 66dbe5a   # the code before issue 29
    python scripts/bench_data_scale.py --tree /tmp/base --label before \\
        --out benchmarks/data-scale/before.json

The trainer runs unchanged (`torchrun -m megalite.train`, megalite imported from --tree) and is
measured from outside: torchrun starts each rank through this script's --rank-wrap, which runs
the rank as its child and reads the kernel's account of it (getrusage: peak RSS, user + system
CPU) when it exits, and samples the rank's private (anonymous) resident memory every 20 ms.
Peak RSS also counts the pages of memory-mapped files a rank touched (page cache shared between
ranks, reclaimable), which on this kernel grows by whole large folios around each read of the
index; peak private memory is what the rank itself holds. The CPU spread over ranks shows a rank that
works alone while the others wait. Wall time is the whole run: start-up, the step, and the end
of a run (an evaluation of 256 tokens, a checkpoint, a 1-token sample).
A run past --timeout or --max-gb (all ranks' RSS together) is stopped and the rest of that
corpus size recorded as skipped. Corpora are written once into --work and reused.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import struct
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # bench/ beside megalite
from bench.proc_counters import status_bytes  # noqa: E402
from bench.provenance import git_commit, megalite_of  # noqa: E402

RANKS = 4
MAX_DOC = 32  # document lengths are uniform in 1..MAX_DOC tokens, eos last
CHUNK = 10_000_000  # documents generated at a time
EOS = 0


def write_corpus(prefix: Path, docs: int, vocab: int, seed: int) -> int:
    """A Megatron .bin/.idx pair (format: megalite/data/indexed.py), one sequence per document,
    uint16 ids in [3, vocab) and eos last; each file is renamed into place once whole, so an
    existing .idx means a finished corpus. Returns its token count."""
    bin_file, idx_file = (prefix.with_name(prefix.name + ext) for ext in (".bin", ".idx"))
    if idx_file.exists():
        return bin_file.stat().st_size // 2
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, MAX_DOC + 1, docs, dtype=np.int32)
    ends = np.cumsum(lengths, dtype=np.int64)
    tmp_bin, tmp_idx = bin_file.with_suffix(".bin.tmp"), idx_file.with_suffix(".idx.tmp")
    with open(tmp_bin, "wb") as f:
        for a in range(0, docs, CHUNK):
            start, stop = ends[a] - lengths[a], ends[min(a + CHUNK, docs) - 1]
            tokens = rng.integers(3, vocab, stop - start, dtype=np.uint16)
            tokens[ends[a:a + CHUNK] - start - 1] = EOS
            tokens.tofile(f)
    with open(tmp_idx, "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, docs, docs + 1))
        lengths.tofile(f)
        for a in range(0, docs, CHUNK):
            (2 * (ends[a:a + CHUNK] - lengths[a:a + CHUNK])).tofile(f)
        for a in range(0, docs + 1, CHUNK):
            np.arange(a, min(a + CHUNK, docs + 1), dtype=np.int64).tofile(f)
    os.replace(tmp_bin, bin_file)
    os.replace(tmp_idx, idx_file)
    return int(ends[-1])


def make_tokenizer(path: Path) -> int:
    """A byte-level BPE holding megalite's special tokens (eos = 0); only its size matters.
    Returns its vocabulary size."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    if not path.exists():
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        texts = [f"Document {i} is about tensors, gradients and shards." for i in range(50)]
        tok.train_from_iterator(texts, trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<|eos|>", "<|bos|>", "<|pad|>"], show_progress=False))
        tok.save(str(path))
    return Tokenizer.from_file(str(path)).get_vocab_size()


def rank_wrap(stats: str, argv: list[str]) -> int:
    """One torchrun rank: the trainer as a child, then its peak RSS and CPU seconds to a file."""
    child = subprocess.Popen([sys.executable, *argv])
    signal.signal(signal.SIGTERM, lambda *_: child.terminate())
    private = 0
    while child.poll() is None:
        private = max(private, private_kb(child.pid))
        time.sleep(0.02)
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    Path(stats, f"rank{os.environ['RANK']}.json").write_text(json.dumps(
        {"peak_rss_mb": round(use.ru_maxrss / 1024, 1), "peak_private_mb": round(private / 1024, 1),
         "cpu_s": round(use.ru_utime + use.ru_stime, 2)}))
    return child.returncode


def private_kb(pid: int) -> int:
    """The process's anonymous resident memory (RssAnon): what it holds itself, without the
    pages of memory-mapped files, which are the kernel's page cache, shared by every rank of a
    node and reclaimed under pressure (this kernel maps whole large folios around each read)."""
    try:
        return status_bytes(pid).get("RssAnon", 0) // 1024
    except OSError:
        return 0


def group_rss_gb(pgid: int) -> float:
    """Resident memory of every process in the run's process group."""
    pages = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            pages += int(fields[21])
    return pages * os.sysconf("SC_PAGE_SIZE") / 1e9


def train_once(args, data: str, mode: str, cache: Path, run_dir: Path, nofile: int | None) -> dict:
    """One 1-step run of the trainer at TP2 x DP2: wall time, per-rank peak RSS and CPU."""
    stats = run_dir / "rank-stats"
    stats.mkdir(parents=True, exist_ok=True)
    overrides = ["model=tiny", "model.n_layers=2", "model.hidden=32", "parallel.tp=2",
                 f"data.path={data}", f"data.tokenizer={args.work / 'tokenizer.json'}",
                 f"data.mode={mode}", "data.seq_len=32", f"data.cache_dir={cache}",
                 "train.max_steps=1", "train.warmup_steps=1", "train.global_batch_size=8",
                 "train.micro_batch_size=4", "train.eval_tokens=256", "train.resume=never",
                 "sample.prompts=[The]", "sample.max_new_tokens=1", f"run.dir={run_dir}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(RANKS), __file__, "--rank-wrap", str(stats), "-m", "megalite.train", *overrides]
    limit = nofile and (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile)))
    env = {**os.environ, "PYTHONPATH": str(args.tree), "OMP_NUM_THREADS": "1"}
    load0, t0, stopped = os.getloadavg()[0], time.perf_counter(), None
    with open(run_dir / "log.txt", "wb") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=args.tree, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=limit)
        while proc.poll() is None and not stopped:
            time.sleep(0.5)
            if time.perf_counter() - t0 > args.timeout:
                stopped = f"stopped past {args.timeout:.0f} s"
            elif group_rss_gb(proc.pid) > args.max_gb:
                stopped = f"stopped past {args.max_gb:.0f} GB of RSS over all ranks"
        wall = time.perf_counter() - t0
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # stopped runs, and ranks a failure left behind
        except ProcessLookupError:
            pass
        proc.wait()
    ranks = [json.loads((stats / f"rank{r}.json").read_text()) if (stats / f"rank{r}.json").exists()
             else {} for r in range(RANKS)]
    cpu = [r.get("cpu_s") for r in ranks]
    record = {"status": "skipped" if stopped else ("ok" if proc.returncode == 0 else "failed"),
              "wall_s": round(wall, 2), "rank_peak_rss_mb": [r.get("peak_rss_mb") for r in ranks],
              "rank_peak_private_mb": [r.get("peak_private_mb") for r in ranks],
              "rank_cpu_s": cpu, "load_avg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)]}
    if None not in cpu:
        record["cpu_spread_s"] = round(max(cpu) - min(cpu), 2)
    if stopped or proc.returncode:
        errors = [line for line in (run_dir / "log.txt").read_text(errors="replace").splitlines()
                  if "rror" in line and not line[:1].isspace() and "torch.distributed" not in line]
        record["reason"] = stopped or (errors[-1] if errors else f"exit {proc.returncode}")
    return record


COLUMNS = {"corpus (documents)": "corpus", "tokens": "tokens", "shards": "shards", "mode": "mode",
           "run": "run", "status": "status", "wall s": "wall_s",
           "peak private MB per rank": "rank_peak_private_mb",
           "peak RSS MB per rank": "rank_peak_rss_mb", "CPU s per rank": "rank_cpu_s",
           "CPU spread s": "cpu_spread_s", "load 1m": "load_avg_1m"}


def table(records: list[dict]) -> str:
    rows = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for r in records:
        cells = {**r, "tokens": f"{r['tokens']:.2e}",
                 "status": r["status"] + (f" ({r['reason']})" if "reason" in r else "")}
        rows.append("| " + " | ".join(str(cells.get(key, "")) for key in COLUMNS.values()) + " |")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", type=Path, default=ROOT,
                   help="the megalite source tree the runs import")
    p.add_argument("--work", type=Path, default=Path("/tmp/megalite-data-scale"),
                   help="corpora (kept for reuse), caches and run directories")
    p.add_argument("--label", default="after", help="names this measurement in the records")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "data-scale" / "results.json")
    p.add_argument("--sizes", type=float, nargs="*", default=[1e6, 1e7, 1e8],
                   help="documents per corpus")
    p.add_argument("--modes", nargs="*", default=["packed", "padded"])
    p.add_argument("--shards", type=int, default=2000,
                   help="shards of the many-shard corpus (0: none)")
    p.add_argument("--nofile", type=int, default=1024, help="ulimit -n of the many-shard runs")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a run is stopped")
    p.add_argument("--max-gb", type=float, default=20.0,
                   help="RSS of all ranks together before a run is stopped")
    args = p.parse_args()
    args.tree, args.work, args.out = (a.resolve() for a in (args.tree, args.work, args.out))
    args.work.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(args.work / "tokenizer.json")
    imports = megalite_of(args.tree, {**os.environ, "PYTHONPATH": str(args.tree)})
    base = {"label": args.label, "device": f"CPU ({os.cpu_count()} cores)", "ranks": RANKS,
            "layout": "TP2 x DP2", "megalite": str(imports),
            "commit": git_commit(args.tree, ("megalite",))}
    plans = []  # (corpus name, data path, docs, tokens, shards, nofile)
    for docs in map(int, args.sizes):
        name = f"{docs:.0e}".replace("e+0", "e")
        prefix = args.work / f"corpus-{name}" / "data"
        prefix.parent.mkdir(exist_ok=True)
        plans.append((name, str(prefix), docs, write_corpus(prefix, docs, vocab, docs), 1, None))
    if args.shards:
        folder = args.work / f"shards-{args.shards}"
        folder.mkdir(exist_ok=True)
        tokens = sum(write_corpus(folder / f"s{i:05d}", 100, vocab, i) for i in range(args.shards))
        plans.append((f"{args.shards} shards", str(folder / "s*"), 100 * args.shards, tokens,
                      args.shards, args.nofile))
    records = []
    for corpus, data, docs, tokens, shards, nofile in plans:
        skip = None
        for mode in args.modes if shards == 1 else ["packed"]:
            cache = args.work / "runs" / args.label / f"{corpus.replace(' ', '-')}-{mode}" / "cache"
            for run in ("first", "second"):
                record = {**base, "corpus": corpus, "docs": docs, "tokens": tokens,
                          "shards": shards, "nofile_limit": nofile, "mode": mode, "run": run,
                          "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
                if run == "first" and cache.parent.exists():
                    shutil.rmtree(cache.parent)
                if skip:
                    record.update(status="skipped", reason=skip)
                else:
                    record.update(train_once(args, data, mode, cache, cache.parent / run, nofile))
                    if record["status"] == "skipped":
                        skip = f"{mode} {run} run {record['reason']}"
                records.append(record)
                print(table([record]).splitlines()[-1], flush=True)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(records, indent=1) + "\n")
    print(table(records))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank-wrap"]:
        sys.exit(rank_wrap(sys.argv[2], sys.argv[3:]))
    sys.exit(main())
