"""``--config FILE [key=value ...]`` into nested dataclasses, with errors that name the key.

A config file (YAML or JSON) mirrors a tree of ``@dataclass`` configs; ``section.key=value``
overrides any leaf from the command line (values parsed as YAML scalars: ``lr=1e-5``,
``rehearsal.enabled=false``). An unknown key, a wrong type or a missing required value raises
:class:`~megatron_rlhf.utils.InputError` naming the file and the dotted key, with the closest
valid key. ``to_dict`` gives the resolved config that is saved beside every checkpoint.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from pathlib import Path

import yaml

from megatron_rlhf.utils import InputError


def load_config(cls, path: str | Path | None, overrides: list[str] = ()):
    """Build ``cls`` from the file at ``path`` (may be None) and ``key=value`` overrides."""
    raw: dict = {}
    source = "command line"
    if path is not None:
        source = str(path)
        if not Path(path).exists():
            raise InputError(f"{path}: config file does not exist")
        text = Path(path).read_text()
        try:
            raw = (json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)) or {}
        except (json.JSONDecodeError, yaml.YAMLError) as err:
            raise InputError(f"{path}: cannot parse config ({err})") from None
        if not isinstance(raw, dict):
            raise InputError(f"{path}: the config must be a mapping of keys to values")
    for item in overrides:
        if "=" not in item:
            raise InputError(f"override {item!r}: expected key=value (e.g. optim.lr=1e-5)")
        key, value = item.split("=", 1)
        _set_dotted(raw, key.strip(), yaml.safe_load(value))
    return _build(cls, raw, prefix="", source=source)


def to_dict(config) -> dict:
    return dataclasses.asdict(config)


def _set_dotted(tree: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
        if not isinstance(tree, dict):
            raise InputError(f"override {dotted}: {part} is not a section")
    tree[leaf] = value


def _build(cls, raw: dict, prefix: str, source: str):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, list(fields), n=1)
        hint = f"; did you mean {prefix}{close[0]}?" if close else ""
        raise InputError(
            f"{source}: unknown config key {prefix}{key}{hint} "
            f"(valid keys in {prefix or 'the top level'}: {', '.join(sorted(fields))})"
        )
    values = {}
    for name, field in fields.items():
        key = prefix + name
        hint = hints[name]
        if name in raw:
            values[name] = _convert(hint, raw[name], key, source)
        elif dataclasses.is_dataclass(hint):
            values[name] = _build(hint, {}, key + ".", source)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise InputError(f"{source}: missing required config key {key}")
    return cls(**values)


def _convert(hint, value, key: str, source: str):
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise InputError(f"{source}: {key} must be a section (mapping)")
        return _build(hint, value, key + ".", source)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        for option in options:
            try:
                return _convert(option, value, key, source)
            except InputError:
                continue
        raise InputError(f"{source}: {key}={value!r} does not fit {hint}")
    if origin is typing.Literal:
        if value not in typing.get_args(hint):
            raise InputError(
                f"{source}: {key}={value!r}; choose one of {list(typing.get_args(hint))}"
            )
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise InputError(f"{source}: {key} must be a list")
        (item_type, *_) = typing.get_args(hint) or (object,)
        converted = [_convert(item_type, v, key, source) for v in value]
        return tuple(converted) if origin is tuple else converted
    if hint in (int, float, str, bool):
        return _scalar(hint, value, key, source)
    return value


def _scalar(hint, value, key: str, source: str):
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    elif not isinstance(value, bool):
        try:  # YAML reads "1e-5" as a string; accept numbers written either way
            number = hint(value) if hint is float else int(str(value))
            return number
        except (TypeError, ValueError):
            pass
    raise InputError(f"{source}: {key}={value!r} must be of type {hint.__name__}")
