"""Checks of user input shared by the API, the CLI, cluster specs and plan files.

Every check raises an AutoparError subclass (the caller picks which) whose message names the
argument or field, what it got (truncated: a 10 MB value is not echoed back) and what to give
instead. Sizes are bounded here, before anything is built or enumerated, so an absurd number
fails in microseconds instead of hanging a divisor loop or a layer-by-layer build.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from autopar.errors import AutoparError, ConfigError

MAX_NODES = 65_536
"""Nodes in one cluster (the largest published training jobs use a few thousand)."""
MAX_DEVICES_PER_NODE = 1_024
"""Devices (or gloo processes) per node."""
MAX_DEVICES = 1_048_576
"""Devices in one cluster: bounds the planner's enumeration of mesh shapes."""
MAX_GLOBAL_BATCH = 1_048_576
"""Samples per optimizer step: bounds the enumeration of microbatch sizes."""
MAX_TEXT_CHARS = 10_000
"""Longest name, note or placement a plan or cluster file may hold."""
MAX_FILE_BYTES = 1 << 30
"""Largest plan, profile or cluster file read (a plan for a 1,000-layer model is a few MB)."""
SHOWN_CHARS = 80
"""Characters of a value shown in an error message."""

_INTEGER = re.compile(r"[+-]?[0-9]+", re.ASCII)


def shorten(value: Any, limit: int = SHOWN_CHARS) -> str:
    """repr(value), cut to `limit` characters with the full length said."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= limit:
        return repr(value) if isinstance(value, str) else text
    return f"{text[:limit]!r}... ({len(text):,} characters)" if isinstance(value, str) else \
        f"{text[:limit]}... ({len(text):,} characters)"


def shorten_path(path: Any, limit: int = SHOWN_CHARS) -> str:
    """A path quoted, its start cut when long (the file's name, at the end, is what the reader needs)."""
    text = str(path)
    return repr(text) if len(text) <= limit else f"...{text[-limit:]!r} ({len(text):,} characters)"


def clip(text: str, limit: int = SHOWN_CHARS) -> str:
    """`text` itself (no quotes), cut to `limit` characters with the full length said."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def type_name(value: Any) -> str:
    """"a str", "an int", "None", "a class": how a value is named in messages."""
    if value is None:
        return "None"
    if isinstance(value, type):
        return f"the class {value.__name__} (not an instance)"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiouAEIOU' else 'a'} {name}"


# --- numbers ------------------------------------------------------------------------------------

def human_count(value: float, unit: str = "") -> str:
    for threshold, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= threshold:
            return f"{value / threshold:.2f} {suffix}{unit}"
    return f"{value:.0f} {unit}".rstrip()


def human_bytes(value: float) -> str:
    for threshold, suffix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(value) >= threshold:
            return f"{value / threshold:.2f} {suffix}"
    return f"{value:.0f} B"


def check_int(value: Any, name: str, *, minimum: int = 1, maximum: int | None = None,
              error: type[AutoparError] = ConfigError, where: str = "") -> int:
    """An int (not a bool, float or str) in [minimum, maximum]."""
    prefix = f"{where}: " if where else ""
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{prefix}{name} must be an integer, got {type_name(value)} {shorten(value)}")
    return check_range(value, name, minimum=minimum, maximum=maximum, error=error, where=where)


def check_range(value: int | float, name: str, *, minimum: float | None = None, maximum: float | None = None,
                error: type[AutoparError] = ConfigError, where: str = "") -> Any:
    prefix = f"{where}: " if where else ""
    if minimum is not None and value < minimum:
        raise error(f"{prefix}{name} must be >= {minimum}, got {shorten(value)}")
    if maximum is not None and value > maximum:
        raise error(f"{prefix}{name} must be at most {maximum:,}, got {shorten(value)}")
    return value


def parse_int(text: str, name: str, *, minimum: int = 1, maximum: int | None = None,
              error: type[AutoparError] = ConfigError, where: str = "") -> int:
    """An integer written in ASCII digits ("12", not "1.5", "1e3" or "١٢"), then range-checked."""
    prefix = f"{where}: " if where else ""
    if not _INTEGER.fullmatch(text.strip()):
        raise error(f"{prefix}{name} must be an integer, got {shorten(text)}")
    digits = text.strip().lstrip("+-")
    if maximum is not None and len(digits.lstrip("0")) > len(str(maximum)):  # no int() of 10,000 digits
        raise error(f"{prefix}{name} must be at most {maximum:,}, got {shorten(text.strip())}")
    return check_range(int(text), name, minimum=minimum, maximum=maximum, error=error, where=where)


def check_number(value: Any, name: str, *, minimum: float | None = None, maximum: float | None = None,
                 positive: bool = False, error: type[AutoparError] = ConfigError, where: str = "") -> float:
    """A finite int or float (not a bool or str), optionally > 0 and within bounds."""
    prefix = f"{where}: " if where else ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error(f"{prefix}{name} must be a number, got {type_name(value)} {shorten(value)}")
    if not math.isfinite(value):
        raise error(f"{prefix}{name} must be a finite number, got {value}")
    if positive and value <= 0:
        raise error(f"{prefix}{name} must be positive, got {value}")
    return float(check_range(value, name, minimum=minimum, maximum=maximum, error=error, where=where))


def check_choice(value: Any, name: str, choices: Iterable[Any], *, error: type[AutoparError] = ConfigError,
                 where: str = "") -> Any:
    prefix = f"{where}: " if where else ""
    allowed = tuple(choices)
    if isinstance(value, bool) or not any(type(value) is type(choice) and value == choice for choice in allowed):
        raise error(f"{prefix}{name} must be one of {', '.join(repr(choice) for choice in allowed)}, "
                    f"got {shorten(value)}")
    return value


def check_text(value: Any, name: str, *, allow_empty: bool = False, maximum: int = MAX_TEXT_CHARS,
               error: type[AutoparError] = ConfigError, where: str = "") -> str:
    prefix = f"{where}: " if where else ""
    if not isinstance(value, str):
        raise error(f"{prefix}{name} must be a string, got {type_name(value)} {shorten(value)}")
    if not allow_empty and not value.strip():
        raise error(f"{prefix}{name} is empty; give a name")
    if len(value) > maximum:
        raise error(f"{prefix}{name} must be at most {maximum:,} characters, got {shorten(value)}")
    return value


# --- files --------------------------------------------------------------------------------------

def read_text_file(path: str | Path, what: str, *, error: type[AutoparError]) -> str:
    """The UTF-8 text of a file, or `error` saying why it cannot be read (missing, a folder, a
    name too long, binary, huge)."""
    shown = shorten_path(path)
    try:
        size = os.stat(path).st_size
        if Path(path).is_dir():
            raise error(f"{what} {shown} is a folder, not a file; give the file's path")
        if size > MAX_FILE_BYTES:
            raise error(f"{what} {shown} is {size / 2**20:,.0f} MiB, more than a {what} can be "
                        f"({MAX_FILE_BYTES >> 20:,} MiB); give the right file")
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except UnicodeDecodeError as decode:
        raise error(f"{what} {shown} is not UTF-8 text (byte {decode.start} is {decode.object[decode.start]:#04x}): "
                    f"it looks binary; give the text file autopar wrote") from None
    except OSError as os_error:
        raise error(f"cannot read {what} {shown}: {_os_reason(os_error)}") from None
    except ValueError as value_error:  # an embedded NUL byte in the name
        raise error(f"cannot read {what} {shown}: {value_error}") from None


def _os_reason(error: OSError) -> str:
    if error.errno == 36 or isinstance(error, OSError) and "name too long" in str(error).lower():
        return "the file name is too long for the operating system"
    if isinstance(error, IsADirectoryError):
        return "it is a folder, not a file"
    return error.strerror or str(error)


def parse_json(text: str, source: str, what: str, *, error: type[AutoparError]) -> Any:
    """json.loads with a message for malformed or absurdly nested text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as decode:
        raise error(f"{what} {shorten(source)} is not valid JSON ({decode.msg} at line {decode.lineno})") from None
    except RecursionError:
        raise error(f"{what} {shorten(source)} is nested too deeply to be a {what}; give the file autopar "
                    "wrote") from None


def path_is_file(text: str) -> bool:
    """Path(text).is_file() that answers False for names the OS refuses (too long, NUL bytes)."""
    try:
        return Path(text).is_file()
    except (OSError, ValueError):
        return False


def check_output_path(path: Any, flag: str = "--out") -> Path:
    """A file that can be written: not empty, not a folder, in a folder that exists; checked
    before the work whose result it will hold."""
    if not isinstance(path, (str, Path)):
        raise ConfigError(f"{flag} must be a file path, got {type_name(path)}")
    text = str(path)
    if not text.strip():
        raise ConfigError(f"{flag} is empty; give a file name such as {flag} result.json")
    if "\x00" in text:
        raise ConfigError(f"{flag} {shorten(text)} holds a NUL byte; give a file name")
    target = Path(text).expanduser()
    too_long = len(target.name.encode()) > 255 or len(text.encode()) > 4096
    if too_long:
        raise ConfigError(f"{flag} {shorten(text)} is too long for a file name; give a shorter one")
    if target.is_dir():
        raise ConfigError(f"{flag} {shorten(text)} is a folder; give a file name inside it, e.g. "
                          f"{flag} {target / 'result.json'}")
    folder = target.parent
    if not folder.is_dir():
        raise ConfigError(f"{flag} {shorten(text)}: the folder {shorten(str(folder))} does not exist; "
                          "create it first or write elsewhere")
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"{flag} {shorten(text)}: the folder {shorten(str(folder))} is not writable")
    return target


# --- planning arguments -------------------------------------------------------------------------

def check_global_batch(value: Any, name: str = "global_batch") -> int:
    return check_int(value, name, maximum=MAX_GLOBAL_BATCH)
