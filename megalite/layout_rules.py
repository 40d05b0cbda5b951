"""The rules a model config and a parallel layout must satisfy together, checked on every rank
before any collective runs: one ConfigError naming each value and its fix."""
from megalite.config import ModelConfig, ParallelConfig
from megalite.typed_config import at_least_one, failing


def layout_problems(model: ModelConfig, parallel: ParallelConfig, world_size: int,
                    micro_batches: int | None = None, vocab: bool = True) -> list[str]:
    """Every way `model` cannot run on `parallel`'s layout of `world_size` processes (with
    `micro_batches` per step, if known; vocab False: model.vocab_size is not the run's yet, so
    tp's split of it is left unchecked), one line each, the model's own rules (its sections')
    included. The plan (plan.py) gathers them with the other rules,
    before any collective, on every rank."""
    tp, pp, cp = parallel.tp, parallel.pp, parallel.cp
    problems = at_least_one("parallel.", tp=tp, cp=cp)
    world_misfit = tp >= 1 and pp >= 1 and cp >= 1 and world_size % (tp * cp * pp)
    if world_misfit and (cp > 1 or pp > 1):
        named = {k: v for k, v in {"tp": tp, "cp": cp, "pp": pp}.items() if k == "tp" or v > 1}
        what = " x ".join(f"parallel.{k}" for k in named) + " = " + " x ".join(map(str, named.values()))
        tps = (f"use parallel.tp among {_divisors(world_size // (pp * cp))} or "
               if world_size % (pp * cp) == 0 else "")  # else no tp fits
        problems.append(f"world size {world_size} is not divisible by {what}: {tps}launch a "
                        f"multiple of {tp * cp * pp} processes")
    problems += pipeline_problems(model.n_layers, parallel, micro_batches)
    if cp > 1 and model.mla and parallel.cp_comm == "p2p":
        problems.append(f"parallel.cp={cp} with model.attention.kind=mla gathers each layer's latent "
                        f"(kv_lora_rank + qk_rope_head_dim per token, less than a ring's K/V): "
                        f"set parallel.cp_comm=all_gather")
    if cp > 1 and model.dropout > 0:
        # A CP rank holds a zig-zag subset of the tokens: the single process's dropout masks
        # would have to be drawn whole and indexed for every layer to stay the same model.
        problems.append(f"parallel.cp={cp} with model.dropout={model.dropout}: context parallelism "
                        f"trains without dropout (as pretraining does); set model.dropout=0")
    bad_values = model.problems()
    splittable = None if bad_values else model  # a model whose sizes are valid: what tp must divide
    problems += bad_values or _model_split_problems(model)
    if tp >= 1 and pp >= 1 and cp >= 1:
        problems += _tp_problem(splittable, tp, world_size, cp * pp, world_misfit and cp == pp == 1, vocab)
    if splittable is not None and tp >= 1 and parallel.sequence_parallel and model.max_seq_len % tp:
        # Inputs are padded to a multiple of tp to split them (model/gpt.py); the padded
        # length must still have positions.
        m = model.max_seq_len
        problems.append(f"parallel.sequence_parallel=true splits every sequence into "
                        f"parallel.tp={tp} shards, so model.max_seq_len={m} must be a "
                        f"multiple of {tp}: use max_seq_len={m + tp - m % tp}, or "
                        f"parallel.sequence_parallel=false")
    return problems + _expert_parallel_problems(splittable, parallel, world_size, world_misfit)


def _expert_parallel_problems(model: ModelConfig | None, parallel: ParallelConfig, world_size: int,
                              world_misfit: bool) -> list[str]:
    ep = parallel.ep
    if ep <= 1:  # no expert parallelism: only its bound
        return at_least_one("parallel.", ep=ep)
    experts = None if model is None else model.n_experts  # None: not known
    grad_ranks = parallel.cp * data_parallel_size(parallel, world_size)
    return failing(
        (experts != 0, f"parallel.ep={ep} splits a mixture of experts, but model.mlp.kind=dense: "
                       f"set model.mlp.kind=moe, or parallel.ep=1"),
        (not experts or experts % ep == 0,
         f"parallel.ep={ep} must divide model.mlp.experts={experts} (each EP rank holds experts / ep "
         f"experts): use ep among {_divisors(experts or 0)}"),
        (world_misfit or grad_ranks % ep == 0,
         f"parallel.ep={ep} must divide the CP x DP ranks ({grad_ranks} = world {world_size} / (tp x pp)): "
         f"use ep among {_divisors(grad_ranks)}"),
    )


def _model_split_problems(model: ModelConfig) -> list[str]:
    return failing(
        (model.mla or model.attention.head_dim is not None or model.hidden % model.n_heads == 0,
         f"model.hidden={model.hidden} is not divisible by model.n_heads={model.n_heads}: "
         f"choose n_heads among {_divisors(model.hidden)}, or set model.attention.head_dim"),
        (model.n_heads % model.kv_heads == 0,
         f"model.n_heads={model.n_heads} is not divisible by model.attention.n_kv_heads="
         f"{model.kv_heads}: choose n_kv_heads among {_divisors(model.n_heads)}"),
        (model.rotary is None or model.rotary_dim % 2 == 0,
         f"rotary positions need an even head dim, got {model.rotary_dim}: change "
         f"model.attention.head_dim (or model.hidden or model.n_heads; MLA: "
         f"model.attention.qk_rope_head_dim)"),
    )


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


def _listed(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def data_parallel_size(parallel: ParallelConfig, world: int) -> int:
    """DP ranks of a world: what tp x cp x pp leaves (at least 1; check_layout says when it
    does not divide)."""
    return max(1, world // max(1, parallel.tp * parallel.cp * parallel.pp))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def pipeline_problems(n_layers: int, parallel: ParallelConfig, micro_batches: int | None) -> list[str]:
    """Every way this pipeline layout cannot run, one line each (empty: it can)."""
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
    if explicit is not None:
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
