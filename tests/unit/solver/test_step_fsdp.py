"""Expert parallelism under ZeRO-1/2/3 in the step model: expert states sharded over the ranks
holding the same experts (dp / ep, x cp), their FSDP all-gathers and reduce-scatters on that group,
and the search trying ep with every ZeRO stage."""

from dataclasses import replace

import pytest

import autopar
from autopar.models import build_model
from autopar.solver.experts import find_expert_ops
from autopar.solver.step_tail import replica_group
from cost_model.comm import Group
from cost_model.memory import BF16_ADAM, FSDP2_BF16_FP32_REDUCE

TINY_MOE = "moe:layers=2,hidden=32,heads=4,seq=16,vocab=64,num_experts=4"


@pytest.fixture(scope="module")
def tiny_graph():
    bundle = build_model(TINY_MOE, device="meta", batch_size=2)
    return autopar.capture_for_planning(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                        example_targets=bundle.example_targets)


def _evaluate(graph, **config):
    return autopar.evaluate(graph, cluster="dgx-h100:nodes=1", global_batch=16, microbatch_size=2, tp=1, pp=1,
                            dp=8, **config).predicted


def _expert_numel(graph) -> int:
    return sum(graph[op.param].output.numel for op in find_expert_ops(graph))


def test_zero3_shards_experts_over_ep_times_dp_rep_as_all_weights_over_dp(tiny_graph) -> None:
    """ep x dp_rep = dp: ZeRO-3 with ep holds what ZeRO-3 without it holds."""
    plain, split = _evaluate(tiny_graph, zero_stage=3), _evaluate(tiny_graph, zero_stage=3, ep=2)
    for term in ("parameters", "gradients", "optimizer"):
        assert split.memory_bytes[term] == pytest.approx(plain.memory_bytes[term]), term


def test_zero1_keeps_its_experts_whole_and_shards_their_optimizer_states(tiny_graph) -> None:
    plain, split = _evaluate(tiny_graph, zero_stage=1), _evaluate(tiny_graph, zero_stage=1, ep=2)
    experts = _expert_numel(tiny_graph)
    # bf16 parameters of the other half of the experts are not held; optimizer states are sharded
    # over all 8 ranks either way (1/2 of the experts over 4, or all of them over 8).
    assert plain.memory_bytes["parameters"] - split.memory_bytes["parameters"] == pytest.approx(experts / 2 * 2)
    assert split.memory_bytes["optimizer"] == pytest.approx(plain.memory_bytes["optimizer"])


# Experts large enough that the gathers' bandwidth, not their latency, sets their time.
WIDE_MOE = "moe:layers=2,hidden=1024,heads=16,seq=512,vocab=1024,num_experts=16,expert_ffn_hidden=4096"


@pytest.fixture(scope="module")
def wide_graph():
    bundle = build_model(WIDE_MOE, device="meta", batch_size=2)
    return autopar.capture_for_planning(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                        example_targets=bundle.example_targets)


@pytest.fixture(scope="module")
def planner(wide_graph):
    from autopar.plans.planning import planner_for

    return planner_for(wide_graph, None, "dgx-h100:nodes=1", global_batch=16)


def _stage(planner, dp: int = 8, **config):
    from autopar.solver.configs import ParallelConfig

    estimate, _ = planner.evaluate(ParallelConfig(dp=dp, tp=1, pp=1, microbatch_size=2,
                                                  num_microbatches=16 // (dp * 2), **config))
    return estimate.stages[0]


def test_expert_gathers_move_this_ranks_experts_over_their_replicas(planner) -> None:
    plain, split, alone = (_stage(planner, zero_stage=3, ep=ep).fsdp for ep in (1, 2, 4))
    # ep = 2: the experts' gathers move half the experts, over 4 ranks instead of 8.
    assert 0 < split.gather_s < plain.gather_s and 0 < split.reduce_scatter_s < plain.reduce_scatter_s
    # ep = 4 of dp = 8: a quarter of the experts over 2 ranks: less again.
    assert alone.gather_s < split.gather_s


def test_with_dp_equal_to_ep_experts_are_not_gathered(planner, wide_graph) -> None:
    """dp_rep = 1: each rank holds its experts whole; only the other weights are gathered, as
    a dp8 x ep8 stage gathers less than a dp8 x ep4 one, whose experts are sharded over 2."""
    alone, paired = _stage(planner, zero_stage=3, ep=8), _stage(planner, zero_stage=3, ep=4)
    assert alone.expert_param_numel == _expert_numel(wide_graph) / 8
    assert 0 < alone.fsdp.gather_s < paired.fsdp.gather_s
    assert _stage(planner, zero_stage=0, ep=8).fsdp is None


def test_ep_runs_with_every_zero_stage(tiny_graph) -> None:
    for zero in (1, 2, 3):
        plan = autopar.plan(tiny_graph, cluster="dgx-h100:nodes=1", global_batch=16,
                            constraints={"ep": 2, "zero_stage": zero, "tp": 1})
        assert plan.ep == 2 and plan.zero_stage == zero, plan.summary()
        assert plan.predicted.breakdown_s["ep.dispatch"] > 0


@pytest.mark.parametrize("dp_rep, ep, cp, tp, expected", [
    (4, 2, 1, 1, Group(num_nodes=1, devices_per_node=4)),   # stride 2: four in a node of 8
    (2, 8, 1, 1, Group(num_nodes=2, devices_per_node=1)),   # stride 8: one per node
    (2, 2, 2, 2, Group(num_nodes=2, devices_per_node=2)),   # cp pairs in a node, dp_rep across nodes
    (4, 2, 2, 1, Group(num_nodes=2, devices_per_node=4)),   # a node holds 2 dp_rep x 2 cp of one ep index
    (2, 1, 4, 4, Group(num_nodes=4, devices_per_node=2)),   # cp strided by tp = 4: 2 cp ranks per node
])
def test_the_expert_replica_group_spans_what_the_layout_places(dp_rep, ep, cp, tp, expected) -> None:
    assert replica_group(dp_rep, ep, cp, tp, devices_per_node=8) == expected


def test_a_forced_ep_is_planned_with_zero_where_that_is_faster() -> None:
    """Experts dominate (64 experts of 1024 x 4096 per layer): with ep = 8 forced, ZeRO shards the
    rest and the experts' optimizer states, instead of a pipeline holding them (ZeRO-0 pp2, 0.164 s
    predicted before ep ran with ZeRO)."""
    big_moe = "moe:layers=16,hidden=1024,heads=16,seq=1024,vocab=32000,num_experts=64,top_k=2,expert_ffn_hidden=4096"
    plan = autopar.plan(big_moe, cluster="dgx-h100:nodes=8", global_batch=256, constraints={"ep": 8})
    assert plan.ep == 8 and plan.zero_stage > 0, plan.summary()
    zero0 = autopar.plan(big_moe, cluster="dgx-h100:nodes=8", global_batch=256, constraints={"ep": 8, "zero_stage": 0})
    assert plan.predicted.step_time_s < zero0.predicted.step_time_s


def test_pipelined_zero2_accumulates_only_this_ranks_experts(planner) -> None:
    """Under pipelining ZeRO-2 accumulates unsharded gradients until the step's reduce-scatter:
    of the experts, only the 1/ep this rank holds."""
    from autopar.solver.configs import ParallelConfig

    def gradients(ep: int) -> float:
        config = ParallelConfig(dp=4, tp=1, pp=2, microbatch_size=2, num_microbatches=2, zero_stage=2, ep=ep)
        estimate, _ = planner.evaluate(config)
        return max(stage.memory_bytes["gradients"] for stage in estimate.stages)

    assert gradients(4) < gradients(2) < gradients(1)


# --- the SMs FSDP2's collectives hold while the compute hides them (cost_model/contention.py) ---

DENSE = "llama:layers=4,hidden=1024,heads=16,kv_heads=4,ffn_hidden=4096,vocab=2048,seq=2048"


@pytest.fixture(scope="module")
def dense_graph():
    return autopar.capture_for_planning(DENSE)


def _fsdp_terms(graph, cluster: str, dp: int) -> dict:
    estimate = autopar.evaluate(graph, cluster=cluster, global_batch=dp, microbatch_size=1, tp=1, pp=1, dp=dp,
                                zero_stage=3).predicted
    return estimate.breakdown_s


def test_hidden_fsdp_collectives_slow_the_compute_by_their_sm_share(dense_graph) -> None:
    terms = _fsdp_terms(dense_graph, "dgx-h100:nodes=1", 8)
    assert terms["dp.all_gather.sm_contention"] > 0
    assert terms["dp.reduce_scatter.sm_contention"] > 0


def test_the_contention_grows_as_the_collectives_grow_across_nodes(dense_graph) -> None:
    one_node = _fsdp_terms(dense_graph, "dgx-h100:nodes=1", 8)
    sixteen = _fsdp_terms(dense_graph, "dgx-h100:nodes=16", 128)
    assert sixteen["dp.all_gather.sm_contention"] > one_node["dp.all_gather.sm_contention"]


def test_without_the_libraries_channels_nothing_is_priced(dense_graph) -> None:
    terms = _fsdp_terms(dense_graph, "cpu:procs=4", 4)
    assert "dp.all_gather.sm_contention" not in terms


def test_zero0s_all_reduce_hidden_behind_the_backward_holds_sms_too(dense_graph, monkeypatch) -> None:
    from autopar.solver.step_tail import StepTail

    def sync(graph) -> float:
        return autopar.evaluate(graph, cluster="dgx-h100:nodes=1", global_batch=8, microbatch_size=1, tp=1, pp=1,
                                dp=8, zero_stage=0).predicted.breakdown_s["dp.gradient_sync"]

    with_sms = sync(dense_graph)
    monkeypatch.setattr(StepTail, "comm_sm_share", lambda self: 0.0)
    assert with_sms > sync(dense_graph) > 0


@pytest.mark.parametrize("zero_stage, num_microbatches", [(3, 1), (3, 4), (2, 4), (1, 4)])
@pytest.mark.parametrize("policy", [FSDP2_BF16_FP32_REDUCE, BF16_ADAM], ids=["torchtitan", "autopar"])
def test_fsdp_copies_are_priced_on_the_compute_stream(zero_stage, num_microbatches, policy):
    """FSDP2's copy-out after each all-gather and copy-in before each reduce-scatter. Under
    autopar's own runtime (BF16_ADAM) each microbatch's copy-in is the gradients' cast to fp32,
    which the segments' backward already prices (evaluate._add_gradient_cast): not counted twice."""
    from test_step_model import model, segments

    from autopar.solver.step_model import ParallelConfig, PreparedSegments

    step_model = model(policy=policy)
    config = ParallelConfig(dp=8, tp=1, pp=1, microbatch_size=1, num_microbatches=num_microbatches,
                            zero_stage=zero_stage)
    result = step_model.estimate(PreparedSegments.build(segments(), "none"), config)
    numel = 8 * 1e6  # the stage's unsharded parameters (segments(): 8 units of 1e6)
    bandwidth = step_model.compute.bandwidth_bytes_per_s
    policy = step_model.policy
    copy_out_s = 2 * numel * policy.fsdp_gather_bytes / bandwidth
    copy_in_s = numel * (policy.fsdp_gather_bytes + policy.dp_reduce_bytes) / bandwidth
    breakdown = result.breakdown_s
    m = num_microbatches
    if zero_stage == 3:  # gathered before the forward and again before the backward, every microbatch
        assert breakdown["dp.copy_out"] == pytest.approx(2 * m * copy_out_s)
    else:  # kept gathered from the first forward to the last backward: once
        assert breakdown["dp.copy_out.once"] == pytest.approx(copy_out_s)
    if zero_stage >= 2 and policy.casts_once_per_step:
        assert "dp.copy_in" not in breakdown and "dp.copy_in.once" not in breakdown
    elif zero_stage >= 2:  # reduce-scattered every microbatch
        assert breakdown["dp.copy_in"] == pytest.approx(m * copy_in_s)
    else:
        assert breakdown["dp.copy_in.once"] == pytest.approx(copy_in_s)
    unsharded = step_model.estimate(PreparedSegments.build(segments(), "none"),
                                    ParallelConfig(dp=8, tp=1, pp=1, microbatch_size=1,
                                                   num_microbatches=num_microbatches, zero_stage=0))
    assert not any(term.startswith("dp.copy") for term in unsharded.breakdown_s)  # DDP: no FSDP copies


@pytest.mark.parametrize("pp", [1, 2])
def test_a_root_unit_holding_the_ends_is_priced_where_one_stage_holds_the_model(pp):
    """fsdp_root_ends (torchtitan's wrapping until 2025-07): with pp = 1 the first and last
    segments' parameters stay gathered and the last one's gradients are held (memory), the
    root's reduce-scatter after the whole backward is exposed, and the root and the last block
    are not gathered again for backward; under pipelining each unit is priced on its own."""
    from dataclasses import replace

    from test_step_model import model, segments

    from autopar.solver.step_model import ParallelConfig, PreparedSegments

    config = ParallelConfig(dp=8, tp=1, pp=pp, microbatch_size=1, num_microbatches=4, zero_stage=3)
    ends = model(policy=replace(FSDP2_BF16_FP32_REDUCE, fsdp_root_ends=True)).estimate(
        PreparedSegments.build(segments(), "none"), config)
    apart = model(policy=FSDP2_BF16_FP32_REDUCE).estimate(PreparedSegments.build(segments(), "none"), config)
    if pp == 2:
        assert ends.memory_bytes == apart.memory_bytes and ends.breakdown_s == apart.breakdown_s
        return
    unit = 1e6  # segments(): 8 units of 1e6 parameters
    # root (2 units) + a pair of blocks in bf16, the head's bf16 gradients, one block's fp32 ones
    assert ends.memory_bytes["fsdp_unsharded"] == pytest.approx((2 + 2) * unit * 2 + unit * 2 + unit * 4)
    assert apart.memory_bytes["fsdp_unsharded"] == pytest.approx(2 * unit * 2 + unit * 4)
    assert ends.breakdown_s["dp.reduce_scatter"] > apart.breakdown_s["dp.reduce_scatter"]
    # copy-out after each gather: 8 units before forward, 5 before backward (not 0, 6 and 7)
    assert ends.breakdown_s["dp.copy_out"] == pytest.approx(apart.breakdown_s["dp.copy_out"] * 13 / 16)


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_a_runtime_that_gathers_after_the_optimizer_step_exposes_every_gather(zero_stage):
    """PrecisionPolicy.param_gather_overlap False (Megatron-Core's distributed optimizer without
    overlap_param_gather): the updated parameters are all-gathered synchronously after the step,
    none of it hidden by the first forward, which FSDP2's prefetch (and overlap_param_gather) does."""
    from dataclasses import replace

    from test_step_model import model, segments

    from autopar.solver.step_model import ParallelConfig, PreparedSegments
    from cost_model.memory import MEGATRON_BF16

    config = ParallelConfig(dp=8, tp=1, pp=1, microbatch_size=1, num_microbatches=4, zero_stage=zero_stage)
    overlapped = model(policy=MEGATRON_BF16).estimate(PreparedSegments.build(segments(), "none"), config)
    synchronous = model(policy=replace(MEGATRON_BF16, param_gather_overlap=False)).estimate(
        PreparedSegments.build(segments(), "none"), config)
    assert synchronous.breakdown_s["dp.all_gather.once"] == pytest.approx(overlapped.stages[0].fsdp.gather_s)
    assert synchronous.breakdown_s["dp.all_gather.once"] > overlapped.breakdown_s["dp.all_gather.once"]
    assert not synchronous.breakdown_s.get("dp.all_gather.sm_contention.once")
    assert synchronous.step_time_s > overlapped.step_time_s


@pytest.mark.parametrize("end_numel, joins", [(4e5, True), (6e5, False)])
def test_autopar_runtime_makes_small_ends_the_roots_and_prices_them_so(end_numel, joins):
    """BF16_ADAM (autopar's runtime) wraps the first and last segments into the root unit where
    together they hold no more parameters than a block (cost_model/fsdp.ends_fit_a_block): the
    estimate says so (FsdpTimeline.root_ends, which the plan records) and prices that wrapping,
    as fsdp_root_ends does; larger ends stay units of their own, priced as before."""
    from dataclasses import replace

    from test_step_model import model, segments

    from autopar.solver.step_model import ParallelConfig, PreparedSegments
    from cost_model.memory import BF16_ADAM

    items = segments()
    items[0].param_numel = items[-1].param_numel = end_numel
    config = ParallelConfig(dp=8, tp=1, pp=1, microbatch_size=1, num_microbatches=4, zero_stage=3)
    chosen = model().estimate(PreparedSegments.build(items, "none"), config)
    forced = model(policy=replace(BF16_ADAM, fsdp_small_root_ends=False, fsdp_root_ends=joins)).estimate(
        PreparedSegments.build(items, "none"), config)
    assert [stage.fsdp.root_ends for stage in chosen.stages] == [joins]
    assert chosen.breakdown_s == forced.breakdown_s and chosen.memory_bytes == forced.memory_bytes
    piped = model().estimate(PreparedSegments.build(items, "none"), replace(config, pp=2))
    assert not any(stage.fsdp.root_ends for stage in piped.stages)  # one stage holding the model only


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_megatrons_buffers_are_the_parameters_own_storage_nothing_copied(zero_stage):
    """Megatron-Core's distributed optimizer and Megatron-FSDP gather into and reduce from the
    buffers that hold the parameters and gradients (PrecisionPolicy.fsdp_copies False): no
    dp.copy_in / dp.copy_out, the collectives themselves as FSDP2's."""
    from test_step_model import model, segments

    from autopar.solver.step_model import ParallelConfig, PreparedSegments
    from cost_model.memory import MEGATRON_BF16

    config = ParallelConfig(dp=8, tp=1, pp=1, microbatch_size=1, num_microbatches=4, zero_stage=zero_stage)
    copied, megatron = (model(policy=policy).estimate(PreparedSegments.build(segments(), "none"), config).breakdown_s
                        for policy in (replace(MEGATRON_BF16, fsdp_copies=True), MEGATRON_BF16))
    assert any(term.startswith("dp.copy") for term in copied)
    assert not any(term.startswith("dp.copy") for term in megatron)
    collectives = [term for term in copied if term.startswith("dp.") and "copy" not in term]
    assert collectives and all(megatron[term] == pytest.approx(copied[term]) for term in collectives)
