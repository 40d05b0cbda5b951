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
import csv
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
CODE = ROOT  # the tree whose megalite is measured: a snapshot of a commit (see --code) or ROOT
MB = 1e6  # sizes and rates are decimal: 1 MB = 10**6 bytes, 1 GB = 10**9 bytes
GOAL_RSS_BYTES = 1.5e9
GOAL_RSS_GROWTH = 1.3
GOAL_THROUGHPUT_RATIO = 0.8
PSS_INTERVAL = 1.0  # seconds between PSS samples (a page-table walk per process)


# ---------------------------------------------------------------- machine and CPU accounting

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


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.rstrip("\n")


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
            "megalite_diff_sha256": _sha256(git("diff", "HEAD", "--", "megalite").encode())}


def snapshot(commit: str, root: Path) -> tuple[str, Path]:
    """megalite/ and configs/ of `commit` extracted under `root` (once): (full sha, directory)."""
    import io
    import tarfile
    sha = git("rev-parse", f"{commit}^{{commit}}")
    dest = root / f"code-{sha[:12]}"
    if not (dest / "megalite" / "__init__.py").is_file():
        tmp = root / f".code-{sha[:12]}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        tar = subprocess.run(["git", "archive", "--format=tar", sha, "megalite", "configs"], cwd=ROOT,
                             check=True, capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
            archive.extractall(tmp, filter="data")
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    return sha, dest


def _sha256(data: bytes) -> str:
    import hashlib
    return hashlib.sha256(data).hexdigest()


def _busy_seconds() -> float:
    """CPU seconds the whole machine has been busy (all cores)."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + getattr(t, "steal", 0.0)


class CpuWindow:
    """Cores used by the measured work, by this benchmark process around it (the sampler), and
    by everything else on the machine, over a window."""

    def __init__(self):
        self.start, self.busy, self.load = time.perf_counter(), _busy_seconds(), os.getloadavg()
        self.bench = time.process_time()

    def result(self, own_cpu_s: float, bench_is_own: bool = False) -> dict:
        """own_cpu_s: the measured work's CPU seconds (which include this process's when
        bench_is_own: work done in this process)."""
        wall = max(time.perf_counter() - self.start, 1e-9)
        busy = _busy_seconds() - self.busy
        bench = 0.0 if bench_is_own else time.process_time() - self.bench
        return {"wall_s": wall, "own_cpu_s": own_cpu_s, "own_cores": own_cpu_s / wall,
                "sampler_cores": bench / wall,
                "others_cores": max(busy - own_cpu_s - bench, 0.0) / wall,
                "loadavg_1min_before": self.load[0], "loadavg_1min_after": os.getloadavg()[0]}


def wait_quiet(threshold: float, timeout: float, window: float = 5.0) -> dict:
    """Wait (at most `timeout` s) until the rest of the machine uses under `threshold` cores
    over `window` s: timings on a shared machine mean little while others compute."""
    start, others = time.perf_counter(), None
    while True:
        if timeout <= 0:
            return {"waited_s": 0.0, "others_cores": None, "quiet": None}
        busy = _busy_seconds()
        time.sleep(window)
        others = (_busy_seconds() - busy) / window
        waited = time.perf_counter() - start
        if others < threshold or waited >= timeout:
            return {"waited_s": waited, "others_cores": others, "quiet": others < threshold}


def measured(fn, others_of, quiet: dict):
    """fn() after waiting for a quiet machine, again (at most quiet["retries"] times) while the
    rest of the machine used over quiet["threshold"] cores during it; the least disturbed
    attempt is returned, with every attempt's disturbance and wait listed."""
    attempts, best = [], None
    for attempt in range(1 + quiet["retries"]):
        gate = wait_quiet(quiet["threshold"], quiet["timeout"])
        result = fn()
        others = others_of(result)
        attempts.append({"others_cores": others, "waited_s": gate["waited_s"],
                         "others_cores_before": gate["others_cores"]})
        if best is None or (others is not None and others < best[0]):
            best = (others if others is not None else float("inf"), result)
        if others is None or others <= quiet["threshold"]:
            break
    best[1]["attempts"] = attempts
    return best[1]


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


# ------------------------------------------------------------------- a process tree, sampled

def _hwm_bytes(pid: int) -> int:
    """The process's own peak RSS so far (VmHWM), 0 if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def run_sampled(cmd: list[str], log: Path, interval: float, env: dict | None = None,
                pss_interval: float = PSS_INTERVAL) -> dict:
    """Run `cmd`, sampling its process tree every `interval` s until it exits. Peak RSS (and
    PSS, every pss_interval s) is the max over samples of the sum over every process alive at
    that sample."""
    window = CpuWindow()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=CODE, stdout=out, stderr=subprocess.STDOUT, env=env)
        root = psutil.Process(proc.pid)
        procs: dict[int, psutil.Process] = {proc.pid: root}
        peak = {"rss": 0, "pss": 0, "rss_main": 0, "rss_others": 0, "processes": 0}
        hwm: dict[int, int] = {}
        names: dict[int, str] = {}
        samples, sample_time, last_pss = 0, 0.0, -1e9
        start = time.perf_counter()
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            t0 = time.perf_counter()
            if samples % 5 == 0:  # a scan of /proc: the tree is looked for every 5th sample
                try:
                    for child in root.children(recursive=True):
                        procs.setdefault(child.pid, child)
                except psutil.Error:
                    pass
            with_pss = t0 - last_pss >= pss_interval
            rss = pss = rss_main = alive = 0
            for p in list(procs.values()):
                try:
                    # RSS from statm every sample (cheap); PSS walks the page tables (ms per
                    # process), so it is sampled every pss_interval s only.
                    mem = p.memory_full_info() if with_pss else p.memory_info()
                except psutil.Error:
                    continue
                alive += 1
                rss += mem.rss
                pss += mem.pss if with_pss else 0
                if p.pid == proc.pid:
                    rss_main = mem.rss
                hwm[p.pid] = max(hwm.get(p.pid, 0), _hwm_bytes(p.pid), mem.rss)
                if p.pid not in names:
                    try:
                        names[p.pid] = f"{p.pid}: " + " ".join(p.cmdline())[:120]
                    except psutil.Error:
                        names[p.pid] = f"{p.pid}: ?"
            if with_pss:
                last_pss = t0
                peak["pss"] = max(peak["pss"], pss)
            if rss > peak["rss"]:
                peak.update(rss=rss, rss_main=rss_main, rss_others=rss - rss_main)
            peak["processes"] = max(peak["processes"], alive)
            samples += 1
            sample_time += time.perf_counter() - t0
            time.sleep(interval)
        wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    # usage: the child's CPU and that of every descendant it waited for (its workers).
    return {"command": shlex.join(cmd), "returncode": proc.returncode, "wall_s": wall,
            "peak_rss_bytes": peak["rss"], "peak_pss_bytes": peak["pss"],
            "peak_rss_main_bytes_at_peak": peak["rss_main"],
            "peak_rss_children_bytes_at_peak": peak["rss_others"],
            "sum_of_each_process_peak_rss_bytes": sum(hwm.values()),
            "main_process_peak_rss_bytes": hwm.get(proc.pid, 0),
            "processes_seen": len(procs), "max_processes_at_once": peak["processes"],
            "process_peak_rss_bytes": {names.get(pid, f"{pid}: ?"): b for pid, b in hwm.items()},
            "samples": samples, "mean_sample_s": sample_time / max(samples, 1),
            "cpu": window.result(usage.ru_utime + usage.ru_stime),
            "log_tail": log.read_text(errors="replace")[-3000:]}


# ------------------------------------------------------------------- prepare, raw encoding

def run_prepare(corpus: Path, tokenizer: Path, out: Path, workers: int, interval: float) -> dict:
    """`megalite prepare-data` into a fresh `out`, measured."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "megalite", "prepare-data", "--input", str(corpus),
           "--tokenizer", str(tokenizer), "--out", str(out), "--workers", str(workers)]
    result = run_sampled(cmd, out.with_name(out.name + ".log"), interval)
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


def jsonl_batches(path: Path, batch_docs: int, limit_bytes: int | None):
    """(texts, jsonl bytes, text bytes) of batch_docs documents at a time, stopping at the first
    batch boundary past limit_bytes. Records as megalite's parse keeps them: whitespace-only
    text is skipped."""
    texts, size, text_size, consumed = [], 0, 0, 0
    with open(path, "rb") as f:
        for line in f:
            size += len(line)
            text = json.loads(line).get("text") if line.strip() else None
            if isinstance(text, str) and text.strip():
                texts.append(text)
                text_size += len(text.encode())
            if len(texts) == batch_docs:
                yield texts, size, text_size
                consumed += size
                texts, size, text_size = [], 0, 0
                if limit_bytes is not None and consumed >= limit_bytes:
                    return
    if texts or size:
        yield texts, size, text_size


def raw_encode(corpus: Path, tokenizer: Path, batch_docs: int, limit_bytes: int | None,
               fast_too: bool = True) -> dict:
    """Time `Tokenizer.encode_batch` alone on the corpus's documents (and, in a pass of its
    own, `encode_batch_fast`). Each pass loads the tokenizer afresh: BPE caches the words it
    has merged, and one pass must not warm that cache for the other."""
    from tokenizers import Tokenizer
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "true"  # its default: Rust threads on every core
    result: dict = {"corpus_bytes": corpus.stat().st_size, "batch_docs": batch_docs,
                    "limit_bytes": limit_bytes,
                    "threads": int(os.environ.get("RAYON_NUM_THREADS", os.cpu_count() or 1))}
    try:
        for name in ("encode_batch", "encode_batch_fast") if fast_too else ("encode_batch",):
            tok = Tokenizer.from_file(str(tokenizer))
            encode = getattr(tok, name)
            encode(["start the thread pool"] * 64, add_special_tokens=False)
            seconds = cpu = busy = 0.0
            size = text_size = docs = tokens = 0
            start = time.perf_counter()
            for texts, n_bytes, n_text in jsonl_batches(corpus, batch_docs, limit_bytes):
                size, text_size, docs = size + n_bytes, text_size + n_text, docs + len(texts)
                busy0, cpu0, t0 = _busy_seconds(), time.process_time(), time.perf_counter()
                encoded = encode(texts, add_special_tokens=False)
                seconds += time.perf_counter() - t0
                cpu += time.process_time() - cpu0
                busy += _busy_seconds() - busy0
                tokens += sum(len(e.ids) for e in encoded)
                # Freed before the next call, as a consumer would: kept alive, a batch's
                # encodings make the next call allocate fresh memory (15-40% slower here).
                del encoded
            result.update(measured_bytes=size, measured_text_bytes=text_size, documents=docs,
                          whole_corpus=size == corpus.stat().st_size)
            result[name] = {"seconds": seconds, "tokens": tokens, "mb_per_s": size / MB / seconds,
                            "text_mb_per_s": text_size / MB / seconds, "tokens_per_s": tokens / seconds,
                            "own_cores": cpu / seconds, "others_cores": max(busy - cpu, 0.0) / seconds,
                            "pass_wall_s": time.perf_counter() - start}
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous
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
    result = run_sampled(cmd, work / "train-run.log", interval, env)
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


# ----------------------------------------------------------------------------------- report

def goals(sizes: list[dict]) -> dict:
    """The issue's goals, comparing the largest corpus with the smallest."""
    done = [s for s in sizes if s["prepare"].get("mb_per_s")]
    out: dict = {}
    if not done:
        return {"note": "no prepare run finished: no goal can be checked"}
    big, small = done[-1], done[0]
    out["peak_rss_at_largest"] = {
        "goal": f"peak RSS (all processes) <= {GOAL_RSS_BYTES / 1e9:.1f} GB at ~1 GB",
        "size_mb": big["size_mb"], "value_bytes": big["prepare"]["peak_rss_bytes"],
        "pass": big["prepare"]["peak_rss_bytes"] <= GOAL_RSS_BYTES}
    if big is not small:
        growth = big["prepare"]["peak_rss_bytes"] / small["prepare"]["peak_rss_bytes"]
        out["peak_rss_growth"] = {
            "goal": f"peak RSS at ~1 GB within {GOAL_RSS_GROWTH}x of the ~100 MB peak",
            "sizes_mb": [small["size_mb"], big["size_mb"]], "value": growth,
            "pass": growth <= GOAL_RSS_GROWTH}
    for s in done:
        ratio = s.get("prepare_over_raw_mb_s")
        if ratio is not None:
            out[f"throughput_{s['size_mb']:g}mb"] = {
                "goal": f"prepare MB/s >= {GOAL_THROUGHPUT_RATIO}x raw encode_batch MB/s",
                "size_mb": s["size_mb"], "value": ratio, "pass": ratio >= GOAL_THROUGHPUT_RATIO}
    return out


def disturbance_notes(results: dict, threshold: float) -> list[str]:
    """A note for each measurement during which the rest of the machine used over `threshold`
    cores (after its retries): its numbers are lower than this machine can do."""
    phases = []
    for s in results["sizes"]:
        phases.append((f"prepare at {s['size_mb']:g} MB", s["prepare"]["cpu"]["others_cores"]))
        for name in ("encode_batch", "encode_batch_fast"):
            if name in s["raw"]:
                phases.append((f"raw {name} at {s['size_mb']:g} MB", s["raw"][name]["others_cores"]))
    phases += [(f"collate {name}", c["cpu"]["others_cores"]) for name, c in results.get("collate", {}).items()]
    if results.get("trainer"):
        phases.append(("the trainer run", results["trainer"]["cpu"]["others_cores"]))
    return [f"{name}: the rest of the machine used {others:.2f} cores meanwhile (over the "
            f"{threshold} allowed, after retries): a lower bound of what this machine does"
            for name, others in phases if others is not None and others > threshold]


def flat_rows(results: dict) -> list[tuple]:
    """(section, case, metric, value, unit) for the CSV."""
    rows = []
    for s in results["sizes"]:
        case = f"{s['size_mb']:g}MB"
        p, r = s["prepare"], s["raw"]
        rows += [("corpus", case, "bytes", s["corpus"]["bytes"], "B"),
                 ("corpus", case, "documents", s["corpus"]["documents"], "")]
        for key, unit in (("wall_s", "s"), ("mb_per_s", "MB/s"), ("tokens_per_s", "tokens/s"),
                          ("tokens", "tokens"), ("peak_rss_bytes", "B"), ("peak_pss_bytes", "B"),
                          ("sum_of_each_process_peak_rss_bytes", "B"), ("main_process_peak_rss_bytes", "B"),
                          ("peak_rss_main_bytes_at_peak", "B"), ("peak_rss_children_bytes_at_peak", "B"),
                          ("max_processes_at_once", ""), ("returncode", "")):
            if key in p:
                rows.append(("prepare", case, key, p[key], unit))
        rows.append(("prepare", case, "others_cores", p["cpu"]["others_cores"], "cores"))
        rows.append(("raw", case, "measured_bytes", r.get("measured_bytes"), "B"))
        for name in ("encode_batch", "encode_batch_fast"):
            if name in r:
                for key, unit in (("mb_per_s", "MB/s"), ("tokens_per_s", "tokens/s"),
                                  ("tokens", "tokens"), ("others_cores", "cores")):
                    rows.append(("raw", case, f"{name}.{key}", r[name][key], unit))
        if s.get("prepare_over_raw_mb_s") is not None:
            rows.append(("ratio", case, "prepare_mb_s/raw_encode_batch_mb_s", s["prepare_over_raw_mb_s"], ""))
        if s.get("prepare_over_raw_fast_mb_s") is not None:
            rows.append(("ratio", case, "prepare_mb_s/raw_encode_batch_fast_mb_s", s["prepare_over_raw_fast_mb_s"], ""))
    for name, g in results["goals"].items():
        if isinstance(g, dict):
            rows.append(("goal", name, "value", g.get("value", g.get("value_bytes")), ""))
            rows.append(("goal", name, "pass", g["pass"], ""))
    for name, c in results.get("collate", {}).items():
        for key in ("median_step_s", "mean_step_s", "p95_step_s", "first_step_s", "setup_s"):
            rows.append(("collate", name, key, c.get(key), "s"))
    t = results.get("trainer")
    if t:
        for key in ("median_step_s", "mean_step_s", "median_step_s_from_time_field", "returncode"):
            rows.append(("trainer", "demo tp=1", key, t.get(key), "s" if key != "returncode" else ""))
    if results.get("collate_over_step") is not None:
        rows.append(("ratio", "demo", "collate_median/step_median", results["collate_over_step"], ""))
    return rows


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sizes = [s for s in results["sizes"] if s["prepare"].get("mb_per_s")]
    labels = [f"{s['size_mb']:g} MB" for s in sizes]
    x = range(len(sizes))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    w = 0.27
    prep = [s["prepare"]["mb_per_s"] for s in sizes]
    raw = [s["raw"].get("encode_batch", {}).get("mb_per_s", 0) for s in sizes]
    fast = [s["raw"].get("encode_batch_fast", {}).get("mb_per_s", 0) for s in sizes]
    a.bar([i - w for i in x], prep, w, label="megalite prepare-data (wall)")
    a.bar(list(x), raw, w, label="raw encode_batch")
    a.bar([i + w for i in x], fast, w, label="raw encode_batch_fast")
    for i, s in enumerate(sizes):
        if s.get("prepare_over_raw_mb_s") is not None:
            a.text(i - w, prep[i], f"{s['prepare_over_raw_mb_s']:.2f}x", ha="center", va="bottom", fontsize=8)
    a.set_xticks(list(x), labels)
    a.set_ylabel("MB/s of jsonl input")
    a.set_title("throughput")
    a.legend(fontsize=8, loc="lower right")
    rss = [s["prepare"]["peak_rss_bytes"] / 1e9 for s in sizes]
    pss = [s["prepare"]["peak_pss_bytes"] / 1e9 for s in sizes]
    b.bar([i - w / 2 for i in x], rss, w, label="peak RSS, all processes summed")
    b.bar([i + w / 2 for i in x], pss, w, label=f"peak PSS, all processes summed (every {PSS_INTERVAL:g} s)")
    b.axhline(GOAL_RSS_BYTES / 1e9, color="red", linestyle="--", label="goal 1.5 GB")
    b.set_xticks(list(x), labels)
    b.set_ylabel("GB")
    b.set_title(f"prepare-data memory (--workers {results['settings']['workers']})")
    b.legend(fontsize=8)
    fig.suptitle(f"{results['device']['cpu_model']}, {results['device']['logical_cores']} cores", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _f(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _code_note(g: dict) -> str:
    if g.get("uncommitted_changes"):
        return " plus the working tree's uncommitted changes (listed in results.json `git`)"
    if "working_tree_changes_not_measured" in g:
        return " (its megalite/ and configs/ extracted and run: edits not committed were not measured)"
    return ""


def readme(results: dict) -> str:
    d, st = results["device"], results["settings"]
    lines = ["# Data preparation benchmark", "",
             f"`scripts/bench_data.py` on {d['cpu_model']} ({d['logical_cores']} cores, "
             f"{d['memory_bytes'] / 2**30:.0f} GiB), {results['date']}, commit "
             f"`{results['git']['commit'][:12]}`" + _code_note(results["git"]) + ".", "",
             "Reproduce (`--code current` measures the working tree instead of HEAD; `--sizes-mb`, "
             "`--workers`, `--work` and the rest: `--help`):", "", "```bash", results["reproduce"], "```", "",
             f"Tokenizer: byte-level BPE of {results['tokenizer']['vocab_size']} tokens "
             f"(`megalite.data.tokenizer.train_bpe` on the embedded corpus). Corpora: the embedded "
             f"documents written again and again (each repetition prefixed with its number) into one "
             f"jsonl file. Prepare: `python -m megalite prepare-data --input C --tokenizer T --out D "
             f"--workers {st['workers']}`, wall time of the whole command. Raw: "
             f"`Tokenizer.encode_batch` of the same tokenizer on the same documents, "
             f"{st['batch_docs']} per call, Rust threads on all {d['logical_cores']} cores, only the "
             f"calls timed, each batch's encodings freed before the next call "
             f"(`encode_batch_fast`, which prepare-data calls, in a pass of its own). "
             f"MB = 10^6 bytes of jsonl input. Others' CPU: cores the rest of the machine used "
             f"during the measurement (the machine is shared). The corpora repeat a 5 MB corpus, so "
             f"BPE's word cache hits far more often than on varied text: absolute rates are "
             f"optimistic, the ratios less so (both sides have the cache).", "",
             "| corpus | documents | tokens | prepare s | prepare MB/s | prepare Mtok/s | raw measured on "
             "| encode_batch MB/s | encode_batch Mtok/s | **prepare / raw** | encode_batch_fast MB/s "
             "| prepare / fast | others' CPU: prepare / raw |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in results["sizes"]:
        p, r = s["prepare"], s["raw"]
        eb, ef = r.get("encode_batch", {}), r.get("encode_batch_fast", {})
        on = "all" if r.get("whole_corpus") else f"first {r.get('measured_bytes', 0) / MB:,.0f} MB"
        lines.append(
            f"| {s['corpus']['bytes'] / MB:,.0f} MB | {s['corpus']['documents']:,} "
            f"| {_f(p.get('tokens'), ',')} | {_f(p.get('wall_s'), '.1f')} | {_f(p.get('mb_per_s'))} "
            f"| {_f(p.get('tokens_per_s', 0) / 1e6)} | {on} | {_f(eb.get('mb_per_s'))} "
            f"| {_f(eb.get('tokens_per_s', 0) / 1e6)} | **{_f(s.get('prepare_over_raw_mb_s'))}** "
            f"| {_f(ef.get('mb_per_s'))} | {_f(s.get('prepare_over_raw_fast_mb_s'))} "
            f"| {_f(p['cpu']['others_cores'])} / {_f(eb.get('others_cores'))} |")
    lines += ["", f"Memory of prepare-data: RSS sampled every {st['interval_s']} s and summed over the "
              f"process tree (main process, {st['workers']} workers, multiprocessing's resource "
              f"tracker); the peak is the largest sum. PSS (shared pages counted once) every "
              f"{st['pss_interval_s']:g} s. VmHWM: each process's own peak, summed (an upper bound "
              f"that sampling cannot miss).", "",
              "| corpus | **peak RSS (sum)** | main process at peak | the others at peak | peak PSS (sum) "
              "| sum of VmHWM | main process VmHWM | processes |", "|---|---|---|---|---|---|---|---|"]
    for s in results["sizes"]:
        p = s["prepare"]
        mb = lambda key: _f(p.get(key, 0) / 1e6, ",.0f") + " MB"  # noqa: E731
        lines.append(f"| {s['corpus']['bytes'] / MB:,.0f} MB | **{mb('peak_rss_bytes')}** "
                     f"| {mb('peak_rss_main_bytes_at_peak')} | {mb('peak_rss_children_bytes_at_peak')} "
                     f"| {mb('peak_pss_bytes')} | {mb('sum_of_each_process_peak_rss_bytes')} "
                     f"| {mb('main_process_peak_rss_bytes')} "
                     f"| {p.get('max_processes_at_once', '-')} |")
    lines += ["", "Goals (the issue's):", "", "| goal | measured | result |", "|---|---|---|"]
    for g in results["goals"].values():
        if not isinstance(g, dict):
            continue
        value = f"{g['value_bytes'] / 1e9:.3f} GB" if "value_bytes" in g else f"{g['value']:.2f}"
        where = (f"{g['size_mb']:g} MB" if "size_mb" in g
                 else " vs ".join(f"{x:g} MB" for x in g["sizes_mb"]))
        lines.append(f"| {g['goal']} ({where}) | {value} | {'pass' if g['pass'] else '**fail**'} |")
    if results.get("collate") or results.get("trainer"):
        lines += ["", "Loader collate per step (train.py's `host_batches` at DP=1: every micro-batch "
                  "of a step) and the trainer's step:", "",
                  "| case | mode | seq | global / micro batch | median s/step | p95 s/step "
                  "| first step s | data setup s | others' CPU |", "|---|---|---|---|---|---|---|---|---|"]
        for name, c in results.get("collate", {}).items():
            lines.append(f"| collate: {name} | {c['mode']} | {c['seq_len']} | {c['global_batch']} / "
                         f"{c['micro_batch']} | {_f(c['median_step_s'], '.5f')} | {_f(c['p95_step_s'], '.5f')} "
                         f"| {_f(c['first_step_s'], '.4f')} | {_f(c['setup_s'], '.2f')} "
                         f"| {_f(c['cpu']['others_cores'])} |")
        t = results.get("trainer")
        if t:
            lines.append(f"| trainer step: demo, TP=1, one process ({len(t.get('step_s', []))} steps "
                         f"after {t.get('warmup_records_dropped', '-')} dropped) | packed | 128 | 16 / 4 "
                         f"| {_f(t.get('median_step_s'), '.4f')} | - | - | - | {_f(t['cpu']['others_cores'])} |")
        if results.get("collate_over_step") is not None:
            lines += ["", f"Demo collate / demo trainer step (medians): {results['collate_over_step']:.4f}. "
                          f"In training the collate of step k + 1 runs in a prefetch thread during step k."]
    if results.get("notes"):
        lines += ["", "Notes:", ""] + [f"- {n}" for n in results["notes"]]
    lines += ["", "Files: `results.json` (every number, the commands, per-process peaks, each "
              "measurement's attempts), `results.csv`, `data_prep.png`.", ""]
    return "\n".join(lines)


def write_outputs(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["section", "case", "metric", "value", "unit"])
        w.writerows(flat_rows(results))
    plot(results, out / "data_prep.png")
    (out / "README.md").write_text(readme(results))


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
