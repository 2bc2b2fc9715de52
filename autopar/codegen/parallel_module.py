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

from autopar.codegen import watchdog
from autopar.codegen.data_parallel import (all_reduce_gradients, divide_expert_gradients, reduce_partial_gradients,
                                          set_gradient_sync, set_reshard_after_backward, sum_over_group, uses_fsdp)
from autopar.codegen.expert_folding import expert_gradient_divisor
from autopar.codegen.interpreter import RunStats
from autopar.codegen.loss_parallel import ModelLoss, replicated_local
from autopar.codegen.pipeline import forward_only
from autopar.codegen.program import ParameterOwner, WeightCasts, attribute_name, shared_parameters
from autopar.codegen.grad_overlap import OverlappedReduction, ReduceGroup
from autopar.codegen.runtime import Runtime
from autopar.errors import PlanMismatchError
from autopar.plans.plan import Plan


class ParallelModule(nn.Module):
    def __init__(self, *, plan: Plan, runtime: Runtime, stages: list[nn.Module], loss_fn: Callable | None,
                 params: dict[str, nn.Parameter], listing: str, stats: RunStats, schedule=None,
                 tied_groups: dict | None = None, has_first: bool = True, has_last: bool = True,
                 input_shapes: tuple = (), keyword_names: tuple[str, ...] = (),
                 model_output: Callable | None = None, expert_params: frozenset = frozenset(),
                 weight_casts: WeightCasts | None = None) -> None:
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
        self.expert_params = expert_params
        """FQNs of the weights split by expert over the ep group (their gradients are reduced over
        the dp ranks holding the same experts)."""
        self.weight_casts = weight_casts or WeightCasts()
        """bf16 plans: the weights' bf16 copies, made once per train_step/eval_step (program.py)."""
        self.loss = ModelLoss(loss_fn, self.model_output, sharded=plan.loss_parallel) if loss_fn else None
        """`loss_fn` on the model output, gathered or (plan.loss_parallel) with its logits class-sharded."""
        self._step_starts_s: deque[float] = deque(maxlen=4096)
        self._step_durations_s: deque[float] = deque(maxlen=4096)
        self._num_train_steps = 0
        self._overlap: OverlappedReduction | None | bool = False  # False: not built yet
        self.random_ops: tuple[str, ...] = ()
        """The random ops of the program that draw (dropout with p > 0, rand_like...), one per node."""
        self.random_sync: Callable[[], None] | None = None
        """Makes the tp group's generators equal at each step's start (codegen/random_ops.py); None
        without tensor parallelism or random ops."""

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
        flat_inputs = self._flat_inputs(inputs, keyword_inputs)
        local = self._is_local_batch(flat_inputs)
        self._sync_random()
        output = self.stages[0](*[self._data_parallel_share(x, local) for x in flat_inputs])
        values = replicated_local(output if isinstance(output, tuple) else (output,))
        return self.model_output(tuple(values if local else (self._gather_batch(value) for value in values)))

    def timing_report(self, *, skip: int = 2):
        """Measured step time (interval between train_step starts, slowest rank) against the
        plan's prediction; every rank must call it. `print(pm.timing_report())`."""
        from autopar.codegen.timing import timing_report

        return timing_report(list(self._step_starts_s), list(self._step_durations_s), self.plan, skip=skip)

    def expert_load(self) -> dict[str, float]:
        """The router's measured load of each dropless expert layer run expert-parallel: the rows
        the busiest rank of the ep group received over the group's mean, summed over every step
        so far ({layer's first expert op: max / mean}; 1.0 = balanced; {} without ep). The price's
        `moe_load_imbalance` states the same ratio. A collective over the ep group: every rank
        calls it."""
        rows = self.stats.expert_rows
        group = self.runtime.ep_group if self.plan.ep > 1 else None
        if group is None or not rows:
            return {}
        names = sorted(rows)
        received = torch.tensor([float(rows[name][0]) for name in names], device=self.runtime.device)
        sent = torch.tensor([float(rows[name][1]) for name in names], device=self.runtime.device)
        dist.all_reduce(received, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(sent, op=dist.ReduceOp.SUM, group=group)
        return {name: float(most / (total / self.plan.ep)) if total else 1.0
                for name, most, total in zip(names, received.tolist(), sent.tolist())}

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
        local_inputs, local_targets = self._local_batch(inputs, targets)
        self._num_train_steps += 1
        step = self._num_train_steps
        overlap = self._gradient_overlap()
        if overlap is not None:
            overlap.begin_step()
        # a collective that times out (a stopped peer) fails naming the peer (watchdog.py)
        with watchdog.watched(step, watchdog.PHASES[0]), self._weight_copies():
            self._sync_random()
            if self.schedule is not None:
                loss = self._pipelined_step(local_inputs, local_targets)
            else:
                loss = self._accumulated_step(local_inputs, local_targets)
        with watchdog.watched(step, watchdog.PHASES[1]):
            self._sync_gradients()
        with watchdog.watched(step, watchdog.PHASES[2]):
            return self._mean_over_data_parallel(loss)

    @property
    def num_train_steps(self) -> int:
        """train_step calls so far in this process (a resumed job counts from its restart)."""
        return self._num_train_steps

    @property
    def _sharded_by_fsdp(self) -> bool:
        """Whether FSDP2 shards this module's parameters (over dp, or dp x cp)."""
        return uses_fsdp(self.plan.zero_stage, self.plan.mesh["dp"] * self.plan.mesh.get("cp", 1), self.plan.offload)

    def _sync_random(self) -> None:
        if self.random_sync is not None:
            self.random_sync()

    def _weight_copies(self):
        """One bf16 copy of each fp32 weight for the whole step (WeightCasts), cast on entry;
        under FSDP2 the gathered parameters are the copies (its MixedPrecisionPolicy)."""
        if self._sharded_by_fsdp:
            return self.weight_casts.step()
        owners = [module for module in self.stages.modules() if isinstance(module, ParameterOwner)]
        return self.weight_casts.step([weight for owner in owners for weight in owner.cast_weights()])

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

    def _local_batch(self, inputs, targets) -> tuple[list, object]:
        """This rank's share of the inputs (a tuple, one tensor or a dict of keyword inputs, global
        or already this rank's dp share) and of the targets, on this rank's device."""
        if isinstance(inputs, Mapping):
            inputs = self._flat_inputs((), inputs)
        else:
            inputs = self._flat_inputs(tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,), {})
        local = self._check_batch(inputs, targets)
        return [self._data_parallel_share(x, local) for x in inputs], self._data_parallel_share(targets, local)

    def _microbatch_loss(self, inputs: list, targets) -> torch.Tensor:
        """`loss_fn` of one microbatch, given the model's own output object (tensor, tuple, ModelOutput)."""
        output = self.stages[0](*inputs)
        flat = output if isinstance(output, tuple) else (output,)
        return self.loss(flat, targets)

    def _accumulated_step(self, inputs: list, targets) -> torch.Tensor:
        m = self.plan.num_microbatches
        split_inputs = [_split(x, m) for x in inputs]
        split_targets = _split(targets, m)
        total = torch.zeros((), device=self.runtime.device)
        fsdp = self._sharded_by_fsdp
        for index in range(m):
            if fsdp and self.plan.zero_stage == 1:
                set_gradient_sync(list(self.stages), index == m - 1)
            if fsdp and self.plan.zero_stage in (1, 2):
                set_reshard_after_backward(list(self.stages), index == m - 1)
            loss = self._microbatch_loss([chunks[index] for chunks in split_inputs], split_targets[index])
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
        last_rank = dist.get_global_rank(self.runtime.pp_group, self._last_stage_rank())
        dist.broadcast(loss, src=last_rank, group=self.runtime.pp_group)
        return loss

    def _last_stage_rank(self) -> int:
        """Pipeline rank of the last stage (pp - 1; rank 0 under ZB-V's V)."""
        from autopar.solver.pipeline import rank_of
        from autopar.solver.step_model import chunks_per_device

        pp = self.plan.mesh["pp"]
        last = pp * chunks_per_device(self.plan.schedule, self.plan.virtual_stages) - 1
        return rank_of(self.plan.schedule, stage=last, num_ranks=pp)

    def _gradient_replicas(self):
        """(process group, size) over which gradients are averaged (FSDP shards over it)."""
        return self.runtime.dp_mesh.get_group(), self.plan.mesh["dp"]

    def _gradient_overlap(self) -> OverlappedReduction | None:
        """ZeRO-0 with data parallelism: the all-reduce of each bucket of gradients issued as its
        last gradient completes in backward (grad_overlap.py), built on the first step."""
        if self._overlap is False:
            group, dp = self._gradient_replicas()
            self._overlap = None
            if dp > 1 and not uses_fsdp(self.plan.zero_stage, dp, self.plan.offload):
                experts = {id(param) for fqn, param in self.named_model_parameters().items()
                           if fqn in self.expert_params}
                if self.schedule is not None:  # its division after backward would miss the buckets
                    self.schedule.scale_grads = False
                divisor = dp * (self.plan.num_microbatches if self.schedule is not None else 1)
                dense = ReduceGroup(group, divisor)
                expert = ReduceGroup(self.runtime.expert_replica_group, divisor) if experts else None
                where = {id(param): (param, expert if id(param) in experts else dense)
                         for param in self.parameters() if param.requires_grad}
                self._overlap = OverlappedReduction(where)
        return self._overlap

    def _sync_gradients(self) -> None:
        group, dp = self._gradient_replicas()
        params = self.named_model_parameters()
        overlap = self._gradient_overlap()
        done = overlap.finish() if overlap is not None else set()  # averaged while backward ran
        if self.schedule is not None and not self.schedule.scale_grads:  # once per parameter (pipeline.py)
            for param in self.parameters():
                if param.grad is not None and id(param) not in done:
                    param.grad.div_(self.plan.num_microbatches)
        reduce_partial_gradients(params.values())
        if not uses_fsdp(self.plan.zero_stage, dp, self.plan.offload):
            experts = [param for fqn, param in params.items() if fqn in self.expert_params and id(param) not in done]
            handled = {id(param) for param in experts} | done
            others = [param for param in self.parameters() if id(param) not in handled]
            all_reduce_gradients(others, group, dp)
            if experts:  # complete within the expert group: summed over its replicas, averaged over dp
                all_reduce_gradients(experts, self.runtime.expert_replica_group, dp)
        else:  # FSDP averaged what it shards; it leaves whole a weight several local chunks read (data_parallel.py)
            all_reduce_gradients(shared_parameters(list(self.stages)), group, dp)
            divide_expert_gradients([param for fqn, param in params.items() if fqn in self.expert_params],
                                    expert_gradient_divisor(self.plan))
        for fqn, group in self.tied_groups.items():
            grad = params[fqn].grad
            if grad is not None:
                params[fqn].grad = _all_reduce_tied(grad, group)

    # --- batches -------------------------------------------------------------------------------

    def _check_batch(self, inputs: tuple, targets) -> bool:
        """Checks shapes; True when the batch is this rank's data-parallel share (per-rank data)."""
        local = self._is_local_batch(tuple(inputs) + (targets,))
        expected = self.plan.global_batch // self.plan.mesh["dp"] if local else self.plan.global_batch
        for index, (value, shape) in enumerate(zip(inputs, self.input_shapes)):
            if isinstance(value, torch.Tensor) and tuple(value.shape[1:]) != tuple(shape[1:]):
                raise PlanMismatchError(f"input {index} has shape {tuple(value.shape)}, but the plan and the traced "
                                        f"program are for (batch, {', '.join(map(str, shape[1:]))}): pass inputs "
                                        "of the traced shape or parallelize again with such example inputs")
        for value in list(inputs) + [targets]:
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] != expected:
                dp = self.plan.mesh["dp"]
                local_form = f" or this rank's share of {self.plan.global_batch // dp} (dp = {dp})" if dp > 1 else ""
                raise PlanMismatchError(f"the plan is for a global batch of {self.plan.global_batch}{local_form}, "
                                        f"but an input has batch {value.shape[0]} (shape {tuple(value.shape)}): "
                                        "pass batches of one size to train_step, or re-plan")
        return local

    def _is_local_batch(self, values: tuple) -> bool:
        """The first batched tensor decides: global batch, or this rank's dp share of it."""
        dp = self.plan.mesh["dp"]
        for value in values:
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                return dp > 1 and value.shape[0] == self.plan.global_batch // dp != self.plan.global_batch
        return False

    def _data_parallel_share(self, value, local: bool = False):
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        dp = self.plan.mesh["dp"]
        value = value.to(self.runtime.device)
        if dp == 1 or local:
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


    # --- training-loop pieces: per-rank data, evaluation, checkpoints, clipping, shutdown -----------

    def eval_step(self, inputs, targets) -> torch.Tensor:
        """The mean loss of a batch (global, or this rank's share) without backward, under any
        plan (pipelined ones included); the same on every rank. The program runs as it was
        traced (in training mode): a model's dropout ops still drop under `pm.eval()`."""
        if self.loss_fn is None:
            raise PlanMismatchError("eval_step needs a loss: pass loss_fn to autopar.parallelize")
        local_inputs, local_targets = self._local_batch(inputs, targets)
        self._sync_random()
        with torch.no_grad(), self._weight_copies():
            if self.schedule is None:
                m = self.plan.num_microbatches
                split_inputs, split_targets = [_split(x, m) for x in local_inputs], _split(local_targets, m)
                losses = [self._microbatch_loss([chunks[i] for chunks in split_inputs], split_targets[i])
                          for i in range(m)]
                loss = torch.stack([value.float() for value in losses]).mean()
            else:
                loss = self._pipelined_eval(local_inputs, local_targets)
        return self._mean_over_data_parallel(loss)

    def _pipelined_eval(self, inputs: list, targets) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        args = inputs if self.has_first else []
        with forward_only(self.schedule):
            if self.has_last:
                self.schedule.eval(*args, target=targets, losses=losses)
            else:
                self.schedule.eval(*args)
        loss = torch.stack([value.detach().float() for value in losses]).mean() if losses else \
            torch.zeros((), device=self.runtime.device)
        last_rank = dist.get_global_rank(self.runtime.pp_group, self._last_stage_rank())
        dist.broadcast(loss, src=last_rank, group=self.runtime.pp_group)
        return loss

    @property
    def dp_rank(self) -> int:
        """This rank's index on the data-parallel axis (`DistributedSampler(rank=pm.dp_rank)`)."""
        return self.runtime.coordinate("dp")

    @property
    def dp_size(self) -> int:
        """Number of data-parallel replicas (`DistributedSampler(num_replicas=pm.dp_size)`);
        `train_step` takes a batch of `plan.global_batch // pm.dp_size` from each."""
        return self.plan.mesh["dp"]

    def original_names(self) -> dict[str, str]:
        """Rank-local parameter name (as `self.named_parameters()` says) -> original model name."""
        return {name: self.fqn_of_attribute.get(name.rsplit(".", 1)[-1], name)
                for name, _ in self.named_parameters()}

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:  # noqa: ARG002 - nn.Module's signature
        """This rank's parameters and persistent buffers by their original names, full shapes
        (DTensors where sharded): what DCP saves and loads."""
        state = dict(self.named_model_parameters())
        state.update(getattr(self, "persistent_buffers", {}))
        return state

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):  # noqa: ARG002
        """Copy full tensors (or DTensors) keyed by original names into this rank's shards."""
        from autopar.codegen.checkpoint import copy_into

        mine = self.state_dict()
        missing = sorted(set(mine) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(mine) - set(self.parameter_aliases_flat()))
        if strict and missing:
            raise PlanMismatchError(f"load_state_dict: no value for {', '.join(missing[:5])}"
                                    f"{' and more' if len(missing) > 5 else ''}: pass the original model's state "
                                    "dict (keys are its parameter names), or strict=False")
        for name, target in mine.items():
            source = state_dict.get(name)
            if source is None:
                source = next((state_dict[alias] for alias in self.parameter_aliases.get(name, [])
                               if alias in state_dict), None)
            if source is not None:
                copy_into(target, source)
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)

    def parameter_aliases_flat(self) -> list[str]:
        return [alias for aliases in getattr(self, "parameter_aliases", {}).values() for alias in aliases]

    def save(self, path, *, optimizer=None, extra: dict | None = None):
        """Save model (and optimizer) state with DCP into the folder `path`, atomically; loadable
        under any plan and world size. Every rank must call it."""
        from autopar.codegen.checkpoint import save

        return save(self, path, optimizer=optimizer, extra=extra)

    def load(self, path, *, optimizer=None, prefix: str = "") -> dict:
        """Load a checkpoint saved by `save` under any plan (or Hugging Face safetensors, whose
        key K fills parameter `prefix + K`); returns the saved `extra`. Every rank must call it."""
        from autopar.codegen.checkpoint import load

        return load(self, path, optimizer=optimizer, prefix=prefix)

    checkpointing = None
    """The CheckpointPolicy `steps` saves and resumes by (parallelize's checkpoint=), or None."""

    def steps(self, total_steps: int, dataset, *, optimizer=None, scheduler=None, shuffle: bool = True,
              seed: int = 0, collate_fn=None):
        """Iterate `(step, batch)` up to step `total_steps`, resuming from the newest complete
        checkpoint of parallelize's `checkpoint=` folder and saving one every `checkpoint_every`
        steps: `batch` is this rank's data-parallel share of the step's global batch of `dataset`
        (collated), the same samples whatever the world size (codegen/training_loop.py). Every rank
        must run the loop."""
        from autopar.codegen.training_loop import run_steps

        return run_steps(self, self.checkpointing, total_steps, dataset, optimizer=optimizer, scheduler=scheduler,
                         shuffle=shuffle, seed=seed, collate_fn=collate_fn)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every gradient so that their total norm over the whole model is at most
        `max_norm`, as `torch.nn.utils.clip_grad_norm_` does on one device; returns the norm."""
        from autopar.codegen.clipping import clip_grad_norm

        with watchdog.watched(self._num_train_steps, "gradient clipping"):
            return clip_grad_norm(self, max_norm, norm_type)

    def close(self) -> None:
        """Release what this module holds of the job: waits for peers, then ends the process group
        (see `runtime.shutdown`). Idempotent; also run by `with` and, for unclosed modules, at exit."""
        from autopar.codegen.runtime import shutdown

        self.schedule = None
        self.tied_groups = {}
        shutdown()

    def __enter__(self) -> "ParallelModule":
        return self

    def __exit__(self, *exc_info) -> None:
        if exc_info[0] is None:
            self.close()


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


