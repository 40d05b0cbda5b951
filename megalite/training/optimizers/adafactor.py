"""Adafactor: torch.optim.Adafactor's arithmetic, untouched, on whole logical matrices.

Its second moment is factored (per matrix a row vector, the mean over columns, and a column
vector, the mean over rows) and its step is scaled by the weight's RMS and clipped by the
update's: nothing in it is element-wise, so a TP slice or a ZeRO-1 block of rows cannot step
alone. Each step gathers the whole logical matrices of a stepped tensor's weight and gradient
(MatrixLayout, as Muon's update), lets torch's Adafactor step each, and keeps this rank's part.
Every rank holding a matrix keeps its factors (rows + columns: small), stacked along a leading
dim with one entry per logical matrix (chained.MATRICES).
"""
import torch

from megalite.training.optimizers.chained import MATRICES
from megalite.training.optimizers.matrices import MatrixLayout

FACTORS = ("row_var", "col_var")


class Adafactor(torch.optim.Optimizer):
    states = dict.fromkeys(FACTORS, MATRICES)

    def __init__(self, params, layouts: dict[int, MatrixLayout], settings):
        """settings: train.adafactor (run_config.AdafactorConfig), a parameter group's defaults."""
        super().__init__(params, {"lr": settings.lr, "beta2_decay": settings.beta2_decay,
                                  "eps": (settings.eps1, settings.eps2), "d": settings.d,
                                  "weight_decay": settings.weight_decay})
        self.layouts = layouts

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            settings = {k: group[k] for k in ("lr", "beta2_decay", "eps", "d", "weight_decay")}
            for p in group["params"]:
                if p.grad is None:
                    continue
                layout, state = self.layouts[id(p)], self.state[p]
                weights = [w.clone() for w in layout.matrices(layout.whole(p))]
                for w, g in zip(weights, layout.matrices(layout.whole(p.grad))):
                    w.grad = g
                # One torch optimizer per step: it holds nothing but views of this one's state.
                inner = torch.optim.Adafactor(weights, **settings)
                if state:  # each matrix's factors, views of the stacks: updated in place
                    for j, w in enumerate(weights):
                        inner.state[w] = {"step": state["step"].clone(),
                                          **{f: state[f][j] for f in FACTORS}}
                inner.step()
                if not state:
                    state.update({f: torch.stack([inner.state[w][f] for w in weights]) for f in FACTORS})
                state["step"] = inner.state[weights[0]]["step"]
                p.copy_(layout.mine(layout.join(weights)))
