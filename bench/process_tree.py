"""A command measured on a shared machine: its process tree's memory, sampled while it runs,
and the cores it used against those the rest of the machine used meanwhile; a quiet-machine
gate and retries for timings that others' work would spoil."""
from __future__ import annotations

import os
import shlex
import subprocess
import time
from pathlib import Path

import psutil

from bench.proc_counters import hwm_bytes

PSS_INTERVAL = 1.0  # seconds between PSS samples (a page-table walk per process)


def busy_seconds() -> float:
    """CPU seconds the whole machine has been busy (all cores)."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + getattr(t, "steal", 0.0)


class CpuWindow:
    """Cores used by the measured work, by this benchmark process around it (the sampler), and
    by everything else on the machine, over a window."""

    def __init__(self):
        self.start, self.busy, self.load = time.perf_counter(), busy_seconds(), os.getloadavg()
        self.bench = time.process_time()

    def result(self, own_cpu_s: float, bench_is_own: bool = False) -> dict:
        """own_cpu_s: the measured work's CPU seconds (which include this process's when
        bench_is_own: work done in this process)."""
        wall = max(time.perf_counter() - self.start, 1e-9)
        busy = busy_seconds() - self.busy
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
        busy = busy_seconds()
        time.sleep(window)
        others = (busy_seconds() - busy) / window
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


def run_sampled(cmd: list[str], cwd: Path, log: Path, interval: float, env: dict | None = None,
                pss_interval: float = PSS_INTERVAL) -> dict:
    """Run `cmd` in `cwd`, sampling its process tree every `interval` s until it exits. Peak RSS (and
    PSS, every pss_interval s) is the max over samples of the sum over every process alive at
    that sample."""
    window = CpuWindow()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env)
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
                hwm[p.pid] = max(hwm.get(p.pid, 0), hwm_bytes(p.pid), mem.rss)
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

