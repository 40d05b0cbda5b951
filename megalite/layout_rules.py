"""The rules a model config and a parallel layout must satisfy together, checked on every rank
before any collective runs: one ConfigError naming each value and its fix."""
from __future__ import annotations

import dataclasses
from typing import Callable

from megalite.config import ModelConfig, ParallelConfig
from megalite.typed_config import ConfigError


def check_layout(model: ModelConfig | None, parallel: ParallelConfig, world_size: int,
                 micro_batches: int | None = None, vocab: bool = True) -> None:
    """Raise ONE ConfigError listing every way `model` cannot run on `parallel`'s layout of
    `world_size` processes (with `micro_batches` per step, if known; model None: not known yet;
    vocab False: model.vocab_size is not the run's yet, so tp's split of it is left unchecked).

    Every entry point calls it before any collective (run_setup.validate for a run, inference
    for generate and eval), so a bad config fails on every rank with the same message instead
    of deadlocking the ranks that did not fail; GPT calls it for the split it is built on.
    """
    tp, pp, cp, sequence_parallel = parallel.tp, parallel.pp, parallel.cp, parallel.sequence_parallel
    problems = [] if tp >= 1 else [f"parallel.tp={tp} must be >= 1"]
    if cp < 1:
        problems.append(f"parallel.cp={cp} must be >= 1")
    world_misfit = tp >= 1 and pp >= 1 and cp >= 1 and world_size % (tp * cp * pp)
    if world_misfit and (cp > 1 or pp > 1):
        split = {"tp": tp, "cp": cp, "pp": pp}
        named = [k for k, v in split.items() if k == "tp" or v > 1]
        what = " x ".join(f"parallel.{k}" for k in named) + " = " + " x ".join(str(split[k]) for k in named)
        tps = (f"use parallel.tp among {_divisors(world_size // (pp * cp))} or "
               if world_size % (pp * cp) == 0 else "")  # else no tp fits
        problems.append(f"world size {world_size} is not divisible by {what}: {tps}launch a "
                        f"multiple of {tp * cp * pp} processes")
    problems += pipeline_problems(None if model is None else model.n_layers, parallel, micro_batches)
    if model is not None and cp > 1 and model.attention == "mla" and parallel.cp_comm == "p2p":
        problems.append(f"parallel.cp={cp} with model.attention=mla gathers each layer's latent "
                        f"(kv_lora_rank + qk_rope_head_dim per token, less than a ring's K/V): "
                        f"set parallel.cp_comm=all_gather")
    if model is not None and cp > 1 and model.dropout > 0:
        # A CP rank holds a zig-zag subset of the tokens: the single process's dropout masks
        # would have to be drawn whole and indexed for every layer to stay the same model.
        problems.append(f"parallel.cp={cp} with model.dropout={model.dropout}: context parallelism "
                        f"trains without dropout (as pretraining does); set model.dropout=0")
    splittable = model  # a model whose sizes are valid: what tp must divide
    if model is not None:
        bad_values = _model_value_problems(model)
        problems += bad_values
        if bad_values:
            splittable = None
        else:
            problems += _model_split_problems(model)
    if tp >= 1 and pp >= 1 and cp >= 1:
        problems += _tp_problem(splittable, tp, world_size, cp * pp, world_misfit and cp == pp == 1,
                                vocab)
    if splittable is not None and tp >= 1:
        if sequence_parallel and model.max_seq_len % tp:
            # Inputs are padded to a multiple of tp to split them (model/gpt.py); the padded
            # length must still have positions.
            m = model.max_seq_len
            problems.append(f"parallel.sequence_parallel=true splits every sequence into "
                            f"parallel.tp={tp} shards, so model.max_seq_len={m} must be a "
                            f"multiple of {tp}: use max_seq_len={m + tp - m % tp}, or "
                            f"parallel.sequence_parallel=false")
    problems += _expert_parallel_problems(splittable, parallel, world_size, world_misfit)
    if len(problems) == 1:
        raise ConfigError(f"invalid config: {problems[0]}")
    if problems:
        raise ConfigError("invalid config:\n" + "\n".join(f"  - {p}" for p in problems))


def _model_value_problems(model: ModelConfig) -> list[str]:
    sizes = {"vocab_size": model.vocab_size, "vocab_pad_multiple": model.vocab_pad_multiple,
             "max_seq_len": model.max_seq_len, "n_layers": model.n_layers, "hidden": model.hidden,
             "n_heads": model.n_heads, "n_kv_heads": model.kv_heads, "ffn_hidden": model.ffn}
    problems = [f"model.{key}={value} must be >= 1" for key, value in sizes.items() if value < 1]
    checks = [
        (0.0 <= model.dropout < 1.0, f"model.dropout={model.dropout} must be in [0, 1)"),
        (model.norm_eps > 0, f"model.norm_eps={model.norm_eps} must be > 0"),
        (model.init_std > 0, f"model.init_std={model.init_std} must be > 0"),
        (model.rope_theta > 0, f"model.rope_theta={model.rope_theta} must be > 0"),
    ]
    return (problems + [message for ok, message in checks if not ok] + _rope_scaling_problems(model)
            + _attention_problems(model) + _latent_problems(model) + _moe_problems(model))


MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _latent_problems(model: ModelConfig) -> list[str]:
    if model.attention != "mla":  # a setting that would silently do nothing
        stray = _set(model, lambda name: name in MLA_KEYS)
        return [f"{_listed(stray)} only apply to model.attention=mla: set it, or leave them "
                f"out"] if stray else []
    sizes = {"kv_lora_rank": model.kv_lora_rank, "qk_rope_head_dim": model.qk_rope_head_dim,
             "v_head_dim": model.v_head_dim}
    problems = [f"model.{key}={value} must be >= 1" for key, value in sizes.items() if value < 1]
    if model.qk_nope_head_dim < 0:
        problems.append(f"model.qk_nope_head_dim={model.qk_nope_head_dim} must be >= 0")
    if model.position != "rotary":
        problems.append(f"model.attention=mla rotates one shared key: it needs "
                        f"model.position=rotary, not {model.position!r}")
    if model.q_lora_rank is not None and model.q_lora_rank < 1:
        problems.append(f"model.q_lora_rank={model.q_lora_rank} must be >= 1, or null (a plain "
                        f"query projection)")
    ignored = [f"model.{key}={getattr(model, key)}" for key, unset in (
        ("n_kv_heads", model.n_kv_heads in (None, model.n_heads)), ("head_dim", model.head_dim is None),
        ("qk_norm", not model.qk_norm), ("bias", not model.bias), ("qkv_bias", not model.qkv_bias),
        ("query_pre_attn_scalar", model.query_pre_attn_scalar is None),
        ("rope_local_theta", model.rope_local_theta is None)) if not unset]
    if ignored:
        problems.append(f"model.attention=mla makes keys and values from a latent, without "
                        f"biases, at a scale of its own: {_listed(ignored)} would do nothing; "
                        f"leave them out (its widths are qk_nope_head_dim, qk_rope_head_dim, "
                        f"v_head_dim)")
    return problems


def _attention_problems(model: ModelConfig) -> list[str]:
    window, pattern = model.sliding_window, model.sliding_window_pattern
    local, scalar = model.rope_local_theta, model.query_pre_attn_scalar
    checks = [
        (model.head_dim is None or model.head_dim >= 1,
         f"model.head_dim={model.head_dim} must be >= 1 (or null: hidden / n_heads)"),
        (window is None or window >= 1,
         f"model.sliding_window={window} must be >= 1 (or null: the whole context)"),
        (pattern >= 1, f"model.sliding_window_pattern={pattern} must be >= 1"),
        (pattern == 1 or window is not None,
         f"model.sliding_window_pattern={pattern} spaces the global layers among sliding ones: "
         f"it needs model.sliding_window"),
        (scalar is None or scalar > 0, f"model.query_pre_attn_scalar={scalar} must be > 0"),
        (local is None or local > 0, f"model.rope_local_theta={local} must be > 0"),
        (model.final_logit_softcap is None or model.final_logit_softcap > 0,
         f"model.final_logit_softcap={model.final_logit_softcap} must be > 0 (or null: none)"),
        (local is None or (window is not None and model.position == "rotary"),
         f"model.rope_local_theta={local} is the sliding-window layers' rotary base: it needs "
         f"model.position=rotary and model.sliding_window"),
    ]
    return [message for ok, message in checks if not ok]


def _moe_problems(model: ModelConfig) -> list[str]:
    if model.n_experts < 0:
        return [f"model.n_experts={model.n_experts} must be >= 0 (0: dense)"]
    if model.n_experts == 0:  # a dense model: a mixture's setting would silently do nothing
        stray = _set(model, lambda name: name.startswith("moe_") or name == "n_shared_experts")
        return [f"{_listed(stray)} only apply to a mixture of experts, and model.n_experts=0: "
                f"set model.n_experts, or leave them out"] if stray else []
    cf = model.moe_capacity_factor
    checks = [
        (1 <= model.moe_top_k <= model.n_experts, f"model.moe_top_k={model.moe_top_k} must be "
                                                  f"in [1, model.n_experts={model.n_experts}]"),
        (model.moe_every >= 1, f"model.moe_every={model.moe_every} must be >= 1"),
        (model.moe_groups >= 1 and model.n_experts % model.moe_groups == 0
         and (model.moe_groups == 1 or model.n_experts // model.moe_groups >= 2),
         f"model.moe_groups={model.moe_groups} must divide model.n_experts={model.n_experts} "
         f"into groups of 2 or more (a group is ranked by its two best scores), or be 1"),
        (1 <= model.moe_topk_groups <= model.moe_groups and (
            model.moe_groups == 1
            or model.moe_top_k <= model.moe_topk_groups * (model.n_experts // model.moe_groups)),
         f"model.moe_topk_groups={model.moe_topk_groups} must be in [1, model.moe_groups="
         f"{model.moe_groups}] and its groups hold model.moe_top_k={model.moe_top_k} experts"),
        (model.moe_routed_scaling > 0,
         f"model.moe_routed_scaling={model.moe_routed_scaling} must be > 0"),
        (all(0 <= i < model.n_layers for i in model.moe_dense_layers),
         f"model.moe_dense_layers={list(model.moe_dense_layers)} must name layers in "
         f"[0, model.n_layers={model.n_layers})"),
        (model.expert_ffn >= 1, f"model.moe_ffn_hidden={model.moe_ffn_hidden} must be >= 1"),
        (model.n_shared_experts >= 0, f"model.n_shared_experts={model.n_shared_experts} must be >= 0"),
        (not model.moe_shared_gate or model.n_shared_experts > 0,
         "model.moe_shared_gate=true gates the shared experts: set model.n_shared_experts >= 1"),
        (cf is None or cf > 0, f"model.moe_capacity_factor={cf} must be > 0 (or null: dropless)"),
        (min(model.moe_aux_loss_coeff, model.moe_z_loss_coeff, model.moe_bias_update_rate) >= 0,
         "model.moe_aux_loss_coeff, moe_z_loss_coeff and moe_bias_update_rate must be >= 0"),
    ]
    return [message for ok, message in checks if not ok]


def _expert_parallel_problems(model: ModelConfig | None, parallel: ParallelConfig, world_size: int,
                              world_misfit: bool) -> list[str]:
    ep = parallel.ep
    if ep < 1:
        return [f"parallel.ep={ep} must be >= 1"]
    if ep == 1:
        return []
    problems = []
    if model is not None and model.n_experts == 0:
        problems.append(f"parallel.ep={ep} splits a mixture of experts, but model.n_experts=0: "
                        f"set n_experts, or parallel.ep=1")
    elif model is not None and model.n_experts % ep:
        problems.append(f"parallel.ep={ep} must divide model.n_experts={model.n_experts} (each EP "
                        f"rank holds n_experts / ep experts): use ep among "
                        f"{_divisors(model.n_experts)}")
    grad_ranks = parallel.cp * data_parallel_size(parallel, world_size)
    if not world_misfit and grad_ranks % ep:
        problems.append(f"parallel.ep={ep} must divide the CP x DP ranks ({grad_ranks} = world "
                        f"{world_size} / (tp x pp)): use ep among {_divisors(grad_ranks)}")
    return problems


def _rope_scaling_problems(model: ModelConfig) -> list[str]:
    scaling = model.rope_scaling
    yarn_keys = ("rope_beta_fast", "rope_beta_slow", "rope_attention_factor", "rope_mscale",
                 "rope_mscale_all_dim")
    stray = _set(model, lambda name: name in yarn_keys)
    if stray and scaling != "yarn":
        return [f"{_listed(stray)} only apply to model.rope_scaling=yarn (got {scaling!r}): "
                f"set it, or leave them out"]
    if scaling == "none":
        return []
    if model.position != "rotary":
        return [f"model.rope_scaling={scaling!r} scales rotary positions, but "
                f"model.position={model.position!r}: set model.position=rotary or "
                f"model.rope_scaling=none"]
    checks = [(model.rope_factor > 0, f"model.rope_factor={model.rope_factor} must be > 0 "
                                      f"(with model.rope_scaling={scaling!r})")]
    if scaling == "yarn":
        checks += [
            (model.rope_beta_fast > model.rope_beta_slow > 0,
             f"model.rope_beta_fast={model.rope_beta_fast} must be > model.rope_beta_slow="
             f"{model.rope_beta_slow} > 0 (YaRN: 32 and 1)"),
            (model.rope_original_max_seq_len >= 1,
             f"model.rope_original_max_seq_len={model.rope_original_max_seq_len} must be >= 1"),
        ]
    if scaling == "llama3":
        low, high = model.rope_low_freq_factor, model.rope_high_freq_factor
        checks += [
            (low > 0, f"model.rope_low_freq_factor={low} must be > 0"),
            (high > low, f"model.rope_high_freq_factor={high} must be > "
                         f"model.rope_low_freq_factor={low} (Llama 3.1: 4 and 1)"),
            (model.rope_original_max_seq_len >= 1,
             f"model.rope_original_max_seq_len={model.rope_original_max_seq_len} must be >= 1"),
        ]
    return [message for ok, message in checks if not ok]


def _model_split_problems(model: ModelConfig) -> list[str]:
    checks = [
        (model.head_dim is not None or model.attention == "mla" or model.hidden % model.n_heads == 0,
         f"model.hidden={model.hidden} is not divisible by model.n_heads={model.n_heads}: "
         f"choose n_heads among {_divisors(model.hidden)}, or set model.head_dim"),
        (model.n_heads % model.kv_heads == 0,
         f"model.n_heads={model.n_heads} is not divisible by model.n_kv_heads={model.kv_heads}: "
         f"choose n_kv_heads among {_divisors(model.n_heads)}"),
        (model.position != "rotary" or model.rotary_dim % 2 == 0,
         f"rotary positions need an even head dim, got {model.rotary_dim}: change "
         f"model.head_dim (or model.hidden or model.n_heads; MLA: model.qk_rope_head_dim)"),
    ]
    return [message for ok, message in checks if not ok]


def _tp_problem(model: ModelConfig | None, tp: int, world_size: int, cp_pp: int,
                world_misfit: bool, vocab: bool) -> list[str]:
    """At most one line for a tp that does not split the world or the model: what it must
    divide, and the tp values that would."""
    sizes = _tp_misfits(model, tp, vocab) if model is not None else {}
    misfits = [f"the world size {world_size}"] if world_misfit else []
    if sizes:
        misfits.append("the model's " + _listed([f"{name} ({n})" for name, n in sizes.items()]))
    if not misfits:
        return []
    room = world_size // cp_pp if world_size % cp_pp == 0 else world_size
    fits = [t for t in _divisors(room) if model is None or not _tp_misfits(model, t, vocab)]
    of = f"the world size {world_size}" if room == world_size else \
        f"{room} (the world size {world_size} / (cp x pp) {cp_pp})"
    fix = f"use parallel.tp among {fits} (the divisors of {of}" + (
        " that split the model)" if model is not None else ")")
    if not sizes:
        fix += f" or launch a multiple of {tp * cp_pp} processes"
    if list(sizes) == ["padded vocab"]:
        fix += f", or a model.vocab_pad_multiple that is a multiple of {tp}"
    return [f"parallel.tp={tp} must divide {_listed(misfits)}: {fix}"]


def _tp_misfits(model: ModelConfig, tp: int, vocab: bool = True) -> dict[str, int]:
    """The model's sizes a TP degree must split into equal whole parts, where it does not
    (vocab False: but the vocabulary)."""
    return {name: n for name, n, ok in (
        ("heads", model.n_heads, model.n_heads % tp == 0),
        # GQA with fewer KV heads than ranks: each rank keeps a whole copy of one.
        ("KV heads", model.kv_heads, model.kv_heads % tp == 0 or tp % model.kv_heads == 0),
        ("ffn_hidden", model.ffn, model.ffn % tp == 0),
        ("shared experts' width", model.shared_ffn, model.shared_ffn % tp == 0),
        ("padded vocab", model.padded_vocab, model.padded_vocab % tp == 0 or not vocab),
    ) if not ok}


def _set(model: ModelConfig, among: Callable[[str], bool]) -> list[str]:
    """"model.KEY=VALUE" of each setting `among` names that is not at its default: a part's
    settings given where that part is not used (they would silently do nothing)."""
    return [f"model.{f.name}={getattr(model, f.name)}" for f in dataclasses.fields(model)
            if among(f.name) and getattr(model, f.name) != f.default]


def _listed(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def data_parallel_size(parallel: ParallelConfig, world: int) -> int:
    """DP ranks of a world: what tp x cp x pp leaves (at least 1; check_layout says when it
    does not divide)."""
    return max(1, world // max(1, parallel.tp * parallel.cp * parallel.pp))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def pipeline_problems(n_layers: int | None, parallel: ParallelConfig,
                      micro_batches: int | None) -> list[str]:
    """Every way this pipeline layout cannot run, one line each (empty: it can); n_layers None:
    the model is not known yet."""
    pp, virtual, explicit = parallel.pp, parallel.virtual_stages, parallel.pp_layers
    schedule = parallel.pp_schedule
    if pp < 1 or virtual < 1:
        return [f"parallel.pp={pp} and parallel.virtual_stages={virtual} must be >= 1"]
    stages = pp * virtual
    problems = []
    if virtual > 1 and schedule != "interleaved":
        problems.append(f"parallel.virtual_stages={virtual} needs parallel.pp_schedule=interleaved "
                        f"(got {schedule}): set it, or virtual_stages=1")
    if virtual > 1 and pp == 1:
        problems.append(f"parallel.virtual_stages={virtual} interleaves pipeline stages: it needs "
                        f"parallel.pp > 1")
    if schedule == "interleaved" and pp > 1 and virtual < 2:
        problems.append("parallel.pp_schedule=interleaved needs parallel.virtual_stages >= 2 "
                        "model chunks per rank: set it, or use pp_schedule=1f1b")
    if n_layers is None:
        pass
    elif explicit is not None:
        if len(explicit) != stages or any(n < 1 for n in explicit) or sum(explicit) != n_layers:
            problems.append(f"parallel.pp_layers={list(explicit)} must give each of the "
                            f"pp x virtual_stages = {stages} stages >= 1 layer, "
                            f"{n_layers} (model.n_layers) in all")
    elif n_layers % stages:
        problems.append(f"model.n_layers={n_layers} does not split evenly into pp x "
                        f"virtual_stages = {stages} stages: give parallel.pp_layers (layers per "
                        f"stage, e.g. {_uneven_example(n_layers, stages)}; megalite generate: "
                        f"--pp-layers) or change pp")
    if micro_batches is not None and pp > 1 and schedule != "gpipe" and micro_batches % pp:
        # Megatron's rule for the interleaved schedule; for 1F1B, fewer micro-batches than
        # stages would leave the steady phase empty and the bubble over half the step.
        problems.append(f"pp_schedule={schedule} needs the micro-batches per step "
                        f"({micro_batches} = global batch / (micro batch x DP)) to be a multiple "
                        f"of parallel.pp={pp}: change train.global_batch_size or "
                        f"train.micro_batch_size")
    return problems


def _uneven_example(n_layers: int, stages: int) -> list[int] | str:
    if n_layers < stages:
        return f"impossible with {n_layers} layers; lower pp or virtual_stages"
    base, extra = divmod(n_layers, stages)
    return [base + (s < extra) for s in range(stages)]
