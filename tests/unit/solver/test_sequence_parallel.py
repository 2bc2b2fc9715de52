"""Tensor parallelism without sequence parallelism as a user asks for it: the constraint and
`evaluate`'s argument, what the search may then pick, the plan that records it (JSON, report,
diff, validation) and the command line. What the restriction does to the intra-op solve is in
test_sharding.py; that codegen runs such a plan, in tests/dist/test_collectives.py."""

import json

import pytest

from autopar import api
from autopar.cli import main
from autopar.errors import PlanMismatchError
from autopar.plans.plan import Plan
from autopar.report.diff import diff_plans
from autopar.solver.constraints import Constraints

# Wide enough that sequence-sharded norms pay for their reduce-scatter + all-gather on tp = 8
# (at hidden 2048 the all-reduce's fewer latencies win: the solve keeps it).
MODEL = "gpt:layers=2,hidden=4096,heads=32,seq=2048,vocab=8192"
CLUSTER = "dgx-a100-80g"
TINY = "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128"


@pytest.fixture(scope="module")
def planner():
    return api.planner_for(MODEL, None, CLUSTER, global_batch=8)


@pytest.fixture(scope="module")
def plans(planner):
    fixed = dict(tp=8, pp=1)
    return {sp: api.plan_with(planner, Constraints(**fixed, sequence_parallel=None if sp else False))
            for sp in (True, False)}


def test_the_search_keeps_sequence_parallelism_where_it_is_cheaper(plans):
    with_sp, without = plans[True], plans[False]
    assert (with_sp.sequence_parallel, without.sequence_parallel) == (True, False)
    assert with_sp.predicted.collectives_per_microbatch.get("reduce_scatter", 0) > 0  # chosen here
    assert with_sp.predicted.step_time_s < without.predicted.step_time_s
    assert with_sp.predicted.memory_bytes["activations"] < without.predicted.memory_bytes["activations"]


def test_without_sp_the_plan_all_reduces_and_never_regathers(planner, plans):
    """Nothing is reduce-scattered; the blocks all-reduce (all-gathers remain where a sharded
    weight's output is gathered: here the hidden-parallel embedding's, before the first norm)."""
    without = plans[False]
    assert without.predicted.collectives_per_microbatch.get("reduce_scatter", 0) == 0
    for segment in planner.segment_costs(8, without.microbatch_size, sequence_parallel=False):
        if segment.name.startswith("layers.") and segment.name != "layers.0":
            assert {event.op for event in segment.comm} == {"all_reduce"}, segment.name
    assert without.recompute != "gathers"
    runners_up = [other["config"] for other in without.search["runners_up"]]
    assert runners_up and all(" no-sp" in config and "recompute=gathers" not in config for config in runners_up)


def test_a_plan_without_sp_survives_json_and_says_so(plans, tmp_path):
    without = plans[False]
    path = tmp_path / "plan.json"
    without.save(path)
    loaded = Plan.load(path)
    assert loaded.sequence_parallel is False and loaded.to_dict() == without.to_dict()
    assert "sequence par. off" in loaded.summary()
    assert "sequence par. on" in plans[True].summary()
    assert ("sequence parallel", "off (all-reduce)", "allowed") in diff_plans(loaded, plans[True]).settings


@pytest.mark.parametrize("changes, fragment", [
    (dict(sequence_parallel="no"), "sequence_parallel"),
    (dict(sequence_parallel=False, recompute="gathers"), "'gathers' with sequence_parallel=false"),
])
def test_bad_sequence_parallel_in_a_plan_file(plans, tmp_path, changes, fragment):
    data = {**plans[False].to_dict(), **changes}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanMismatchError, match=fragment):
        Plan.load(path)


def test_a_plan_written_before_the_field_reads_as_allowed(plans):
    data = plans[True].to_dict()
    del data["sequence_parallel"]
    assert Plan.from_dict(data).sequence_parallel is True


def test_evaluate_prices_the_configuration_as_asked(planner, plans):
    chosen = plans[False]
    config = api.fixed_config(planner, tp=8, pp=1, dp=None, microbatch_size=chosen.microbatch_size, schedule="1f1b",
                              virtual_stages=None, layers_per_virtual_stage=None, recompute=chosen.recompute,
                              zero_stage=0, sequence_parallel=False)
    evaluated = api.evaluate_with(planner, config)
    assert evaluated.sequence_parallel is False
    assert evaluated.placements == plans[False].placements
    assert "no-sp" in config.describe()


def test_command_line(capsys):
    common = [TINY, "--cluster", "dgx-a100-80g:gpus_per_node=2", "--global-batch", "4", "--tp", "2"]
    assert main(["evaluate", *common, "--pp", "1", "--microbatch-size", "4", "--sequence-parallel", "off", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sequence_parallel"] is False
    assert main(["plan", *common, "--sequence-parallel", "off", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sequence_parallel"] is False
    assert main(["plan", *common, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sequence_parallel"] is True
    assert main(["evaluate", *common, "--pp", "1", "--microbatch-size", "4", "--sequence-parallel", "off",
                 "--recompute", "gathers"]) == 2
    assert "sequence_parallel=False" in capsys.readouterr().err


def test_no_pipeline_stage_takes_gathers_without_sp(planner):
    """A stage that fits may take a lighter mode than the plan's; 'gathers' is not one of them
    without sequence parallelism (it would name a mechanism the plan does not have)."""
    from autopar.solver.step_model import ParallelConfig

    for sp, expected in ((True, ["none", "gathers", "selective", "op"]), (False, ["none", "selective", "op"])):
        config = ParallelConfig(dp=2, tp=2, pp=2, microbatch_size=1, num_microbatches=4, recompute="full",
                                sequence_parallel=sp)
        assert list(planner.pricing.lighter(config)) == expected


def test_partial_weight_gradients_are_reduced_once_per_step(planner):
    """Sequence-parallel norms' replicated weights get Partial gradients; the runtime sums the
    microbatches' and reduces once after the last one (reduce_partial_gradients), so the price
    of those reductions does not grow with the microbatches and is outside each microbatch's."""
    from autopar.solver.prepared import once_per_step

    config = dict(tp=8, pp=1, dp=1, schedule="1f1b", virtual_stages=None, layers_per_virtual_stage=None,
                  recompute="none", zero_stage=0, ep=1, cp=1, offload=False, sequence_parallel=True)
    one, four = (api.evaluate_with(planner, api.fixed_config(planner, microbatch_size=size, **config))
                 for size in (8, 2))
    assert (one.num_microbatches, four.num_microbatches) == (1, 4)
    reductions = sum(event.time_s for segment in planner.segment_costs(8, 2) for event in segment.comm
                     if once_per_step(event))
    assert reductions > 0
    assert four.predicted.breakdown_s["tp.grad_reduce.once"] == pytest.approx(reductions)
    per_microbatch = sum(event.time_s for segment in planner.segment_costs(8, 2) for event in segment.comm
                         if event.op == "all_reduce" and not once_per_step(event))
    assert four.predicted.breakdown_s.get("tp.all_reduce", 0.0) == pytest.approx(4 * per_microbatch)


def test_without_sp_a_stage_sends_its_replicated_output_as_slices(planner):
    """Megatron-LM's scatter/gather: a replicated activation leaving a stage is sent as each tp
    rank's 1/tp slice and all-gathered over tp by the receiving stage (codegen/pipeline.py's
    boundary_wires; tests/dist/test_numerics.py runs it)."""
    from autopar.strategies.placement import boundary_wire

    assert boundary_wire((2, 2048, 4096), "R", 8) == "S1" and boundary_wire((8, 2048, 4096), "R", 8) == "S0"
    assert boundary_wire((2, 2048, 4096), "R", 1) == "R" and boundary_wire((2, 2048, 4096), "S1", 8) == "S1"
    assert boundary_wire((3, 5), "R", 2) == "R" and boundary_wire((2, 2048), "R", 2, floating=False) == "R"
    config = api.fixed_config(planner, tp=4, pp=2, dp=None, microbatch_size=1, schedule="1f1b", virtual_stages=None,
                              layers_per_virtual_stage=None, recompute="none", zero_stage=0, sequence_parallel=False)
    estimate, _ = planner.evaluate(config)
    segments = planner.segment_costs(4, 1, sequence_parallel=False)
    sliced = [segment for segment in segments if segment.gathered_output_bytes]
    assert sliced and all(s.output_bytes == pytest.approx(s.gathered_output_bytes / 4) for s in sliced)
    names = [segment.name for segment in segments]
    last_of_first = names.index(estimate.stages[0].segment_names[-1])
    gathered = segments[last_of_first].gathered_output_bytes
    assert gathered > 0  # the last stage sends nothing: its p2p is the all-gather of what it receives
    assert estimate.stages[1].p2p_s == pytest.approx(planner.step_model._tp_gather_s(gathered, estimate.config))


def test_sequence_parallel_collectives_pay_their_layout_copies_where_the_runtime_makes_them(planner, plans):
    """DTensor's collectives (tp overlap off) copy a (batch, seq, hidden) tensor sharded on seq into
    place around NCCL's dim-0 gathers and scatters (tp.layout_copy, compute-stream time outside the
    collective's own term); Megatron's (seq, batch, hidden) layout makes none; fused async TP lays
    its chunks out in its kernels (Transformer Engine's: none), torch's symmetric-memory kernels with
    a pass of their own each (tp_overlap_passes), and a summed gradient's reduce-scatter they do not
    fuse keeps DTensor's copy."""
    from dataclasses import replace

    from autopar.solver.search import Planner

    with_sp = plans[True]

    def breakdown(**policy):
        again = Planner(planner.graph, planner.cluster, global_batch=8, policy=replace(planner.policy, **policy))
        config = api.fixed_config(again, tp=8, pp=1, dp=1, microbatch_size=2, schedule="1f1b", virtual_stages=None,
                                  layers_per_virtual_stage=None, recompute=with_sp.recompute, zero_stage=0)
        return again.evaluate(config)[0].breakdown_s

    dtensor = breakdown(tp_comm_overlap=False)
    assert dtensor.get("tp.layout_copy.gather", 0.0) > 0 and dtensor.get("tp.layout_copy.scatter", 0.0) > 0
    copies = lambda terms: [name for name in terms if name.startswith("tp.layout_copy")]  # noqa: E731
    assert not copies(breakdown(tp_comm_overlap=False, sp_layout_copies="none"))
    fused_all = breakdown(tp_comm_overlap=True, tp_overlap_sums=True, tp_overlap_passes=False)
    torch_async = breakdown(tp_comm_overlap=True, tp_overlap_sums=False, tp_overlap_passes=True)
    summed_too = breakdown(tp_comm_overlap=True, tp_overlap_sums=False, tp_overlap_passes=False)
    total = lambda terms: sum(terms[name] for name in copies(terms))  # noqa: E731
    # what no GEMM is beside (the embedding's reduce-scatter and its gradient's gather) stays unfused
    assert 0 < total(fused_all) < total(summed_too) < total(torch_async) < total(dtensor)
