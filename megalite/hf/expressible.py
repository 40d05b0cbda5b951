"""Whether a Hugging Face architecture can hold a megalite model config: one rule for every
architecture. Each says which settings it fixes (`NEEDS`: dotted keys, the sections' kinds among
them) and which it carries at any value (`FREE`: a key, or a section whose keys all are); every
other setting of the variants chosen must be at its default, or the export would silently drop
it. A variant an architecture does not take is one NEEDS entry (`mlp.kind: dense`), whatever
keys it has.
"""
from megalite.config import ModelConfig
from megalite.typed_config import leaves

# What every architecture carries: the sizes, and what only training reads.
SHARED = frozenset({"architecture", "vocab_size", "vocab_pad_multiple", "max_seq_len", "n_layers",
                    "hidden", "n_heads", "mlp.ffn_hidden", "norms.eps", "dropout", "init_std"})


def check_expressible(cfg: ModelConfig, arch) -> list[str]:
    """Each setting the architecture module `arch` cannot hold (its NEEDS, FREE and, if it has
    them, its own problems first); none where it holds the config."""
    name, needs = arch.NAME, arch.NEEDS
    values = {key: (value, default) for key, value, default in leaves(cfg)}
    wrong = [f"model.{key}={values.get(key, ('absent',))[0]!r} ({name} needs {value!r})"
             for key, value in needs.items() if values.get(key, (None,))[0] != value]
    if not wrong:  # the variants are the architecture's: their settings and its own rules
        wrong = list(getattr(arch, "problems", lambda _: [])(cfg))
        wrong += [f"model.{key}={value!r} ({name} has no such setting: {default!r})"
                  for key, (value, default) in values.items()
                  if key not in needs and key not in SHARED and value != default
                  and not any(key == free or key.startswith(free + ".") for free in arch.FREE)]
    return wrong
