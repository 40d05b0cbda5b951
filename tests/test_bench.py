"""`python -m bench sweep`: a CPU sweep writes its results and plots, the collectives it counts are
the ones the Megatron formulas predict, byte for byte, for every kind of layout (TP, SP, DP with
the distributed optimizer, PP, CP, Muon's whole-matrix gathers), and a bad or stuck point is recorded while the sweep goes on,
and a crashed one names the rank that crashed and why.

The sweeps here are written by the tests: each kind of layout of the shipped ones
(configs/bench/), fewer points, shorter and fewer steps, since a point's cost is mostly its
processes' start; the shipped sweeps' points are checked valid without running them.
"""
import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bench.report import COLUMNS
from bench.runner import _reason, load_bench, main as bench
from megalite.model import GPT
from megalite.parallel.sharding import row_range, shard_of
from megalite.parallel.state import ParallelState
from megalite.run_config import load_config

pytestmark = pytest.mark.e2e

CONFIGS = Path(__file__).parent.parent / "configs"
DEMO = str(CONFIGS / "demo.yaml")
# The shipped CPU sweeps' kinds of layout, on rows of 256 tokens: one process (cpu.yaml's
# first point, cpu-context.yaml's CP1), TP alone, and CP2 and CP4 exchanging K/V by all-gather
# and by ring (CP4's ring has more blocks than CP2's); below, latent attention and TP with SP
# across DP ranks. Two micro-batches per DP rank; buckets of 0.1 MiB, so that the gradients
# fill several.
LAYOUTS = {"name": "layouts", "base": DEMO, "batch": "packed",
           "overrides": ["model=tiny", "model.max_seq_len=256", "data.seq_len=256", "parallel.tp=1",
                         "train.micro_batch_size=1", "train.global_batch_size=2",
                         "parallel.dp_bucket_mb=0.1"],
           "points": [{}, {"parallel.tp": 2},
                      {"parallel.cp": 2, "parallel.cp_comm": "all_gather"},
                      {"parallel.cp": 2, "parallel.cp_comm": "p2p"},
                      {"parallel.cp": 4, "parallel.cp_comm": "p2p"}],
           "warmup_steps": 0, "steps": 1}
# Multi-head latent attention (DeepSeek-V3's), at TP2 and at CP2: what TP and CP move.
MLA = {"model.positions.kind": "rotary", "model.norms.kind": "rmsnorm",
       "model.mlp.activation": "swiglu", "model.bias": False, "model.attention.kind": "mla",
       "model.attention.q_lora_rank": 24, "model.attention.kv_lora_rank": 16,
       "model.attention.qk_nope_head_dim": 8, "model.attention.qk_rope_head_dim": 4,
       "model.attention.v_head_dim": 12}
LAYOUTS["points"] += [{**MLA, "parallel.tp": 2}, {**MLA, "parallel.cp": 2}]
# TP with SP across DP ranks (ZeRO-1, the default), the global batch grown with them (scaling:
# weak), with Muon: each matrix's update gathered whole over DP and TP (optimizer_gathers);
# the CP points count ZeRO-1 with AdamW.
LAYOUTS["points"] += [{"parallel.tp": 2, "parallel.sequence_parallel": True, "dp": 2,
                       "scaling": "weak", "train.optimizer": "muon"}]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    sweep = out / "sweep.yaml"
    sweep.write_text(yaml.safe_dump(LAYOUTS))
    code = bench([str(sweep), "--out", str(out)])
    failed = [p for p in json.loads((out / "results.json").read_text())["points"]
              if p["status"] != "ok"]
    # A failed point's log lives in a temporary folder: CI shows only this message.
    assert code == 0 and not failed, "\n".join(
        f"{p['point']}: {p['error']}\n" + _log_tail(out / "points" / p["point"] / "log.txt")
        for p in failed)
    return out


def _log_tail(log: Path, lines: int = 60) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""


def point_config(point: dict):
    overrides = LAYOUTS["overrides"] + [f"{k}={v}" for k, v in point["settings"].items()
                                        if k not in ("dp", "scaling")]
    return load_config(LAYOUTS["base"], overrides)


def expected_comm(point: dict) -> dict[tuple[str, str], int]:
    """Elements each collective moves on one rank in one optimizer step, from the formulas.

    TP (Narayanan et al. 2021, section 3.2), per layer and micro-batch: g after attention and
    after the MLP (all-reduce forward), f before them (all-reduce backward), each of b·s·h. The
    vocab-parallel embedding adds an all-reduce of b·s·h forward, the LM head's f one backward,
    and the vocab-parallel cross-entropy three of b·s (max, target logit, sum of exponentials).
    The TP-aware gradient norm adds one scalar per step.
    Sequence parallelism (Korthikanti et al. 2022) turns each of those 4L + 2 all-reduces of
    b·s·h into a reduce-scatter and an all-gather of the same full tensor, plus one all-gather
    per column-parallel input of a block in backward (megalite keeps only the sequence shard of
    those inputs and gathers it again: 2 per layer; the fused LM head + loss makes its input's
    gradient in forward and keeps nothing to gather), and the replicated parameters'
    gradients (norms, row-parallel biases, positions), computed on a shard of the tokens, are
    all-reduced per micro-batch. CP: see kv_elements. DP: see grad_sync, over the DP ranks, or
    with CP over the CP x DP ranks that hold the same parameters.
    """
    cfg = point_config(point)
    t, d, c = point["tp"], point["dp"], point["cp"]
    b, s, h, L = point["micro_batch_size"], point["seq_len"], cfg.model.hidden, cfg.model.n_layers
    micro_batches = point["global_batch_size"] // (b * d)
    params = list(GPT(cfg.model, ParallelState(), seed=0).parameters())
    replicated = sum(p.numel() for p in params if shard_of(p) is None)
    comm = {}
    if t > 1:
        bsh = micro_batches * (4 * L + 2) * b * s * h
        loss = micro_batches * 3 * b * s
        comm.update({key: e for key, (e, _) in optimizer_gathers(cfg, t, 1, "tp").items()
                     if key[1] == "tp"})
        if point["sequence_parallel"]:
            comm[("reduce_scatter", "tp")] = bsh
            comm[("all_gather", "tp")] = bsh + micro_batches * 2 * L * b * s * h
            comm[("all_reduce", "tp")] = loss + micro_batches * replicated + 1
        else:
            comm[("all_reduce", "tp")] = bsh + loss + 1 + micro_batches * L * latent_weights(cfg.model)
    if c > 1:
        comm.update(kv_elements(point, cfg))
    n, group = grad_group(point)
    return {**comm, **{key: elements for key, (elements, _) in dp_side(cfg, t, n, group).items()}}


def dp_side(cfg, tp: int, replicas: int, group: str) -> dict[tuple[str, str], tuple[int, int]]:
    """(elements, calls) of each collective of the gradient sync and the optimizer over the
    gradient group."""
    both: dict[tuple[str, str], tuple[int, int]] = {}
    optimizer = {k: v for k, v in optimizer_gathers(cfg, tp, replicas, group).items() if k[1] == group}
    for key, (elements, calls) in [*grad_sync(cfg, tp, replicas, group).items(), *optimizer.items()]:
        before = both.get(key, (0, 0))
        both[key] = (before[0] + elements, before[1] + calls)
    return both


def optimizer_gathers(cfg, tp: int, replicas: int, group: str) -> dict[tuple[str, str], tuple[int, int]]:
    """train.optimizer=muon: each block matrix's update gathered whole before Newton-Schulz
    (docs/optimizers.md): its ZeRO-1 rows over the replicas (a block of the longest share's
    rows from each), then its TP slices over TP (each slice from each rank), one all-gather
    each. Experts' rows are whole experts, gathered from nobody."""
    if cfg.train.optimizer != "muon":
        return {}
    gathers = {}
    for name, p in GPT(cfg.model, ParallelState(), seed=0).named_parameters():
        if not (name.startswith("blocks.") and p.dim() == 2):
            continue
        shape, shard = list(p.shape), shard_of(p)
        split = shard is not None and tp > 1  # as grad_sync counts TP slices
        if split:
            shape[shard.dim] //= tp
        cols = math.prod(shape[1:])
        if replicas > 1 and cfg.train.zero_stage == 1:
            longest = max(stop - start for start, stop in
                          (row_range(shape[0], k, replicas) for k in range(replicas)))
            elements, calls = gathers.get(("all_gather_into_tensor", group), (0, 0))
            gathers[("all_gather_into_tensor", group)] = (elements + replicas * longest * cols, calls + 1)
        if split:
            elements, calls = gathers.get(("all_gather_into_tensor", "tp"), (0, 0))
            gathers[("all_gather_into_tensor", "tp")] = (elements + tp * math.prod(shape), calls + 1)
    return gathers


def latent_weights(m) -> int:
    """MLA: one layer's replicated weights read by this rank's heads only (the down-projections
    and the latent norms), whose gradients are all-reduced over TP in each backward."""
    if not m.mla:
        return 0
    a = m.attention
    q = (m.hidden + 1) * a.q_lora_rank if a.q_lora_rank else 0
    return q + m.hidden * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank


def grad_group(point: dict) -> tuple[int, str]:
    """The ranks that hold the same parameters, and their group's name."""
    return (point["dp"], "dp") if point["cp"] == 1 else (point["cp"] * point["dp"], "cp_dp")


def grad_sync(cfg, tp: int, replicas: int, group: str) -> dict[tuple[str, str], tuple[int, int]]:
    """(elements, calls) of each collective over the gradient group, `replicas` ranks, in one
    step. Buckets of parallel.dp_bucket_mb MiB, filled with this rank's fp32 gradients (its TP
    slices and the replicated ones) in backward (reverse definition) order until the next would
    pass the cap. zero_stage=0: each bucket all-reduced. zero_stage=1 (the distributed
    optimizer): each bucket reduce-scattered and its updated rows all-gathered, both of the
    bucket laid out rank-major, each rank's region padded to the largest one's rows
    (sharding.row_range); the norm's two sums of squares all-reduced."""
    if replicas == 1:
        return {}
    cap = cfg.parallel.dp_bucket_mb * 1024 * 1024
    buckets, used = [], cap  # full: the first parameter opens a bucket
    for p in reversed(list(GPT(cfg.model, ParallelState(), seed=0).parameters())):
        shape = list(p.shape)
        if shard_of(p) is not None:
            shape[shard_of(p).dim] //= tp
        if used + 4 * math.prod(shape) > cap:
            buckets, used = buckets + [[]], 0
        buckets[-1].append(shape)
        used += 4 * math.prod(shape)
    if cfg.train.zero_stage == 0:
        return {("all_reduce", group): (sum(math.prod(s) for b in buckets for s in b), len(buckets))}
    regions = [max(sum(math.prod(s) // s[0] * (stop - start) for s in bucket
                       for start, stop in [row_range(s[0], k, replicas)])
                   for k in range(replicas)) for bucket in buckets]
    elements = replicas * sum(regions)
    return {("reduce_scatter_tensor", group): (elements, len(buckets)),
            ("all_gather_into_tensor", group): (elements, len(buckets)),
            ("all_reduce", group): (2, 1)}


def kv_elements(point: dict, cfg) -> dict[tuple[str, str], int]:
    """K/V elements the CP group moves per step on one rank, from the formulas: per layer and
    micro-batch, all_gather gathers K and V of the whole row (b x 2 kv_heads x s x head_dim) and
    reduce-scatters their gradients; p2p receives cp - 1 K/V blocks of s / cp tokens forward,
    the same backward, and cp dK/dV accumulators, each a step behind its block, the last one
    its own block's, home. MLA gathers the latent and the rotary key of each token instead
    (b x s x (kv_lora_rank + qk_rope_head_dim)), whatever the heads."""
    m = cfg.model
    b, s, cp = point["micro_batch_size"], point["seq_len"], point["cp"]
    layers = (point["global_batch_size"] // (b * point["dp"])) * m.n_layers * b
    if m.mla:
        per = layers * (m.attention.kv_lora_rank + m.attention.qk_rope_head_dim) * s
        return {("all_gather", "cp"): per, ("reduce_scatter", "cp"): per}
    per = layers * m.kv_heads * m.head_size
    if point["cp_comm"] == "all_gather":
        return {("all_gather", "cp"): per * 2 * s, ("reduce_scatter", "cp"): per * 2 * s}
    return {("recv", "cp"): per * (s // cp) * (2 * (cp - 1) + 2 * (cp - 1) + 2 * cp)}


def test_a_cpu_sweep_writes_results_and_plots(results):
    data = json.loads((results / "results.json").read_text())
    for key in ("device", "torch", "date", "git_commit", "command"):
        assert data[key], key
    assert data["device"].startswith("cpu") and "bench" in data["command"]
    rows = list(csv.DictReader((results / "results.csv").open()))
    assert len(rows) == len(data["points"]) == len(LAYOUTS["points"])
    assert set(COLUMNS) <= set(rows[0])
    for row in rows:
        assert row["status"] == "ok", row
        assert row["batch"] == "packed"  # rows of several documents: the packed attention path
        for key in ("step_s", "tokens_per_s", "tokens_per_s_per_device", "tflops_per_device",
                    "peak_memory_gb", "compute_s", "head_loss_saved_bytes"):
            assert float(row[key]) > 0, (row["point"], key)
        assert row["head_loss_peak_bytes"] == ""  # CUDA only
        if int(row["devices"]) > 1:
            assert float(row["comm_bytes"]) > 0 and float(row["comm_s"]) > 0, row["point"]
    # Sequence parallelism stores less per layer than TP alone, as Korthikanti et al. count.
    # (Per layer and micro-batch of the same size: the SP point's DP ranks change nothing.)
    tp2 = {p["sequence_parallel"]: p for p in data["points"]
           if p["tp"] == 2 and "model.attention.kind" not in p["settings"]}
    assert len(tp2) == 2
    assert tp2[True]["activation_bytes_per_layer"] < tp2[False]["activation_bytes_per_layer"]
    assert (tp2[True]["activation_formula_bytes_per_layer"]
            < tp2[False]["activation_formula_bytes_per_layer"])
    for plot in ("scaling.png", "mfu.png", "memory.png", "step.png"):
        assert (results / plot).read_bytes()[:4] == b"\x89PNG", plot


def test_counted_communication_equals_the_formulas(results):
    points = json.loads((results / "results.json").read_text())["points"]
    for point in points:
        counted = {(c["op"], c["group"]): c["elements"] for c in point["comm"]}
        assert counted == expected_comm(point), point["point"]
        n, group = grad_group(point)
        grad_calls = {c["op"]: c["calls"] for c in point["comm"] if c["group"] == group}
        expected = dp_side(point_config(point), point["tp"], n, group)
        assert grad_calls == {op: calls for (op, _), (_, calls) in expected.items()}, point["point"]
        for c in point["comm"]:
            assert c["bytes"] == 4 * c["elements"]  # fp32 on CPU
    assert any(c["group"] == "dp" and c["calls"] > 1 for p in points for c in p["comm"])  # buckets


def test_context_parallel_shrinks_activations(results):
    points = json.loads((results / "results.json").read_text())["points"]
    activations = {(p["cp"], p["cp_comm"]): p["activation_bytes_per_layer"] for p in points
                   if p["tp"] == 1}
    # Ring attention keeps its share of the row (and its mask rows): less per rank as cp grows.
    assert activations[4, "p2p"] < activations[2, "p2p"] < 0.7 * activations[1, None]
    assert activations[4, "p2p"] < 0.4 * activations[1, None]


def test_a_pipeline_point_reports_its_schedule_bubble_and_pipeline_collectives(tmp_path):
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({
        "name": "pp", "base": DEMO, "batch": "packed",
        "overrides": ["model.vocab_size=4096", "data.seq_len=64", "train.global_batch_size=8",
                      "train.micro_batch_size=2", "parallel.tp=1"],
        "points": [{"parallel.pp": 2, "parallel.pp_schedule": "interleaved",
                    "parallel.virtual_stages": 2}], "warmup_steps": 0, "steps": 1}))
    assert bench([str(sweep), "--out", str(tmp_path / "out")]) == 0
    point, = json.loads((tmp_path / "out" / "results.json").read_text())["points"]
    assert point["status"] == "ok" and point["devices"] == point["pp"] == 2
    assert point["pp_schedule"] == "interleaved"
    assert point["pipeline_bubble"] == (2 - 1) / (2 * 4)  # (p - 1) / (v m), m = 8 / 2
    comm = {(c["op"], c["group"]): c for c in point["comm"]}
    # The gradient norm's sum of squares over the stages; the tied embedding's two copies.
    assert comm["all_reduce", "pp"]["elements"] == 1
    assert comm["all_reduce", "embedding"]["elements"] == 4096 * 64
    assert point["head_loss_saved_bytes"] > 0  # measured on the last stage
    # Rank 0 holds virtual stages 0 and 2 of 4: it receives the activations of stage 2's m
    # micro-batches and the gradients of both of its stages' outputs, 3m tensors of b·s·h.
    assert comm["recv", "pp"]["calls"] == 3 * 4
    assert comm["recv", "pp"]["elements"] == 3 * 4 * 2 * 64 * 64
    assert 0 < point["pipeline_wait_s"] < point["instrumented_step_s"]
    assert point["pipeline_bubble_measured"] > 0
    assert (tmp_path / "out" / "bubble.png").read_bytes()[:4] == b"\x89PNG"


def test_a_bad_or_stuck_point_is_recorded_and_the_sweep_goes_on(tmp_path):
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({
        "name": "bad", "base": DEMO, "timeout_s": 0.5,
        "points": [{"parallel.tp": 3}, {"parallel.tp": 1}]}))
    assert bench([str(sweep), "--out", str(tmp_path / "out")]) == 1
    rows = list(csv.DictReader((tmp_path / "out" / "results.csv").open()))
    assert [r["status"] for r in rows] == ["invalid", "timeout"]
    assert "parallel.tp=3 must divide the model's heads" in rows[0]["error"]
    assert "bench.timeout_s=0.5" in rows[1]["error"]


def processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:  # gone meanwhile
            pass
    return found


def test_a_sweep_time_limit_cuts_the_running_point_and_its_workers_and_skips_the_rest(tmp_path):
    sweep = tmp_path / "sweep.yaml"
    # Steps enough to be still running when the limit comes, its workers started.
    sweep.write_text(yaml.safe_dump({
        "name": "lease", "base": DEMO, "timeout_s": 600,
        "steps": 100000, "points": [{"parallel.tp": 1}, {"parallel.tp": 2}]}))
    assert bench([str(sweep), "--out", str(tmp_path / "out"), "--time-limit-s", "12"]) == 3
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["status"] for r in result["points"]] == ["timeout", "skipped"]
    assert "--time-limit-s" in result["points"][0]["error"]
    # torchrun's workers run in sessions of their own: stopped with it, not left computing.
    assert processes_mentioning(str(tmp_path / "out")) == []


def test_a_resumed_sweep_keeps_the_points_that_ended_and_runs_the_rest(tmp_path):
    base = {"name": "lease", "base": DEMO, "timeout_s": 600, "warmup_steps": 0, "steps": 1,
            "overrides": ["model.n_layers=2", "data.seq_len=32", "train.global_batch_size=4",
                          "train.micro_batch_size=4"]}
    first, both = tmp_path / "first.yaml", tmp_path / "both.yaml"
    first.write_text(yaml.safe_dump({**base, "points": [{"parallel.tp": 1}]}))
    both.write_text(yaml.safe_dump({**base, "points": [{"parallel.tp": 1}, {"parallel.tp": 2}]}))
    out = tmp_path / "out"
    assert bench([str(first), "--out", str(out)]) == 0
    (done,) = json.loads((out / "results.json").read_text())["points"]
    # The kept point costs nothing; the new one finds the limit spent.
    assert bench([str(both), "--out", str(out), "--resume", "--time-limit-s", "0"]) == 3
    kept, cut = json.loads((out / "results.json").read_text())["points"]
    assert kept == done and cut["status"] == "skipped"
    assert bench([str(both), "--out", str(out), "--time-limit-s", "0"]) == 3
    assert [p["status"] for p in json.loads((out / "results.json").read_text())["points"]] == \
        ["skipped", "skipped"]  # without --resume nothing is kept


CRASHES = {"raises": "raise RuntimeError('rank 1 gave up')",
           "segfaults": "os.kill(os.getpid(), signal.SIGSEGV)"}


@pytest.mark.parametrize("how", CRASHES)
def test_a_crashed_point_is_reported_by_its_rank_and_cause(tmp_path, how):
    script = tmp_path / "crash.py"
    script.write_text("import os, signal\nimport torch.distributed as dist\n"
                      "dist.init_process_group('gloo')\n"
                      f"if dist.get_rank() == 1:\n    {CRASHES[how]}\ndist.barrier()\n")
    log = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node=2", str(script)], capture_output=True, text=True,
                         timeout=300)
    assert log.returncode != 0
    reason = _reason(log.stdout + log.stderr)
    # Rank 0 fails too ("connection closed by peer"); the cause is rank 1's.
    assert reason.startswith("rank 1 exited with ")
    assert reason.endswith("RuntimeError: rank 1 gave up") if how == "raises" else "SIGSEGV" in reason


def test_a_rank_that_only_lost_its_peer_is_not_named_the_cause():
    # torchrun's root cause is the first failure it observed: sometimes the bystander's.
    log = "\n".join([
        "[rank1]: RuntimeError: rank 1 gave up",
        "[rank0]: RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1",
        "Failures:", "[1]:", "  rank      : 1 (local_rank: 1)", "  exitcode  : 1 (pid: 11)",
        "Root Cause (first observed failure):", "[0]:", "  rank      : 0 (local_rank: 0)",
        "  exitcode  : 1 (pid: 10)"])
    assert _reason(log) == "rank 1 exited with 1 (pid: 11): RuntimeError: rank 1 gave up"
    # With nothing better, the root cause stands.
    assert _reason(log.replace("rank 1 gave up", "Broken pipe")).startswith("rank 0 exited with 1 (pid: 10)")


# scaling.yaml holds the scaling model's inputs, not a sweep.
@pytest.mark.parametrize("sweep", sorted(p for p in (CONFIGS / "bench").glob("*.yaml")
                                         if p.name != "scaling.yaml"), ids=lambda p: p.name)
def test_shipped_bench_sweeps_have_only_valid_points(sweep):
    _, points = load_bench(sweep)
    assert points and all(not p.error for p in points), [p.error for p in points if p.error]
