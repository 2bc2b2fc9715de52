"""Float8 linears with their casts compiled (Plan.fp8_casts "compiled"), as torchtitan runs them.

torchao's float8 linear run eagerly is op by op: each cast is six element passes and three scalar
kernels (cost_model/fp8.py "eager", 33 bytes per bf16 element). Under torch.compile, inductor fuses
a cast into an amax reduction and one scale-and-cast pass (5 bytes per element): that is where
torchtitan's float8 speed comes from, and what makes float8 pay on H100s (cost_model/fp8.py
"compiled"). Here each float8 linear's call, torchao's `matmul_with_hp_or_float8_args` on the
tensors the plan placed, is compiled whole, forward and backward (AOTAutograd traces torchao's
autograd.Function), once per signature of its operands: shapes, strides, dtypes, DTensor
placements and mesh, tensor subclass (FSDP2's float8-gathered weights arrive as torchao's float8
tensors), grad mode. Each signature gets a function of its own (a copy of the code object), so
dynamo's per-code recompile limit never sends a model's many linear shapes back to eager silently.

What composes (checked by tests/dist/test_fp8_runs.py on gloo, emulated): DTensor operands under
tensor parallelism (dynamo traces DTensor; the tensorwise amax of a sharded tensor stays an
all-reduce, a functional collective in the graph), FSDP2's float8 all-gather, pipelining (each
stage compiles its own linears), full recomputation (the recomputed forward calls the same compiled
function). The plan's tp redistributions stay outside the compiled region (the interpreter runs
them before the op), so a sequence-parallel input is gathered in bf16 and cast after.

Where a signature does not compile (no C++ compiler for inductor's CPU backend, a graph break, an
unsupported composition), its first call says why in a warning and that signature runs torchao
eagerly from then on (`fallbacks` keeps the reasons): correct, at eager's price. The backward is
compiled with the forward on the first call (not lazily at the first backward), so a failure is
met where it can still fall back.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor


def signature(*tensors) -> tuple:
    """What a compiled float8 linear is specialised on (see the module docstring)."""
    parts: list = [torch.is_grad_enabled()]
    for tensor in tensors:
        if tensor is None:
            parts.append(None)
            continue
        local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        parts.append((type(tensor), type(local), tuple(tensor.shape), tuple(local.stride()), tensor.dtype,
                      tensor.requires_grad, str(tensor.device),
                      (tuple(tensor.placements), id(tensor.device_mesh)) if isinstance(tensor, DTensor) else None))
    return tuple(parts)


def _own_copy(function: Callable) -> Callable:
    """`function` with a code object of its own: dynamo keeps compiled code per code object."""
    return types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)


class CompiledFloat8Matmul:
    """`eager(input, weight)` compiled per operand signature, with an eager fallback that says why."""

    def __init__(self, eager: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.eager = eager
        self.compiled: dict[tuple, Callable] = {}
        """Signature -> its compiled function (compiled on its first call)."""
        self.fallbacks: dict[tuple, str] = {}
        """Signature -> why it runs eagerly (its compilation failed)."""

    def __call__(self, input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        key = signature(input, weight)
        if key in self.fallbacks:
            return self.eager(input, weight)
        compiled = self.compiled.get(key)
        if compiled is not None:
            return compiled(input, weight)
        return self._first_call(key, input, weight)

    def _first_call(self, key: tuple, input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        compiled = torch.compile(_own_copy(self.eager), fullgraph=True, dynamic=False)
        try:
            with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
                output = compiled(input, weight)
        except Exception as error:  # noqa: BLE001 - any compile failure falls back; eager re-raises real errors
            reason = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
            self.fallbacks[key] = reason
            warnings.warn(f"autopar fp8: torch.compile could not compile a float8 linear on {_describe(key)} "
                          f"({reason}); it runs torchao's casts eagerly (correct, slower than the plan priced: "
                          "re-plan with fp8_casts='eager' to price that)", RuntimeWarning, stacklevel=3)
            return self.eager(input, weight)
        self.compiled[key] = compiled
        return output


def _describe(key: tuple) -> str:
    shapes = [f"{part[0].__name__}{list(part[2])}" for part in key[1:] if part is not None]
    return " x ".join(shapes)
