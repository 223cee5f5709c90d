"""Strict conversion of plain dicts (from YAML or JSON) into typed config dataclasses.

Every error names where it happened: the file, the dotted key, and what was allowed.
Unknown keys fail with the nearest valid key, so `lerning_rate` says "did you mean
'learning_rate'?". Numeric ranges come from field metadata (`bounded(...)`).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin


class ConfigError(ValueError):
    """A recipe config that cannot be used; the message says where and why."""


def bounded(default: Any = dataclasses.MISSING, *, ge: float | None = None, gt: float | None = None,
            le: float | None = None, lt: float | None = None, **field_kwargs: Any) -> Any:
    """A dataclass field with an allowed numeric range, checked on load."""
    metadata = {"ge": ge, "gt": gt, "le": le, "lt": lt}
    return dataclasses.field(default=default, metadata=metadata, **field_kwargs)


def _where(source: str, key: str) -> str:
    location = f"'{key}'" if key else "the top level"
    return f"{location} in {source}"


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp))
    if origin is list:
        return f"a list of {_describe(get_args(tp)[0])}"
    if origin is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return f"a mapping ({tp.__name__})"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _convert(tp: Any, value: Any, key: str, source: str, invariants: bool = True) -> Any:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        options = [o for o in get_args(tp) if o is not type(None)]
        if value is None and len(options) < len(get_args(tp)):
            return None
        if len(options) == 1:  # Optional[X]: X's own error says what is wrong inside the value
            return _convert(options[0], value, key, source, invariants)
        for option in options:
            try:
                return _convert(option, value, key, source, invariants)
            except ConfigError:
                continue
        raise ConfigError(f"{_where(source, key)} must be {_describe(tp)}, got {value!r}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{_where(source, key)} must be null, got {value!r}")
    if origin is Literal:
        if value in get_args(tp):
            return value
        raise ConfigError(f"{_where(source, key)} must be {_describe(tp)}, got {value!r}")
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{_where(source, key)} must be {_describe(tp)}, got {value!r}")
        (item_tp,) = get_args(tp)
        return [_convert(item_tp, v, f"{key}.{i}", source, invariants) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{_where(source, key)} must be a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, source=source, prefix=key, invariants=invariants)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is dict:
        if isinstance(value, dict):
            return dict(value)
    elif tp is Any:
        return value
    raise ConfigError(f"{_where(source, key)} must be {_describe(tp)}, got {value!r}")


def _check_range(field: dataclasses.Field, value: Any, key: str, source: str) -> None:
    if value is None or not field.metadata:
        return
    checks = [("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
              ("le", lambda v, b: v <= b, "<="), ("lt", lambda v, b: v < b, "<")]
    for name, ok, symbol in checks:
        bound = field.metadata.get(name)
        if bound is not None and not ok(value, bound):
            raise ConfigError(f"{_where(source, key)} must be {symbol} {bound}, got {value!r}")


def _nearest_hint(cls: type, key: str, fields) -> str:
    """What an unknown key of section `cls` should be: its replacement when the section names it
    in `RENAMED` (a key that was renamed or replaced: {old key: what to write instead}), else
    the nearest valid key."""
    renamed = getattr(cls, "RENAMED", {})
    if key in renamed:
        return f"; it was replaced: use {renamed[key]}"
    nearest = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.5)
    return f"; did you mean '{nearest[0]}'?" if nearest else ""


def from_dict(cls: type, data: Any, *, source: str = "<config>", prefix: str = "", invariants: bool = True) -> Any:
    """Build dataclass `cls` from `data`, rejecting unknown keys, wrong types and out-of-range values.

    With `invariants`, each dataclass's `validate()` (cross-field rules) runs too.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{_where(source, prefix)} must be a mapping ({cls.__name__}), got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = config_fields(cls)
    for key in data:
        if key not in fields:
            dotted = f"{prefix}.{key}" if prefix else str(key)
            hint = _nearest_hint(cls, str(key), fields)
            raise ConfigError(
                f"unknown key '{dotted}' in {source}{hint} (valid keys here: {', '.join(sorted(fields))})"
            )
    kwargs = {}
    for name, field in fields.items():
        dotted = f"{prefix}.{name}" if prefix else name
        if name not in data:
            if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                raise ConfigError(f"missing required key '{dotted}' in {source} ({_describe(hints[name])})")
            continue
        value = _convert(hints[name], data[name], dotted, source, invariants)
        _check_range(field, value, dotted, source)
        kwargs[name] = value
    instance = cls(**kwargs)
    validate = getattr(instance, "validate", None)
    if invariants and callable(validate):
        try:
            validate()
        except ConfigError as exc:
            raise ConfigError(f"{exc} (in {source})") from None
    return instance


def config_fields(cls: type) -> dict[str, dataclasses.Field]:
    """A config dataclass's keys: its fields but those filled in at run time (metadata
    `run_time`, e.g. a sampling section's stop token ids), which no config file sets."""
    return {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("run_time")}


def to_dict(instance: Any) -> Any:
    """The plain-dict form of a config dataclass (what YAML would hold; run-time fields left out)."""
    if dataclasses.is_dataclass(instance) and not isinstance(instance, type):
        return {name: to_dict(getattr(instance, name)) for name in config_fields(type(instance))}
    if isinstance(instance, (list, tuple)):
        return [to_dict(v) for v in instance]
    if isinstance(instance, dict):
        return {k: to_dict(v) for k, v in instance.items()}
    return copy.deepcopy(instance)


def apply_overrides(data: dict, overrides: dict, *, source: str = "overrides") -> dict:
    """Return a deep copy of `data` with overrides applied.

    `overrides` maps dotted keys to values (`{"train.max_steps": 5}`) or holds nested
    mappings (`{"train": {"max_steps": 5}}`); both forms may be mixed. List items are
    addressed by index (`data.sources.0.path`).
    """
    result = copy.deepcopy(data)
    for dotted, value in _flatten(overrides):
        parts = dotted.split(".")
        node = result
        for i, part in enumerate(parts[:-1]):
            node = _descend(node, part, ".".join(parts[: i + 1]), source)
        last = parts[-1]
        if isinstance(node, list):
            node[_index(node, last, dotted, source)] = value
        elif isinstance(node, dict):
            node[last] = value
        else:
            raise ConfigError(f"cannot set '{dotted}' from {source}: '{'.'.join(parts[:-1])}' is not a mapping")
    return result


def check_overrides(cls: type, overrides: dict, *, source: str = "overrides") -> None:
    """Check each override's key path, value type and range against the schema of `cls`.

    Works without the config the overrides will apply to: list indices are accepted as they
    are, and a mapping value is checked as a partial section (its keys must exist; required
    keys need not be there). Cross-field rules run when the merged config is built.
    """
    for dotted, value in _flatten(overrides):
        parts = dotted.split(".")
        tp: Any = cls
        field: dataclasses.Field | None = None
        for i, part in enumerate(parts):
            here = ".".join(parts[: i + 1])
            tp = _strip_optional(tp)
            field = None
            if get_origin(tp) is list:
                if not part.isdigit():
                    raise ConfigError(f"'{here}' in {source}: '{part}' is not a list index")
                (tp,) = get_args(tp)
            elif dataclasses.is_dataclass(tp):
                fields = config_fields(tp)
                if part not in fields:
                    hint = _nearest_hint(tp, part, fields)
                    raise ConfigError(f"unknown key '{here}' in {source}{hint} "
                                      f"(valid keys here: {', '.join(sorted(fields))})")
                field = fields[part]
                tp = typing.get_type_hints(tp)[part]
            elif tp is dict or get_origin(tp) is dict:
                tp = Any
            else:
                raise ConfigError(f"'{here}' in {source}: a value of type {_describe(tp)} has no keys")
        section = _strip_optional(tp)
        if isinstance(value, dict) and dataclasses.is_dataclass(section):
            check_overrides(section, value, source=f"{source} ('{dotted}')")
            continue
        converted = _convert(tp, value, dotted, source, invariants=False)
        if field is not None:
            _check_range(field, converted, dotted, source)


def _strip_optional(tp: Any) -> Any:
    """`X` for `Optional[X]`; anything else unchanged."""
    if get_origin(tp) in (Union, types.UnionType):
        options = [o for o in get_args(tp) if o is not type(None)]
        if len(options) == 1:
            return options[0]
    return tp


def _flatten(overrides: dict, prefix: str = ""):
    for key, value in overrides.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            yield from _flatten(value, dotted)
        else:
            yield dotted, value


def _descend(node: Any, part: str, dotted: str, source: str) -> Any:
    if isinstance(node, list):
        return node[_index(node, part, dotted, source)]
    if isinstance(node, dict):
        if node.get(part) is None:
            node[part] = {}
        return node[part]
    raise ConfigError(f"cannot descend into '{dotted}' from {source}: not a mapping")


def _index(node: list, part: str, dotted: str, source: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"'{dotted}' in {source}: '{part}' is not an index of a list of {len(node)}")
    return int(part)
