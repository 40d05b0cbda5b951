"""The data-preparation benchmark's outputs (scripts/bench_data.py): its goals checked, the
CSV rows, the plot and the README written from results.json's numbers."""
from __future__ import annotations

import csv
import json
from pathlib import Path

from bench.process_tree import PSS_INTERVAL

MB = 1e6  # sizes and rates are decimal: 1 MB = 10**6 bytes, 1 GB = 10**9 bytes
GOAL_RSS_BYTES = 1.5e9
GOAL_RSS_GROWTH = 1.3
GOAL_THROUGHPUT_RATIO = 0.8


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
