"""The planner against Megatron-LM SC21 (shared/reference/megatron_table1.csv): for each row,
evaluating Megatron's published configuration as it ran (tensor parallelism without sequence
parallelism, which SC21 predates) predicts the published throughput within 10% (-5% to +6%
today; with sequence parallelism it was +9% to +12%), and the search, which may use sequence
parallelism, finds a configuration no slower than it. Rows are data; numbers come from the cost
model."""

import pytest

from autopar import api
from autopar.cluster import Cluster
from autopar.solver.constraints import Constraints
from autopar.solver.search import Planner
from cost_model.memory import MEGATRON_BF16
from benchmarks.megatron_table import REFERENCE, Row, evaluate_published, planner_for, read_rows

pytestmark = pytest.mark.slow

if not REFERENCE.exists():
    pytest.skip(f"reference data {REFERENCE} not present", allow_module_level=True)

ROWS = read_rows()


@pytest.fixture(scope="module", params=range(len(ROWS)), ids=[f"{row.params_billion}B" for row in ROWS])
def row_and_planner(request):
    row: Row = ROWS[request.param]
    return row, planner_for(row)


def test_published_configuration_is_predicted_within_10_percent(row_and_planner):
    row, planner = row_and_planner
    estimate = evaluate_published(planner, row)
    assert estimate.fits, f"Megatron's configuration for {row.params_billion}B should fit in memory"
    predicted = row.tflops(estimate.step_time_s)
    assert predicted == pytest.approx(row.tflops_per_gpu, rel=0.10), (
        f"{row.params_billion}B: predicted {predicted:.0f} TFLOP/s per GPU, published {row.tflops_per_gpu:.0f}")


def test_search_is_no_slower_than_megatron(row_and_planner):
    row, planner = row_and_planner
    published = evaluate_published(planner, row)
    found = planner.search(Constraints()).best
    assert found.fits
    assert found.step_time_s <= published.step_time_s * (1 + 1e-9)


def test_figure_13_trend_tp8_pp8_is_fastest():
    """Narayanan et al. Fig. 13: a 162.2B GPT on 64 GPUs, batch 128: of all tp x pp = 64 splits,
    tensor parallelism inside a node and pipelining across nodes (tp=8, pp=8) is fastest. Priced
    as Megatron-LM ran it: bf16 weights used as they are (autopar's runtime also casts them per
    microbatch and keeps a copy per microbatch in flight, which favours shallower pipelines), and
    tensor parallelism without sequence parallelism (it wins by 1.6% over tp=4 pp=16 so, by 0.6%
    with it)."""
    graph = api.capture_for_planning("gpt:layers=32,hidden=20480,heads=128,seq=2048,vocab=51200")
    planner = Planner(graph, Cluster.from_spec("dgx-a100-80g:nodes=8"), global_batch=128, policy=MEGATRON_BF16)
    times = {}
    for tp, pp in ((2, 32), (4, 16), (8, 8), (16, 4), (32, 2), (64, 1)):
        times[(tp, pp)] = planner.search(Constraints(tp=tp, pp=pp, sequence_parallel=False)).best.step_time_s
    assert min(times, key=times.get) == (8, 8), times
