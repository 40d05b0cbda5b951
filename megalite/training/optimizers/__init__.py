"""Which optimizer steps the tensors a data-parallel engine hands it (train.optimizer).

    build.py        the parameter groups (which tensor each optimizer takes) and their settings
    chained.py      several torch optimizers over disjoint tensors as one, with their
                    per-parameter state read and set by name (checkpoints' side)
    muon.py         Muon: orthogonalised momentum, its update of a whole logical matrix
    adafactor.py    torch's Adafactor on whole logical matrices, its factors one per matrix
    matrices.py     where a stepped tensor (a TP slice, a ZeRO-1 block of rows, a fused weight,
                    stacked experts) sits in the logical matrices Muon orthogonalises

The engines (training/engine.py, distributed_optimizer.py) decide how gradients and state cross
data-parallel ranks; these files decide how the tensors they hand over are updated.
"""
