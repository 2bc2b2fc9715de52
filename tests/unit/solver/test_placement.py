"""Pipeline ranks' placements (solver/placement.py) and the memory-bounded stage partition."""

import itertools

import pytest

from autopar.cluster import Cluster
from autopar.solver.evaluate import SegmentCost
from autopar.solver.pipeline import ChainCosts, partition
from autopar.solver.pipeline_time import chunks_in_flight
from autopar.solver.step_model import ParallelConfig, PreparedSegments, StepModel
from cost_model.comm import CommModel
from cost_model.compute import ComputeModel, ComputeTime
from cost_model.memory import BF16_ADAM


def segments(count: int = 12) -> list[SegmentCost]:
    made = []
    for index in range(count):
        segment = SegmentCost(name=f"layers.{index}", forward=ComputeTime(matmul_s=0.01 * (1 + index % 3)),
                              backward=ComputeTime(matmul_s=0.02), param_numel=1e6, saved_bytes=1e8,
                              input_bytes=1e6, output_bytes=4e6 * (1 + index % 2),
                              selective_recompute=ComputeTime(memory_s=0.001))
        segment.selective_kept["x"] = 5e7
        made.append(segment)
    return made


def model(budget: float = 1e12) -> StepModel:
    cluster = Cluster.from_spec("dgx-a100-80g:nodes=4")
    return StepModel(devices_per_node=8, compute=ComputeModel(cluster.device), comm=CommModel(cluster),
                     policy=BF16_ADAM, memory_budget_bytes=budget)


def test_zbv_placement_owns_the_v_and_sends_nowhere_at_its_turn():
    p = 3
    config = ParallelConfig(dp=1, tp=1, pp=p, microbatch_size=1, num_microbatches=6, schedule="zbv", virtual_stages=2)
    prepared = PreparedSegments.build(segments(), "none")
    spans = prepared.time_partition(2 * p)
    step = model()
    flights = chunks_in_flight(config)
    places = [step._placed(prepared, spans, config, rank, flights) for rank in range(p)]
    assert [place.stage_indices for place in places] == [(0, 5), (1, 4), (2, 3)]
    assert places[0].own == [spans[0], spans[5]]
    assert places[1].in_flight == [flights[1], flights[4]]
    outputs = prepared.listed("output_bytes")
    send = lambda chunk: 2 * step._send_recv_s(outputs[spans[chunk].stop - 1], False)  # noqa: E731
    # Rank 0: chunk 0 sends on, chunk 5 is the last. The turn (rank 2: chunks 2 and 3) sends only
    # from chunk 3: chunk 2's successor runs on the same rank.
    assert places[0].p2p_s == pytest.approx(send(0))
    assert places[1].p2p_s == pytest.approx(send(1) + send(4))
    assert places[2].p2p_s == pytest.approx(send(3))


def test_one_placement_serves_every_mode_and_keeps_each_signature_once(monkeypatch):
    items = segments()
    modes = {mode: PreparedSegments.build(items, mode) for mode in ("none", "selective", "full")}
    # What the sends read is the same in every recomputation mode.
    assert len({tuple(prepared.listed("output_bytes")) for prepared in modes.values()}) == 1
    config = ParallelConfig(dp=1, tp=1, pp=2, microbatch_size=1, num_microbatches=4, recompute="full")
    spans = modes["full"].time_partition(2)
    place = model()._placed(modes["full"], spans, config, 1, chunks_in_flight(config))
    calls = []
    for prepared in modes.values():
        original = prepared.signature
        monkeypatch.setattr(prepared, "signature", lambda own, original=original: calls.append(1) or original(own))
    first = {mode: place.signature(prepared) for mode, prepared in modes.items()}
    again = {mode: place.signature(prepared) for mode, prepared in modes.items()}
    assert first == again and len(calls) == len(modes)
    assert first["none"] == PreparedSegments.build(items, "none").signature(place.own)


@pytest.mark.parametrize("schedule,virtual,mixes", [("1f1b", 1, True), ("interleaved", 2, True), ("zb1p", 1, False),
                                                    ("zbv", 2, False)])
def test_a_cutoff_prunes_or_changes_nothing(schedule, virtual, mixes):
    items = segments()
    config = ParallelConfig(dp=1, tp=1, pp=3, microbatch_size=1, num_microbatches=6, schedule=schedule,
                            virtual_stages=virtual, recompute="full")
    mixed, fitted = False, 0
    for budget in [2e8 + 5e7 * k for k in range(40)]:
        # Prepared segments cache what one planner's budget decides: fresh ones per budget.
        prepared = PreparedSegments.build(items, "full")
        lighter = {mode: PreparedSegments.build(items, mode) for mode in ("none", "selective")}
        free = model(budget).stages(prepared, config, lighter)
        if not free.fits:
            continue
        fitted += 1
        modes = [stage.recompute for stage in free.stages]
        mixed |= len(set(modes)) > 1
        above = model(budget).stages(prepared, config, lighter, cutoff_s=free.bound_s * (1 + 1e-9),
                                     price_unfit=False)
        assert [s.recompute for s in above.stages] == modes
        assert [s.time_per_microbatch_s for s in above.stages] == [s.time_per_microbatch_s for s in free.stages]
        assert [s.total_memory_bytes for s in above.stages] == [s.total_memory_bytes for s in free.stages]
        below = model(budget).stages(prepared, config, lighter, cutoff_s=free.bound_s * 0.5, price_unfit=False)
        assert below.stages == [] and below.bound_s > free.bound_s * 0.5
    assert fitted >= 5
    # 1F1B's first stages hold more microbatches than its last: some budget splits the modes.
    assert mixed or not mixes


def _brute_force(costs: ChainCosts, num_stages: int, in_flight, budget: float, fixed: float):
    """The smallest slowest stage over every split that fits (None if none fits)."""
    count = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, count), num_stages - 1):
        bounds = (0, *cuts, count)
        fits = all(sum(costs.state_bytes[bounds[k]:bounds[k + 1]])
                   + in_flight(k) * sum(costs.activation_bytes[bounds[k]:bounds[k + 1]]) + fixed <= budget
                   for k in range(num_stages))
        if fits:
            slowest = max(sum(costs.time_s[bounds[k]:bounds[k + 1]]) for k in range(num_stages))
            best = slowest if best is None else min(best, slowest)
    return best


@pytest.mark.parametrize("budget", [2.2e9, 3.0e9, 4.5e9, 1.0e9])
def test_memory_bounded_partition_matches_brute_force(budget):
    times = [1.0, 2.0, 1.5, 3.0, 1.0, 2.5, 1.0, 2.0, 1.0]
    costs = ChainCosts(time_s=times, state_bytes=[1e8 * (1 + i % 2) for i in range(len(times))],
                       activation_bytes=[2e8] * len(times))
    in_flight = lambda stage: 3 - stage  # noqa: E731 - 1F1B on 3 stages
    expected = _brute_force(costs, 3, in_flight, budget, fixed=1e8)
    found = partition(costs, 3, in_flight=in_flight, memory_budget_bytes=budget, fixed_bytes=1e8)
    if expected is None:
        assert found is None
        return
    assert len(found) == 3 and found[0].start == 0 and found[-1].stop == len(times)
    for k, span in enumerate(found):
        memory = costs.total("state_bytes", span) + in_flight(k) * costs.total("activation_bytes", span) + 1e8
        assert memory <= budget
    assert max(costs.total("time_s", span) for span in found) == pytest.approx(expected, rel=2e-4)
