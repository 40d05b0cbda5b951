"""Several torch optimizers over disjoint tensors, stepped as one (Megatron's ChainedOptimizer):
what the engines hold as `optimizer`, and the one place that reads and sets per-parameter state
by name, for checkpoints."""
from typing import Iterable

import torch


# How a piece of per-parameter state is split where its parameter is (checkpoints read and
# write it by this, training/sharded_state.state_piece):
ROWS = "rows"  # shaped as the stepped tensor, element by element (AdamW's moments, Muon's momentum)
MATRICES = "matrices"  # one entry per logical matrix along dim 0 (optimizers/matrices.py), the
# same on every rank holding the matrices: stacked experts' along their rows, else all of them

ADAMW_STATE = {"exp_avg": ROWS, "exp_avg_sq": ROWS}


def states(optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """The per-parameter state an optimizer keeps, by name, with its split: torch's AdamW
    (DeepSpeed takes it by its exact type) its two moments; megalite's own optimizers say theirs."""
    return ADAMW_STATE if isinstance(optimizer, torch.optim.AdamW) else optimizer.states


def state_by_name(optimizer, t: torch.Tensor, names) -> dict[str, torch.Tensor]:
    """Stepped tensor t's state `names` in `optimizer` (none before its first step)."""
    state = optimizer.state.get(t, {})
    return {name: state[name] for name in names if name in state}


def load_state(optimizer, tensors: dict[int, dict], step: int, counted: bool) -> None:
    """Set the state of `optimizer`'s tensors from {id(tensor): {name: tensor}}, `step` steps in
    (counted: each tensor's state holds the step count, as AdamW's)."""
    # Through load_state_dict, so torch places "step" and the state as each optimizer (fused
    # or not) expects.
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    # A step tensor each: AdamW increments them in place.
    state = {index[k]: {**({"step": torch.tensor(float(step))} if counted else {}), **v}
             for k, v in tensors.items()}
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})


class ChainedOptimizer:
    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers
        self.owner = {id(p): o for o in optimizers for g in o.param_groups for p in g["params"]}

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict:
        """Every optimizer's state by stepped tensor, merged (a copy of the index)."""
        return {t: s for o in self.optimizers for t, s in o.state.items()}

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def states(self, t: torch.Tensor) -> dict[str, str]:
        """The per-parameter state the optimizer of stepped tensor t keeps, with its splits."""
        return states(self.owner[id(t)])

    def state_of(self, t: torch.Tensor) -> dict[str, torch.Tensor]:
        """Stepped tensor t's state by name (none before its first step)."""
        owner = self.owner[id(t)]
        return state_by_name(owner, t, states(owner))

    def load_state(self, pairs: Iterable[tuple[torch.Tensor, dict]], step: int) -> None:
        """Set each stepped tensor's state from {name: tensor} after `step` steps."""
        mine: dict[int, dict] = {id(o): {} for o in self.optimizers}
        for t, tensors in pairs:
            mine[id(self.owner[id(t)])][id(t)] = tensors
        for o in self.optimizers:
            # AdamW's and Adafactor's state hold the step count (bias correction, relative step).
            load_state(o, mine[id(o)], step, counted=getattr(o, "steps_counted", True))
