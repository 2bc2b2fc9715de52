"""A checkpoint's `extra` as data: JSON for the values (numbers, strings, booleans, None, lists,
tuples and dicts with string keys) and DCP tensor entries for the tensors in it (an RNG state, a
sampler's buffer). Loading builds nothing else, so a checkpoint's extra can hold no code; what
has no such form is refused when the checkpoint is saved, with the path of the value."""

from __future__ import annotations

import json
import math

import torch

from autopar.errors import AutoparError

JSON_KEY = "extra_json"
TENSORS_KEY = "extra_tensors"
"""DCP keys: the JSON text, and the tensors it refers to as {"tensor": i} ("extra_tensors.<i>")."""
MAX_DEPTH = 64


class ExtraError(AutoparError):
    """An extra that cannot be saved as data, or a stored one that is not what save wrote."""


def encode(extra: dict) -> tuple[str, dict[str, torch.Tensor]]:
    """(JSON text, tensors by index) of `extra`, or ExtraError naming the value that has no form."""
    if not isinstance(extra, dict):
        raise ExtraError(f"extra must be a dict, got a {type(extra).__name__}")
    tensors: dict[str, torch.Tensor] = {}
    body = _encode(extra, "extra", tensors, 0)
    return json.dumps(body, allow_nan=False), tensors


def _encode(value, path: str, tensors: dict, depth: int):
    if depth > MAX_DEPTH:
        raise ExtraError(f"{path} is nested deeper than {MAX_DEPTH} levels")
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, (list, tuple)):
        items = [_encode(item, f"{path}[{index}]", tensors, depth + 1) for index, item in enumerate(value)]
        return items if isinstance(value, list) else {"tuple": items}
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise ExtraError(f"{path} has the key {key!r}: a checkpoint's extra takes dicts with string keys")
        return {"dict": {key: _encode(item, f"{path}[{key!r}]", tensors, depth + 1) for key, item in value.items()}}
    if type(value) is torch.Tensor:
        tensors[str(len(tensors))] = value.detach().cpu()
        return {"tensor": len(tensors) - 1}
    raise ExtraError(f"{path} is a {type(value).__module__}.{type(value).__qualname__}: a checkpoint's extra holds "
                     "data only (numbers, strings, booleans, None, lists, tuples, dicts with string keys, and plain "
                     "tensors); store its state instead (e.g. its state_dict(), a DTensor's full_tensor())")


def decode(text, tensors: dict[str, torch.Tensor]) -> dict:
    """The extra `encode` wrote; ExtraError for anything else."""
    try:
        value = _decode(json.loads(text, parse_constant=_refuse), tensors, 0) if isinstance(text, str) else None
    except (ValueError, RecursionError, KeyError, TypeError):
        value = None
    if not isinstance(value, dict):
        raise ExtraError("the checkpoint's extra is not what pm.save writes: it was changed after the save")
    return value


def _refuse(name: str):
    raise ValueError(name)


def _decode(value, tensors: dict, depth: int):
    if depth > MAX_DEPTH:
        raise ValueError("too deep")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_decode(item, tensors, depth + 1) for item in value]
    if not isinstance(value, dict) or len(value) != 1:
        raise ValueError("not a tagged value")
    ((tag, body),) = value.items()
    if tag == "tuple" and isinstance(body, list):
        return tuple(_decode(item, tensors, depth + 1) for item in body)
    if tag == "dict" and isinstance(body, dict):
        return {key: _decode(item, tensors, depth + 1) for key, item in body.items()}
    if tag == "tensor" and isinstance(body, int) and not isinstance(body, bool):
        return tensors[str(body)]
    if tag == "float" and body in ("inf", "-inf", "nan"):
        return float(body)
    raise ValueError(f"unknown tag {tag!r}")
