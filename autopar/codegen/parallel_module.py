"""ParallelModule: the model as this rank runs it under a plan.

    loss = pm.train_step(inputs, targets)   # forward + backward over every microbatch
    optimizer.step()                        # an optimizer over pm.parameters()

`train_step` takes the global batch (the same on every rank) and runs this rank's data-parallel
share of it in `plan.num_microbatches` microbatches; the gradients it leaves are those of the
mean loss over the global batch, as on one device. `pm(inputs)` runs the forward pass (plans
without pipeline stages) and returns the whole output.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from autopar.codegen.data_parallel import (all_reduce_gradients, set_gradient_sync, set_reshard_after_backward,
                                          sum_over_group, uses_fsdp)
from autopar.codegen.interpreter import RunStats, contiguous_grad
from autopar.codegen.program import attribute_name
from autopar.codegen.runtime import Runtime
from autopar.errors import PlanMismatchError
from autopar.plans import Plan


class ParallelModule(nn.Module):
    def __init__(self, *, plan: Plan, runtime: Runtime, stages: list[nn.Module], loss_fn: Callable | None,
                 params: dict[str, nn.Parameter], listing: str, stats: RunStats, schedule=None,
                 tied_groups: dict | None = None, has_first: bool = True, has_last: bool = True,
                 input_shapes: tuple = (), keyword_names: tuple[str, ...] = (),
                 model_output: Callable | None = None) -> None:
        super().__init__()
        self.plan = plan
        self.runtime = runtime
        self.stages = nn.ModuleList(stages)
        self.loss_fn = loss_fn
        self.fqn_of_attribute = {attribute_name(fqn): fqn for fqn in params}
        self._listing = listing
        self.stats = stats
        self.schedule = schedule
        self.tied_groups = tied_groups or {}
        self.has_first = has_first
        self.has_last = has_last
        self.input_shapes = input_shapes
        """Shapes of the model inputs as traced (dim 0 is the batch), keyword inputs last."""
        self.keyword_names = keyword_names
        """The keyword inputs the model was traced with, in the traced order."""
        self.model_output = model_output or (lambda values: values[0] if len(values) == 1 else values)
        """Rebuilds the model's return value (tensor, tuple, ModelOutput) from the program's tensors."""
        self._step_starts_s: deque[float] = deque(maxlen=4096)
        self._step_durations_s: deque[float] = deque(maxlen=4096)

    # --- public API ----------------------------------------------------------------------------

    def generated_code(self) -> str:
        """The rank-local program: ops with their placements and the collectives between them."""
        return self._listing

    def named_model_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's parameters by their name in the original model (the objects FSDP
        registered, when it sharded them)."""
        found = {}
        for name, param in self.stages.named_parameters():
            attribute = name.rsplit(".", 1)[-1]
            found[self.fqn_of_attribute.get(attribute, attribute)] = param
        return found

    def forward(self, *inputs, **keyword_inputs):
        if self.plan.mesh["pp"] > 1:
            raise PlanMismatchError("pm(inputs) runs plans without pipeline stages; use pm.train_step(inputs, "
                                    "targets) with a pipelined plan")
        local = [self._data_parallel_share(x) for x in self._flat_inputs(inputs, keyword_inputs)]
        output = self.stages[0](*local)
        flat = output if isinstance(output, tuple) else (output,)
        return self.model_output(tuple(self._gather_batch(value) for value in _replicated_local(flat)))

    def timing_report(self, *, skip: int = 2):
        """Measured step time (interval between train_step starts, slowest rank) against the
        plan's prediction; every rank must call it. `print(pm.timing_report())`."""
        from autopar.tune.timing import timing_report

        return timing_report(list(self._step_starts_s), list(self._step_durations_s), self.plan, skip=skip)

    def train_step(self, inputs, targets) -> torch.Tensor:
        """Forward and backward of the global batch; returns the mean loss (the same on every rank).
        `inputs` is a tuple of positional inputs, one tensor, or a dict of keyword inputs."""
        started = time.perf_counter()
        self._step_starts_s.append(started)
        loss = self._train_step(inputs, targets)
        self._step_durations_s.append(time.perf_counter() - started)
        return loss

    def _train_step(self, inputs, targets) -> torch.Tensor:
        if self.loss_fn is None:
            raise PlanMismatchError("train_step needs a loss: pass loss_fn to autopar.parallelize")
        if isinstance(inputs, Mapping):
            inputs = self._flat_inputs((), inputs)
        else:
            inputs = self._flat_inputs(tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,), {})
        self._check_batch(inputs, targets)
        local_inputs = [self._data_parallel_share(x) for x in inputs]
        local_targets = self._data_parallel_share(targets)
        if self.schedule is not None:
            loss = self._pipelined_step(local_inputs, local_targets)
        else:
            loss = self._accumulated_step(local_inputs, local_targets)
        self._sync_gradients()
        return self._mean_over_data_parallel(loss)

    def _flat_inputs(self, positional: tuple, keywords) -> tuple:
        """Positional inputs, then the keyword inputs in the order the model was traced with."""
        keywords = dict(keywords)
        num_positional = len(self.input_shapes) - len(self.keyword_names)
        if set(keywords) != set(self.keyword_names) or (self.input_shapes and len(positional) != num_positional):
            traced = ", ".join(self.keyword_names) or "none"
            raise PlanMismatchError(f"the model was traced with keyword inputs ({traced}) and "
                                    f"{num_positional} positional ones, but got "
                                    f"keywords ({', '.join(keywords) or 'none'}) and {len(positional)} positional: "
                                    "pass the inputs as they were given to parallelize")
        return tuple(positional) + tuple(keywords[name] for name in self.keyword_names)

    # --- steps ---------------------------------------------------------------------------------

    def _accumulated_step(self, inputs: list, targets) -> torch.Tensor:
        m = self.plan.num_microbatches
        split_inputs = [_split(x, m) for x in inputs]
        split_targets = _split(targets, m)
        total = torch.zeros((), device=self.runtime.device)
        fsdp = uses_fsdp(self.plan.zero_stage, self.plan.mesh["dp"])
        for index in range(m):
            if fsdp and self.plan.zero_stage == 1:
                set_gradient_sync(list(self.stages), index == m - 1)
            if fsdp and self.plan.zero_stage in (1, 2):
                set_reshard_after_backward(list(self.stages), index == m - 1)
            output = self.stages[0](*[chunks[index] for chunks in split_inputs])
            flat = output if isinstance(output, tuple) else (output,)
            loss = self.loss_fn(self.model_output(tuple(_float(value) for value in _replicated_local(flat))),
                                split_targets[index])
            (loss / m).backward()
            total += loss.detach()
        return total / m

    def _pipelined_step(self, inputs: list, targets) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        args = inputs if self.has_first else []
        if self.has_last:
            self.schedule.step(*args, target=targets, losses=losses)
        else:
            self.schedule.step(*args)
        loss = torch.stack([value.detach().float() for value in losses]).mean() if losses else \
            torch.zeros((), device=self.runtime.device)
        last_rank = dist.get_global_rank(self.runtime.pp_group, self.plan.mesh["pp"] - 1)
        dist.broadcast(loss, src=last_rank, group=self.runtime.pp_group)
        return loss

    def _sync_gradients(self) -> None:
        dp = self.plan.mesh["dp"]
        if not uses_fsdp(self.plan.zero_stage, dp):
            all_reduce_gradients(list(self.parameters()), self.runtime.dp_mesh.get_group(), dp)
        params = self.named_model_parameters()
        for fqn, group in self.tied_groups.items():
            grad = params[fqn].grad
            if grad is not None:
                params[fqn].grad = _all_reduce_tied(grad, group)

    # --- batches -------------------------------------------------------------------------------

    def _check_batch(self, inputs: tuple, targets) -> None:
        for index, (value, shape) in enumerate(zip(inputs, self.input_shapes)):
            if isinstance(value, torch.Tensor) and tuple(value.shape[1:]) != tuple(shape[1:]):
                raise PlanMismatchError(f"input {index} has shape {tuple(value.shape)}, but the plan and the traced "
                                        f"program are for (batch, {', '.join(map(str, shape[1:]))}): pass inputs "
                                        "of the traced shape or parallelize again with such example inputs")
        for value in list(inputs) + [targets]:
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] != self.plan.global_batch:
                raise PlanMismatchError(f"the plan is for a global batch of {self.plan.global_batch}, but an input "
                                        f"has batch {value.shape[0]} (shape {tuple(value.shape)}): pass the global "
                                        "batch to train_step or re-plan")

    def _data_parallel_share(self, value):
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        dp = self.plan.mesh["dp"]
        value = value.to(self.runtime.device)
        if dp == 1:
            return value
        share = value.shape[0] // dp
        start = self.runtime.coordinate("dp") * share
        return value[start:start + share]

    def _gather_batch(self, output: torch.Tensor) -> torch.Tensor:
        dp = self.plan.mesh["dp"]
        if dp == 1:
            return output
        pieces = [torch.empty_like(output) for _ in range(dp)]
        dist.all_gather(pieces, output.contiguous(), group=self.runtime.dp_mesh.get_group())
        return torch.cat(pieces)

    def _mean_over_data_parallel(self, loss: torch.Tensor) -> torch.Tensor:
        dp = self.plan.mesh["dp"]
        if dp == 1:
            return loss
        return sum_over_group(loss, self.runtime.dp_mesh.get_group()) / dp


@torch.no_grad()
def _all_reduce_tied(grad: torch.Tensor, group) -> torch.Tensor:
    """Sum a tied weight's gradient over the pipeline ranks that hold a copy of it.

    The copies may be placed differently on each stage (a replicated embedding on the first, a
    vocab-parallel head on the last) and a gradient may still be partial, so the local pieces
    differ: the whole gradient is reduced, and each rank keeps its shard of the sum (a partial
    gradient becomes the replicated sum)."""
    if not isinstance(grad, DTensor):
        dist.all_reduce(grad, group=group)
        return grad
    if all(isinstance(placement, Replicate) for placement in grad.placements):
        dist.all_reduce(grad.to_local(), group=group)
        return grad
    full = grad.full_tensor()
    dist.all_reduce(full, group=group)
    mesh = grad.device_mesh
    placements = [Replicate() if isinstance(placement, Partial) else placement for placement in grad.placements]
    mine = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False).redistribute(mesh, placements)
    if tuple(placements) == tuple(grad.placements):
        grad.to_local().copy_(mine.to_local())
        return grad
    return mine


def _split(value, parts: int):
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return list(value.chunk(parts))
    return [value] * parts


def _replicated_local(value):
    if isinstance(value, DTensor):
        return contiguous_grad(value).redistribute(value.device_mesh, [Replicate()]).to_local()
    if isinstance(value, (tuple, list)):
        return type(value)(_replicated_local(item) for item in value)
    return value


def _float(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.float()
    return value
