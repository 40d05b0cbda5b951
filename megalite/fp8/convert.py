"""Which matmuls run in FP8 (train.fp8): the blocks' column- and row-parallel linears and the
experts, chosen by name and size as torchtitan's float8 converter chooses nn.Linear modules
(filter_fqns, auto_filter_small_kn); the LM head, the router (fp32 logits) and the embeddings
keep their precision."""
from torch import nn

from megalite.model.moe import Experts
from megalite.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megalite.parallel.matmul import HIGH
from megalite.parallel.sharding import full_shape
from megalite.typed_config import ConfigError


def _shapes(module: nn.Module) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(whole [N, K], this rank's [N, K]) of each matrix the module multiplies by."""
    if isinstance(module, Experts):
        return [(tuple(w.shape[1:]),) * 2 for w in (module.gate, module.up, module.down)
                if w is not None]
    return [(tuple(full_shape(module.weight)), tuple(module.weight.shape))]


def _size_filter(fp8):
    """Whether a layer of a whole shape [N, K] takes FP8 by size: with train.fp8.layers=auto
    torchao's auto filter for the recipe (H100 thresholds below which FP8 loses to bf16), asked
    about an nn.Linear of that shape, rowwise's for rowwise_with_gw_hp; else every layer. A
    private torchao function (torchtitan calls it too): pyproject pins torchao below 0.19."""
    if fp8.layers != "auto":
        return lambda name, n, k: True
    from torchao.float8.float8_linear_utils import _auto_filter_for_recipe
    pick = _auto_filter_for_recipe("rowwise" if fp8.recipe == "rowwise_with_gw_hp" else fp8.recipe, [])
    return lambda name, n, k: pick(nn.Linear(k, n, bias=False, device="meta"), name)


def _refuse_inexact(name: str, module: nn.Module, pstate) -> None:
    if why := getattr(module, "partial_output_grad", None):
        raise ConfigError(
            f"train.fp8 on {name}: {why}, so its FP8 scales could not be one process's; add "
            f"'{name.split('.')[-1]}' to train.fp8.exclude, or use a layout that splits it over "
            f"every rank (for KV heads: model.attention.n_kv_heads >= parallel.tp)")
    if isinstance(module, Experts) and pstate.ep_size > 1 and pstate.ep_size % pstate.cp_size:
        raise ConfigError(
            f"train.fp8 on {name} with parallel.ep={pstate.ep_size} and parallel.cp="
            f"{pstate.cp_size}: an expert's rows would come from part of the CP ranks; use an ep "
            f"that is a multiple of cp, or add 'experts' to train.fp8.exclude")


def fp8_problems(cfg) -> list[str]:
    """The layouts whose FP8 scales could not be one process's (plan.py gathers them)."""
    fp8, parallel, data = cfg.train.fp8, cfg.parallel, cfg.data
    if fp8.recipe == "none":
        return []
    problems, ep, cp = [], parallel.ep, parallel.cp
    if ep > 1 and cp > 1 and ep % cp and cp % ep:
        problems.append(f"train.fp8.recipe={fp8.recipe} with parallel.ep={ep} and parallel.cp={cp}: "
                        f"a row's CP ranks would take their scales over different EP groups; "
                        f"use an ep that is a multiple of cp, or a divisor of it")
    sp = parallel.sequence_parallel and parallel.tp > 1
    if ((cp > 1 or sp) and data.mode == "padded") or (sp and cp == 1 and data.seq_len % parallel.tp):
        cut = f"parallel.cp={cp}" if cp > 1 else f"sequence parallelism over parallel.tp={parallel.tp}"
        problems.append(f"train.fp8.recipe={fp8.recipe} with data.mode={data.mode}, data.seq_len="
                        f"{data.seq_len} and {cut}: rows are padded to whole shards, and that "
                        f"padding's activations would enter the FP8 scales, which one process "
                        f"does not have; use data.mode=packed with data.seq_len a multiple of "
                        f"the shards, or train.fp8.recipe=none")
    if any(not part for part in fp8.exclude):
        problems.append(f"train.fp8.exclude={list(fp8.exclude)} has an empty entry, which would "
                        f"exclude every layer: list name parts such as out_proj, or none")
    return problems


def _units(model: nn.Module) -> list[list[tuple[str, nn.Module]]]:
    """The model's FP8-able matmuls: each layer alone, or the layers one fused matmul reads
    together (a module's `fused_linears`: Q and KV, gate and up), which take one precision."""
    layers = {name: m for name, m in model.named_modules()
              if isinstance(m, (ColumnParallelLinear, RowParallelLinear, Experts))}
    units, grouped = [], set()
    for name, module in model.named_modules():
        for group in getattr(module, "fused_linears", ()):
            names = [f"{name}.{part}" if name else part for part in group]
            units.append([(n, layers[n]) for n in names])
            grouped.update(names)
    units += [[(name, m)] for name, m in layers.items() if name not in grouped]
    return units


def _kept_because(unit, fp8, keep) -> str | None:
    """Why the unit stays in high precision (None: it takes FP8), as the run's line says it."""
    names = [name for name, _ in unit]
    if any(part in name for name in names for part in fp8.exclude):
        return "in train.fp8.exclude"
    shapes = [shape for _, m in unit for shape in _shapes(m)]
    # torch._scaled_mm multiplies dims that are multiples of 16 (what this rank holds).
    if not all(d % 16 == 0 for _, local in shapes for d in local):
        return "with dims not multiples of 16"
    # The whole [N, K] of each matmul the unit does: one for a fused unit, its layers' N stacked.
    wholes = [whole for whole, _ in shapes]
    if len(unit) > 1:
        wholes = [(sum(n for n, _ in wholes), wholes[0][1])]
    if not all(keep(names[0], n, k) for n, k in wholes):
        return ("too small to gain (train.fp8.layers=auto, torchao's size filter; "
                "train.fp8.layers=all converts them)")
    return None


def convert_to_fp8(model: nn.Module, fp8, pstate) -> list[str]:
    """Set the FP8 recipe (fp8: train.fp8) on each chosen layer; returns their names."""
    if fp8.recipe == "none":
        return []
    from megalite.fp8.recipe import Float8Matmul, float8_config
    recipe = Float8Matmul(float8_config(fp8.recipe, fp8.emulate))
    experts = Float8Matmul(float8_config(fp8.recipe, fp8.emulate, pad_inner_dim=True))
    keep, chosen = _size_filter(fp8), set()
    for unit in _units(model):
        if _kept_because(unit, fp8, keep):
            continue
        for name, module in unit:
            _refuse_inexact(name, module, pstate)
            module.matmul = experts if isinstance(module, Experts) else recipe
            chosen.add(name)
    return [name for name, _ in model.named_modules() if name in chosen]


def fp8_layers(model: nn.Module) -> int:
    """How many of the model's layers multiply in FP8."""
    return sum(getattr(m, "matmul", HIGH) is not HIGH for m in model.modules())


def describe_fp8(model: nn.Module, fp8, chosen: list[str], pstate) -> str:
    """The run's line: how many layers convert_to_fp8 chose (0 too: `layers: auto` can keep a
    small model whole) and, by reason, how many stay in high precision."""
    keep, kept = _size_filter(fp8), {}
    for unit in _units(model):
        if why := _kept_because(unit, fp8, keep):
            kept[why] = kept.get(why, 0) + len(unit)
    names = f" ({', '.join(chosen[:3])}{', ...' if len(chosen) > 3 else ''})" if chosen else ""
    stage = " of rank 0's pipeline stage" if pstate.pp_size > 1 else ""
    text = (f"fp8 {fp8.recipe}: {len(chosen)} of {len(chosen) + sum(kept.values())} block "
            f"layers{stage} in FP8{names}")
    if kept:
        text += "; in high precision: " + ", ".join(f"{n} {why}" for why, n in kept.items())
    return text
