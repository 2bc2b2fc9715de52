"""An OpGraph as JSON and back, for the capture cache: plain data both ways.

Each of graph.py's dataclasses is written as a row of its fields in declaration order; the
TensorMeta and Kernel values, which repeat across identical blocks, are written once in tables
and referenced by index. The call arguments an op keeps (`OpNode.args`, `kwargs`) are written as
JSON arrays for tuples and tagged objects for lists, dicts, slices, `Ref`s and non-finite floats.

The decoder reads every field with the type graph.py declares for it and builds nothing but
those classes and Python's plain values: a row of the wrong length, a value of the wrong type, an
unknown tag, an index out of range, an integer beyond int64 or call arguments nested deeper than
MAX_DEPTH raise CodecError (the cache then treats the entry as a miss). Nothing read can name a
class, a function or a module to load, so an entry can hold no code.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import fields
from functools import lru_cache
from typing import Any

from autopar.capture.heap import collector_paused
from autopar.graph import BlockGroup, Kernel, OpGraph, OpNode, ParamInfo, Ref, Segment, TensorMeta

FORMAT = "autopar-opgraph-4"
"""Names this layout; a change of graph.py's fields changes the rows, so bump it with them."""
MAX_DEPTH = 32
"""Deepest nesting of call arguments (a real op's arguments nest a few levels)."""
MAX_INT = 2**63 - 1
"""Integers beyond int64 are no shape, count or index a capture makes."""
_CLASSES = {cls.__name__: cls for cls in (OpGraph, OpNode, ParamInfo, BlockGroup, Segment, TensorMeta, Kernel)}
_TABLES = ("TensorMeta", "Kernel")
"""Classes written once in a table and referenced by index."""
_SCALARS = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}


class CodecError(ValueError):
    """The text is not an OpGraph this codec wrote."""


@lru_cache(maxsize=None)
def _field_kinds(cls: type) -> tuple[tuple[str, str], ...]:
    """(name, declared type without spaces) of each field, in order."""
    return tuple((item.name, str(item.type).replace(" ", "")) for item in fields(cls))


# --- encoding --------------------------------------------------------------------------------------

def encode(graph: OpGraph) -> str:
    """The graph as one line of JSON (CodecError if it holds a value the format has no form for)."""
    tables: dict[str, dict] = {name: {} for name in _TABLES}
    body = _row(graph, tables)
    rows = {name: [_row(value, tables) for value in table] for name, table in tables.items()}
    return json.dumps({"format": FORMAT, "tables": rows, "graph": body}, separators=(",", ":"), allow_nan=False)


def _row(value, tables: dict) -> list:
    return [_put(getattr(value, name), kind, tables) for name, kind in _field_kinds(type(value))]


def _put(value, kind: str, tables: dict):
    if kind.endswith("|None"):
        if value is None:
            return None
        kind = kind[:-len("|None")]
    if kind in _TABLES:
        return tables[kind].setdefault(value, len(tables[kind]))
    if kind in _CLASSES:
        return _row(value, tables)
    if kind in _SCALARS:
        return _scalar(value)
    if kind in ("object", "tuple"):
        return _plain(value)
    inner = _arguments(kind)
    if kind.startswith("dict["):
        return [[_put(key, inner[0], tables), _put(item, inner[1], tables)] for key, item in value.items()]
    if kind.endswith(",...]"):
        return [_put(item, inner[0], tables) for item in value]
    return [_put(item, part, tables) for item, part in zip(value, inner)]


def _scalar(value):
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        raise CodecError(f"integer {value} out of range")
    return value


def _plain(value, depth: int = 0):
    """A call argument: tuples as arrays, everything else tagged."""
    if depth > MAX_DEPTH:
        raise CodecError(f"arguments nested deeper than {MAX_DEPTH}")
    if value is None or isinstance(value, (bool, int, float, str)):
        return _scalar(value)
    if isinstance(value, tuple):
        return [_plain(item, depth + 1) for item in value]
    if isinstance(value, list):
        return {"list": [_plain(item, depth + 1) for item in value]}
    if isinstance(value, dict):
        return {"dict": [[_plain(key, depth + 1), _plain(item, depth + 1)] for key, item in value.items()]}
    if isinstance(value, Ref):
        return {"ref": value.index}
    if isinstance(value, slice):
        return {"slice": [_plain(value.start, depth + 1), _plain(value.stop, depth + 1), _plain(value.step, depth + 1)]}
    if value is Ellipsis:
        return {"ellipsis": True}
    raise CodecError(f"a {type(value).__name__} argument has no JSON form")


# --- decoding --------------------------------------------------------------------------------------

def decode(text: str) -> OpGraph:
    """The OpGraph `text` encodes; CodecError for anything else."""
    try:
        with collector_paused():  # ~10^5 new objects, no garbage: the collector's passes tripled the time
            data = json.loads(text, parse_constant=_no_constant)
            return _graph(data)
    except (ValueError, RecursionError, TypeError) as error:  # JSONDecodeError and 5,000-digit ints are
        # ValueErrors; a list inside a tuple used as a dict key is a TypeError (unhashable)
        if isinstance(error, CodecError):
            raise
        raise CodecError(f"not JSON: {str(error)[:200]}") from None


def _graph(data) -> OpGraph:
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("tables"), dict):
        raise CodecError("not an OpGraph entry of this format")
    tables: dict[str, list] = {}
    for name in _TABLES:
        rows = data["tables"].get(name)
        if not isinstance(rows, list):
            raise CodecError(f"no {name} table")
        read_row = _class_reader(_CLASSES[name])
        tables[name] = [read_row(row, tables) for row in rows]
    return _reader("OpGraph")(data.get("graph"), tables)


def _no_constant(name: str):
    raise CodecError(f"{name} is not a value the encoder writes")


@lru_cache(maxsize=None)
def _reader(kind: str) -> Callable[[Any, dict], Any]:
    """A function that reads a JSON value of the declared type `kind` (tables: the decoded
    TensorMeta and Kernel values), or raises CodecError."""
    if kind.endswith("|None"):
        some = _reader(kind[:-len("|None")])
        return lambda value, tables: None if value is None else some(value, tables)
    if kind in _TABLES:
        return lambda value, tables: _table_entry(tables[kind], value, kind)
    if kind in _CLASSES:
        return _class_reader(_CLASSES[kind])
    if kind in _SCALARS:
        return lambda value, tables: _read_scalar(value, kind)
    if kind in ("object", "tuple"):
        return lambda value, tables: _read_plain(value, 0)
    inner = [_reader(part) for part in _arguments(kind)]
    if kind.startswith("dict["):
        return lambda value, tables: {_read_key(inner[0](pair[0], tables)): inner[1](pair[1], tables)
                                      for pair in _pairs(value)}
    if kind.endswith(",...]"):
        return lambda value, tables: tuple(inner[0](item, tables) for item in _array(value))
    return lambda value, tables: tuple(read(item, tables) for read, item in zip(inner, _array(value, len(inner))))


def _class_reader(cls: type) -> Callable[[Any, dict], Any]:
    names = [name for name, _ in _field_kinds(cls)]
    readers = [_reader(kind) for _, kind in _field_kinds(cls)]

    def read(value, tables):
        row = _array(value, len(readers))
        return cls(**{name: reader(item, tables) for name, reader, item in zip(names, readers, row)})

    return read


def _table_entry(table: list, index, kind: str):
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(table):
        raise CodecError(f"no {kind} number {str(index)[:40]}")
    return table[index]


def _read_scalar(value, kind: str):
    if kind == "float" and isinstance(value, dict):
        return _special_float(value)
    if not isinstance(value, _SCALARS[kind]) or kind != "bool" and isinstance(value, bool):
        raise CodecError(f"expected a {kind}, got a {type(value).__name__}")
    if isinstance(value, int) and abs(value) > MAX_INT:
        raise CodecError("integer out of range")
    return value


def _special_float(value: dict) -> float:
    if set(value) != {"float"} or value["float"] not in ("inf", "-inf", "nan"):
        raise CodecError("expected a float")
    return float(value["float"])


def _read_plain(value, depth: int):
    if depth > MAX_DEPTH:
        raise CodecError(f"arguments nested deeper than {MAX_DEPTH}")
    if value is None or isinstance(value, (bool, str, float)):
        return value
    if isinstance(value, int):
        return _read_scalar(value, "int")
    if isinstance(value, list):
        return tuple(_read_plain(item, depth + 1) for item in value)
    if not isinstance(value, dict) or len(value) != 1:
        raise CodecError(f"unexpected argument {type(value).__name__}")
    ((tag, body),) = value.items()
    if tag == "list":
        return [_read_plain(item, depth + 1) for item in _array(body)]
    if tag == "dict":
        return {_read_key(_read_plain(pair[0], depth + 1)): _read_plain(pair[1], depth + 1) for pair in _pairs(body)}
    if tag == "ref":
        return Ref(index=_read_scalar(body, "int"))
    if tag == "slice":
        return slice(*(_read_plain(item, depth + 1) for item in _array(body, 3)))
    if tag == "ellipsis" and body is True:
        return Ellipsis
    if tag == "float":
        return _special_float(value)
    raise CodecError(f"unknown tag {str(tag)[:40]!r}")


def _array(value, length: int | None = None) -> list:
    if not isinstance(value, list) or length is not None and len(value) != length:
        raise CodecError(f"expected an array{f' of {length}' if length is not None else ''}")
    return value


def _pairs(value) -> list:
    pairs = _array(value)
    if not all(isinstance(pair, list) and len(pair) == 2 for pair in pairs):
        raise CodecError("expected [key, value] pairs")
    return pairs


def _read_key(key):
    if isinstance(key, (list, dict, slice)):
        raise CodecError("a dict key that is not a plain value")
    return key


@lru_cache(maxsize=None)
def _arguments(kind: str) -> tuple[str, ...]:
    """The type arguments of "tuple[...]" or "dict[...]" ("..." dropped), split at top level."""
    text = kind[kind.index("[") + 1:-1]
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    parts.append(text[start:])
    return tuple(part for part in parts if part != "...")
