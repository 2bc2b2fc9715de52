"""Why a capture failed, said so that the user can act: the exception, the innermost model module
and the user's line on the stack, and whether the forward reads tensor values (data-dependent
code, which autopar cannot price from shapes)."""

from __future__ import annotations

import contextlib
import io
import linecache
import logging
import sys
import sysconfig
from pathlib import Path

import torch
from torch import nn

DATA_DEPENDENT_ADVICE = (
    "The forward is data-dependent: a shape or a branch follows tensor values (boolean-mask indexing like "
    "y[y > 0], nonzero, unique; an `if` on a tensor, .item()), and autopar prices ops from shapes alone. Keep "
    "shapes fixed (torch.where(y > 0, y, 0) instead of y[y > 0]) and branch with torch.where or torch.cond. "
    "A mixture-of-experts layer that loops over the experts that got tokens (nonzero or where on the routing "
    "mask) can instead sort the token copies by expert and run one grouped matmul (torch._grouped_mm, as "
    "Hugging Face's Mixtral and autopar's `moe` family do): static shapes, and expert parallelism splits it.")
_DATA_DEPENDENT_MARKS = ("data-dependent", "datadependent", "data dependent", "unbacked", "nonzero",
                         "masked_select", "dynamic output shape", *(_VALUE_READ_MARKS := (
                             # a value read on the meta tensors planning runs on: `if t.sum() > 0`,
                             # bool(t), int(t), t.item(), t.tolist(), t.numpy()
                             "item() cannot be called on meta tensors", "cannot copy out of meta tensor",
                             "convert meta device type tensor")))


def is_data_dependent_text(text: str) -> bool:
    lowered = text.lower()
    return any(mark in lowered for mark in _DATA_DEPENDENT_MARKS)


def is_data_dependent(error: BaseException) -> bool:
    """An error raised because a shape or a branch depends on tensor values (y[y > 0], nonzero,
    unique, an `if` on a tensor...)."""
    return _any_cause(error, is_data_dependent_text)


def reads_values(error: BaseException) -> bool:
    """An error raised because the forward read a tensor's value (a branch, .item(), .tolist())."""
    return _any_cause(error, lambda text: any(mark in text.lower() for mark in _VALUE_READ_MARKS))


def _any_cause(error: BaseException | None, test) -> bool:
    seen = 0
    while error is not None and seen < 8:
        if test(f"{type(error).__name__} {str(error)[:2000]}"):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


UNTRACED_TENSOR_ADVICE = (
    "torch.export met a tensor that no traced op made: the forward writes to a tensor's `.data` (in "
    "training, Gemma 3n's AltUp clamps its coefficients with `weight.data.clamp_`) or builds a tensor outside "
    "torch's ops. A graph without that write would train another model: move the write out of forward "
    "(a clamp of weights after the optimizer step) or into an op on the tensor itself.")
_UNTRACED_TENSOR_MARK = "fake tensor in the exported program constant"


def failure_reason(error: BaseException, model: nn.Module) -> str:
    """One or two lines: the exception and the innermost model module on the stack."""
    message = str(error).strip().splitlines()
    first = next((line for line in message if line.strip()), type(error).__name__)
    location = failing_location(error, model)
    advice = f" {UNTRACED_TENSOR_ADVICE}" if _UNTRACED_TENSOR_MARK in first else ""
    return f"{type(error).__name__}: {first[:300]}" + (f" (in {location})" if location else "") + advice


_TORCH_DIR = str(Path(torch.__file__).parent)
_AUTOPAR_DIR = str(Path(__file__).parents[1])
_STDLIB_DIR = sysconfig.get_paths()["stdlib"]
_LIBRARY_DIRS = (_TORCH_DIR, _STDLIB_DIR, sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])
"""Code that is not the user's: a failure's location is the last line outside these, autopar and
generated code ("<string>", "<eval_with_key>"), or in a file that defines one of the model's module
classes (an installed model such as transformers' modeling files is the model's code)."""


def failing_location(error: BaseException, model: nn.Module) -> str:
    """The innermost model module on the stack, and the last line of user code that ran."""
    names = {id(module): path for path, module in model.named_modules()}
    model_files = {getattr(sys.modules.get(type(module).__module__), "__file__", None) for module in model.modules()}
    module_text, code_text = "", ""
    traceback = error.__traceback__
    while traceback is not None:
        frame = traceback.tb_frame
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            module_text = f"module '{names[id(owner)] or '<root>'}' ({type(owner).__name__})"
        filename = frame.f_code.co_filename
        if filename in model_files or not filename.startswith((*_LIBRARY_DIRS, _AUTOPAR_DIR, "<")):
            line = linecache.getline(filename, traceback.tb_lineno).strip()
            code_text = f"{filename}:{traceback.tb_lineno}: {line}"
        traceback = traceback.tb_next
    return ", ".join(part for part in (module_text, code_text) if part)


@contextlib.contextmanager
def quiet_torch_logs():
    """torch.export logs and prints whole graphs when it fails; the user gets our one-paragraph
    error instead."""
    loggers = [logging.getLogger(name) for name in ("torch", "torch.fx", "torch.export", "torch._dynamo")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@contextlib.contextmanager
def without_stack_traces():
    """torch.fx records the Python stack of every node it traces (CapturedTraceback, about 5% of
    planning's export); the OpGraph never reads it. Off inside (torch.fx.config's documented
    switch, where this torch has it), as it was after."""
    config = getattr(torch.fx, "config", None)
    if config is None or not hasattr(config, "do_not_emit_stack_traces"):
        yield
        return
    previous = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = previous
