"""Capture: a model and example inputs -> OpGraph.

torch.export on fake/meta tensors (export.py) with a torch.fx fallback (fx.py); each op probed on
meta tensors for its kernels (probe.py); repeated blocks found (blocks.py) and, at real size,
traced three periods deep and copied for the rest (block_match.py, block_reuse.py); the backward
kernels no single op shows (gradient_sums.py, gradient_layouts.py); the weightless replica that
planning captures (replica.py) and the cache of planning captures (cache.py).

`autopar.capture.capture` and `capture_program` are loaded on first use, so that importing a
light module of this package (the cache, for the CLI) does not import torch.export.
"""

_EXPORTED = {"capture": "autopar.capture.export", "capture_program": "autopar.capture.export"}


def __getattr__(name: str):
    if name in _EXPORTED:
        import importlib

        return getattr(importlib.import_module(_EXPORTED[name]), name)
    raise AttributeError(f"module 'autopar.capture' has no attribute '{name}'")
