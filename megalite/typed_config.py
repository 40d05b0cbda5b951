"""Strict conversion of YAML-shaped dicts into typed dataclasses.

Every key is checked against the dataclass: an unknown key is an error that names the nearest
valid key, and every value is checked against its annotated type, so a typo in a config file
fails at load time instead of silently falling back to a default.

A section may be one of several variants (`attention: GroupedQuery | Latent`): dataclasses each
with a `kind` literal, the mapping's `kind` choosing (absent: the first, the field's default). A
variant has only its own keys, so a key of a variant not chosen is refused naming the one that has it.
"""
import contextlib
import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, Union


class ConfigError(ValueError):
    """A config that cannot describe a valid run; the message names the value and the fix."""


# What coerce names each plain type and the types it takes for it (dict and list: free-form
# sections, a sweep's grid and points)
PLAIN = {bool: ("true or false", bool), int: ("an integer", int), float: ("a number", (int, float)),
         str: ("a string", str), dict: ("a mapping", dict), list: ("a list", list)}


def failing(*checks: tuple[bool, str]) -> list[str]:
    """The messages of the (ok, message) checks that fail: a rule set's problems, one a line."""
    return [message for ok, message in checks if not ok]


def at_least_one(where: str, **values) -> list[str]:
    """The message of each value (but None: unset) that is not >= 1, its key after `where`."""
    return [f"{where}{key}={value} must be >= 1" for key, value in values.items()
            if value is not None and not value >= 1]


def positive(where: str, **values) -> list[str]:
    """As at_least_one, for values that must be > 0 (NaN is not)."""
    return [f"{where}{key}={value} must be > 0" for key, value in values.items()
            if value is not None and not value > 0]


def from_dict(cls: type, data: Any, where: str = ""):
    if not isinstance(data, dict):
        raise ConfigError(f"{where.rstrip('.') or cls.__name__}: expected a mapping, got {data!r}")
    fields, hints = sorted(field_names(cls)), typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean '{where}{close[0]}'?" if close else ""
            raise ConfigError(f"unknown config key '{where}{key}'{hint} "
                              f"(valid keys: {', '.join(fields)})")
    return cls(**{key: coerce(hints[key], value, f"{where}{key}") for key, value in data.items()})


def variants(annotation: Any) -> dict[str, type]:
    """A variant section's dataclasses by kind ({} for any other annotation)."""
    options = typing.get_args(annotation) if typing.get_origin(annotation) in (Union, types.UnionType) else ()
    if not options or not all(dataclasses.is_dataclass(o) for o in options):
        return {}
    return {typing.get_args(typing.get_type_hints(o)["kind"])[0]: o for o in options}


def coerce(annotation: Any, value: Any, key: str) -> Any:
    """Return `value` as `annotation`, or raise ConfigError naming `key`."""
    origin = typing.get_origin(annotation)
    if choices := variants(annotation):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping with a kind ({', '.join(choices)}), got {value!r}")
        # Absent: the first variant, which is every variant section's default (config.py).
        kind = value.get("kind", next(iter(choices)))
        if kind not in choices:
            raise ConfigError(f"{key}.kind: {kind!r} is not one of {', '.join(map(repr, choices))}")
        for name in value:
            owners = [k for k, cls in choices.items() if name in field_names(cls)]
            if name not in field_names(choices[kind]) and owners:
                raise ConfigError(f"{key}.{name} is a key of {key}.kind={' or '.join(owners)}, and "
                                  f"{key}.kind={kind}: set {key}.kind={owners[0]}, or leave it out")
        return from_dict(choices[kind], {"kind": kind, **value}, f"{key}.")
    if dataclasses.is_dataclass(annotation):
        return from_dict(annotation, value, f"{key}.")
    if origin is Literal:
        options = typing.get_args(annotation)
        if value not in options:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(repr, options))}")
        return value
    if origin in (Union, types.UnionType):  # Optional[X]: the unions of sections are variants, above
        (option,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        return None if value is None else coerce(option, value, key)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return origin(coerce(typing.get_args(annotation)[0], v, f"{key}[{i}]") for i, v in enumerate(value))
    if annotation is float and isinstance(value, str):
        # YAML 1.1 (PyYAML) reads exponents without a dot, like 1e-5, as strings.
        with contextlib.suppress(ValueError):
            return float(value)
    if annotation in PLAIN:
        what, taken = PLAIN[annotation]
        # bool is an int to isinstance: true is not a number here
        if not isinstance(value, taken) or (annotation is not bool and isinstance(value, bool)):
            raise ConfigError(f"{key}: expected {what}, got {value!r}")
        return float(value) if annotation is float else value
    raise TypeError(f"{key}: unsupported config annotation {annotation!r}")


def merged(base: dict, over: dict, cls: type) -> dict:
    """`over`'s keys on `base`'s, section by section. A section whose kind `over` changes starts
    from the new variant's defaults, keeping the keys of base's that the new variant has (a
    preset's activation when `model.mlp.kind=moe` is given)."""
    out, hints = dict(base), typing.get_type_hints(cls)
    for key, value in over.items():
        old, out[key] = out.get(key), value
        if not (isinstance(value, dict) and isinstance(old, dict) and key in hints):
            continue
        choices = variants(hints[key])
        # A field's default is its class's attribute (none under a default_factory: Config's)
        was = old.get("kind", getattr(getattr(cls, key, None), "kind", None))
        kind = value.get("kind", was)
        target = choices.get(kind) if choices else hints[key]
        if dataclasses.is_dataclass(target):
            if choices and kind != was:
                old = {k: v for k, v in old.items() if k in field_names(target) and k != "kind"}
            out[key] = merged(old, value, target)
    return out


def field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def set_dotted(raw: dict, keys: list[str], value) -> None:
    """raw[keys[0]][keys[1]]... = value, the sections made on the way (a model preset's name
    becomes the section {preset: name})."""
    for depth, key in enumerate(keys[:-1]):
        child = raw.setdefault(key, {})
        if isinstance(child, str) and key == "model":
            child = raw[key] = {"preset": child}
        if not isinstance(child, dict):
            raise ConfigError(f"'{'.'.join(keys[:depth + 1])}' is a value, not a section")
        raw = child
    raw[keys[-1]] = value


def leaves(obj, prefix: str = ""):
    """(dotted key, value, its default) of every setting of a config, its sections' chosen
    variants walked (their kinds included)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from leaves(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value, f.default


def replaced(obj, key: str, value):
    """`obj` with the setting at dotted `key` replaced (its sections copied on the way)."""
    head, _, rest = key.partition(".")
    return dataclasses.replace(obj, **{head: replaced(getattr(obj, head), rest, value) if rest else value})
