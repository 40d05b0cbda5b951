"""Strict conversion of YAML-shaped dicts into typed dataclasses.

Every key is checked against the dataclass: an unknown key is an error that names the nearest
valid key, and every value is checked against its annotated type, so a typo in a config file
fails at load time instead of silently falling back to a default.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, Union


class ConfigError(ValueError):
    """A config that cannot describe a valid run; the message names the value and the fix."""


def from_dict(cls: type, data: Any, where: str = ""):
    if not isinstance(data, dict):
        raise ConfigError(f"{where.rstrip('.') or cls.__name__}: expected a mapping, got {data!r}")
    fields = {f.name for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(key, sorted(fields), n=1)
            hint = f"; did you mean '{where}{close[0]}'?" if close else ""
            raise ConfigError(f"unknown config key '{where}{key}'{hint} "
                              f"(valid keys: {', '.join(sorted(fields))})")
    return cls(**{key: coerce(hints[key], value, f"{where}{key}") for key, value in data.items()})


def coerce(annotation: Any, value: Any, key: str) -> Any:
    """Return `value` as `annotation`, or raise ConfigError naming `key`."""
    origin = typing.get_origin(annotation)
    if dataclasses.is_dataclass(annotation):
        return from_dict(annotation, value, f"{key}.")
    if origin is Literal:
        if value not in typing.get_args(annotation):
            choices = ", ".join(repr(c) for c in typing.get_args(annotation))
            raise ConfigError(f"{key}: {value!r} is not one of {choices}")
        return value
    if origin in (Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None and len(options) < len(typing.get_args(annotation)):
            return None
        errors = []
        for option in options:
            try:
                return coerce(option, value, key)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError("; ".join(errors))
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (item,) = typing.get_args(annotation)[:1]
        return origin(coerce(item, v, f"{key}[{i}]") for i, v in enumerate(value))
    if annotation in (dict, list):  # free-form sections (a sweep's grid and points)
        if not isinstance(value, annotation):
            raise ConfigError(f"{key}: expected a {'mapping' if annotation is dict else 'list'}, "
                              f"got {value!r}")
        return value
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, str):
            # YAML 1.1 (PyYAML) reads exponents without a dot, like 1e-5, as strings.
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise TypeError(f"{key}: unsupported config annotation {annotation!r}")
