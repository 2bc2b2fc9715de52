"""The step-time and memory model on synthetic segments with known answers."""

import pytest

from autopar.cluster import Cluster
from autopar.solver.costing import CommEvent
from autopar.solver.evaluate import SegmentCost
from autopar.solver.step_model import ParallelConfig, PreparedSegments, StepModel
from cost_model.comm import CommModel
from cost_model.compute import ComputeModel, ComputeTime
from cost_model.memory import BF16_ADAM, MEGATRON_BF16

FORWARD_S, BACKWARD_S = 0.01, 0.02


def segments(count: int = 8, *, tp_comm_s: float = 0.0) -> list[SegmentCost]:
    made = []
    for index in range(count):
        segment = SegmentCost(name=f"layers.{index}", forward=ComputeTime(matmul_s=FORWARD_S),
                              backward=ComputeTime(matmul_s=BACKWARD_S), param_numel=1e6, saved_bytes=1e8,
                              input_bytes=1e6, output_bytes=0.0, selective_recompute=ComputeTime(memory_s=0.001))
        segment.selective_kept["x"] = 5e7
        if tp_comm_s:
            segment.comm.append(CommEvent(op="all_reduce", axis=0, message_bytes=1e6, time_s=tp_comm_s, phase="fwd"))
        made.append(segment)
    return made


def model(budget: float = 1e12, policy=BF16_ADAM) -> StepModel:
    cluster = Cluster.from_spec("dgx-a100-80g:nodes=4")
    return StepModel(devices_per_node=8, compute=ComputeModel(cluster.device), comm=CommModel(cluster),
                     policy=policy, memory_budget_bytes=budget)


def estimate(config: ParallelConfig, recompute: str | None = None, **kwargs):
    items = segments(**kwargs)
    return model().estimate(PreparedSegments.build(items, recompute or config.recompute), config)


def test_no_pipeline_accumulates_microbatches():
    config = ParallelConfig(dp=1, tp=1, pp=1, microbatch_size=1, num_microbatches=4)
    result = estimate(config)
    assert result.breakdown_s["bubble"] == pytest.approx(0.0, abs=1e-12)
    assert result.breakdown_s["compute"] == pytest.approx(4 * 8 * (FORWARD_S + BACKWARD_S))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_1f1b_bubble_is_p_minus_1_over_m(schedule):
    p, m = 4, 8
    config = ParallelConfig(dp=1, tp=1, pp=p, microbatch_size=1, num_microbatches=m, schedule=schedule)
    result = estimate(config)
    per_stage = 2 * (FORWARD_S + BACKWARD_S)
    assert result.breakdown_s["bubble"] / (m * per_stage) == pytest.approx((p - 1) / m, rel=1e-6)


def test_interleaving_divides_the_bubble():
    p, m, v = 2, 8, 2
    plain = estimate(ParallelConfig(dp=1, tp=1, pp=p, microbatch_size=1, num_microbatches=m))
    interleaved = estimate(ParallelConfig(dp=1, tp=1, pp=p, microbatch_size=1, num_microbatches=m,
                                          schedule="interleaved", virtual_stages=v))
    assert interleaved.breakdown_s["bubble"] == pytest.approx(plain.breakdown_s["bubble"] / v, rel=1e-6)
    assert [len(stage.chunks) for stage in interleaved.stages] == [v, v]


def test_recomputation_trades_time_for_memory():
    config = ParallelConfig(dp=1, tp=1, pp=1, microbatch_size=1, num_microbatches=1)
    none = estimate(config)
    full = estimate(ParallelConfig(dp=1, tp=1, pp=1, microbatch_size=1, num_microbatches=1, recompute="full"))
    selective = estimate(ParallelConfig(dp=1, tp=1, pp=1, microbatch_size=1, num_microbatches=1,
                                        recompute="selective"))
    assert full.breakdown_s["recompute"] == pytest.approx(8 * FORWARD_S)
    assert none.memory_bytes["activations"] == pytest.approx(8e8)
    assert full.memory_bytes["activations"] == pytest.approx(8e6)
    assert selective.memory_bytes["activations"] == pytest.approx(4e8)
    assert none.step_time_s < selective.step_time_s < full.step_time_s


def test_full_recompute_repeats_forward_collectives():
    plain = estimate(ParallelConfig(dp=1, tp=2, pp=1, microbatch_size=1, num_microbatches=1), tp_comm_s=0.001)
    full = estimate(ParallelConfig(dp=1, tp=2, pp=1, microbatch_size=1, num_microbatches=1, recompute="full"),
                    tp_comm_s=0.001)
    assert plain.breakdown_s["tp.all_reduce"] == pytest.approx(8 * 0.001)
    assert full.breakdown_s["tp.all_reduce"] == pytest.approx(16 * 0.001)


@pytest.mark.parametrize("zero, params, grads, optimizer", [
    (0, 2.0, 2.0, 12.0), (1, 2.0, 2.0, 12.0 / 8), (2, 2.0, 2.0 / 8, 12.0 / 8), (3, 2.0 / 8, 2.0 / 8, 12.0 / 8)])
def test_zero_stage_memory(zero, params, grads, optimizer):
    config = ParallelConfig(dp=8, tp=1, pp=1, microbatch_size=1, num_microbatches=1, zero_stage=zero)
    result = estimate(config)
    numel = 8e6
    assert result.memory_bytes["parameters"] == pytest.approx(params * numel)
    assert result.memory_bytes["gradients"] == pytest.approx(grads * numel)
    assert result.memory_bytes["optimizer"] == pytest.approx(optimizer * numel)
    assert sum(seconds for name, seconds in result.breakdown_s.items() if name.startswith("dp.")) > 0


def test_memory_budget_marks_configurations_that_do_not_fit():
    config = ParallelConfig(dp=1, tp=1, pp=1, microbatch_size=1, num_microbatches=1)
    prepared = PreparedSegments.build(segments(), "none")
    assert model(budget=1e12).estimate(prepared, config).fits
    assert not model(budget=1e8).estimate(prepared, config).fits


def test_a_stage_fits_by_its_own_memory_not_the_bound_over_stages():
    """The split search bounds every stage's workspace by the whole model's (the last segment's
    large gradient workspace, a vocabulary head's, on the first stage too); a built stage that
    holds less fits, and the estimate says so."""
    config = ParallelConfig(dp=1, tp=1, pp=2, microbatch_size=1, num_microbatches=2)
    items = segments()
    items[-1].grad_workspace_bytes = 6e8
    prepared = PreparedSegments.build(items, "none")
    roomy = model().estimate(prepared, config)
    first, last = (stage.total_memory_bytes for stage in roomy.stages)
    assert first < last and roomy.memory_bytes["gradient_workspace"] == pytest.approx(6e8)
    fitting = model(budget=last * 1.001).estimate(prepared, config)
    assert fitting.fits
    assert not model(budget=last * 0.999).estimate(prepared, config).fits


def test_later_pipeline_stages_recompute_less_when_they_fit():
    """1F1B's stage s holds pp - s microbatches, so the last stages may keep their activations."""
    config = ParallelConfig(dp=1, tp=1, pp=4, microbatch_size=1, num_microbatches=8, recompute="full")
    items = segments()
    prepared = {mode: PreparedSegments.build(items, mode) for mode in ("none", "selective", "full")}
    # Stage s, 2 segments: states 3.2e7 + (4 - s) in flight x (2e8 none | 1e8 selective | 2e6 full)
    # + the recompute workspace of one segment (1e8 - kept): 4.5e8 fits full, then selective,
    # then none twice.
    step_model = model(budget=4.5e8)
    uniform = step_model.estimate(prepared["full"], config)
    mixed = step_model.estimate(prepared["full"], config, {m: prepared[m] for m in ("none", "selective")})
    assert [stage.recompute for stage in uniform.stages] == ["full"] * 4
    assert [stage.recompute for stage in mixed.stages] == ["full", "selective", "none", "none"]
    assert all(stage.total_memory_bytes <= 4.5e8 for stage in mixed.stages)
    assert mixed.step_time_s < uniform.step_time_s


@pytest.mark.parametrize("num_microbatches", [1, 4])
def test_bf16_weights_are_cast_once_per_step_and_their_copies_held_for_the_step(num_microbatches):
    """autopar's runtime (BF16_ADAM): without FSDP every fp32 weight is cast to a bf16 copy once
    per step (read 4, write 2 bytes per element), whatever the number of microbatches, and the
    copies (2 bytes per parameter) are held for the whole step. Under FSDP2 the gathered
    parameters are the copies: no cast term, no copies."""
    step_model = model()
    prepared = PreparedSegments.build(segments(), "none")
    plain = step_model.estimate(prepared, ParallelConfig(dp=8, tp=1, pp=1, microbatch_size=1,
                                                         num_microbatches=num_microbatches))
    numel = 8 * 1e6
    assert plain.breakdown_s["weight_cast"] == pytest.approx(6 * numel / step_model.compute.bandwidth_bytes_per_s)
    assert plain.memory_bytes["weight_copies"] == pytest.approx(2 * numel)
    assert step_model.state_bytes_per_param(plain.config) == pytest.approx(16 + 2)
    for zero_stage in (1, 3):
        sharded = step_model.estimate(prepared, ParallelConfig(dp=8, tp=1, pp=1, microbatch_size=1,
                                                               num_microbatches=num_microbatches, zero_stage=zero_stage))
        assert "weight_cast" not in sharded.breakdown_s and "weight_copies" not in sharded.memory_bytes
    megatron = model(policy=MEGATRON_BF16).estimate(PreparedSegments.build(segments(), "none"), plain.config)
    assert "weight_cast" not in megatron.breakdown_s and "weight_copies" not in megatron.memory_bytes
    # ... and its users' torch.optim.AdamW runs foreach (84 bytes per parameter), Megatron's fused (32).
    assert plain.breakdown_s["optimizer"] == pytest.approx(megatron.breakdown_s["optimizer"] * 84 / 32)
    extra = plain.breakdown_s["weight_cast"] + plain.breakdown_s.get("gradient_accumulate", 0.0) \
        + plain.breakdown_s["optimizer"] - megatron.breakdown_s["optimizer"]
    assert plain.step_time_s == pytest.approx(megatron.step_time_s + extra)


def test_gradients_of_every_microbatch_after_the_first_are_added_into_the_fp32_ones():
    """autopar's runtime accumulates over microbatches in fp32: without FSDP the bf16 copy's
    backward adds each gradient into the fp32 one in one kernel, 4 bytes per weight more than the
    cast priced per microbatch (codegen/main_grad.py), from the second microbatch on; torch's
    zero-bubble weight pass casts, then reads the fp32 gradient and the new one and writes the
    sum (12 bytes); FSDP2 with a reduce-scatter per microbatch adds only the shard."""
    step_model = model()
    bandwidth = step_model.compute.bandwidth_bytes_per_s
    numel = 8 * 1e6

    def accumulate_s(m, zero_stage=0, schedule="1f1b"):
        config = ParallelConfig(dp=8, tp=1, pp=1, microbatch_size=1, num_microbatches=m, zero_stage=zero_stage,
                                schedule=schedule)
        return step_model.estimate(PreparedSegments.build(segments(), "none"), config).breakdown_s.get(
            "gradient_accumulate", 0.0)

    assert accumulate_s(1) == 0.0
    assert accumulate_s(4) == pytest.approx(3 * 4 * numel / bandwidth)
    assert accumulate_s(4, schedule="zb1p") == pytest.approx(3 * 12 * numel / bandwidth)
    assert accumulate_s(4, zero_stage=3) == pytest.approx(3 * 12 * numel / 8 / bandwidth)
    assert accumulate_s(4, zero_stage=1) == pytest.approx(3 * 4 * numel / bandwidth)
    megatron = model(policy=MEGATRON_BF16).estimate(
        PreparedSegments.build(segments(), "none"),
        ParallelConfig(dp=8, tp=1, pp=1, microbatch_size=1, num_microbatches=4))
    assert "gradient_accumulate" not in megatron.breakdown_s


def test_zero2_under_pipelining_counts_accumulated_gradients_once_and_at_the_peak():
    """ZeRO-2 with pp > 1 accumulates every unit's unsharded gradients (reduce dtype, fp32 under
    BF16_ADAM) until the step's reduce-scatter: they are "gradients", not also FSDP2's per-unit
    unsharded gradient buffer; with all microbatches held before the first backward (GPipe) the
    peak carries none of them."""
    numel, saved = 2 * 1e6, 2 * 1e8  # per stage: two segments
    for schedule, grads in (("gpipe", 0.0), ("1f1b", 4.0 * numel)):
        config = ParallelConfig(dp=8, tp=1, pp=4, microbatch_size=1, num_microbatches=8, zero_stage=2,
                                schedule=schedule)
        stage = estimate(config).stages[0]
        assert stage.memory_bytes.get("fsdp_unsharded", 0.0) == 0.0
        assert stage.memory_bytes["gradients"] == pytest.approx(grads)
        held = 8 if schedule == "gpipe" else 4
        assert stage.memory_bytes["activations"] == pytest.approx(held * saved)


def test_a_weight_shared_by_three_segments_is_held_and_summed_on_every_rank_that_reads_it():
    """T5's shared embedding is read by the encoder's embedding (first segment), the decoder's
    (a middle one) and the tied head (last): each pipeline rank reading it keeps a copy, counted
    once on the segments (the first reader's), and the copies' gradients are summed over all of
    them after the step."""
    import torch
    import transformers

    from autopar import api

    config = transformers.T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                   num_heads=4)
    tokens = torch.randint(0, 128, (4, 8))
    planner = api.planner_for(transformers.T5ForConditionalGeneration(config),
                              dict(input_ids=tokens, decoder_input_ids=tokens), "dgx-a100-80g:nodes=1,gpus_per_node=3",
                              global_batch=4, example_targets=tokens,
                              loss_fn=lambda out, t: torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), t.flatten()))
    ((numel, readers),) = planner.step_model.shared_params
    names = [segment.name for segment in planner.graph.segments]
    assert numel == 128 * 32 and len(readers) == 3 and readers[0] == 0 and readers[-1] == len(names) - 1
    fixed = api.fixed_config(planner, tp=1, pp=3, dp=None, microbatch_size=1, schedule="1f1b", virtual_stages=None,
                             layers_per_virtual_stage=None, recompute="none", zero_stage=0)
    estimate, _ = planner.evaluate(fixed)
    segment_numel = dict(zip(planner.prepared_for(estimate.config).names,
                             planner.prepared_for(estimate.config).param_numel))
    reading = 0
    for stage in estimate.stages:
        indices = {names.index(name) for name in stage.segment_names}
        copy = numel if indices & set(readers) and readers[0] not in indices else 0.0
        reading += bool(indices & set(readers))
        assert stage.param_numel == pytest.approx(sum(segment_numel[name] for name in stage.segment_names) + copy)
    assert reading == 3  # the middle reader is on its own rank in this partition
    exchange = 2 * planner.step_model.comm.send_recv_s(numel * 2, crosses_nodes=False)  # bf16 gradient
    assert estimate.breakdown_s["pp.tied_weights"] == pytest.approx(2 * exchange)


def test_weight_gradients_fused_into_their_gemms_pay_no_cast_or_add_where_the_runtime_fuses():
    """Segments whose weights can accumulate inside their GEMMs (evaluate.SegmentCost.fused_wgrad_*):
    outside the zero-bubble schedules, without FSDP or where FSDP2 keeps fp32 unsharded gradients
    over the microbatches (ZeRO-1, ZeRO-2 pipelined), each microbatch's backward saves the priced
    saving and nothing is added after the first microbatch (codegen/fused_wgrad.py); under ZeRO-2
    without pipelining, ZeRO-3, one microbatch or a zero-bubble schedule (no fusion there) the
    estimate is the unfused one."""
    saving_s = 1e-4

    def fused_segments():
        items = segments()
        for segment in items:
            segment.fused_wgrad_numel = segment.param_numel
            segment.fused_wgrad_saving = ComputeTime(memory_s=saving_s)
        return items

    def both(**overrides):
        config = ParallelConfig(**{**dict(dp=8, tp=1, pp=1, microbatch_size=1, num_microbatches=4), **overrides})
        return (model().estimate(PreparedSegments.build(fused_segments(), "none"), config),
                model().estimate(PreparedSegments.build(segments(), "none"), config))

    for config in (dict(), dict(zero_stage=1)):
        fused, plain = both(**config)
        assert "gradient_accumulate" not in fused.breakdown_s and plain.breakdown_s["gradient_accumulate"] > 0, config
        assert fused.breakdown_s["compute"] == pytest.approx(plain.breakdown_s["compute"] - 4 * 8 * saving_s), config
        assert fused.stages[0].fused_wgrad_numel == pytest.approx(8e6), config
    fused, plain = both(zero_stage=2, pp=2, dp=4)
    assert "gradient_accumulate" not in fused.breakdown_s and plain.breakdown_s["gradient_accumulate"] > 0
    assert fused.stages[0].fused_wgrad_numel > 0 and fused.step_time_s < plain.step_time_s
    for config in (dict(schedule="zb1p", pp=2, num_microbatches=4, dp=4), dict(zero_stage=3), dict(zero_stage=2),
                   dict(zero_stage=1, num_microbatches=1)):
        fused, plain = both(**config)
        assert fused.step_time_s == pytest.approx(plain.step_time_s, rel=1e-12), config
        assert fused.stages[0].fused_wgrad_numel == 0, config


def test_the_search_lower_bound_holds_where_weight_gradients_fuse():
    """Fusion takes its saving off a configuration's stages after the segments are priced: the
    bound that prunes configurations must stay below their priced step time."""
    from autopar import api
    from autopar.solver.pricing import lower_bound_s

    graph = api.capture_for_planning("gpt:layers=4,hidden=256,heads=4,seq=128,vocab=512")
    planner = api.planner_for(graph, None, "dgx-h100:nodes=1", global_batch=16)
    for pp, tp in ((1, 1), (1, 2), (2, 2)):
        config = api.fixed_config(planner, tp=tp, pp=pp, dp=8 // (pp * tp), microbatch_size=1, schedule="1f1b",
                                  virtual_stages=None, layers_per_virtual_stage=None, recompute="none",
                                  zero_stage=0, ep=1)
        estimate, _ = planner.evaluate(config)
        assert estimate.stages[0].fused_wgrad_numel > 0
        assert lower_bound_s(planner.pricing.least_work(config), config) <= estimate.step_time_s


@pytest.mark.parametrize("recompute, forward", [("none", 3e-3), ("full", 6e-3), ("op", 4e-3)])
def test_an_moe_regions_collectives_are_counted_with_their_replays(recompute, forward):
    """PreparedSegments' MoE-region collectives (evaluate.SegmentCost.expert_region_comm, what
    Megatron's per-share dispatch replaces): the forward ones again where recomputation replays
    them (full: all; "op": the non-reducing), the backward ones once."""
    from autopar.solver.experts import ExpertExchange

    segment = segments(1)[0]
    segment.expert_exchanges.append(ExpertExchange(token_bytes=1e6, output_bytes=1e6, token_grad=True, dropless=True,
                                                   compute_s=1e-3))
    region = [CommEvent(op="all_gather", axis=0, message_bytes=1e6, time_s=1e-3, phase="fwd"),
              CommEvent(op="all_reduce", axis=0, message_bytes=1e6, time_s=2e-3, phase="fwd"),
              CommEvent(op="reduce_scatter", axis=0, message_bytes=1e6, time_s=3e-3, phase="bwd")]
    segment.comm += region  # the region's collectives are among the segment's (SegmentCost.expert_region_comm)
    segment.expert_region_comm += region
    prepared = PreparedSegments.build([segment], recompute)
    assert prepared.ep_region_fwd_s.tolist() == pytest.approx([forward])
    assert prepared.ep_region_bwd_s.tolist() == pytest.approx([3e-3])

