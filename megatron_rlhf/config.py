"""``--config FILE [key=value ...]`` into nested dataclasses, with errors that name the key.

A config file (YAML or JSON) mirrors a tree of ``@dataclass`` configs; ``section.key=value``
overrides any leaf from the command line (values parsed as YAML scalars: ``lr=1e-5``,
``rehearsal.enabled=false``). An unknown key, a wrong type or a missing required value raises
:class:`~megatron_rlhf.utils.InputError` naming the file and the dotted key, with the closest
valid key. A key listed in its section's ``MOVED_KEYS`` class attribute (old key -> the dotted
key that replaced it) still loads, at its new key, with one warning per key on stderr (rank 0);
the old and the new key given with different values are refused (:func:`move_keys`, also
applied to a run's saved config when it resumes). ``to_dict`` gives the resolved config that is
saved beside every checkpoint.
A field whose key is a Python keyword is named with a trailing underscore and carries its key in
its metadata: ``async_: AsyncConfig = field(..., metadata={"key": "async"})`` is the section
``async`` of files, overrides (``async.max_staleness=1``), ``to_dict`` and ``--print-config``.

``config_parser`` gives a command ``--config``, the overrides and ``--print-config``,
which lists every key with its default and the first line of the docstring under its field
(``describe_config``; any ``@dataclass`` config tree gets it).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import json
import os
import sys
import textwrap
import types
import typing
from pathlib import Path

import yaml

from megatron_rlhf.utils import InputError


def load_config(cls, path: str | Path | None, overrides: list[str] = ()):
    """Build ``cls`` from the file at ``path`` (may be None) and ``key=value`` overrides."""
    moved = moved_keys(cls)
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
        move_keys(raw, moved, source)
    given, written = {}, []  # the overrides, moved among themselves, then set over the file's
    for item in overrides:
        if "=" not in item:
            raise InputError(f"override {item!r}: expected key=value (e.g. optim.lr=1e-5)")
        key, value = item.split("=", 1)
        _set_dotted(given, key.strip(), yaml.safe_load(value))
        written.append(key.strip())
    written += [new for old, new in moved.items() if _get_dotted(given, old)[0]]
    move_keys(given, moved, "command line")
    for key in dict.fromkeys(written):
        found, value = _get_dotted(given, key)
        if found:
            _set_dotted(raw, key, value)
    return _build(cls, raw, prefix="", source=source)


def moved_keys(cls, prefix: str = "") -> dict[str, str]:
    """{old dotted key: new dotted key} of every section's ``MOVED_KEYS`` in the tree ``cls``."""
    moved = {prefix + old: new for old, new in getattr(cls, "MOVED_KEYS", {}).items()}
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[field.name]):
            moved |= moved_keys(hints[field.name], prefix + key_of(field) + ".")
    return moved


def move_keys(raw: dict, moved: dict[str, str], source: str, warn: bool = True) -> dict:
    """Move each old key of ``moved`` ({old: new} dotted keys) found in the nested ``raw`` to
    its new key, in place, with one warning per old key (``warn``: on stderr, rank 0, once per
    process); both keys given with different values are an InputError naming both."""
    for old, new in moved.items():
        found, value = _pop_dotted(raw, old)
        if not found:
            continue
        present, current = _get_dotted(raw, new)
        if present and current != value:
            raise InputError(
                f"{source}: config keys {old}={json.dumps(value)} and {new}={json.dumps(current)} "
                f"are one setting ({old} has moved to {new}); keep only {new}"
            )
        _set_dotted(raw, new, value)
        if warn and old not in _WARNED and os.environ.get("RANK", "0") == "0":
            _WARNED.add(old)
            print(
                f"warning: {source}: config key {old} has moved to {new}; write "
                f"{new}={json.dumps(value)} instead",
                file=sys.stderr,
            )
    return raw


_WARNED: set[str] = set()
"""Old keys warned about in this process (one warning each)."""


def to_dict(config) -> dict:
    """The config tree as plain dicts, lists and values, under its config keys (:func:`key_of`)."""
    if dataclasses.is_dataclass(config):
        return {key_of(f): to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, (list, tuple)):
        return type(config)(to_dict(value) for value in config)
    if isinstance(config, dict):
        return {key: to_dict(value) for key, value in config.items()}
    return config


def key_of(field: dataclasses.Field) -> str:
    """A field's config key: its ``metadata["key"]`` (for a Python keyword), else its name."""
    return field.metadata.get("key", field.name)


def config_parser(prog: str, description: str, examples: str) -> argparse.ArgumentParser:
    """The parser of a command configured by a dataclass tree: ``--config FILE``, ``key=value``
    overrides and ``--print-config`` (``examples``: where example configs live)."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", help=f"YAML/JSON config (see {examples})")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. optim.lr=1e-5")
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print every config key with its default and what it means, then exit",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="with train.resume=false: delete the checkpoints and logs already in "
        "train.output_dir and start over",
    )
    parser.add_argument(
        "--force-config-change",
        action="store_true",
        help="resume even though config keys other than steps, intervals and logging changed "
        "(the changes are logged to config_changes.jsonl)",
    )
    parser.add_argument(
        "--skip-memory-check",
        action="store_true",
        help="start even when the planner predicts more memory per rank than this machine has",
    )
    return parser


def describe_config(cls) -> str:
    """One line per leaf key of the dataclass tree ``cls``: ``key = default  # type: doc``
    (``REQUIRED`` where there is no default). Defaults of a section built by a factory (e.g.
    ``actor_optim``) are that factory's."""
    lines = []
    for key, hint, default, doc in _leaves(cls, None, ""):
        shown = "REQUIRED" if default is dataclasses.MISSING else json.dumps(default)
        lines.append(f"{key} = {shown}  # {_type_name(hint)}: {doc}".rstrip(": "))
    return "\n".join(lines)


def config_defaults(cls) -> dict:
    """{dotted key: default} of every leaf of the dataclass tree ``cls`` that has a default
    (those :func:`describe_config` lists), as ``to_dict`` would write them."""
    return {
        key: json.loads(json.dumps(default))
        for key, _, default, _ in _leaves(cls, None, "")
        if default is not dataclasses.MISSING
    }


def _leaves(cls, instance, prefix: str):
    """(dotted key, type hint, default or MISSING, doc) of each leaf of the tree ``cls``."""
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    for field in dataclasses.fields(cls):
        hint, key = hints[field.name], prefix + key_of(field)
        if instance is not None:
            default = getattr(instance, field.name)
        elif field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            default = dataclasses.MISSING
        if dataclasses.is_dataclass(hint):
            section = None if default is dataclasses.MISSING else default
            yield from _leaves(hint, section, key + ".")
        else:
            yield key, hint, default, docs.get(field.name, "")


def field_docs(cls) -> dict[str, str]:
    """{field: its docstring on one line} from the string literal under each field of ``cls``
    (and its dataclass bases)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body
        for node, after in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _type_name(hint) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return " | ".join(map(str, typing.get_args(hint)))
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(hint))
    return "None" if hint is type(None) else getattr(hint, "__name__", str(hint))


def _get_dotted(tree: dict, dotted: str) -> tuple[bool, object]:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return False, None
        tree = tree[part]
    return True, tree


def _pop_dotted(tree: dict, dotted: str) -> tuple[bool, object]:
    *parents, leaf = dotted.split(".")
    found, parent = _get_dotted(tree, ".".join(parents)) if parents else (True, tree)
    if not found or not isinstance(parent, dict) or leaf not in parent:
        return False, None
    return True, parent.pop(leaf)


def _set_dotted(tree: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
        if not isinstance(tree, dict):
            raise InputError(f"override {dotted}: {part} is not a section")
    tree[leaf] = value


def _build(cls, raw: dict, prefix: str, source: str):
    fields = {key_of(f): f for f in dataclasses.fields(cls)}
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
        hint = hints[field.name]
        if name in raw:
            values[field.name] = _convert(hint, raw[name], key, source)
        elif dataclasses.is_dataclass(hint):
            values[field.name] = _build(hint, {}, key + ".", source)
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
