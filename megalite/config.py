"""Typed configs: the model and the parallel layout (their rules: layout_rules.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import yaml

from megalite.typed_config import ConfigError, from_dict

PRESET_DIR = Path(__file__).resolve().parent / "presets"  # package data: installed with it


@dataclass(frozen=True)
class ModelConfig:
    """Enough knobs to express GPT-2 and Llama exactly."""

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
    n_kv_heads: Optional[int] = None  # None: multi-head attention (n_kv_heads = n_heads)
    # gqa: heads of keys and values (multi-head, grouped-query, multi-query); mla: multi-head
    # latent attention (DeepSeek-V2/V3), keys and values from a latent (model/latent_attention.py)
    attention: Literal["gqa", "mla"] = "gqa"
    q_lora_rank: Optional[int] = None  # mla: the queries' latent width; None: a plain projection
    kv_lora_rank: int = 512  # mla: the keys' and values' latent width
    qk_nope_head_dim: int = 128  # mla: each head's query/key width without rotary
    qk_rope_head_dim: int = 64  # mla: the rotary part of each query, and the one shared rotary key
    v_head_dim: int = 128  # mla: each head's value width
    head_dim: Optional[int] = None  # width of a head; None: hidden / n_heads (Qwen3: free of it)
    qk_norm: bool = False  # RMSNorm over each head's q and k before rotary (Qwen3, Gemma 3)
    # Softmax scale of the attention scores, as query_pre_attn_scalar ** -0.5 (Gemma 3); None:
    # head_dim ** -0.5
    query_pre_attn_scalar: Optional[float] = None
    # Sliding-window attention (Mistral, Gemma 3): a query sees itself and the sliding_window - 1
    # tokens before it. None: the whole context. Every layer slides when sliding_window_pattern
    # is 1; with N > 1, layers i with (i + 1) % N == 0 attend to the whole context (Gemma 3: 6).
    sliding_window: Optional[int] = None
    sliding_window_pattern: int = 1  # N > 1: every N-th layer attends to the whole context
    ffn_hidden: Optional[int] = None  # None: 4 * hidden
    # MLP: GeLU (exact or tanh), SwiGLU (Llama) or GeGLU with tanh GeLU (Gemma)
    activation: Literal["gelu", "gelu_tanh", "swiglu", "geglu_tanh"] = "gelu_tanh"
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"  # LayerNorm (GPT-2) or RMSNorm (Llama)
    norm_eps: float = 1e-5  # the norms' epsilon
    norm_weight_offset: float = 0.0  # norms scale by offset + weight (Gemma: 1, weights from 0)
    position: Literal["learned", "rotary"] = "learned"  # a learned table (GPT-2) or rotary (Llama)
    rope_theta: float = 10000.0  # rotary base frequency
    # The sliding-window layers' rotary base (Gemma 3: 10000 against the global layers' 1e6),
    # unscaled; None: rope_theta and its scaling, as every other layer
    rope_local_theta: Optional[float] = None
    # Rotary frequencies stretched for contexts longer than pretraining's: none, linear (every
    # frequency / rope_factor), llama3 (Llama 3.1+: long wavelengths / rope_factor, short ones
    # kept, a smooth blend between) or yarn (YaRN, Peng et al. 2023: a blend by rotations over
    # the pretraining context, and an attention factor; DeepSeek-V3, Qwen2.5 long context;
    # model/positions.py)
    rope_scaling: Literal["none", "linear", "llama3", "yarn"] = "none"
    rope_factor: float = 1.0  # linear, llama3, yarn: how much longer the context is (Llama 3.1: 8)
    # llama3: wavelengths above rope_original_max_seq_len / rope_low_freq_factor are divided by
    # rope_factor (Llama 3.1: 1)
    rope_low_freq_factor: float = 1.0
    # llama3: wavelengths below rope_original_max_seq_len / rope_high_freq_factor are kept
    # (Llama 3.1: 4)
    rope_high_freq_factor: float = 4.0
    # llama3, yarn: the context length the model was pretrained at (Llama 3.1: 8192)
    rope_original_max_seq_len: int = 8192
    # yarn: frequencies turning more than rope_beta_fast times over the pretraining context are
    # kept, fewer than rope_beta_slow times divided by rope_factor, a linear ramp between
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0  # yarn: see rope_beta_fast
    # yarn: cos and sin times this; None: 0.1 ln(factor) + 1, or with rope_mscale and
    # rope_mscale_all_dim the ratio of those two scales (DeepSeek-V3: 1)
    rope_attention_factor: Optional[float] = None
    rope_mscale: float = 0.0  # yarn: see rope_attention_factor (0: unset)
    # yarn: see rope_attention_factor; MLA's softmax scale is also multiplied by
    # (0.1 rope_mscale_all_dim ln(factor) + 1)^2 (DeepSeek-V3)
    rope_mscale_all_dim: float = 0.0
    bias: bool = True  # biases in the linear layers and norms (GPT-2), or none (Llama)
    # Norms also on the attention's and the MLP's outputs, before the residual adds (Gemma 2/3)
    post_norms: bool = False
    scale_embeddings: bool = False  # the embeddings times sqrt(hidden) (Gemma)
    qkv_bias: bool = False  # biases on the q, k and v projections even without `bias` (Qwen2)
    tie_embeddings: bool = True  # the LM head is the embedding matrix
    # The logits soft-capped to cap x tanh(logits / cap) (Gemma 2's final_logit_softcapping)
    final_logit_softcap: Optional[float] = None
    dropout: float = 0.0  # embedding, residual and attention dropout (0 for pretraining)
    init_std: float = 0.02  # normal init's std; projections into the residual / sqrt(2 n_layers)
    # Mixture of experts (model/moe.py): 0 keeps the dense MLP in every layer. Otherwise layers
    # i with (i + 1) % moe_every == 0 route each token to its moe_top_k best of n_experts MLPs.
    n_experts: int = 0
    moe_top_k: int = 2  # experts per token
    moe_ffn_hidden: Optional[int] = None  # each expert's hidden width (None: ffn_hidden)
    moe_every: int = 1  # every moe_every-th layer is a mixture of experts, the others dense
    moe_dense_layers: tuple[int, ...] = ()  # layers kept dense whatever moe_every says (Qwen3-MoE)
    # Router scores: softmax over the experts (Mixtral) or a sigmoid per expert (DeepSeek-V3)
    moe_router: Literal["softmax", "sigmoid"] = "softmax"
    moe_renormalize: bool = True  # the top-k weights divided by their sum (Mixtral, DeepSeek-V3)
    # Group-limited routing (DeepSeek-V3): experts in moe_groups groups; a token picks its top-k
    # among the moe_topk_groups groups with the best sums of their two best scores
    moe_groups: int = 1
    moe_topk_groups: int = 1  # groups a token's experts come from (with moe_groups > 1)
    moe_routed_scaling: float = 1.0  # the routed experts' weights times this (DeepSeek-V3: 2.5)
    # Switch-style load-balancing loss coefficient (Fedus et al. 2021), per MoE layer
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0  # router z-loss (Zoph et al. 2022): mean logsumexp^2
    # Auxiliary-loss-free balancing (DeepSeek-V3): after each step every expert's selection bias
    # moves by this much toward balance (up if it took fewer copies than the mean). 0: off.
    moe_bias_update_rate: float = 0.0
    # Tokens an expert takes per micro-batch: capacity_factor x tokens x top_k / n_experts;
    # later ones (by position) are dropped. None: dropless.
    moe_capacity_factor: Optional[float] = None
    # Shared experts every token passes (DeepSeek-V3, Qwen2-MoE): one TP-split MLP of
    # n_shared_experts x moe_ffn_hidden.
    n_shared_experts: int = 0
    moe_shared_gate: bool = False  # the shared experts scaled by sigmoid(g x) (Qwen2-MoE)

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_size(self) -> int:
        return self.hidden // self.n_heads if self.head_dim is None else self.head_dim

    @property
    def rotary_dim(self) -> int:
        """The width rotary positions turn: a head's, or MLA's rotary part."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_size

    @property
    def qk_width(self) -> int:
        """A head's query/key width (the scores' dot products)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.attention == "mla" else self.head_size

    @property
    def v_width(self) -> int:
        return self.v_head_dim if self.attention == "mla" else self.head_size

    def window_of(self, layer: int) -> int | None:
        """The sliding window of a layer, or None where it attends to the whole context."""
        pattern = self.sliding_window_pattern
        if self.sliding_window is None or (pattern > 1 and (layer + 1) % pattern == 0):
            return None
        return self.sliding_window

    @property
    def gated(self) -> bool:
        """The MLP multiplies a gate projection's activation by an up projection."""
        return self.activation in ("swiglu", "geglu_tanh")

    @property
    def ffn(self) -> int:
        return 4 * self.hidden if self.ffn_hidden is None else self.ffn_hidden

    @property
    def expert_ffn(self) -> int:
        return self.ffn if self.moe_ffn_hidden is None else self.moe_ffn_hidden

    @property
    def shared_ffn(self) -> int:
        """The shared experts' MLP width (0: none)."""
        return self.n_shared_experts * self.expert_ffn if self.n_experts else 0

    def is_moe_layer(self, layer: int) -> bool:
        return (self.n_experts > 0 and (layer + 1) % self.moe_every == 0
                and layer not in self.moe_dense_layers)

    @property
    def padded_vocab(self) -> int:
        return math.ceil(self.vocab_size / self.vocab_pad_multiple) * self.vocab_pad_multiple


# The model settings that are training's, not the architecture's: under train.init_from the
# checkpoint fixes every other model key, and these are the config's where it gives them.
TRAINING_SETTINGS = ("dropout", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_bias_update_rate",
                     "moe_capacity_factor")


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


def read_preset(name: str) -> dict:
    """The raw mapping of a model preset under megalite/presets/ (e.g. 'gpt2-small')."""
    path = PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        presets = ", ".join(sorted(p.stem for p in PRESET_DIR.glob("*.yaml")))
        raise ConfigError(f"model config '{name}' not found (presets: {presets})")
    return yaml.safe_load(path.read_text()) or {}


def load_model_config(name_or_path: str | Path, **overrides) -> ModelConfig:
    """A preset name from megalite/presets/ or a path to a YAML file, with keyword overrides."""
    path = Path(name_or_path)
    is_file = path.suffix in (".yaml", ".yml") or path.is_file()  # a preset: qwen3-0.6b
    if is_file and not path.is_file():
        raise ConfigError(f"model config file '{path}' not found")
    data = (yaml.safe_load(path.read_text()) or {}) if is_file else read_preset(str(name_or_path))
    return from_dict(ModelConfig, {**data, **overrides}, "model.")
