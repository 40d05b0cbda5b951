"""What became of a file's records: written, or skipped as empty, not JSON or without the text
(or conversation), each bad one counted under its kind and its reason and the first KEEP_BAD
listed by place (data/sources.parse counts them, prepare-data and the trainer say them)."""
import re
from collections import Counter
from dataclasses import dataclass, field, fields

from megalite.typed_config import ConfigError

KEEP_BAD = 20  # bad records listed by line per file (all are counted)


@dataclass
class Counts:
    records: int = 0
    documents: int = 0
    empty: int = 0
    not_json: int = 0
    no_text: int = 0
    invalid_utf8: int = 0
    bad: list = field(default_factory=list)  # "line N: why", at most KEEP_BAD
    # bad records per reason (count_bad's); a dict, not a Counter, which dataclasses.asdict mangles
    reasons: dict = field(default_factory=dict)

    def count_bad(self, where: str, listed: str, why: str, kind: str, strict: bool) -> None:
        """A bad record: with `strict` an error naming it (`where`), else counted under `kind`
        and its reason and, among the first KEEP_BAD, listed as `listed: why`."""
        if strict:
            raise ConfigError(f"{where}: {why}; fix or drop it, or leave out --strict "
                              f"(data.strict) to skip and count such records")
        setattr(self, kind, getattr(self, kind) + 1)
        # Counted under its why without the detail after ' (' or ': ' (a JSON error's position,
        # a record's keys, the template's own message), so reasons stay few.
        reason = re.split(r" \(|: ", why, maxsplit=1)[0]
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        if len(self.bad) < KEEP_BAD:
            self.bad.append(f"{listed}: {why}")

    def add(self, other: "Counts") -> None:
        for name in COUNT_KEYS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.bad = (self.bad + other.bad)[:KEEP_BAD]
        # Counter's + keeps the order first met (and drops counts under 1: a reason has 1 or more).
        self.reasons = dict(Counter(self.reasons) + Counter(other.reasons))


COUNT_KEYS = tuple(f.name for f in fields(Counts) if f.name not in ("bad", "reasons"))


def summed(counts: list[dict], keys: tuple = COUNT_KEYS) -> dict:
    """Several files' (or prepared directories') counts of `keys`, and their reasons, summed
    (in the order first met; a shard an earlier version wrote has no reasons)."""
    return {**{key: sum(c.get(key, 0) for c in counts) for key in keys},
            "reasons": dict(sum((Counter(c.get("reasons", {})) for c in counts), Counter()))}


def skipped_records(meta: dict, listed_in: str) -> str | None:
    """'N records skipped: K reason, ...' (most first) of prepared data's counts, or None."""
    # Data prepared before reasons were counted has only the kinds.
    reasons = Counter(meta.get("reasons")
                      or {"not JSON": meta["not_json"], "without text": meta["no_text"]})
    if not sum(reasons.values()):
        return None
    return (f"{sum(reasons.values())} records skipped: "
            + ", ".join(f"{n} {reason}" for reason, n in reasons.most_common() if n)
            + f" (the first {KEEP_BAD} of each file listed by line in {listed_in})")
