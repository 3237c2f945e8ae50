"""YAML -> typed dataclasses: `defaults:` inheritance, dotted overrides, strict key and type checks.

Nothing here imports torch: validating a config must take well under a second, so a typo costs a
user seconds, not a cluster allocation.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any, Union

import yaml


class ConfigError(ValueError):
    """A config that cannot run. ``problems`` lists every issue found, each naming its key."""

    def __init__(self, problems: list[str], source: str = ""):
        self.problems = list(problems)
        where = f" in {source}" if source else ""
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid config{where} ({len(self.problems)} problem(s)):\n{lines}")


# ---------------------------------------------------------------------------------------------
# YAML files with `defaults:` inheritance


def load_yaml_tree(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict:
    """Read a YAML config, first merging the files named in its ``defaults:`` (a path or a list
    of paths, relative to this file), in order; this file's own keys win."""
    path = Path(path).resolve()
    if path.is_dir():
        raise ConfigError([f"config file {path} is a folder, not a YAML file: name a .yaml file in it"])
    if not path.is_file():
        raise ConfigError([f"config file {path} does not exist: check the path"])
    if path in _seen:
        chain = " -> ".join(p.name for p in (*_seen, path))
        raise ConfigError([f"defaults: cycle {chain}: remove one of the references"])
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{path} is not UTF-8 text (byte {exc.start} is {exc.object[exc.start]:#04x}): save it "
                           f"as UTF-8"]) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader) or {}
    except _DuplicateKey as exc:
        raise ConfigError([f"{path}:{exc.line}: key {exc.key!r} is given twice in one mapping (first on line "
                           f"{exc.first}); YAML would silently keep only the last one: delete or merge one of "
                           f"them"]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path.name} is not valid YAML: {exc}"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"{path.name} must hold a mapping of sections, got {type(data).__name__}"])
    parents = data.pop("defaults", None) or []
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) and p for p in parents):
        raise ConfigError([f"{path}: defaults: {parents!r} must be a list of YAML paths (relative to this file), "
                           f"e.g. 'defaults: [base.yaml]', or one path"])
    merged: dict = {}
    for parent in parents:
        merged = deep_merge(merged, load_yaml_tree(path.parent / parent, (*_seen, path)))
    return deep_merge(merged, data)


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, line: int, first: int):
        super().__init__(f"duplicate key {key!r} on line {line} (first on line {first})")
        self.key, self.line, self.first = key, line, first


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load, but a key given twice in one mapping (two ``trainer:`` blocks, ``tp: 1`` then
    ``tp: 3``) is an error instead of the last one silently winning. Keys a ``<<:`` merge brings in
    may still be overridden (that is what a merge is for)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    if key in first:
                        raise _DuplicateKey(key, key_node.start_mark.line + 1, first[key])
                    first[key] = key_node.start_mark.line + 1
                except TypeError:  # an unhashable key: the base class names it
                    continue
        return super().construct_mapping(node, deep=deep)


def deep_merge(base: dict, override: dict) -> dict:
    """Recursive dict merge; mappings merge key by key, anything else is replaced."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def apply_overrides(tree: dict, overrides: list[str]) -> dict:
    """Apply ``section.key=value`` overrides (value parsed as YAML: ``2``, ``true``, ``[a, b]``)."""
    tree = dict(tree)
    problems = []
    for item in overrides:
        if "=" not in item:
            problems.append(f"override {item!r} must look like section.key=value (e.g. trainer.tp=2)")
            continue
        dotted, raw = item.split("=", 1)
        keys = dotted.strip().split(".")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        node = tree
        for key in keys[:-1]:
            child = node.get(key)
            child = dict(child) if isinstance(child, dict) else {}
            node[key] = child
            node = child
        node[keys[-1]] = value
    if problems:
        raise ConfigError(problems)
    return tree


# ---------------------------------------------------------------------------------------------
# dict -> dataclass with type checks


def build(cls: type, data: Any, prefix: str = "") -> tuple[Any, list[str]]:
    """Instantiate dataclass ``cls`` from ``data``; returns (instance or None, problems)."""
    where = prefix or "<top level>"
    if data is None and prefix:  # `controller:` with every key commented out: would reset it to the defaults
        return None, [f"{prefix}: empty (null) where a section of keys is expected (every key commented out?); it "
                      f"would reset the whole section, what defaults: gave it included, to the built-in defaults: "
                      f"delete the '{prefix}:' line or give it keys"]
    if data is None:
        data = {}
    if not isinstance(data, dict):
        return None, [f"{where}: expected a mapping of keys, got {data!r}"]
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    problems: list[str] = []
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            guess = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"; did you mean '{prefix + '.' if prefix else ''}{guess[0]}'?" if guess else ""
            problems.append(f"{dotted}: unknown key{hint} (known: {', '.join(sorted(fields))})")
            continue
        value, errs = _coerce(hints[key], value, dotted)
        problems += errs
        choices = fields[key].metadata.get("choices")
        if not errs and choices and value not in choices:
            problems.append(f"{dotted}: {value!r} is not one of {list(choices)}")
        kwargs[key] = value
    if problems:
        return None, problems
    try:
        return cls(**kwargs), []
    except (TypeError, ValueError) as exc:  # a required field left out, or a section's own range check
        return None, [f"{where}: {exc}"]


def _coerce(tp: Any, value: Any, dotted: str) -> tuple[Any, list[str]]:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, dotted)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None, []
        for arg in (a for a in args if a is not type(None)):
            coerced, errs = _coerce(arg, value, dotted)
            if not errs:
                return coerced, []
        if float in args and _non_finite(value):  # Optional[float]: say why, not just the type
            return _coerce(float, value, dotted)
        return value, [f"{dotted}: {value!r} does not fit type {_name(tp)}"]
    if origin is typing.Literal:
        if value in args:
            return value, []
        return value, [f"{dotted}: {value!r} is not one of {list(args)}"]
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return value, [f"{dotted}: expected a list ({_name(tp)}), got {value!r}"]
        inner = args[0] if args else Any
        items, problems = [], []
        for i, item in enumerate(value):
            coerced, errs = _coerce(inner, item, f"{dotted}[{i}]")
            items.append(coerced)
            problems += errs
        return (tuple(items) if origin is tuple else items), problems
    if origin is dict:
        if not isinstance(value, dict):
            return value, [f"{dotted}: expected a mapping, got {value!r}"]
        return dict(value), []
    if tp is Any:
        return value, []
    if tp is float and (isinstance(value, (int, float, str)) and not isinstance(value, bool)):
        try:  # YAML 1.1 reads `1e-5` (no dot) as a string
            number = float(value)
        except OverflowError:  # an integer past a float's range
            number = math.inf
        except ValueError:
            number = None
        if number is not None:
            # Every float knob is a finite number: NaN passes every `x <= 0` range check, and no knob has an
            # infinite default or a documented meaning for inf (one that gets one must be let through here).
            if not math.isfinite(number):
                return value, [f"{dotted}: {value!r} is not a finite number; give a number (see `megarl config "
                               f"explain {dotted.split('.')[0]}` for its range)"]
            return number, []
    if tp is bool and not isinstance(value, bool):
        return value, [f"{dotted}: expected true or false, got {value!r}"]
    if tp is int and isinstance(value, bool):
        return value, [f"{dotted}: expected an integer, got {value!r}"]
    if tp is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value), []
    if isinstance(tp, type) and not isinstance(value, tp):
        return value, [f"{dotted}: expected {_name(tp)}, got {value!r} ({type(value).__name__})"]
    return value, []


def _non_finite(value: Any) -> bool:
    """A NaN or infinity however written: YAML's .nan / .inf, or an override's 'nan' / 'inf' / '1e999'."""
    try:
        return not math.isfinite(float(value))
    except OverflowError:
        return True
    except (TypeError, ValueError):
        return False


def _name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def to_dict(cfg: Any) -> dict:
    """Dataclass tree -> plain dict (for printing, saving with checkpoints and metrics)."""
    return dataclasses.asdict(cfg)


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, help) for every knob of a dataclass tree: `megarl config explain`."""
    rows = []
    for f in dataclasses.fields(cls):
        dotted = f"{prefix}.{f.name}" if prefix else f.name
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            rows += describe(hint, dotted)
            continue
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = repr(f.default_factory())  # type: ignore[misc]
        else:
            default = "(required)"
        help_text = f.metadata.get("help", "")
        if f.metadata.get("choices"):
            help_text += f" One of {list(f.metadata['choices'])}."
        rows.append((dotted, default, help_text))
    return rows
