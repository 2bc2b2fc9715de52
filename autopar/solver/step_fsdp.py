"""The step model's FSDP2 terms per stage (solver/step_model.py's module docstring says what is
priced): each unit's all-gather and reduce-scatter on a timeline against the stage's compute,
FSDP2's copy-out and copy-in, and under optimizer offload the host copies and gradient
accumulation; the notes the report shows for them.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from autopar.solver.configs import ParallelConfig, StageEstimate
from autopar.solver.prepared import PreparedSegments
from autopar.solver.step_tail import uses_fsdp
from cost_model.fsdp import copy_bytes, ends_fit_a_block, root_ends, timelines_of_arrays


class StepFsdp:
    """StepModel's FSDP2 terms (a mixin: the figures they read are StepModel's fields)."""

    def _fsdp(self, prepared: PreparedSegments, own, config: ParallelConfig):
        """(timeline, exposed seconds by collective per microbatch, once per step, and exposed
        offload copies per microbatch by term)."""
        if not uses_fsdp(config):
            return None, {}, {}, {}
        # What the timeline depends on: identical stages (the middle ones of a deep model) share one.
        key = (prepared.signature(own), config.data_shards, config.pp, config.tp, config.zero_stage,
               config.offload, config.num_microbatches if config.offload else 0, self._fsdp_ep(prepared, config))
        if key not in prepared.fsdp_cache:
            prepared.fsdp_cache[key] = self._fsdp_uncached(prepared, own, config)
        timeline, per_microbatch, step_end, offload = prepared.fsdp_cache[key]
        return timeline, dict(per_microbatch), dict(step_end), dict(offload)

    def fsdp_root_ends(self, config: ParallelConfig, unit_param_numel) -> bool:
        """Whether the stage's first and last units are the runtime's root unit (the policy's
        fsdp_root_ends, or fsdp_small_root_ends where they are small: cost_model/fsdp.py), given
        each unit's parameters on this device: only where one stage holds the whole model
        (pp = 1), without offload, and with a block between them."""
        sizes = list(unit_param_numel)
        if config.pp != 1 or config.offload or len(sizes) < 3:
            return False
        return self.policy.fsdp_root_ends or (self.policy.fsdp_small_root_ends and ends_fit_a_block(sizes))

    @staticmethod
    def _fsdp_ep(prepared: PreparedSegments, config: ParallelConfig) -> int:
        """The ep the FSDP units are priced with (1: no expert weights split)."""
        return config.ep if config.ep > 1 and prepared.expert_numel is not None else 1

    def _fsdp_uncached(self, prepared: PreparedSegments, own, config: ParallelConfig):
        group = self._data_shard_group(config)
        indices = [i for span in own for i in range(span.start, span.stop)]
        numel = prepared.param_numel[indices]
        ep = self._fsdp_ep(prepared, config)
        experts = prepared.expert_numel[indices] / ep if ep > 1 else np.zeros(len(indices))
        numel = numel - experts * (ep - 1)  # this rank's experts, 1/ep of them
        # Identical blocks: price each size once (np.unique's sorted sizes, without its cost on a
        # stage's few segments). A segment with experts is two FSDP units, gathered one after
        # the other: its experts over the dp ranks holding the same ones (expert_replica_group),
        # the rest over all data shards.
        listed = list(zip((numel - experts).tolist(), experts.tolist()))
        sizes = sorted(set(listed))
        position = {size: index for index, size in enumerate(sizes)}
        inverse = [position[size] for size in listed]
        replicas = self.expert_replica_group(config) if ep > 1 else group
        gather = [self.comm.time_s("all_gather", dense * self.policy.fsdp_gather_bytes, group)
                  + self.comm.time_s("all_gather", expert * self.policy.fsdp_gather_bytes, replicas)
                  for dense, expert in sizes]
        scatter = [self.comm.time_s("reduce_scatter", dense * self.policy.dp_reduce_bytes, group)
                   + self.comm.time_s("reduce_scatter", expert * self.policy.dp_reduce_bytes, replicas)
                   for dense, expert in sizes]
        forward = prepared.forward_s[indices]
        arrays = dict(forward_s=forward.tolist(), backward_s=(prepared.time_s[indices] - forward).tolist(),
                      gather_s=[gather[i] for i in inverse], scatter_s=[scatter[i] for i in inverse])
        reshard = config.zero_stage == 3
        ends = self.fsdp_root_ends(config, numel.tolist())
        if ends:  # the runtime's root unit holds the first and last segments (cost_model/fsdp.py)
            forward_gathers, backward_gathers, scatters = root_ends(arrays["gather_s"], arrays["scatter_s"])
            arrays = dict(arrays, gather_s=forward_gathers, backward_gather_s=backward_gathers, scatter_s=scatters)
        offload: dict[str, float] = {}
        if config.offload:  # (offload runs with ep = 1: constraints.check_ep)
            arrays, offload, overlapped = self._with_offload_copies(arrays, np.asarray([sum(size) for size in sizes]),
                                                                    np.asarray(inverse),
                                                                    config, reshard)
        timeline, gathers_only_s = timelines_of_arrays(**arrays, reshard_after_forward=reshard)
        timeline = replace(timeline, root_ends=ends)
        scatter_s = max(0.0, timeline.exposed_s - gathers_only_s)
        per_microbatch: dict[str, float] = {}
        step_end: dict[str, float] = {}
        # ZeRO-3 gathers in every microbatch; ZeRO-1/2 keep parameters gathered from the first
        # forward to the last backward (codegen's set_reshard_after_backward, and what
        # torch.distributed.pipelining does under FSDP2), so their gathers are exposed once:
        # where the first forward does not hide them, or all of them where the runtime gathers
        # synchronously after the optimizer step (PrecisionPolicy.param_gather_overlap False).
        if not reshard and not self.policy.param_gather_overlap:  # all gathered before the forward
            gathers_only_s = timeline.gather_s
        (per_microbatch if reshard else step_end)["all_gather"] = gathers_only_s
        # Gradients are reduce-scattered every microbatch by ZeRO-2/3 without pipelining; ZeRO-1
        # and any ZeRO under pipelining (set_requires_gradient_sync) reduce once, in the last.
        (per_microbatch if config.zero_stage >= 2 and config.pp == 1 else step_end)["reduce_scatter"] = scatter_s
        # What the compute hides is not free: the collectives' blocks hold SMs while they run
        # beside it (cost_model/contention.py), where and as often as each collective runs.
        share = self.comm_sm_share()
        if share:
            hidden_gathers = max(0.0, timeline.gather_s - gathers_only_s)
            hidden_scatters = max(0.0, timeline.reduce_scatter_s - scatter_s)
            (per_microbatch if reshard else step_end)["all_gather.sm_contention"] = hidden_gathers * share
            (per_microbatch if config.zero_stage >= 2 and config.pp == 1 else step_end)[
                "reduce_scatter.sm_contention"] = hidden_scatters * share
        self._add_copies(per_microbatch, step_end, numel, config, reshard=reshard, ends=ends)
        if config.offload:
            # The copies' share of the exposed time is priced as offload.*, not as collectives.
            per_microbatch["all_gather"] = max(0.0, per_microbatch["all_gather"] - offload.get("offload.h2d", 0.0))
            per_microbatch["reduce_scatter"] = max(0.0, per_microbatch["reduce_scatter"] - overlapped["offload.d2h"])
            for op, seconds in per_microbatch.items():  # round-off of the subtractions
                per_microbatch[op] = seconds if seconds > 1e-9 * timeline.compute_s else 0.0
        return timeline, per_microbatch, step_end, offload


    def _add_copies(self, per_microbatch: dict, step_end: dict, numel, config, *, reshard: bool, ends) -> None:
        """FSDP2's copies around its collectives (cost_model/fsdp.py copy_bytes): dp.copy_out after each
        all-gather, dp.copy_in before each reduce-scatter; none where the collectives read and write the
        parameters' own buffers (PrecisionPolicy.fsdp_copies False: Megatron-Core's)."""
        if not self.policy.fsdp_copies:
            return
        copy_out, copy_in = copy_bytes(float(numel.sum()), gather_bytes=self.policy.fsdp_gather_bytes,
                                       reduce_bytes=self.policy.dp_reduce_bytes)
        if reshard:  # each gather before a backward copies out again (the root ends and last block: none)
            regathered = float(numel[1:-2].sum()) if ends else float(numel.sum())
            copy_out += copy_bytes(regathered, gather_bytes=self.policy.fsdp_gather_bytes,
                                   reduce_bytes=self.policy.dp_reduce_bytes)[0]
        bandwidth = self.compute.bandwidth_bytes_per_s
        (per_microbatch if reshard else step_end)["copy_out"] = copy_out / bandwidth
        reduces_each_microbatch = config.zero_stage >= 2 and config.pp == 1
        if not (reduces_each_microbatch and self.policy.casts_once_per_step):
            # (Under casts_once_per_step each microbatch's copy-in is the gradients' cast to the
            # reduce dtype, already in the segments' backward: evaluate._add_gradient_cast.)
            (per_microbatch if reduces_each_microbatch else step_end)["copy_in"] = copy_in / bandwidth
    def _with_offload_copies(self, arrays: dict, sizes, inverse, config: ParallelConfig, reshard: bool):
        """The FSDP2 arrays with each unit's host copies on the collectives' streams, and the exposed
        seconds per microbatch the copies add (by term; see the module docstring), and what of
        those the collectives' own exposure now holds."""
        link = self.host_link_bytes_per_s
        shard = sizes / config.data_shards
        h2d = (shard * self.policy.master_bytes / link)[inverse].tolist()  # the fp32 shard, cast on the device
        d2h = (shard * self.policy.dp_reduce_bytes / link)[inverse].tolist()
        base, _ = timelines_of_arrays(**arrays, reshard_after_forward=reshard)
        copied_in = dict(arrays, gather_s=[g + c for g, c in zip(arrays["gather_s"], h2d)])
        with_h2d, _ = timelines_of_arrays(**copied_in, reshard_after_forward=reshard)
        both = dict(copied_in, scatter_s=[r + c for r, c in zip(arrays["scatter_s"], d2h)])
        with_both, _ = timelines_of_arrays(**both, reshard_after_forward=reshard)
        m = config.num_microbatches
        # From the second microbatch on the D2H copy is blocking (it feeds the host's gradient
        # accumulation, FSDP2's to_accumulate_grad): all of it is exposed, plus the host's add
        # (read two fp32 shards, write one).
        accumulate_s = float(shard[inverse].sum()) * 3 * self.policy.dp_reduce_bytes / self.host_memory_bandwidth_bytes_per_s
        blocking_d2h_s = sum(d2h)
        overlapped = {"offload.h2d": max(0.0, with_h2d.exposed_s - base.exposed_s),
                      "offload.d2h": max(0.0, with_both.exposed_s - with_h2d.exposed_s)}
        terms = {"offload.h2d": overlapped["offload.h2d"],
                 "offload.d2h": (overlapped["offload.d2h"] + (m - 1) * blocking_d2h_s) / m,
                 "offload.grad_accumulate": (m - 1) * accumulate_s / m}
        return both, terms, overlapped


def fsdp_notes(stage: StageEstimate, config: ParallelConfig) -> tuple[str, ...]:
    """What the report says about FSDP2's overlap on the slowest stage."""
    timeline = stage.fsdp
    if timeline is None or timeline.gather_s + timeline.reduce_scatter_s <= 0:
        return ()
    m = config.num_microbatches
    gathers = "forward and backward" if config.zero_stage == 3 else "forward"
    per_step = [op.replace("_", "-") + "s" for op in ("all_gather", "reduce_scatter") if op in stage.fsdp_step_end_s]
    once = f"; {' and '.join(per_step)} once per step, the rest" if per_step and m > 1 else ""
    shards = f"dp={config.dp}" + (f" x cp={config.cp}" if config.cp > 1 else "")
    return (f"FSDP2 (ZeRO-{config.zero_stage}, {shards}) on stage {stage.index}, one pass: all-gathers "
            f"({gathers}) {timeline.gather_s * 1e3:.3g} ms and reduce-scatters {timeline.reduce_scatter_s * 1e3:.3g} ms "
            f"against {timeline.compute_s * 1e3:.3g} ms of compute; exposed {timeline.exposed_s * 1e3:.3g} ms "
            f"({100 * timeline.hidden_fraction:.0f}% hidden): the first unit's gather {timeline.first_gather_s * 1e3:.3g} ms, "
            f"the last reduce-scatter {timeline.last_reduce_scatter_s * 1e3:.3g} ms; worst unit's communication is "
            f"{timeline.worst_unit_ratio:.2f}x its compute{once} x{m} microbatches",)
