"""The scaling model (megalite/bench/scaling_model.py): one published row recomputed by hand
from configs/bench/scaling.yaml, every row of the shipped table within the stated bound, and
layouts that cannot run refused with the value named."""
from pathlib import Path

import pytest

from megalite.bench.scaling_check import ERROR_BOUND, check_file, layout_of, markdown
from megalite.bench.scaling_config import load_scaling_file
from megalite.bench.scaling_model import (dp_bytes_per_step, efficiency_from_single_device,
                                          executed_flops_per_step, main, model_flops_per_step,
                                          tp_bytes_per_layer_per_microbatch)
from megalite.typed_config import ConfigError

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "bench" / "scaling.yaml"


@pytest.fixture(scope="module")
def scaling():
    return load_scaling_file(CONFIG)


def narayanan(scaling):
    return next(s for s in scaling.sources if s.name.startswith("Narayanan"))


def megatron_flops(B, s, l, h, V, recompute):
    """Narayanan et al. 2021: 72 B s l h^2 (1 + s/6h + V/12lh) model FLOPs per step; Eq. 3,
    96 B s l h^2 (1 + s/6h + V/16lh), with the recomputed forward."""
    if recompute:
        return 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    return 72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h))


def test_the_7_5b_t4_row_recomputed_by_hand_is_within_the_bound(scaling):
    source, a100 = narayanan(scaling), scaling.profile("A100")
    s, V = 2048, 51200
    peak, intra, nic = a100.peak_tflops * 1e12, a100.intra_node_gbs * 1e9, a100.inter_node_gbs * 1e9
    assert (source.seq_len, source.vocab_size, source.grad_bytes) == (s, V, 2)
    assert source.activation_recompute and not source.dp_overlap

    # Calibration on the 1.7B row (t=1, 32 GPUs, B=512, 137 TFLOP/s): its published step time,
    # less its DP all-reduce (the 32 ranks are 8 per node, driving 8 NICs), is its compute.
    l, h, gpus, B = 24, 2304, 32, 512
    step = megatron_flops(B, s, l, h, V, True) / (137e12 * gpus)
    dp = 2 * 31 / 32 * (12 * l * h**2 + V * h) * 2 / min(intra, 8 * nic)
    efficiency = megatron_flops(B, s, l, h, V, True) / (gpus * peak * (step - dp))

    # The 7.5B row: t=4 x d=32, B=512, so 16 micro-batches of 1 per DP rank.
    l, h, t, d, B, b = 36, 4096, 4, 32, 512, 1
    layout = layout_of(source, source.row("7.5B"))
    assert (layout.model.n_layers, layout.model.hidden, layout.tp, layout.dp) == (l, h, t, d)
    model, executed = megatron_flops(B, s, l, h, V, False), megatron_flops(B, s, l, h, V, True)
    assert model_flops_per_step(layout) == pytest.approx(model, rel=1e-12)
    assert executed_flops_per_step(layout) == pytest.approx(executed, rel=1e-12)
    # 2 all-reduces forward, 2 backward, 2 in the recomputed forward, of b s h bf16 elements,
    # each sending 2(t-1)/t of its size from every GPU.
    tp_bytes = 6 * (2 * 3 / 4) * b * s * h * 2
    assert tp_bytes_per_layer_per_microbatch(layout) == pytest.approx(tp_bytes, rel=1e-12)
    dp_bytes = 2 * 31 / 32 * (12 * l * h**2 + V * h) / t * 2
    assert dp_bytes_per_step(layout) == pytest.approx(dp_bytes, rel=1e-12)

    compute = executed / (t * d * peak * efficiency)
    # DP groups of 32 ranks, 2 per node: 2 NICs per group.
    step = compute + l * 16 * tp_bytes / intra + dp_bytes / min(intra, 2 * nic)
    by_hand = executed / step / (t * d) / 1e12

    checked = next(r for c in check_file(scaling) for r in c.rows if r.row.name == "7.5B")
    assert checked.predicted(False) == pytest.approx(by_hand, rel=1e-6)
    assert abs(by_hand / 142 - 1) <= ERROR_BOUND


def test_every_row_of_the_shipped_table_is_within_the_bound(scaling):
    checks = check_file(scaling)
    assert (ROOT / "benchmarks" / "scaling_table.md").read_text() == markdown(checks), \
        "stale table: run megalite scale-model --out benchmarks/scaling_table.md"
    rows = [(c, r) for c in checks for r in c.rows]
    assert [r.row.name for _, r in rows] == ["1.7B", "3.6B", "7.5B", "18.4B", "1.7B"]
    for check, r in rows:
        for overlap in (False, True):
            assert abs(r.error(overlap)) <= ERROR_BOUND, (check.source.name, r.row.name, overlap)
        if r.calibration:  # reproduced exactly the way the published runs reduced gradients
            assert r.error(check.source.dp_overlap) == pytest.approx(0, abs=1e-9)


def test_a_single_device_step_time_gives_the_efficiency(scaling):
    layout = layout_of(narayanan(scaling), narayanan(scaling).row("1.7B"))
    step = megatron_flops(4, 2048, 24, 2304, 51200, True) / (312e12 * 0.5)
    efficiency = efficiency_from_single_device(layout, scaling.profile("A100"), step, 4)
    assert efficiency == pytest.approx(0.5)


LAYOUT = ["--layers", "24", "--hidden", "2048", "--heads", "16", "--seq-len", "4096",
          "--vocab", "131072", "--global-batch", "512", "--micro-batch", "2"]


def test_a_layout_prints_step_time_tokens_tflops_and_mfu(capsys):
    assert main(["--config", str(CONFIG), "--hardware", "H100", *LAYOUT, "--tp", "2",
                 "--gpus", "64", "--mfu", "0.4"]) == 0
    out = capsys.readouterr().out
    assert "efficiency 0.400 (from single-device MFU 0.400)" in out
    assert "| after backward |" in out and "| overlapped |" in out


@pytest.mark.parametrize("hardware,tp,gpus,message", [
    ("B200", "2", "64", r"hardware 'B200' is not a profile of the scaling config "
                        r"\(profiles: A100, H100\)"),
    ("H100", "16", "64", r"tp=16 does not fit in a node of 8 GPUs \(H100\)"),
    ("H100", "8", "12", r"gpus=12 is not divisible by tp=8"),
])
def test_a_layout_that_cannot_run_names_the_value(hardware, tp, gpus, message):
    with pytest.raises(ConfigError, match=message):
        main(["--config", str(CONFIG), "--hardware", hardware, *LAYOUT, "--tp", tp, "--gpus", gpus])


def test_a_published_row_on_an_unknown_hardware_fails_at_load(tmp_path):
    bad = tmp_path / "scaling.yaml"
    bad.write_text(CONFIG.read_text().replace("hardware: A100", "hardware: A10"))
    with pytest.raises(ConfigError, match=r"hardware 'A10' is not a profile"):
        load_scaling_file(bad)
