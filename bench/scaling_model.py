"""Predicted step time of a TP x CP x PP x DP (x EP) layout across nodes, from one efficiency per GPU type.

    python -m bench scale-model --out benchmarks/scaling_table.md      # checked against published rows
    python -m bench scale-model --hardware H100 --layers 24 --hidden 2048 --heads 16 --seq-len 4096 \\
        --vocab 131072 --global-batch 512 --micro-batch 2 --tp 2 --gpus 64 \\
        [--pp 2 [--virtual-stages 2]] [--cp 2 [--cp-comm p2p]] [--mfu 0.41] \\
        [--experts 64 --top-k 8 --moe-ffn 1024 --ep 8]

A step of global batch B sequences of length s, on N = t x p x d GPUs (TP t inside a node, p
pipeline stages of L/p layers each, DP d), each DP rank running m = B / (b d) micro-batches of
b sequences, costs the sum of these terms, nothing else. Ranks are ordered as megalite orders
them (TP blocks of consecutive ranks, then stages, then DP replicas).

- compute: the FLOPs the GPUs execute, 6N + 12 L h s per token (PaLM appendix B, the count of
  megalite.training.metrics.flops_per_token) plus, with full activation recomputation, a second
  forward of the transformer layers (the LM head is not recomputed: Narayanan et al. 2021, Eq. 3),
  divided by N x peak x efficiency. The efficiency is the fraction of peak the GPU reaches on
  these FLOPs alone: measured on one device (--step-time, --mfu), or calibrated on one published
  row. It is the same at every TP size, although TP makes each GPU's matmuls t times smaller
  (which lowers it) and the weak-scaled models grow (which raises it).
- TP communication, never overlapped: per layer of the GPU's stage and micro-batch, 2
  all-reduces forward and 2 backward of b x s x h bf16 elements (Narayanan et al. 2021, section
  3.2; 2 more with recomputation, which repeats the forward), each moving 2(t-1)/t of its size
  per GPU at the node's all-reduce bus bandwidth.
- pipeline bubble (p > 1): the schedule's fill and drain, (p-1)/(v m) of the compute and TP
  time (Narayanan et al. 2021, section 2.2: (p-1)/m for 1F1B, divided by the v model chunks per
  stage of the interleaved schedule).
- pipeline point-to-point (p > 1), never overlapped: per micro-batch and model chunk, each GPU
  sends its stage's output activation forward and its input gradient backward, b x s x h bf16
  elements each, split over the stage's t ranks (Megatron's scatter/gather: each rank sends
  1/t on its own NIC, and the receivers all-gather it). Within a node at the node's bus
  bandwidth; once a pipeline (t x p consecutive ranks) spans nodes, its slowest boundary, which
  paces every stage, crosses nodes: at the per-GPU network bandwidth. With t=8 on 8-GPU nodes
  every boundary crosses nodes.
- context parallelism (cp > 1): each of the cp ranks of a TP rank holds s / cp of every
  sequence, so the TP all-reduces and pipeline messages above carry b x s/cp x h; the K/V of
  the whole sequence reach every CP rank, per layer of the stage and micro-batch, never
  overlapped (`cp_bytes_per_layer_per_microbatch`): all_gather sends (cp-1)/cp of the
  gathered b x 2 kv_heads/t x s x head_dim bf16 K/V forward and as much reduce-scattering
  their gradients backward (again forward with recomputation); p2p (ring attention as megalite
  runs it) sends the same K/V forward in cp - 1 blocks, and backward those blocks again plus
  cp blocks of dK and dV in fp32 (each block's accumulator passed on, the last step's home).
  Inside a node at the bus bandwidth while t x cp fits in one, else at the per-GPU network
  bandwidth. DP replicas then number N / (t cp p), and the gradients are summed over the
  cp x d ranks that hold the same parameters.
- expert parallelism (a mixture of experts, ep >= 1): per MoE layer of the stage and
  micro-batch, never overlapped, each GPU sends (ep-1)/ep of the top-k copies of its b x s/cp
  tokens' hidden states to the experts and gets as many outputs back, again in backward (and
  forward again with recomputation), bf16, balanced routing (`moe_all_to_all_bytes`); inside a
  node at the bus bandwidth while the EP group's span of ranks (it strides over the t TP ranks)
  fits in one, else at the per-GPU network bandwidth. Compute counts the active parameters
  (the router, k experts, the shared ones); the DP all-reduce sums the dense gradients over the
  cp x d ranks and each GPU's experts' (all E/ep of them, whole over TP) over cp x d / ep.
- DP communication: one all-reduce per step of the rank's params / (t p) gradients (2 or 4
  bytes each), 2(d-1)/d of its size per GPU. Within a node at the node's bus bandwidth; across
  nodes, the group's 8/(t p) ranks per node (at least 1) drive as many NICs together (NCCL runs
  one ring per NIC), so at that many times the per-GPU network bandwidth, capped by the node's
  bus bandwidth. Reported two ways: after backward (not overlapped), or overlapped with the
  backward of the last micro-batch (as Megatron's --overlap-grad-reduce and torch DDP do with
  accumulation): only the excess shows.

Ignored: latency (every message is bandwidth-bound), the embedding and loss all-reduces, the
optimizer step, data loading, kernel launch gaps, non-matmul FLOPs (norms, softmax, dropout),
communication slowing the compute it overlaps with, network contention and topology beyond
the per-GPU NIC rate, and params outside matmuls and the input embedding (position
embeddings, norms, biases: under 1%). With pipelines: the uneven stages (the first also holds
the embedding, the last the LM head, and their DP all-reduces carry them), the end stages
sending fewer messages, and the NVLink all-gather after a scattered send (about 2/3 of the
send's time at t=8 on A100, under 1% of any step of the shipped table).

Against the published rows (benchmarks/scaling_table.md, bench.scaling_check) every
row is within ERROR_BOUND = ±15%, the worst -14.8%. The TP rows all come out low (-6% to -15%):
at a constant efficiency the model's TP communication (4% of the predicted step at t=2, 9% at
t=4, 13% at t=8) costs throughput one for one, while the published per-GPU rate stays flat
or rises with model size: the larger models' bigger matmuls run nearer peak than the 1.7B
calibration row, which a single efficiency cannot capture. The pipeline rows (Table 1, p > 1,
a second source) are calibrated on their own smallest row, 39.1B (t=8, p=2), at efficiency
0.572 against the 1.7B row's 0.444, and then lie within -8.1% to +8.1%; at the 1.7B row's
efficiency they would come out 15% to 28% low (DP after backward), the same limit as the TP
rows. The worst, 1008.0B (-8.1%), is the only one without interleaving past p=2: its bubble,
63/512 of its compute and TP time, is 11% of the predicted step, which the published rate
(163, as for the interleaved 529.6B row) does not show.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from bench.scaling_config import Hardware
from megalite.config import ModelConfig, ParallelConfig
from megalite.run_config import Config, DataConfig, TrainConfig
from megalite.plan import validate
from megalite.training.metrics import flops_per_token, matmul_params
from megalite.typed_config import ConfigError

ACTIVATION_BYTES = 2  # bf16 activations in the TP all-reduces


@dataclass(frozen=True)
class Layout:
    model: ModelConfig  # its max_seq_len is not used: seq_len is
    seq_len: int
    global_batch: int  # sequences per optimizer step, all DP ranks together
    micro_batch: int  # sequences per forward/backward on one DP rank
    tp: int
    gpus: int
    activation_recompute: bool = False
    grad_bytes: int = 4  # fp32 gradients: Megatron's default with bf16
    pp: int = 1
    virtual_stages: int = 1  # model chunks per pipeline stage: interleaved 1F1B when > 1
    cp: int = 1
    cp_comm: str = "all_gather"  # or p2p
    ep: int = 1  # expert-parallel ranks, out of cp x dp (a mixture of experts)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.cp * self.pp)

    @property
    def tokens_per_rank(self) -> int:
        """Tokens of a sequence each rank holds: its context-parallel share."""
        return self.seq_len // self.cp

    @property
    def micro_batches(self) -> int:
        """Forward/backward passes per step on each DP rank (gradient accumulation)."""
        return self.global_batch // (self.micro_batch * self.dp)


def check_fits(layout: Layout, hw: Hardware) -> None:
    """Raise ConfigError, naming the values, for a layout that cannot run on this hardware: TP
    inside a node, and megalite's own rules (plan.validate) for the run it describes."""
    if layout.gpus < 1 or layout.tp < 1:
        raise ConfigError(f"gpus={layout.gpus} and tp={layout.tp} must be >= 1")
    if layout.tp > hw.gpus_per_node or hw.gpus_per_node % layout.tp:
        raise ConfigError(f"tp={layout.tp} does not fit in a node of {hw.gpus_per_node} GPUs "
                          f"({hw.name}): TP stays within a node, use a tp that divides "
                          f"{hw.gpus_per_node}")
    validate(as_run(layout), layout.gpus, installed=False)


def as_run(layout: Layout) -> Config:
    """The megalite run a layout describes (interleaved 1F1B where it has virtual stages)."""
    v = layout.virtual_stages
    parallel = ParallelConfig(tp=layout.tp, pp=layout.pp, cp=layout.cp, cp_comm=layout.cp_comm,
                              ep=layout.ep, virtual_stages=v,
                              pp_schedule="interleaved" if v > 1 else "1f1b")
    train = TrainConfig(global_batch_size=layout.global_batch, micro_batch_size=layout.micro_batch,
                        activation_checkpointing=layout.activation_recompute)
    return Config(model=dataclasses.replace(layout.model, max_seq_len=layout.seq_len),
                  parallel=parallel, data=DataConfig(seq_len=layout.seq_len), train=train)


def model_flops_per_step(layout: Layout) -> float:
    """6N + 12 L h s per token: what MFU and Megatron-Core count."""
    return layout.global_batch * layout.seq_len * flops_per_token(layout.model, layout.seq_len)


def executed_flops_per_step(layout: Layout) -> float:
    """The model FLOPs plus, with recomputation, a second forward (a third of the model FLOPs)
    of everything but the LM head: 96 B s l h^2 (1 + s/6h + V/16lh), Narayanan et al. Eq. 3."""
    flops = model_flops_per_step(layout)
    if layout.activation_recompute:
        head = 6 * layout.model.vocab_size * layout.model.hidden
        flops += (flops - layout.global_batch * layout.seq_len * head) / 3
    return flops


def parameter_count(cfg: ModelConfig) -> int:
    """The gradients the DP all-reduces carry: matmul weights (every expert's), plus the input
    embedding when it is not the LM head's weight."""
    idle = expert_parameter_count(cfg) * (cfg.n_experts - cfg.moe.top_k) // cfg.n_experts if cfg.moe else 0
    return matmul_params(cfg) + idle + (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden)


def expert_parameter_count(cfg: ModelConfig) -> int:
    """Every routed expert's weights, all MoE layers."""
    per_expert = (3 if cfg.gated else 2) * cfg.hidden * cfg.expert_ffn
    return sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers)) * cfg.n_experts * per_expert


def ring_factor(n: int) -> float:
    """Bytes a ring all-reduce sends per GPU, per byte reduced, over n GPUs."""
    return 2 * (n - 1) / n


def tp_bytes_per_layer_per_microbatch(layout: Layout) -> float:
    """Bytes each GPU sends for one layer's TP all-reduces of one micro-batch."""
    all_reduces = 6 if layout.activation_recompute else 4
    message = layout.micro_batch * layout.tokens_per_rank * layout.model.hidden * ACTIVATION_BYTES
    return all_reduces * ring_factor(layout.tp) * message


def moe_all_to_all_bytes(cfg: ModelConfig, tokens: int, element_size: int) -> int:
    """The bytes one rank's all-to-alls take as input for one MoE layer, forward and backward,
    of a micro-batch of which it routes `tokens` (dropless; on average over the EP ranks, as
    the outputs a rank sends back are its experts' rows): the top-k copies of each token's
    hidden state out to the experts and their outputs back, each way again in backward, and
    the counts that size them (int64, forward)."""
    return 4 * cfg.mlp.top_k * tokens * cfg.hidden * element_size + cfg.n_experts * 8


def cp_bytes_per_layer_per_microbatch(layout: Layout) -> float:
    """Bytes each GPU sends for one layer's K/V traffic over its CP group, one micro-batch."""
    c, m = layout.cp, layout.model
    if c == 1:
        return 0.0
    # This TP rank's K/V heads (a copy of one when kv_heads < tp) of the whole sequence.
    kv = layout.micro_batch * 2 * max(1, m.kv_heads // layout.tp) * layout.seq_len * m.head_size
    passes = 2 if layout.activation_recompute else 1
    if layout.cp_comm == "all_gather":  # all-gather forward, reduce-scatter backward
        return (passes + 1) * (c - 1) / c * kv * ACTIVATION_BYTES
    block = kv / c  # K and V of s / cp tokens
    # Backward: the K/V blocks go round again, each block's dK/dV (fp32) a step behind, home last.
    return (passes + 1) * (c - 1) * block * ACTIVATION_BYTES + c * block * 4


def ep_bytes_per_step(layout: Layout) -> float:
    """Bytes each GPU sends over its EP group in a step: its stage's MoE layers' all-to-alls of
    every micro-batch, (ep-1)/ep of their copies leaving the GPU (balanced routing)."""
    m = layout.model
    if layout.ep == 1:
        return 0.0
    moe_layers = sum(m.is_moe_layer(i) for i in range(m.n_layers)) / layout.pp
    tokens = layout.micro_batch * layout.tokens_per_rank
    copies = moe_all_to_all_bytes(m, tokens, ACTIVATION_BYTES) - m.n_experts * 8  # the counts: latency
    passes = (4 + 2 * layout.activation_recompute) / 4  # recomputation repeats the forward's two
    return moe_layers * layout.micro_batches * passes * copies * (layout.ep - 1) / layout.ep


def ep_bandwidth(layout: Layout, hw: Hardware) -> float:
    """Bytes/s of the EP group's all-to-all: its ranks stride over the t TP ranks, within a CP
    group (t x ep consecutive ranks) or, past cp, over whole DP replicas (t x cp x p each)."""
    span = layout.tp * (layout.ep if layout.ep <= layout.cp else layout.cp * layout.pp * layout.ep // layout.cp)
    return block_bandwidth(span, hw)


def block_bandwidth(ranks: int, hw: Hardware) -> float:
    """Bytes/s between the ranks of a block of `ranks` consecutive ranks: the node's bus
    bandwidth while the block fits in a node, else each rank's own NIC (its slowest link)."""
    return (hw.intra_node_gbs if ranks <= hw.gpus_per_node else hw.inter_node_gbs) * 1e9


def cp_bandwidth(layout: Layout, hw: Hardware) -> float:
    """Bytes/s of the CP group's traffic: its ranks are the t x cp consecutive ranks of a TP
    rank's blocks."""
    return block_bandwidth(layout.tp * layout.cp, hw)


def bubble_fraction(layout: Layout) -> float:
    """Pipeline idle time over the ideal time: (p-1)/(v m) (Narayanan et al. 2021, section 2.2)."""
    return (layout.pp - 1) / (layout.virtual_stages * layout.micro_batches)


def p2p_bytes_per_step(layout: Layout) -> float:
    """Bytes each GPU sends to its neighbour stages in a step: per micro-batch and model chunk, a
    b x s x h bf16 activation forward and its gradient backward, of which each of the stage's t
    ranks sends 1/t (Megatron's scatter/gather; the receivers all-gather it)."""
    if layout.pp == 1:
        return 0.0
    message = layout.micro_batch * layout.tokens_per_rank * layout.model.hidden * ACTIVATION_BYTES
    return 2 * layout.virtual_stages * layout.micro_batches * message / layout.tp


def p2p_bandwidth(layout: Layout, hw: Hardware) -> float:
    """Bytes/s of a stage-to-stage send: a pipeline is t x p consecutive ranks, so past one node
    its slowest boundary, which paces every stage, crosses nodes on each rank's own NIC."""
    return block_bandwidth(layout.tp * layout.cp * layout.pp, hw)


def dp_bytes_per_step(layout: Layout) -> float:
    """Bytes each GPU sends for the step's gradient all-reduces: its dense params / (t p) over
    the cp x d replicas, its experts (1/(ep p) of them, whole over TP) over cp x d / ep."""
    experts = expert_parameter_count(layout.model)
    replicas = layout.dp * layout.cp
    dense = ring_factor(replicas) * (parameter_count(layout.model) - experts) / (layout.tp * layout.pp)
    return (dense + ring_factor(replicas // layout.ep) * experts / (layout.ep * layout.pp)) * layout.grad_bytes


def dp_bandwidth(layout: Layout, hw: Hardware) -> float:
    """Bus bandwidth (bytes/s) of a DP group's all-reduce: see the module docstring."""
    if layout.gpus <= hw.gpus_per_node:
        return hw.intra_node_gbs * 1e9
    ranks_per_node = min(layout.dp * layout.cp, max(1, hw.gpus_per_node // (layout.tp * layout.pp)))
    return min(hw.intra_node_gbs, ranks_per_node * hw.inter_node_gbs) * 1e9


@dataclass(frozen=True)
class Prediction:
    layout: Layout
    hardware: Hardware
    efficiency: float
    compute_s: float
    tp_comm_s: float
    bubble_s: float  # pipeline fill and drain: (compute + TP comm) x (p-1)/(v m)
    p2p_comm_s: float
    dp_comm_s: float
    overlap_window_s: float  # backward compute of the last micro-batch
    cp_comm_s: float = 0.0
    ep_comm_s: float = 0.0

    def step_s(self, overlap: bool) -> float:
        dp = max(0.0, self.dp_comm_s - self.overlap_window_s) if overlap else self.dp_comm_s
        return (self.compute_s + self.tp_comm_s + self.cp_comm_s + self.ep_comm_s + self.bubble_s
                + self.p2p_comm_s + dp)

    def tokens_per_s(self, overlap: bool) -> float:
        return self.layout.global_batch * self.layout.seq_len / self.step_s(overlap)

    def tflops_per_gpu(self, overlap: bool, flops: float | None = None) -> float:
        """Model FLOPs (or the given FLOPs per step) per second per GPU, in TFLOP/s."""
        flops = model_flops_per_step(self.layout) if flops is None else flops
        return flops / self.step_s(overlap) / self.layout.gpus / 1e12

    def mfu(self, overlap: bool) -> float:
        return self.tflops_per_gpu(overlap) / self.hardware.peak_tflops


def predict(layout: Layout, hw: Hardware, efficiency: float) -> Prediction:
    check_fits(layout, hw)
    executed = executed_flops_per_step(layout)
    compute = executed / (layout.gpus * hw.peak_tflops * 1e12 * efficiency)
    # Each GPU runs the all-reduces of its own stage's layers only.
    tp_bytes = (layout.model.n_layers // layout.pp * layout.micro_batches
                * tp_bytes_per_layer_per_microbatch(layout))
    tp_comm = tp_bytes / (hw.intra_node_gbs * 1e9)
    cp_bytes = (layout.model.n_layers // layout.pp * layout.micro_batches
                * cp_bytes_per_layer_per_microbatch(layout))
    # Backward is 2/3 of the model FLOPs, plus the recomputed forward that runs inside it.
    backward = (executed - model_flops_per_step(layout) / 3) / executed
    return Prediction(layout, hw, efficiency, compute, tp_comm_s=tp_comm,
                      bubble_s=(compute + tp_comm) * bubble_fraction(layout),
                      p2p_comm_s=p2p_bytes_per_step(layout) / p2p_bandwidth(layout, hw),
                      dp_comm_s=dp_bytes_per_step(layout) / dp_bandwidth(layout, hw),
                      overlap_window_s=compute * backward / layout.micro_batches,
                      cp_comm_s=cp_bytes / cp_bandwidth(layout, hw),
                      ep_comm_s=ep_bytes_per_step(layout) / ep_bandwidth(layout, hw))


def calibrate(layout: Layout, hw: Hardware, step_s: float, overlap: bool) -> float:
    """The efficiency at which `layout` takes `step_s` seconds (the step time falls as the
    efficiency rises, so bisection finds it)."""
    if predict(layout, hw, 1.0).step_s(overlap) >= step_s:
        raise ConfigError(f"a step of {step_s:.4g} s is faster than this layout at 100% of peak "
                          f"on {hw.name}: check the measured time and the shape")
    low, high = 1e-6, 1.0
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if predict(layout, hw, mid).step_s(overlap) > step_s else (low, mid)
    return (low + high) / 2


def efficiency_from_single_device(layout: Layout, hw: Hardware, step_s: float,
                                  sequences: int) -> float:
    """The efficiency of one GPU that ran `sequences` sequences of this model in `step_s`."""
    alone = dataclasses.replace(layout, global_batch=sequences, micro_batch=sequences, tp=1, gpus=1,
                                pp=1, virtual_stages=1, cp=1, ep=1)
    return calibrate(alone, hw, step_s, overlap=False)
