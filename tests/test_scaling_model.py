"""The scaling model (bench/scaling_model.py): one published row recomputed by hand
from configs/bench/scaling.yaml, the pipeline bubble and point-to-point terms recomputed by hand,
every row of the shipped table within the stated bound, and layouts that cannot run refused
with the value named."""
from pathlib import Path

import pytest

from bench.scaling_check import ERROR_BOUND, check_file, layout_of, markdown
from bench.scaling_cli import main
from bench.scaling_config import load_scaling_file
from bench.scaling_model import (Layout, bubble_fraction, cp_bytes_per_layer_per_microbatch,
                                          dp_bytes_per_step,
                                          efficiency_from_single_device, executed_flops_per_step,
                                          model_flops_per_step, p2p_bytes_per_step, predict,
                                          tp_bytes_per_layer_per_microbatch)
from megalite.config import Experts, ModelConfig
from megalite.typed_config import ConfigError

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "bench" / "scaling.yaml"


@pytest.fixture(scope="module")
def scaling():
    return load_scaling_file(CONFIG)


def narayanan(scaling):
    return next(s for s in scaling.sources if s.name.startswith("Narayanan"))


def checked_row(scaling, source_name, row_name):
    check = next(c for c in check_file(scaling) if c.source.name == source_name)
    return check, next(r for r in check.rows if r.row.name == row_name)


PIPELINED = "Narayanan et al. 2021, Table 1 (p>1)"


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
        "stale table: run python -m bench scale-model --out benchmarks/scaling_table.md"
    rows = [(c, r) for c in checks for r in c.rows]
    assert [r.row.name for _, r in rows] == ["1.7B", "3.6B", "7.5B", "18.4B", "39.1B", "76.1B",
                                             "145.6B", "310.1B", "529.6B", "1008.0B", "1.7B"]
    for check, r in rows:
        for overlap in (False, True):
            assert abs(r.error(overlap)) <= ERROR_BOUND, (check.source.name, r.row.name, overlap)
        if r.calibration:  # reproduced exactly the way the published runs reduced gradients
            assert r.error(check.source.dp_overlap) == pytest.approx(0, abs=1e-9)


def test_the_pipeline_bubble_is_p_minus_1_over_v_m_of_compute_and_tp(scaling):
    check, row = checked_row(scaling, PIPELINED, "76.1B")
    peak, intra = 312e12, 230e9
    # t=8, p=4, v=3 on 1024 GPUs: d=32, so m = 1792 / (2 x 32) = 28 micro-batches of b=2.
    l, h, t, p, v, d, B, b, m = 60, 10240, 8, 4, 3, 32, 1792, 2, 28
    layout = row.layout
    assert (layout.tp, layout.pp, layout.virtual_stages, layout.dp, layout.micro_batches) == \
        (t, p, v, d, m)
    assert bubble_fraction(layout) == pytest.approx((p - 1) / (v * m), rel=1e-12)

    compute = megatron_flops(B, 2048, l, h, 51200, True) / (t * p * d * peak * check.efficiency)
    # Each GPU all-reduces for its stage's l/p layers only: 6 all-reduces of b s h bf16 each.
    tp = l / p * m * 6 * (2 * 7 / 8) * b * 2048 * h * 2 / intra
    assert row.prediction.compute_s == pytest.approx(compute, rel=1e-9)
    assert row.prediction.tp_comm_s == pytest.approx(tp, rel=1e-12)
    assert row.prediction.bubble_s == pytest.approx((compute + tp) * 3 / 84, rel=1e-9)

    _, trillion = checked_row(scaling, PIPELINED, "1008.0B")  # 1F1B: p=64, m=3072/6, v=1
    assert bubble_fraction(trillion.layout) == pytest.approx(63 / 512, rel=1e-12)
    for c in check_file(scaling):
        for r in c.rows:
            if r.layout.pp == 1:
                assert r.prediction.bubble_s == r.prediction.p2p_comm_s == 0


def test_the_pipeline_p2p_is_its_bytes_over_the_nic_or_nvlink(scaling):
    _, row = checked_row(scaling, PIPELINED, "529.6B")
    # t=8, p=35, v=3, b=1, m=2520/9=280: per micro-batch and chunk, an activation forward and a
    # gradient backward of b s h bf16, 1/t of it per rank, on the rank's 22.5 GB/s NIC.
    per_gpu = 2 * 3 * 280 * (1 * 2048 * 20480 * 2) / 8
    assert p2p_bytes_per_step(row.layout) == pytest.approx(per_gpu, rel=1e-12)
    assert row.prediction.p2p_comm_s == pytest.approx(per_gpu / 22.5e9, rel=1e-12)

    # t=2 x p=4 fills one 8-GPU node: the stages talk over NVLink.
    model = ModelConfig(vocab_size=1024, max_seq_len=512, n_layers=8, hidden=256, n_heads=4)
    one_node = Layout(model, 512, global_batch=16, micro_batch=2, tp=2, gpus=8, pp=4)
    per_gpu = 2 * 1 * 8 * (2 * 512 * 256 * 2) / 2
    assert p2p_bytes_per_step(one_node) == pytest.approx(per_gpu, rel=1e-12)
    prediction = predict(one_node, scaling.profile("A100"), 0.5)
    assert prediction.p2p_comm_s == pytest.approx(per_gpu / 230e9, rel=1e-12)


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
    ("H100", "8", "12", r"parallel\.tp=8 must divide the world size 12"),
])
def test_a_layout_that_cannot_run_names_the_value(hardware, tp, gpus, message):
    with pytest.raises(ConfigError, match=message):
        main(["--config", str(CONFIG), "--hardware", hardware, *LAYOUT, "--tp", tp, "--gpus", gpus])


def test_a_pipeline_layout_prints_its_bubble_and_p2p(capsys):
    assert main(["--config", str(CONFIG), "--hardware", "H100", *LAYOUT, "--tp", "2",
                 "--gpus", "64", "--pp", "4", "--virtual-stages", "2", "--mfu", "0.4"]) == 0
    out = capsys.readouterr().out
    assert "tp=2 x pp=4 x dp=8 (64 GPUs), 32 micro-batches of 2 per step" in out
    assert "pipeline bubble" in out and "P2P comm" in out


@pytest.mark.parametrize("args,message", [
    (["--pp", "16"], r"model\.n_layers=24 does not split evenly into pp x virtual_stages = 16"),
    (["--pp", "4", "--virtual-stages", "4"],
     r"model\.n_layers=24 does not split evenly into pp x virtual_stages = 16"),
    (["--pp", "3"], r"world size 64 is not divisible by parallel\.tp x parallel\.pp = 2 x 3: "
                    r"launch a multiple of 6 processes"),
    (["--pp", "0"], r"parallel\.pp=0 and parallel\.virtual_stages=1 must be >= 1"),
    (["--virtual-stages", "2"],
     r"parallel\.virtual_stages=2 interleaves pipeline stages: it needs parallel\.pp > 1"),
    (["--pp", "4", "--global-batch", "8"],
     r"train\.global_batch_size=8 is not a multiple of train\.micro_batch_size=2 x DP=8 .* "
     r"a multiple of 16"),
    (["--pp", "4", "--virtual-stages", "2", "--global-batch", "48"],
     r"pp_schedule=interleaved needs the micro-batches per step \(3 = .*\) to be a multiple of "
     r"parallel\.pp=4"),
])
def test_a_pipeline_that_cannot_run_names_the_value(args, message):
    with pytest.raises(ConfigError, match=message):
        main(["--config", str(CONFIG), "--hardware", "H100", *LAYOUT, "--tp", "2", "--gpus", "64",
              *args])


def test_a_published_row_on_an_unknown_hardware_fails_at_load(tmp_path):
    bad = tmp_path / "scaling.yaml"
    bad.write_text(CONFIG.read_text().replace("hardware: A100", "hardware: A10"))
    with pytest.raises(ConfigError, match=r"hardware 'A10' is not a profile"):
        load_scaling_file(bad)


@pytest.mark.parametrize("comm, per_layer", [
    # b x 2 (K and V) x 16 heads / t x s x head_dim = 2 x 2 x 8 x 4096 x 128 elements: all_gather
    # sends (cp-1)/cp of them forward and as much reduce-scattering backward, bf16.
    ("all_gather", 2 * (1 / 2) * (2 * 2 * 8 * 4096 * 128) * 2),
    # p2p: one block of half of them forward (bf16); backward that K/V block again (bf16) and
    # two dK/dV accumulators, one passed on and one home (fp32).
    ("p2p", (2 * 2 * 8 * 4096 * 128) / 2 * 2 + (2 * 2 * 8 * 4096 * 128) / 2 * 2
     + 2 * (2 * 2 * 8 * 4096 * 128) / 2 * 4),
])
def test_the_context_parallel_term_is_its_kv_bytes_over_nvlink(scaling, comm, per_layer, capsys):
    model = ModelConfig(vocab_size=131072, max_seq_len=4096, n_layers=24, hidden=2048, n_heads=16)
    layout = Layout(model, 4096, global_batch=512, micro_batch=2, tp=2, gpus=64, cp=2, cp_comm=comm)
    assert layout.dp == 16 and layout.micro_batches == 16
    assert cp_bytes_per_layer_per_microbatch(layout) == pytest.approx(per_layer, rel=1e-12)
    h100 = scaling.profile("H100")
    prediction = predict(layout, h100, 0.5)
    assert prediction.cp_comm_s == pytest.approx(24 * 16 * per_layer / (h100.intra_node_gbs * 1e9), rel=1e-12)
    # The TP all-reduces carry this rank's half of each sequence.
    assert tp_bytes_per_layer_per_microbatch(layout) == pytest.approx(4 * 1 * 2 * 2048 * 2048 * 2, rel=1e-12)
    assert main(["--config", str(CONFIG), "--hardware", "H100", *LAYOUT, "--tp", "2", "--gpus", "64",
                 "--cp", "2", "--cp-comm", comm, "--mfu", "0.4"]) == 0
    assert f"tp=2 x cp=2 ({comm}) x pp=1 x dp=16 (64 GPUs)" in capsys.readouterr().out


@pytest.mark.parametrize("ep, link", [(8, "intra_node_gbs"), (16, "inter_node_gbs")])
def test_the_expert_parallel_terms_are_their_bytes_over_the_link(scaling, ep, link, capsys):
    """64 experts of width 1024, top-8, in all 16 layers: per layer and micro-batch each GPU
    sends (ep-1)/ep of the 8 copies of its 4096 tokens' hidden states out and as many back,
    twice with backward; an EP group of 8 consecutive ranks stays in an 8-GPU node, one of 16
    does not. The DP all-reduce sums each GPU's 64/ep experts over 64/ep replicas."""
    model = ModelConfig(vocab_size=50304, max_seq_len=4096, n_layers=16, hidden=2048, n_heads=16,
                        mlp=Experts(experts=64, top_k=8, expert_ffn_hidden=1024))
    layout = Layout(model, 4096, global_batch=256, micro_batch=1, tp=1, gpus=64, ep=ep)
    assert layout.dp == 64 and layout.micro_batches == 4
    per_layer = 4 * 8 * 4096 * 2048 * 2 * (ep - 1) / ep
    h100 = scaling.profile("H100")
    prediction = predict(layout, h100, 0.5)
    assert prediction.ep_comm_s == pytest.approx(16 * 4 * per_layer / (getattr(h100, link) * 1e9), rel=1e-12)
    experts = 16 * 64 * 2 * 2048 * 1024
    dense = 16 * (4 * 2048 * 2048 + 2048 * 64) + 50304 * 2048
    ring = lambda n: 2 * (n - 1) / n  # noqa: E731
    assert dp_bytes_per_step(layout) == pytest.approx((ring(64) * dense + ring(64 // ep) * experts / ep) * 4,
                                                      rel=1e-12)
    assert main(["--config", str(CONFIG), "--hardware", "H100", "--layers", "16", "--hidden", "2048",
                 "--heads", "16", "--seq-len", "4096", "--vocab", "50304", "--global-batch", "256",
                 "--micro-batch", "1", "--tp", "1", "--gpus", "64", "--experts", "64", "--top-k", "8",
                 "--moe-ffn", "1024", "--ep", str(ep), "--mfu", "0.4"]) == 0
    assert f"EP comm {prediction.ep_comm_s:.4g} s" in capsys.readouterr().out
