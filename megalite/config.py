"""Typed configs: the model and the parallel layout (their rules: layout_rules.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Union

from megalite.typed_config import at_least_one, failing, positive

PRESET_DIR = Path(__file__).resolve().parent / "presets"  # package data: installed with it


@dataclass(frozen=True)
class GroupedQuery:
    """Heads of keys and values, each shared by a group of query heads: multi-head (n_kv_heads
    = n_heads), grouped-query or multi-query attention (model/attention.py)."""
    kind: Literal["gqa"] = "gqa"  # chooses this variant of the section
    n_kv_heads: Optional[int] = None  # None: multi-head attention (n_kv_heads = n_heads)
    head_dim: Optional[int] = None  # width of a head; None: hidden / n_heads (Qwen3: free of it)
    qk_norm: bool = False  # RMSNorm over each head's q and k before rotary (Qwen3, Gemma 3)
    qkv_bias: bool = False  # biases on the q, k and v projections even without model.bias (Qwen2)
    # Softmax scale of the attention scores, as query_pre_attn_scalar ** -0.5 (Gemma 3); None:
    # head_dim ** -0.5
    query_pre_attn_scalar: Optional[float] = None
    # Sliding-window attention (Mistral, Gemma 3): a query sees itself and the sliding_window - 1
    # tokens before it. None: the whole context. Every layer slides when sliding_window_pattern
    # is 1; with N > 1, layers i with (i + 1) % N == 0 attend to the whole context (Gemma 3: 6).
    sliding_window: Optional[int] = None
    sliding_window_pattern: int = 1  # N > 1: every N-th layer attends to the whole context

    def problems(self, model: ModelConfig) -> list[str]:
        where = "model.attention."
        return at_least_one(where, n_kv_heads=self.n_kv_heads) + failing(
            (self.head_dim is None or self.head_dim >= 1,
             f"{where}head_dim={self.head_dim} must be >= 1 (or null: hidden / n_heads)"),
        ) + positive(where, query_pre_attn_scalar=self.query_pre_attn_scalar) + _window_problems(self)


@dataclass(frozen=True)
class Latent:
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values from a latent, without
    biases; one rotary key shared by the heads (model/latent_attention.py). Needs rotary
    positions."""
    kind: Literal["mla"] = "mla"  # chooses this variant of the section
    q_lora_rank: Optional[int] = None  # the queries' latent width; None: a plain projection
    kv_lora_rank: int = 512  # the keys' and values' latent width
    qk_nope_head_dim: int = 128  # each head's query/key width without rotary
    qk_rope_head_dim: int = 64  # the rotary part of each query, and the one shared rotary key
    v_head_dim: int = 128  # each head's value width
    sliding_window: Optional[int] = None  # as model.attention.kind=gqa's
    sliding_window_pattern: int = 1  # as model.attention.kind=gqa's

    def problems(self, model: ModelConfig) -> list[str]:
        return at_least_one("model.attention.", kv_lora_rank=self.kv_lora_rank,
                            qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim) + failing(
            (self.qk_nope_head_dim >= 0, f"model.attention.qk_nope_head_dim={self.qk_nope_head_dim} must be >= 0"),
            (self.q_lora_rank is None or self.q_lora_rank >= 1,
             f"model.attention.q_lora_rank={self.q_lora_rank} must be >= 1, or null (a plain query projection)"),
            (model.rotary is not None, f"model.attention.kind=mla rotates one shared key: it needs "
                                       f"model.positions.kind=rotary, not {model.positions.kind!r}"),
            (not model.bias, "model.attention.kind=mla makes keys and values from a latent without "
                             "biases: model.bias=true would do nothing; set model.bias=false"),
            (model.rotary is None or model.rotary.local_theta is None,
             f"model.attention.kind=mla turns every layer at model.positions.theta: "
             f"model.positions.local_theta={model.rotary and model.rotary.local_theta} would do nothing; leave it out"),
        ) + _window_problems(self)


@dataclass(frozen=True)
class Learned:
    """A learned table of positions (GPT-2), model.max_seq_len rows."""
    kind: Literal["learned"] = "learned"  # chooses this variant of the section


@dataclass(frozen=True)
class Unscaled:
    """Rotary frequencies as pretrained."""
    kind: Literal["none"] = "none"  # chooses this variant of the section


@dataclass(frozen=True)
class LinearScaling:
    """Every frequency / factor (position interpolation)."""
    kind: Literal["linear"] = "linear"  # chooses this variant of the section
    factor: float = 1.0  # how much longer the context is

    def problems(self, model: ModelConfig) -> list[str]:
        return positive("model.positions.scaling.", factor=self.factor)


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1+: long wavelengths / factor, short ones kept, a smooth blend between."""
    kind: Literal["llama3"] = "llama3"  # chooses this variant of the section
    factor: float = 1.0  # how much longer the context is (Llama 3.1: 8)
    # wavelengths above original_max_seq_len / low_freq_factor are divided by factor (Llama 3.1: 1)
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0  # wavelengths below original_max_seq_len / this are kept (Llama 3.1: 4)
    original_max_seq_len: int = 8192  # the context length the model was pretrained at (Llama 3.1: 8192)

    def problems(self, model: ModelConfig) -> list[str]:
        low, high, where = self.low_freq_factor, self.high_freq_factor, "model.positions.scaling."
        return positive(where, factor=self.factor, low_freq_factor=low) + failing(
            (high > low, f"{where}high_freq_factor={high} must be > low_freq_factor={low} "
                         f"(Llama 3.1: 4 and 1)"),
        ) + at_least_one(where, original_max_seq_len=self.original_max_seq_len)


@dataclass(frozen=True)
class YarnScaling:
    """YaRN (Peng et al. 2023): a blend by rotations over the pretraining context, and an
    attention factor (DeepSeek-V3, Qwen2.5 long context; model/positions.py)."""
    kind: Literal["yarn"] = "yarn"  # chooses this variant of the section
    factor: float = 1.0  # how much longer the context is
    original_max_seq_len: int = 8192  # the context length the model was pretrained at
    # frequencies turning more than beta_fast times over the pretraining context are kept, fewer
    # than beta_slow times divided by factor, a linear ramp between
    beta_fast: float = 32.0
    beta_slow: float = 1.0  # see beta_fast
    # cos and sin times this; None: 0.1 ln(factor) + 1, or with mscale and mscale_all_dim the
    # ratio of those two scales (DeepSeek-V3: 1)
    attention_factor: Optional[float] = None
    mscale: float = 0.0  # see attention_factor (0: unset)
    # see attention_factor; MLA's softmax scale is also multiplied by
    # (0.1 mscale_all_dim ln(factor) + 1)^2 (DeepSeek-V3)
    mscale_all_dim: float = 0.0

    def problems(self, model: ModelConfig) -> list[str]:
        fast, slow, where = self.beta_fast, self.beta_slow, "model.positions.scaling."
        return positive(where, factor=self.factor) + failing(
            (fast > slow > 0, f"{where}beta_fast={fast} must be > beta_slow={slow} > 0 (YaRN: 32 and 1)"),
        ) + at_least_one(where, original_max_seq_len=self.original_max_seq_len)


@dataclass(frozen=True)
class Rotary:
    """Rotary position embeddings (Llama), optionally scaled for longer contexts."""
    kind: Literal["rotary"] = "rotary"  # chooses this variant of the section
    theta: float = 10000.0  # rotary base frequency
    # The sliding-window layers' rotary base (Gemma 3: 10000 against the global layers' 1e6),
    # unscaled; None: theta and its scaling, as every other layer
    local_theta: Optional[float] = None
    # Frequencies stretched for contexts longer than pretraining's: none, linear, llama3 or yarn
    scaling: Union[Unscaled, LinearScaling, Llama3Scaling, YarnScaling] = Unscaled()

    def problems(self, model: ModelConfig) -> list[str]:
        return positive("model.positions.", theta=self.theta, local_theta=self.local_theta) + failing(
            (self.local_theta is None or model.attention.sliding_window is not None,
             f"model.positions.local_theta={self.local_theta} is the sliding-window layers' rotary "
             f"base: it needs model.attention.sliding_window"),
        ) + getattr(self.scaling, "problems", lambda _: [])(model)


Activation = Literal["gelu", "gelu_tanh", "swiglu", "geglu_tanh"]


@dataclass(frozen=True)
class Dense:
    """One MLP per layer (model/mlp.py)."""
    kind: Literal["dense"] = "dense"  # chooses this variant of the section
    ffn_hidden: Optional[int] = None  # None: 4 * hidden
    # GeLU (exact or tanh), SwiGLU (Llama) or GeGLU with tanh GeLU (Gemma)
    activation: Activation = "gelu_tanh"


@dataclass(frozen=True)
class Experts:
    """A mixture of experts (model/moe.py): layers i with (i + 1) % every == 0, but
    dense_layers, route each token to its top_k best of `experts` MLPs; the others are dense."""
    kind: Literal["moe"] = "moe"  # chooses this variant of the section
    ffn_hidden: Optional[int] = None  # the dense layers' MLP width; None: 4 * hidden
    activation: Activation = "gelu_tanh"  # the experts' and the dense layers' (as kind=dense's)
    experts: int = 8  # routed experts per MoE layer
    top_k: int = 2  # experts per token
    expert_ffn_hidden: Optional[int] = None  # each expert's hidden width (None: ffn_hidden)
    every: int = 1  # every `every`-th layer is a mixture of experts, the others dense
    dense_layers: tuple[int, ...] = ()  # layers kept dense whatever `every` says (Qwen3-MoE)
    # Router scores: softmax over the experts (Mixtral) or a sigmoid per expert (DeepSeek-V3)
    router: Literal["softmax", "sigmoid"] = "softmax"
    renormalize: bool = True  # the top-k weights divided by their sum (Mixtral, DeepSeek-V3)
    # Group-limited routing (DeepSeek-V3): experts in `groups` groups; a token picks its top-k
    # among the topk_groups groups with the best sums of their two best scores
    groups: int = 1
    topk_groups: int = 1  # groups a token's experts come from (with groups > 1)
    routed_scaling: float = 1.0  # the routed experts' weights times this (DeepSeek-V3: 2.5)
    # Switch-style load-balancing loss coefficient (Fedus et al. 2021), per MoE layer
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0  # router z-loss (Zoph et al. 2022): mean logsumexp^2
    # Auxiliary-loss-free balancing (DeepSeek-V3): after each step every expert's selection bias
    # moves by this much toward balance (up if it took fewer copies than the mean). 0: off.
    bias_update_rate: float = 0.0
    # Tokens an expert takes per micro-batch: capacity_factor x tokens x top_k / experts; later
    # ones (by position) are dropped. None: dropless.
    capacity_factor: Optional[float] = None
    # Shared experts every token passes (DeepSeek-V3, Qwen2-MoE): one TP-split MLP of
    # shared_experts x expert_ffn_hidden.
    shared_experts: int = 0
    shared_gate: bool = False  # the shared experts scaled by sigmoid(g x) (Qwen2-MoE)

    def problems(self, model: ModelConfig) -> list[str]:
        e, g, cf = self.experts, self.groups, self.capacity_factor
        return failing(
            (e >= 1, f"model.mlp.experts={e} must be >= 1 (a dense model: model.mlp.kind=dense)"),
            (1 <= self.top_k <= e, f"model.mlp.top_k={self.top_k} must be in [1, model.mlp.experts={e}]"),
            (self.every >= 1, f"model.mlp.every={self.every} must be >= 1"),
            (g >= 1 and e % g == 0 and (g == 1 or e // g >= 2),
             f"model.mlp.groups={g} must divide model.mlp.experts={e} into groups of 2 "
             f"or more (a group is ranked by its two best scores), or be 1"),
            # e // g is read only where 1 <= topk_groups <= g already holds: g >= 1
            (1 <= self.topk_groups <= g and (g == 1 or self.top_k <= self.topk_groups * (e // g)),
             f"model.mlp.topk_groups={self.topk_groups} must be in [1, model.mlp.groups="
             f"{g}] and its groups hold model.mlp.top_k={self.top_k} experts"),
            (self.routed_scaling > 0, f"model.mlp.routed_scaling={self.routed_scaling} must be > 0"),
            (all(0 <= i < model.n_layers for i in self.dense_layers),
             f"model.mlp.dense_layers={list(self.dense_layers)} must name layers in "
             f"[0, model.n_layers={model.n_layers})"),
            (model.expert_ffn >= 1, f"model.mlp.expert_ffn_hidden={self.expert_ffn_hidden} must be >= 1"),
            (self.shared_experts >= 0, f"model.mlp.shared_experts={self.shared_experts} must be >= 0"),
            (not self.shared_gate or self.shared_experts > 0,
             "model.mlp.shared_gate=true gates the shared experts: set model.mlp.shared_experts >= 1"),
            (cf is None or cf > 0, f"model.mlp.capacity_factor={cf} must be > 0 (or null: dropless)"),
            (min(self.aux_loss_coeff, self.z_loss_coeff, self.bias_update_rate) >= 0,
             "model.mlp.aux_loss_coeff, z_loss_coeff and bias_update_rate must be >= 0"),
        )


@dataclass(frozen=True)
class Norms:
    """The block's norms and the final one."""
    kind: Literal["layernorm", "rmsnorm"] = "layernorm"  # LayerNorm (GPT-2) or RMSNorm (Llama)
    eps: float = 1e-5  # the norms' epsilon
    weight_offset: float = 0.0  # norms scale by offset + weight (Gemma: 1, weights from 0)
    # Norms also on the attention's and the MLP's outputs, before the residual adds (Gemma 2/3)
    post_norms: bool = False

    def problems(self, model: ModelConfig) -> list[str]:
        return positive("model.norms.", eps=self.eps)


@dataclass(frozen=True)
class ModelConfig:
    """A decoder: sizes, then a section per part, each a variant with its own keys
    (docs/design.md, "adding a model setting")."""

    # The Hugging Face architecture export writes (import sets it; hf/convert.ARCHITECTURES);
    # None: the first that holds the config
    architecture: Optional[str] = None
    vocab_size: int = 50257  # tokens in the vocabulary (the trainer sets it from the tokenizer)
    # Pad the vocabulary to a multiple that does not depend on the TP size, so that changing TP
    # never changes the model (the bug of Megatron-LM #1754, which pads to 128 * tp).
    vocab_pad_multiple: int = 128
    max_seq_len: int = 1024  # longest sequence the model takes (the learned position table's size)
    n_layers: int = 12  # transformer blocks
    hidden: int = 768  # width of the residual stream
    n_heads: int = 12  # attention (query) heads
    # gqa: heads of keys and values (multi-head, grouped-query, multi-query); mla: multi-head
    # latent attention (DeepSeek-V2/V3)
    attention: Union[GroupedQuery, Latent] = GroupedQuery()
    positions: Union[Learned, Rotary] = Learned()  # a learned table (GPT-2) or rotary (Llama)
    mlp: Union[Dense, Experts] = Dense()  # one MLP per layer, or a mixture of experts
    norms: Norms = Norms()
    bias: bool = True  # biases in the linear layers and norms (GPT-2), or none (Llama)
    scale_embeddings: bool = False  # the embeddings times sqrt(hidden) (Gemma)
    tie_embeddings: bool = True  # the LM head is the embedding matrix
    # The logits soft-capped to cap x tanh(logits / cap) (Gemma 2's final_logit_softcapping)
    final_logit_softcap: Optional[float] = None
    dropout: float = 0.0  # embedding, residual and attention dropout (0 for pretraining)
    init_std: float = 0.02  # normal init's std; projections into the residual / sqrt(2 n_layers)

    def problems(self) -> list[str]:
        """Every way this model's settings are invalid (its sections' rules included), one line
        each; layout_rules.layout_problems adds the layout's."""
        return at_least_one("model.", vocab_size=self.vocab_size, vocab_pad_multiple=self.vocab_pad_multiple,
                            max_seq_len=self.max_seq_len, n_layers=self.n_layers, hidden=self.hidden,
                            n_heads=self.n_heads) + at_least_one("model.mlp.", ffn_hidden=self.ffn) + failing(
            (0.0 <= self.dropout < 1.0, f"model.dropout={self.dropout} must be in [0, 1)"),
            (self.init_std > 0, f"model.init_std={self.init_std} must be > 0"),
            (self.final_logit_softcap is None or self.final_logit_softcap > 0,
             f"model.final_logit_softcap={self.final_logit_softcap} must be > 0 (or null: none)"),
        ) + [line for section in (self.attention, self.positions, self.mlp, self.norms)
             for line in getattr(section, "problems", lambda _: [])(self)]

    @property
    def mla(self) -> bool:
        return self.attention.kind == "mla"

    @property
    def rotary(self) -> Rotary | None:
        return self.positions if self.positions.kind == "rotary" else None

    @property
    def moe(self) -> Experts | None:
        return self.mlp if self.mlp.kind == "moe" else None

    @property
    def n_experts(self) -> int:
        """Routed experts per MoE layer (0: dense)."""
        return self.mlp.experts if self.mlp.kind == "moe" else 0

    @property
    def kv_heads(self) -> int:
        kv = None if self.mla else self.attention.n_kv_heads
        return self.n_heads if kv is None else kv

    @property
    def head_size(self) -> int:
        head_dim = None if self.mla else self.attention.head_dim
        return self.hidden // self.n_heads if head_dim is None else head_dim

    @property
    def rotary_dim(self) -> int:
        """The width rotary positions turn: a head's, or MLA's rotary part."""
        return self.attention.qk_rope_head_dim if self.mla else self.head_size

    @property
    def qk_width(self) -> int:
        """A head's query/key width (the scores' dot products)."""
        a = self.attention
        return a.qk_nope_head_dim + a.qk_rope_head_dim if self.mla else self.head_size

    @property
    def v_width(self) -> int:
        return self.attention.v_head_dim if self.mla else self.head_size

    def window_of(self, layer: int) -> int | None:
        """The sliding window of a layer, or None where it attends to the whole context."""
        pattern = self.attention.sliding_window_pattern
        return None if pattern > 1 and (layer + 1) % pattern == 0 else self.attention.sliding_window

    @property
    def gated(self) -> bool:
        """The MLP multiplies a gate projection's activation by an up projection."""
        return self.mlp.activation in ("swiglu", "geglu_tanh")

    @property
    def ffn(self) -> int:
        return 4 * self.hidden if self.mlp.ffn_hidden is None else self.mlp.ffn_hidden

    @property
    def expert_ffn(self) -> int:
        moe = self.moe
        return self.ffn if moe is None or moe.expert_ffn_hidden is None else moe.expert_ffn_hidden

    @property
    def shared_ffn(self) -> int:
        """The shared experts' MLP width (0: none)."""
        return self.mlp.shared_experts * self.expert_ffn if self.moe else 0

    def is_moe_layer(self, layer: int) -> bool:
        moe = self.moe
        return moe is not None and (layer + 1) % moe.every == 0 and layer not in moe.dense_layers

    @property
    def padded_vocab(self) -> int:
        return math.ceil(self.vocab_size / self.vocab_pad_multiple) * self.vocab_pad_multiple


def _window_problems(attention: GroupedQuery | Latent) -> list[str]:
    window, pattern = attention.sliding_window, attention.sliding_window_pattern
    return failing(
        (window is None or window >= 1,
         f"model.attention.sliding_window={window} must be >= 1 (or null: the whole context)"),
        (pattern >= 1, f"model.attention.sliding_window_pattern={pattern} must be >= 1"),
        (pattern == 1 or window is not None,
         f"model.attention.sliding_window_pattern={pattern} spaces the global layers among sliding "
         f"ones: it needs model.attention.sliding_window"),
    )


# The model settings that are training's, not the architecture's: under train.init_from the
# checkpoint fixes every other model key, and these are the config's where it gives them.
TRAINING_SETTINGS = ("dropout", "mlp.aux_loss_coeff", "mlp.z_loss_coeff", "mlp.bias_update_rate",
                     "mlp.capacity_factor")


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1  # tensor-parallel ranks (keep them inside a node)
    # Passed to init_process_group and to every new_group (Megatron-LM #564, #735: a timeout that
    # does not reach the sub-groups turns a dead rank into a silent hang).
    timeout_minutes: float = 10.0
    # Korthikanti et al. 2022: between the TP regions each TP rank holds a 1/tp shard of the
    # sequence, where norms, dropout and residual adds run: activation memory per layer / tp;
    # all-reduces become reduce-scatter + all-gather pairs (docs/parallelism.md).
    sequence_parallel: bool = False
    # DP gradients are all-reduced in buckets of this many MiB (PyTorch DDP's default size), each
    # started as soon as backward has filled it: few collectives, still overlapped with backward.
    dp_bucket_mb: float = 25.0
    # bf16 halves the DP traffic; the summed gradients are then rounded to bf16.
    dp_reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    # Pipeline stages (Narayanan et al. 2021): world = tp x pp x dp. The schedule orders each
    # rank's micro-batch forwards and backwards (pipeline/schedules.py); interleaved gives each
    # rank `virtual_stages` model chunks. pp_layers: layers per virtual stage (default: even).
    pp: int = 1
    # gpipe, 1f1b, or interleaved (with virtual_stages > 1)
    pp_schedule: Literal["gpipe", "1f1b", "interleaved"] = "1f1b"
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved schedule)
    # layers per virtual stage, e.g. [3, 5]; default even
    pp_layers: Optional[tuple[int, ...]] = None
    # Context parallelism: each sample's sequence split over `cp` ranks, zig-zag balanced
    # (parallel/context.py); world = tp x cp x pp x dp. cp_comm: how attention sees the other
    # ranks' keys and values: all_gather (gather K/V whole, reduce-scatter their gradients) or
    # p2p (ring attention: K/V blocks pass around the CP ring, parallel/ring_attention.py).
    cp: int = 1
    # all_gather (K/V gathered) or p2p (ring attention)
    cp_comm: Literal["all_gather", "p2p"] = "all_gather"
    # Expert parallelism: each MoE layer's experts split over `ep` ranks carved out of the CP x DP
    # ranks (Megatron's parallel folding); tokens travel to their experts' ranks and back by
    # all-to-all. Attention and the dense layers keep their TP x CP x DP layout.
    ep: int = 1
