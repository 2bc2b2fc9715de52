"""Model spec strings and config validation.

A model spec is one of
    family                       gpt
    family:key=value,...         gpt:layers=4,hidden=256
    named-size[:key=value,...]   gpt3-175b, gpt3-175b:layers=8
    path/to/file.py:factory      examples/my_model.py:make_model

`parse_spec` splits the string, `make_config` turns overrides into a typed config dataclass,
`import_factory` and `call_factory` load a user's model file and check what its factory returns. The `require_*`
helpers are what the family configs call from `__post_init__`. Every mistake raises
`ModelSpecError` with a message that says what was wrong and what to write instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import io
import functools
import hashlib
import importlib.util
import math
import re
import sys
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch

from autopar.errors import ModelSpecError
from autopar.validation import shorten

_FILE_SPEC = re.compile(r"(?P<path>.+?\.py)\s*(?::(?P<factory>.*))?", re.DOTALL)  # path.py[:factory]
SPEC_EXAMPLES = "e.g. 'gpt', 'gpt:layers=4,hidden=256', 'gpt3-175b' or 'path/to/model.py:factory'"

_WIDTH_LIMIT = 1 << 20
SIZE_LIMITS: dict[str, int] = {
    "layers": 1024, "seq": 1 << 20, "vocab": 1 << 22, "num_experts": 4096, "image_size": 1 << 16,
    "token_types": 1 << 22, "num_classes": 1 << 22,
}
"""Largest value of an int config field, by name (other int fields: _WIDTH_LIMIT). Checked before
anything is built: a 100,000-layer model would be built block by block on meta for minutes, and
require_divisible enumerates divisors. The deepest published models have about 130 layers."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParsedSpec:
    """A model spec string split into its parts; override values are still raw strings."""

    name: str  # registry name (lower case), or the file path of a file spec
    factory: str | None = None  # factory function of a file spec; None for registry names
    overrides: tuple[tuple[str, str], ...] = ()  # (field, raw value) pairs in the order written

    @property
    def is_file(self) -> bool:
        return self.factory is not None


def parse_spec(spec: str) -> ParsedSpec:
    """Splits a model spec string into name, factory and raw overrides (no registry lookup)."""
    if not isinstance(spec, str):
        raise ModelSpecError(f"model spec must be a string ({SPEC_EXAMPLES}), got {type(spec).__name__}")
    text = spec.strip()
    if not text:
        raise ModelSpecError(f"model spec is empty; give one, {SPEC_EXAMPLES}")
    file_match = _FILE_SPEC.fullmatch(text)
    if file_match:
        return _parse_file_spec(file_match.group("path"), file_match.group("factory"))
    name, _, override_text = text.partition(":")
    name = name.strip().lower()
    if not name:
        raise ModelSpecError(f"model spec {shorten(spec)} has no model name before ':'; {SPEC_EXAMPLES}")
    return ParsedSpec(name=name, overrides=_parse_overrides(override_text, spec))


def _parse_file_spec(path: str, factory: str | None) -> ParsedSpec:
    if factory is None or not factory.strip():
        raise ModelSpecError(
            f"model file spec '{path}' names no factory; write '{path}:make_model' where make_model() "
            "returns (model, example_inputs)"
        )
    factory = factory.strip()
    if ":" in factory:
        raise ModelSpecError(
            f"model file spec '{path}:{factory}' has overrides after the factory; file factories take none, "
            f"write '{path}:{factory.partition(':')[0].strip()}'"
        )
    if not factory.isidentifier():
        raise ModelSpecError(
            f"model file spec '{path}:{factory}': factory '{factory}' is not a Python function name; "
            f"write '{path}:make_model'"
        )
    return ParsedSpec(name=path, factory=factory)


def _parse_overrides(text: str, spec: str) -> tuple[tuple[str, str], ...]:
    pairs: dict[str, str] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, equals, value = (part.strip() for part in item.partition("="))
        if not equals or not key:
            raise ModelSpecError(
                f"override {shorten(item)} in model spec {shorten(spec)} is not key=value; "
                "write e.g. 'gpt:layers=4,hidden=256'"
            )
        if not value:
            raise ModelSpecError(f"field {shorten(key)} in model spec {shorten(spec)} has no value; "
                                 f"write '{key}=<value>'")
        if key in pairs:
            raise ModelSpecError(f"field '{key}' is set twice in model spec {shorten(spec)}; keep one")
        pairs[key] = value
    return tuple(pairs.items())


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """"; did you mean 'x'?" for the closest choice, or "" when nothing is close."""
    matches = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean '{matches[0]}'?" if matches else ""


# ---------------------------------------------------------------------------------------------
# Typed overrides


def make_config(config_cls: type, values: Mapping[str, Any], overrides: Iterable[tuple[str, str]]) -> Any:
    """Builds `config_cls(**values)` with the raw string overrides parsed by each field's type."""
    owner = config_cls.family
    hints = field_types(config_cls)
    kwargs = dict(values)
    for key, raw in overrides:
        if key not in hints:
            raise ModelSpecError(
                f"{owner} has no field '{key}'{did_you_mean(key, hints) or '.'} Fields: {', '.join(hints)}"
            )
        kwargs[key] = parse_value(owner, key, hints[key], raw)
    return config_cls(**kwargs)


@functools.cache
def field_types(config_cls: type) -> dict[str, Any]:
    """Field name -> resolved type annotation, in declaration order."""
    hints = typing.get_type_hints(config_cls)
    return {field.name: hints[field.name] for field in dataclasses.fields(config_cls)}


def parse_value(owner: str, field: str, annotation: Any, raw: str) -> Any:
    """Parses one override value by its field type: int, float, bool, str, Literal or Optional."""
    inner = _optional_inner(annotation)
    if inner is not None:
        if raw.lower() in ("none", "null"):
            return None
        annotation = inner
    if typing.get_origin(annotation) is Literal:
        choices = typing.get_args(annotation)
        if raw in choices:
            return raw
        raise ModelSpecError(
            f"{owner} field '{field}' expects one of {', '.join(map(repr, choices))}, got {shorten(raw)}"
            f"{did_you_mean(raw, choices)}"
        )
    parsers: dict[Any, Callable[[str], Any]] = {int: int, float: float, str: str, bool: _parse_bool}
    try:
        return parsers[annotation](raw)
    except ValueError:
        expected = {int: "an int", float: "a number", bool: "true or false"}[annotation]
        if inner is not None:
            expected += " or 'none'"
        raise ModelSpecError(f"{owner} field '{field}' expects {expected}, got {shorten(raw)}") from None


def _parse_bool(raw: str) -> bool:
    lowered = raw.lower()
    if lowered not in ("true", "false"):
        raise ValueError(raw)
    return lowered == "true"


def _optional_inner(annotation: Any) -> Any:
    """X for `X | None`, else None."""
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return None
    inner = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    return inner[0] if len(inner) == 1 else None


def format_value(value: Any) -> str:
    """The override spelling of a config value; `parse_value` reads it back."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def format_overrides(config: Any, only: Iterable[str] | None = None) -> str:
    """"key=value,..." for the config's fields (or the ones in `only`), in declaration order."""
    keep = None if only is None else set(only)
    return ",".join(
        f"{name}={format_value(getattr(config, name))}"
        for name in field_types(type(config))
        if keep is None or name in keep
    )


# ---------------------------------------------------------------------------------------------
# Validation helpers for config __post_init__


def check_field_types(config: Any) -> None:
    """Rejects values of the wrong type (configs built in Python bypass `parse_value`)."""
    for name, annotation in field_types(type(config)).items():
        value = getattr(config, name)
        inner = _optional_inner(annotation)
        if inner is not None:
            if value is None:
                continue
            annotation = inner
        if not _matches(value, annotation):
            raise ModelSpecError(
                f"{config.family} field '{name}' expects {_describe(annotation)}, got {shorten(value)}"
            )
        limit = SIZE_LIMITS.get(name, _WIDTH_LIMIT)
        if annotation is int and value > limit:
            raise ModelSpecError(
                f"{config.family} field '{name}' must be at most {limit:,}, got {shorten(value)}; "
                "autopar bounds model sizes so that a typo does not build for minutes"
            )


def _matches(value: Any, annotation: Any) -> bool:
    if typing.get_origin(annotation) is Literal:
        return value in typing.get_args(annotation)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, annotation)


def _describe(annotation: Any) -> str:
    if typing.get_origin(annotation) is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(annotation)))
    return {int: "an int", float: "a finite number", bool: "true or false", str: "a string"}[annotation]


def require_positive(config: Any, *names: str) -> None:
    """Each named field is > 0."""
    for name in names:
        value = getattr(config, name)
        if value <= 0:
            raise ModelSpecError(f"{config.family} field '{name}' must be positive, got {value}")


def require_divisible(config: Any, name: str, by: str) -> None:
    """Field `name` is a multiple of field `by`; suggests the nearest divisor of `name`."""
    value, divisor = getattr(config, name), getattr(config, by)
    if value % divisor == 0:
        return
    nearest = min(_divisors(value), key=lambda candidate: (abs(candidate - divisor), -candidate))
    raise ModelSpecError(
        f"{config.family}: {name} ({value}) must be divisible by {by} ({divisor}); "
        f"pick {by} that divides {value}, e.g. {by}={nearest}"
    )


def _divisors(value: int) -> list[int]:
    small = [candidate for candidate in range(1, math.isqrt(value) + 1) if value % candidate == 0]
    return small + [value // candidate for candidate in small]


def require_probability(config: Any, *names: str) -> None:
    """Each named field is in [0, 1)."""
    for name in names:
        value = getattr(config, name)
        if not 0.0 <= value < 1.0:
            raise ModelSpecError(f"{config.family} field '{name}' must be in [0, 1), got {value}")


# ---------------------------------------------------------------------------------------------
# `file.py:factory`

FACTORY_CONTRACT = (
    "a factory takes no arguments and returns (model, example_inputs), "
    "(model, example_inputs, loss_fn), (model, example_inputs, loss_fn, example_targets) or a dict "
    "with keys 'model', 'example_inputs' and optionally 'loss_fn', 'example_targets'"
)


class FactoryResult(NamedTuple):
    """What a user factory returned, checked and normalized."""

    model: torch.nn.Module
    example_inputs: tuple
    loss_fn: Callable | None
    example_targets: torch.Tensor | None


def import_factory(path_text: str, factory_name: str) -> Callable:
    """Imports the Python file at `path_text` and returns its callable `factory_name`."""
    path = Path(path_text).expanduser()
    try:
        found = path.is_file()
    except (OSError, ValueError) as error:  # a name the OS refuses: too long, a NUL byte
        reason = "the file name is too long" if getattr(error, "errno", None) == 36 else str(error)[:200]
        raise ModelSpecError(f"model file {shorten(path_text)} cannot be looked up: {reason}") from None
    if not found:
        raise ModelSpecError(
            f"model file '{path_text}' not found (looked at {path.resolve()}); give the path of a Python "
            f"file that defines {factory_name}()"
        )
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    module_name = f"autopar_user_model_{digest}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ModelSpecError(f"model file '{path_text}' cannot be imported as Python; give a .py file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up by name
    try:
        with user_code(f"importing model file {shorten(path_text)}"):
            module_spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        if isinstance(exc, ModelSpecError):
            raise
        reason = "it is not UTF-8 text" if isinstance(exc, (UnicodeDecodeError, SyntaxError)) and \
            "utf-8" in str(exc).lower() else f"{type(exc).__name__}: {str(exc)[:300]}"
        raise ModelSpecError(f"importing model file {shorten(path_text)} failed: {reason}; fix the file") from None
    factory = getattr(module, factory_name, None)
    if factory is None:
        functions = [name for name, value in vars(module).items() if callable(value) and not name.startswith("_")]
        hint = did_you_mean(factory_name, functions) or "."
        raise ModelSpecError(
            f"model file '{path_text}' has no attribute '{factory_name}'{hint} "
            f"Callables there: {', '.join(functions) or 'none'}"
        )
    if not callable(factory):
        raise ModelSpecError(
            f"'{factory_name}' in model file '{path_text}' is {_summarize(factory)}, not a function; "
            f"{FACTORY_CONTRACT}"
        )
    return factory


def call_factory(factory: Callable, where: str) -> FactoryResult:
    """Calls a user factory and checks what it returned; `where` names it in messages."""
    try:
        with user_code(f"factory {where}"):
            result = factory()
    except ModelSpecError:
        raise
    except Exception as exc:
        raise ModelSpecError(
            f"factory {where} raised {type(exc).__name__}: {str(exc)[:300]}; fix the factory ({FACTORY_CONTRACT})"
        ) from None
    return normalize_factory_result(result, where)


@contextlib.contextmanager
def user_code(what: str):
    """Runs a user's file or factory: what it prints goes to stderr (stdout is for autopar's
    report or its one JSON object), and a sys.exit() there (argparse's parse_args() meeting
    autopar's own arguments does one) becomes a ModelSpecError instead of ending autopar."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            yield
    except Exception:
        sys.stderr.write(printed.getvalue())
        raise
    except SystemExit as stop:  # what it printed is its usage message, not autopar's: dropped
        raise ModelSpecError(
            f"{what} called sys.exit({shorten(stop.code)}), which would end autopar; a module-level "
            "argparse parse_args() does this when it meets autopar's command line. Put the script part of "
            "the file under `if __name__ == \"__main__\":` and let the factory only build the model"
        ) from None
    sys.stderr.write(printed.getvalue())


def normalize_factory_result(result: Any, where: str) -> FactoryResult:
    """Accepts a tuple of 2 to 4 items or a dict; anything else raises with the contract."""
    if isinstance(result, Mapping):
        unknown = set(result) - {"model", "example_inputs", "loss_fn", "example_targets"}
        if unknown or "model" not in result or "example_inputs" not in result:
            raise ModelSpecError(
                f"factory {where} returned a dict with keys {sorted(result)}; {FACTORY_CONTRACT}"
            )
        model, inputs = result["model"], result["example_inputs"]
        loss_fn, targets = result.get("loss_fn"), result.get("example_targets")
    elif isinstance(result, tuple) and len(result) in (2, 3, 4):
        model, inputs, loss_fn, targets = *result, *([None] * (4 - len(result)))
    else:
        raise ModelSpecError(f"factory {where} returned {_summarize(result)}; {FACTORY_CONTRACT}")
    if not isinstance(model, torch.nn.Module):
        raise ModelSpecError(
            f"factory {where} returned {_summarize(model)} as the model; it must be a torch.nn.Module"
        )
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, (tuple, list)):
        raise ModelSpecError(
            f"factory {where} returned {_summarize(inputs)} as example_inputs; give a tensor or a tuple "
            "of positional inputs for model(*example_inputs)"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise ModelSpecError(f"factory {where} returned {_summarize(loss_fn)} as loss_fn; give a callable or None")
    if targets is not None and not isinstance(targets, torch.Tensor):
        raise ModelSpecError(f"factory {where} returned {_summarize(targets)} as example_targets; give a tensor")
    return FactoryResult(model, tuple(inputs), loss_fn, targets)


def _summarize(value: Any) -> str:
    """"a tuple of 4 items", "an int", "a str": what a factory gave, for messages."""
    if isinstance(value, tuple):
        return f"a tuple of {len(value)} items"
    type_name = type(value).__name__
    return f"{'an' if type_name[0] in 'aeiouAEIOU' else 'a'} {type_name}"
