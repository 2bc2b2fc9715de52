"""The program codegen runs, traced in the dtypes the runtime computes in.

Under precision "bf16" or "fp8" the runtime keeps fp32 master weights and computes with a bf16
copy of every fp32 parameter, and casts every floating input to bf16 on entry; buffers keep their
dtype (codegen/program.py's ParameterOwner, as FSDP2's MixedPrecisionPolicy). A model traced as
it is given, in fp32, bakes fp32 into its program wherever its code reads a dtype while tracing:
Hugging Face's RMSNorm computes in fp32 and returns `weight * hidden.to(input_dtype)`, so the fp32
trace returns fp32 and the next linear meets a bf16 weight. Such a model is traced here as the
runtime runs it: a weightless replica (replica.py's compute_replica: fake tensors on the model's
own devices, so that code branching on the device takes the branch it will run) whose fp32
parameters are bf16, with bf16 floating inputs. Its buffers stay as the model has them, since
the runtime reads the model's own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autopar.capture.export import capture_program
from autopar.capture.replica import compute_replica

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.bfloat16}
"""The dtype a precision computes its fp32 parameters in (float8 linears cast from it)."""


def traced_in_compute_dtype(model: nn.Module, precision: str) -> bool:
    """Whether `capture_for_codegen` traces a replica: the precision computes fp32 parameters in
    another dtype and the model has some."""
    return precision in COMPUTE_DTYPES and any(param.dtype == torch.float32 for param in model.parameters())


def capture_for_codegen(model: nn.Module, example_inputs: Any, example_kwargs: dict | None = None, *,
                        precision: str = "fp32"):
    """capture_program(model, example_inputs, example_kwargs) as the plan's `precision` runs the
    model (see the module docstring): (program, graph)."""
    if not traced_in_compute_dtype(model, precision):
        return capture_program(model, example_inputs, example_kwargs, allow_fallback=False)
    replica, inputs, keywords = compute_replica(model, COMPUTE_DTYPES[precision], example_inputs, example_kwargs or {})
    program, graph = capture_program(replica, inputs, keywords, allow_fallback=False)
    own = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}
    for name in list(program.state_dict):  # the model's own tensors (the runtime binds them by name), not fakes
        if name in own:
            program.state_dict[name] = own[name]
    return program, graph
