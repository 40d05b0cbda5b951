"""summary.md of a `python -m bench gpu-check` directory: one page of tables from the JSON the steps
wrote (nothing is measured here). MFU is each tool's own: the PaLM count over the device's
peak from training/metrics.py (989 TF/s for H100/H200 bf16)."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

# gpu-check's kinds of step that run a `python -m bench sweep` (its results.json a table here).
SWEEP_KINDS = ("bench", "train", "compile", "fp8")

SHARES = ("attention", "matmul", "elementwise", "optimizer", "communication", "idle")


def write_summary(out: Path, steps: list[dict], state: dict) -> str:
    lines = ["# GPU check", ""] + _runs(state["runs"]) + [""]
    lines += ["## Steps", "", "| step | status | seconds | limit s | output | log |", "|---|---|---|---|---|---|"]
    for step in steps:
        r = state["steps"].get(step["name"], {})
        lines.append(f"| {step['name']} | {r.get('status', 'not run')}{_why(r)} | {r.get('seconds', '')} | "
                     f"{r.get('limit_s', '')} | {step['output']} | {r.get('log', '')} |")
    lines += [""] + _tests([out / s["output"] for s in steps if s["kind"] == "tests"])
    for step in steps:
        if step["kind"] in SWEEP_KINDS:
            lines += [""] + _bench(out / step["output"], step["name"]) + [""]
    lines += _peer([out / s["output"] for s in steps if s["kind"] == "peer"])
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    return text


def _why(record: dict) -> str:
    return f" ({record['reason']})" if record.get("reason") else ""


def _runs(runs: list[dict]) -> list[str]:
    return [f"- {r['date']}: {r['device']}; torch {r['torch']}, CUDA {r['cuda']}, Python {r['python']}; "
            f"nvidia-smi: {r['nvidia_smi'] or '-'}; commit {r['git_commit']}; missing packages: "
            f"{', '.join(r.get('missing_packages') or []) or 'none'}; `{r['command']}`" for r in runs]


def _tests(paths: list[Path]) -> list[str]:
    lines = ["## GPU tests", ""]
    if not paths:
        return lines + ["Not run (--skip tests)."]
    missing = [f"No {p.name}: its step did not run to the end." for p in paths if not p.is_file()]
    cases = [case for p in paths if p.is_file() for case in ET.parse(p).getroot().iter("testcase")]
    outcome = {"passed": [], "failed": [], "skipped": []}
    for case in cases:
        name = f"{case.get('classname')}::{case.get('name')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            outcome["failed"].append(f"- {name}: {(bad.get('message') or '').splitlines()[0][:200]}")
        elif case.find("skipped") is not None:
            outcome["skipped"].append(f"- {name} (skipped: {case.find('skipped').get('message', '')[:120]})")
        else:
            outcome["passed"].append(name)
    lines.append(", ".join(f"{len(v)} {k}" for k, v in outcome.items()) + ".")
    return lines + missing + [""] + outcome["failed"] + outcome["skipped"]


def _bench(path: Path, name: str) -> list[str]:
    lines = [f"## {name} sweep", ""]
    if not path.is_file():
        return lines + [f"No {name}/results.json: the {name} step did not write its report."]
    result = json.loads(path.read_text())
    lines += [f"{result['device']}, torch {result['torch']}, CUDA {result.get('cuda')}, commit "
              f"{result['git_commit']}: `{result['command']}`", "",
              "| point | model | seq | micro-batch | global batch | precision | compile | rows | fp8 (layers) | "
              "tokens/s | x bf16 | MFU | peak GB | status |", "|---" * 14 + "|"]
    bf16 = {_shape(p): p.get("tokens_per_s") for p in result["points"] if not p.get("fp8")}
    for p in result["points"]:
        s = p["settings"]
        base = bf16.get(_shape(p)) if p.get("fp8") else None
        ratio = f"{p['tokens_per_s'] / base:.2f}" if base and p.get("tokens_per_s") else ""
        fp8 = f"{p['fp8']} ({p.get('fp8_layers')})" if p.get("fp8") else "-"
        lines.append(f"| {p['point']} | {s.get('model', '')} | {p.get('seq_len', '')} | "
                     f"{p.get('micro_batch_size', '')} | {p.get('global_batch_size', '')} | "
                     f"{p.get('precision', '')} | {p.get('compile', '')} | {p.get('batch', '')} | "
                     f"{fp8} | {_num(p.get('tokens_per_s'))} | {ratio} | {_pct(p.get('mfu'))} | "
                     f"{_num(p.get('peak_memory_gb'), 1)} | "
                     f"{p['status']}{': ' + p['error'][:160] if p.get('error') else ''} |")
    if any(p.get("fp8") for p in result["points"]):
        lines += ["", "MFU of FP8 points counts the same FLOPs against the bf16 peak."]
    return lines


def _shape(p: dict) -> tuple:
    """What an FP8 point is compared with: the bf16 point of the same model, shape and settings."""
    return (p["settings"].get("model"), p.get("seq_len"), p.get("micro_batch_size"),
            p.get("global_batch_size"), p.get("precision"), p.get("compile"), p.get("batch"))


def _peer(paths: list[Path]) -> list[str]:
    lines = ["## megalite against Hugging Face (peer-bench)", "",
             "| model | seq | rows | compile | system | micro-batch | tokens/s | MFU | peak GB | largest micro-batch (eager) "
             "| megalite / HF | " + " | ".join(SHARES) + " |", "|---" * (11 + len(SHARES)) + "|"]
    missing = []
    for path in paths:
        if not path.is_file():
            missing.append(path.name)
            continue
        result = json.loads(path.read_text())
        for row in result["rows"]:
            shares = (row.get("profile") or {}).get("shares", {})
            lines.append(f"| {result['model']} | {result['seq_len']} | {result['batch']} | {row['compile']} | "
                         f"{row['system']} | {result['micro_batch']} | {_num(row['tokens_per_s'])} | {_pct(row['mfu'])} | "
                         f"{_num(row['peak_memory_gb'], 1)} | {row.get('max_micro_batch', '')} | "
                         f"{_num(row.get('speedup_over_hf'), 2)} | " + " | ".join(_pct(shares.get(k)) for k in SHARES) + " |")
    if paths:
        device = next((json.loads(p.read_text())["device"] for p in paths if p.is_file()), None)
        lines += ["", f"Device: {device}." if device else "No peer-bench result."]
    return lines + ([f"Not written: {', '.join(missing)}."] if missing else [])


def _num(value, digits: int = 0) -> str:
    return "" if value is None else f"{value:,.{digits}f}"


def _pct(value) -> str:
    return "" if value is None else f"{100 * value:.1f}%"
