"""Where settings come from, and one-line errors that name it.

    text = read_yaml(path)            # the file's mapping, with the line of every key
    check_environment(Settings, os.environ)
    ...
    raise explain(exc, Settings, sources)

Every configuration mistake becomes one line, `<source>: <setting>: <problem>`, the
source being `file:line`, a `GATEWAY_*` variable's name, or a command-line option, so
an operator knows which of the three places to fix. The lines never quote a value: a
rejected value may be a key.

Generic over the settings models: a new setting, or a new nested model, needs nothing
here.
"""

from __future__ import annotations

import difflib
import json
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

PREFIX = "GATEWAY_"
NESTING = "__"
# `GATEWAY_*` variables that are not settings and are documented as such: compose.yaml
# reads GATEWAY_BIND on the host for its published address (deploy/README.md), so an
# operator's shell may well have it exported.
NOT_SETTINGS = frozenset({"GATEWAY_BIND"})


class ConfigError(ValueError):
    """Settings that cannot be used: one line per mistake, each naming its source and
    the setting, never a value."""


# --- the settings' names --------------------------------------------------------------


def _members(annotation: Any) -> tuple[Any, ...]:
    """The types a field may hold, Optional and unions taken apart."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _members(typing.get_args(annotation)[0])
    if origin is typing.Union or isinstance(annotation, types.UnionType):
        out: tuple[Any, ...] = ()
        for arg in typing.get_args(annotation):
            if arg is not type(None):
                out += _members(arg)
        return out
    return (annotation,)


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def nested_model(annotation: Any) -> type[BaseModel] | None:
    """The settings model a field holds directly (`media: MediaSettings`, Optional
    included), or None."""
    for tp in _members(annotation):
        if _is_model(tp):
            return typing.cast(type[BaseModel], tp)
    return None


def _is_complex(annotation: Any) -> bool:
    # What pydantic-settings reads from a variable as JSON: collections and models.
    for tp in _members(annotation):
        origin = typing.get_origin(tp) or tp
        if _is_model(tp) or (
            isinstance(origin, type) and issubclass(origin, list | tuple | set | dict)
        ):
            return True
    return False


def _kind(annotation: Any) -> str:
    for tp in _members(annotation):
        origin = typing.get_origin(tp) or tp
        if isinstance(origin, type) and issubclass(origin, list | tuple | set):
            return "a list"
    return "an object"


def models(root: type[BaseModel]) -> Iterator[type[BaseModel]]:
    """Every model reachable from `root` through its fields (lists and unions
    included), `root` first, each once."""
    seen: list[type[BaseModel]] = []
    todo = [root]
    while todo:
        model = todo.pop(0)
        if model in seen:
            continue
        seen.append(model)
        yield model
        for info in model.model_fields.values():
            todo.extend(_models_in(info.annotation))


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    found: list[type[BaseModel]] = []
    for tp in _members(annotation):
        if _is_model(tp):
            found.append(tp)
        for arg in typing.get_args(tp):
            found.extend(_models_in(arg))
    return found


def environment_names(root: type[BaseModel]) -> dict[str, tuple[str, ...]]:
    """Every `GATEWAY_*` variable the settings read, with the setting's path:
    GATEWAY_MEDIA (a JSON object) and GATEWAY_MEDIA__MODE alike."""
    names: dict[str, tuple[str, ...]] = {}

    def walk(model: type[BaseModel], prefix: str, path: tuple[str, ...]) -> None:
        for name, info in model.model_fields.items():
            var = prefix + name.upper()
            names[var] = (*path, name)
            inner = nested_model(info.annotation)
            if inner is not None:
                walk(inner, var + NESTING, (*path, name))

    walk(root, PREFIX, ())
    return names


def _field_annotation(root: type[BaseModel], path: Sequence[str]) -> Any:
    model: type[BaseModel] | None = root
    annotation: Any = None
    for part in path:
        if model is None:
            return None
        annotation = model.model_fields[part].annotation
        model = nested_model(annotation)
    return annotation


def _holds_secret(annotation: Any) -> bool:
    """Whether a value of this type may hold a secret (a SecretStr at any depth)."""
    if "SecretStr" in repr(annotation):
        return True
    return any(
        _holds_secret(info.annotation)
        for model in _models_in(annotation)
        for info in model.model_fields.values()
    )


def suggest(name: str, candidates: Sequence[str]) -> str:
    """`; did you mean <nearest>?`, or nothing when no candidate is near."""
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


# --- the environment --------------------------------------------------------------------


def check_environment(root: type[BaseModel], environ: Mapping[str, str]) -> None:
    """Refuse `GATEWAY_*` variables that name no setting (a misspelt one would leave its
    setting at the default), and variables of list or object settings that are not
    JSON. Raises ConfigError."""
    known = environment_names(root)
    problems: list[str] = []
    for var in sorted(environ):
        upper = var.upper()
        if not upper.startswith(PREFIX) or upper in NOT_SETTINGS:
            continue
        path = known.get(upper)
        if path is None:
            problems.append(f"{var}: unknown setting{suggest(upper, list(known))}")
            continue
        annotation = _field_annotation(root, path)
        if not _is_complex(annotation):
            continue
        try:
            json.loads(environ[var])
        except ValueError:
            kind = _kind(annotation)
            if kind == "an object":
                example = '{"name": "value"}'
            elif _holds_secret(annotation) or "@" in environ[var]:
                # A secret, or a URL's password (refused anyway): never shown, not even
                # reshaped.
                example = '["first", "second"]'
            else:
                # Not a secret: the value as the JSON list it was probably meant to be.
                items = [item.strip() for item in environ[var].split(",") if item.strip()]
                example = json.dumps(items or ["first", "second"])
            problems.append(
                f"{var}: not valid JSON; {'.'.join(path)} is {kind}, given as JSON: "
                f"{var}='{example}'"
            )
    if problems:
        raise ConfigError("\n".join(problems))


# --- the YAML file ----------------------------------------------------------------------


@dataclass
class YamlFile:
    """A settings file: its mapping, and the node tree that knows each key's line."""

    path: Path
    data: dict[str, Any]
    root: yaml.MappingNode

    def line(self, loc: Sequence[str | int]) -> int | None:
        """The line (1-based) of the deepest key or item of `loc` found in the file."""
        node: yaml.Node = self.root
        line: int | None = None
        for part in loc:
            if isinstance(node, yaml.MappingNode) and isinstance(part, str):
                for key, value in node.value:
                    if key.value == part:
                        line, node = key.start_mark.line + 1, value
                        break
                else:
                    return line
            elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
                if not 0 <= part < len(node.value):
                    return line
                node = node.value[part]
                line = node.start_mark.line + 1
            else:
                return line
        return line

    def has(self, key: str) -> bool:
        return key in self.data


def read_yaml(path: Path) -> YamlFile:
    """Read a settings file. Raises ConfigError for a file that is missing, unreadable,
    not YAML, not a mapping at the top, or that gives a key twice."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"{path}: config file cannot be read: {reason}") from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or "cannot be parsed"
        raise ConfigError(f"{where}: not valid YAML: {problem}") from None
    if root is None:
        return YamlFile(path, {}, yaml.MappingNode("tag:yaml.org,2002:map", []))
    if not isinstance(root, yaml.MappingNode) or not isinstance(data, dict):
        raise ConfigError(
            f"{path}:{root.start_mark.line + 1}: expected a mapping of settings "
            "(`name: value` lines) at the top of the file"
        )
    _refuse_repeats(path, root, ())
    return YamlFile(path, data, root)


def _refuse_repeats(path: Path, node: yaml.Node, where: tuple[str, ...]) -> None:
    repeat = repeated_key(node, where)
    if repeat is not None:
        name, line, first = repeat
        raise ConfigError(f"{path}:{line}: {name}: given twice (first on line {first})")


def repeated_key(node: yaml.Node, where: tuple[str, ...] = ()) -> tuple[str, int, int] | None:
    """The first mapping key given twice at any depth below `node`: its dotted name, its
    line and the line it was first given on. PyYAML keeps the last of two equal keys: a
    second `media:` block, or a key's second `models:`, would silently replace the first."""
    if isinstance(node, yaml.MappingNode):
        first: dict[str, int] = {}
        for key, value in node.value:
            name = str(key.value)
            line = key.start_mark.line + 1
            if name in first:
                return ".".join((*where, name)), line, first[name]
            first[name] = line
            found = repeated_key(value, (*where, name))
            if found is not None:
                return found
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            found = repeated_key(item, (*where, str(index)))
            if found is not None:
                return found
    return None


# --- pydantic's errors, explained -------------------------------------------------------


@dataclass
class Sources:
    """What was given where: command-line options, the environment, the file."""

    options: Mapping[str, str] = field(default_factory=dict)  # setting -> option
    environ: Mapping[str, str] = field(default_factory=dict)
    file: YamlFile | None = None

    def of(self, fields: Sequence[str], loc: Sequence[str | int]) -> str | None:
        """The source of the value at `fields` (the setting's names) / `loc`, in the
        order of precedence; None when nothing set it (a default)."""
        if fields and fields[0] in self.options:
            return self.options[fields[0]]
        given = {name.upper(): name for name in self.environ}
        for depth in range(len(fields), 0, -1):
            var = PREFIX + NESTING.join(fields[:depth]).upper()
            if var in given:
                return given[var]
        if self.file is not None and fields and self.file.has(fields[0]):
            line = self.file.line(loc)
            return f"{self.file.path}:{line}" if line is not None else str(self.file.path)
        return None


def _tags(root: type[BaseModel]) -> frozenset[str]:
    # Union branches appear in pydantic's locations by name: a model's (`ApiKeyConfig`)
    # or a validator's (`function-after[...]`). Anything else is a key someone wrote.
    return frozenset(model.__name__ for model in models(root))


def _is_tag(part: str | int, tags: frozenset[str]) -> bool:
    return isinstance(part, str) and ("[" in part or part in tags)


def _model_at(root: type[BaseModel], loc: Sequence[str | int]) -> type[BaseModel] | None:
    """The model whose field the last part of `loc` names."""
    tags = _tags(root)
    current: list[Any] = [root]
    for part in loc[:-1]:
        if isinstance(part, int):
            current = [a for tp in current for a in typing.get_args(tp)[:1]]
        elif _is_tag(part, tags):
            current = [tp for tp in current if getattr(tp, "__name__", None) == part] or current
        else:
            holders = [tp for tp in current if _is_model(tp) and part in tp.model_fields]
            if not holders:
                return None
            current = list(_members(holders[0].model_fields[part].annotation))
        current = [m for tp in current for m in _members(tp)]
    for tp in current:
        if _is_model(tp):
            return typing.cast(type[BaseModel], tp)
    return None


# Errors of a value that should have been a word (an enum member, a literal, a string).
_WORD_EXPECTED = frozenset({"enum", "literal_error", "string_type"})


def _message(error: Mapping[str, Any], root: type[BaseModel], loc: Sequence[str | int]) -> str:
    if error["type"] == "extra_forbidden" and loc and isinstance(loc[-1], str):
        model = _model_at(root, loc)
        names = list(model.model_fields) if model is not None else []
        return f"unknown setting{suggest(loc[-1], names)}"
    msg = str(error["msg"])
    for prefix in ("Value error, ", "Assertion failed, "):
        msg = msg.removeprefix(prefix)
    if isinstance(error.get("input"), bool) and error["type"] in _WORD_EXPECTED:
        # The input is only looked at when it is a bool: a value may be a key.
        msg += "; YAML reads an unquoted off, on, yes or no as false or true: quote it"
    return msg


def explain(exc: ValidationError, root: type[BaseModel], sources: Sources) -> ConfigError:
    """One line per mistake: `<source>: <setting>: <problem>`."""
    errors = exc.errors(include_url=False)
    tags = _tags(root)
    # A value that matches no branch of a union gets one error per branch. When one
    # branch got further into the value (an object with a misspelt key), its errors
    # are the ones that say what is wrong; else the branches' messages are joined.
    groups: dict[tuple[str | int, ...], list[tuple[tuple[str | int, ...], Any]]] = {}
    plain: list[tuple[tuple[str | int, ...], Any]] = []
    for error in errors:
        loc = tuple(error["loc"])
        tag = next((i for i, part in enumerate(loc) if _is_tag(part, tags)), None)
        if tag is None:
            plain.append((loc, error))
        else:
            groups.setdefault(loc[:tag], []).append((loc, error))
    lines: list[str] = []
    chosen: list[tuple[tuple[str | int, ...], Any, str | None]] = [
        (loc, e, None) for loc, e in plain
    ]
    for prefix, branch_errors in groups.items():
        deep = [(loc, e) for loc, e in branch_errors if len(loc) > len(prefix) + 1]
        if deep:
            chosen.extend((loc, e, None) for loc, e in deep)
        else:
            joined = "; or ".join(dict.fromkeys(_message(e, root, loc) for loc, e in branch_errors))
            chosen.append((prefix, branch_errors[0][1], f"matches no accepted form: {joined}"))
    for loc, error, text in chosen:
        clean = tuple(part for part in loc if not _is_tag(part, tags))
        fields = tuple(part for part in clean if isinstance(part, str))
        message = text or _message(error, root, loc)
        setting = ".".join(str(part) for part in clean)
        source = sources.of(fields, clean)
        parts = [p for p in (source, setting) if p]
        lines.append(": ".join([*parts, message]))
    return ConfigError("\n".join(dict.fromkeys(lines)))
