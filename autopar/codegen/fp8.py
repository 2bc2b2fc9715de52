"""Float8 training of a plan's linears with torchao (precision "fp8").

**Where the conversion happens.** Not by `convert_to_float8_training` before capture, but here, at
codegen, on the exported graph's `aten.linear` ops. Planning captures a weightless bf16 replica on
meta with torch.export, and the interpreter runs the captured aten ops on DTensors, taking the
backward from autograd of what it ran. torch.export of a converted model fails outright (torch
2.13, torchao 0.18: "Unable to cast NotImplemented to Tensor" from the Float8TrainingTensor
subclass), and a trace that got through would flatten Float8Linear into the aten ops of its forward
(amax, scale, casts, a dequantised matmul), whose autograd is not torchao's float8 backward
(grad_output cast to e5m2 with its own scale, the grad_input and grad_weight matmuls in float8,
`matmul_with_hp_or_float8_args.backward`), and the planner would meet float8 casts as ops to shard.
So the graph stays the model's own; the plan names the linears that run in float8
(Plan.fp8_linears, solver/fp8.py's rule, by weight), and each of those ops runs torchao's own
autograd.Function on the DTensors the plan placed, with the Float8LinearConfig the recipe names:
forward, backward and scales are torchao's.

**Composition.** Tensor parallelism: torchao casts DTensors (`hp_tensor_and_scale_to_float8`
wraps the local Float8TrainingTensor in a DTensor) and DTensor shards the float8 matmul like the
bf16 one; a tensorwise scale of a sharded tensor is an amax over all of it, which DTensor
all-reduces across the tp ranks (a Partial(max) made whole). FSDP2 (ZeRO): under the tensorwise
recipe the weights become WeightWithDynamicFloat8CastTensor (torchao's FSDP2 extension), so each
shard is cast to float8 before the all-gather and 1 byte per element crosses the wire; the scales
are computed for all weights in one all-reduce at the start of every step (after the previous
optimizer step: `precompute_scales`, torchao's `precompute_float8_dynamic_scale_for_fsdp` for
these parameters). Rowwise scales are per row and torchao gathers those weights in bf16.
Pipelining and recomputation need nothing: a stage's segments run the same ops, and a
recomputed segment runs torchao's forward again.

**Compiled casts.** With `compiled` (Plan.fp8_casts "compiled", the default on GPU clusters) each
float8 linear runs compiled by torch.compile, its casts fused as torchtitan's are
(codegen/fp8_compile.py); otherwise torchao runs op by op (eager).

On CPUs torchao's matmul is emulated (`emulate=True`: float8 values dequantised and multiplied in
the input dtype), the same numbers as the float8 kernels up to accumulation order.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.errors import ConfigError

_LINEAR = torch.ops.aten.linear.default


def require_torchao():
    """torchao's float8 package, or a ConfigError saying how to install it."""
    try:
        import torchao.float8 as float8
    except ImportError as error:
        raise ConfigError(f"precision 'fp8' trains with torchao's float8 linears, and torchao cannot be imported "
                          f"({error}): pip install 'torchao>=0.18' (or `pip install autopar[fp8]`), or plan with "
                          "precision 'bf16'") from None
    return float8


def float8_config(recipe: str, *, emulate: bool, fsdp_float8_all_gather: bool):
    """torchao's Float8LinearConfig of `recipe`; the float8 all-gather is tensorwise's only."""
    float8 = require_torchao()
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=emulate,
                               enable_fsdp_float8_all_gather=fsdp_float8_all_gather and recipe == "tensorwise")


def check_device(device: torch.device) -> None:
    """Float8 kernels need compute capability 8.9 (Ada, Hopper) or more; CPUs emulate them."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise ConfigError(f"precision 'fp8' needs FP8 tensor cores (compute capability 8.9+), and "
                          f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}: re-plan with "
                          "precision 'bf16'")


def float8_matmul(mm_config, config):
    """Float8Linear's matmul as a function of (input, weight): torchao's autograd.Function."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    def matmul(input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return matmul_with_hp_or_float8_args.apply(input, weight.t(), mm_config, config)

    return matmul


class Float8Linears:
    """Runs the plan's float8 linears of one rank's program with torchao."""

    def __init__(self, recipe: str, weights: tuple[str, ...], device: torch.device, *,
                 fsdp_float8_all_gather: bool, compiled: bool = False) -> None:
        check_device(device)
        from torchao.float8.float8_linear import Float8Linear

        self.recipe = recipe
        self.weights = frozenset(weights)
        """FQNs of the weights whose linears run in float8 (Plan.fp8_linears)."""
        self.config = float8_config(recipe, emulate=device.type != "cuda",
                                    fsdp_float8_all_gather=fsdp_float8_all_gather)
        # torchao builds a linear's matmul settings from the config in Float8Linear's constructor.
        self.mm_config = Float8Linear(16, 16, bias=False, device="meta", config=self.config).linear_mm_config
        self.nodes: frozenset[str] = frozenset()
        """Names of the linear nodes (of the codegen graph) that run in float8."""
        self.num_calls = 0
        """Float8 linears run so far (forward passes, recomputations included)."""
        self.gathered_weights: list[nn.Parameter] = []
        """Parameters FSDP2 gathers in float8 (their scales are precomputed each step)."""
        self.compiled = compiled
        """The casts run compiled (codegen/fp8_compile.py), else torchao op by op."""
        self.matmul = float8_matmul(self.mm_config, self.config)
        """(input, weight) -> output of a float8 linear without bias: torchao's, eager or compiled."""
        if compiled:
            from autopar.codegen.fp8_compile import CompiledFloat8Matmul

            self.matmul = CompiledFloat8Matmul(self.matmul)

    @property
    def fsdp_float8_all_gather(self) -> bool:
        return self.config.enable_fsdp_float8_all_gather

    def install(self, interpreter, param_of: dict[str, str], fx_nodes: dict[str, torch.fx.Node]) -> None:
        """Route the chosen linear nodes (those reading a weight of the plan's list) through torchao."""
        self.nodes = frozenset(name for name, node in fx_nodes.items()
                               if node.target is _LINEAR and len(node.args) > 1
                               and param_of.get(getattr(node.args[1], "name", "")) in self.weights)
        previous = interpreter.overrides.get(_LINEAR)

        def run(node, args, kwargs):
            if node.name in self.nodes:
                return self.linear(*args, **kwargs)
            return previous(node, args, kwargs) if previous is not None else node.target(*args, **kwargs)

        interpreter.overrides[_LINEAR] = run

    def linear(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Float8Linear.forward on these tensors."""
        self.num_calls += 1
        output = self.matmul(input, weight)
        return output if bias is None else output + bias.to(output.dtype)

    def wrap_for_fsdp(self, owners: list[nn.Module], params: dict[str, nn.Parameter]) -> None:
        """Before fully_shard: the float8 weights become WeightWithDynamicFloat8CastTensor, FSDP2's
        extension that casts each shard to float8 before the all-gather (tensorwise only)."""
        if not self.fsdp_float8_all_gather:
            return
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

        dtype = self.config.cast_config_weight.target_dtype
        wrapped: dict[int, nn.Parameter] = {}
        for fqn in sorted(self.weights & set(params)):
            param = params[fqn]
            local = param.to_local() if isinstance(param, DTensor) else param.data
            inner = WeightWithDynamicFloat8CastTensor(local, self.mm_config, dtype)
            value = DTensor.from_local(inner, param.device_mesh, param.placements, run_check=False) \
                if isinstance(param, DTensor) else inner
            wrapped[id(param)] = params[fqn] = nn.Parameter(value, requires_grad=param.requires_grad)
        for owner in owners:
            for attr, param in list(owner._parameters.items()):
                if param is not None and id(param) in wrapped:
                    owner._parameters[attr] = wrapped[id(param)]
        self.gathered_weights = list(wrapped.values())

    @torch.no_grad()
    def precompute_scales(self) -> None:
        """Each float8-gathered weight's tensorwise scale from its whole (sharded) tensor, all in one
        all-reduce: torchao's precompute_float8_dynamic_scale_for_fsdp for these parameters."""
        from torchao.float8.float8_utils import EPS
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

        weights = [weight for weight in self.gathered_weights if isinstance(weight, DTensor)
                   and isinstance(weight._local_tensor, WeightWithDynamicFloat8CastTensor)]
        if not weights:
            return
        amax = torch.clamp(torch.stack(torch._foreach_norm(weights, ord=math.inf)), EPS)  # Partial -> one all-reduce
        scales = torch.finfo(self.config.cast_config_weight.target_dtype).max / amax.to(torch.float64)
        local = (scales.to_local() if isinstance(scales, DTensor) else scales).to(torch.float32)
        for index, weight in enumerate(weights):
            weight._local_tensor._precomputed_scale = local[index]
