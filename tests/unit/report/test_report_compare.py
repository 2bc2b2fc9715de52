"""`autopar compare`: plan one model on several clusters; fastest and cheapest with user prices."""

import json

import pytest

from autopar.cli import main
from autopar.cluster import Cluster
from autopar.errors import ClusterSpecError, ConfigError
from autopar.report.compare import compare_clusters, comparison_text
from report_plans import GLOBAL_BATCH, planner

SMALL = "dgx-a100-80g:gpus_per_node=2"
LARGE = "dgx-h100:gpus_per_node=4"


@pytest.fixture(scope="module")
def comparison():
    return compare_clusters(planner().graph, global_batch=GLOBAL_BATCH, clusters=[SMALL, LARGE], prices=[1.0, 4.0],
                            amount=1e9)


def test_each_cluster_is_planned_and_priced(comparison):
    assert [option.cluster for option in comparison.options] == [SMALL, LARGE]
    assert comparison.unit == "tokens"
    for option, price in zip(comparison.options, (1.0, 4.0)):
        plan = option.plan
        assert plan is not None and plan.num_devices == option.num_devices
        assert option.throughput_per_s == pytest.approx(plan.predicted.tokens_per_s)
        seconds = 1e9 / plan.predicted.tokens_per_s
        assert option.time_s(1e9) == pytest.approx(seconds)
        assert option.cost(1e9) == pytest.approx(option.num_devices * price * seconds / 3600)
    fastest = max(comparison.options, key=lambda o: o.plan.predicted.tokens_per_s)
    cheapest = min(comparison.options, key=lambda o: o.cost(1e9))
    assert comparison.fastest is fastest and comparison.cheapest is cheapest
    text = comparison_text(comparison)
    assert f"fastest:  {fastest.cluster}" in text and f"cheapest: {cheapest.cluster}" in text


def test_without_prices_there_is_no_cheapest():
    result = compare_clusters(planner().graph, global_batch=GLOBAL_BATCH, clusters=[SMALL])
    assert result.cheapest is None and "no prices given" in comparison_text(result)


def test_price_comes_from_the_cluster_toml(tmp_path):
    path = tmp_path / "rented.toml"
    path.write_text('preset = "dgx-h100"\nnodes = 2\nprice_per_gpu_hour = 2.5\n')
    cluster = Cluster.from_spec(str(path))
    assert cluster.price_per_gpu_hour == 2.5
    # a price changes no prediction, so it leaves the fingerprint alone
    assert cluster.fingerprint() == Cluster.from_spec("dgx-h100:nodes=2").fingerprint()
    path.write_text('preset = "dgx-h100"\nprice_per_gpu_hour = "cheap"\n')
    with pytest.raises(ClusterSpecError, match="price_per_gpu_hour must be a number"):
        Cluster.from_spec(str(path))


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(clusters=[SMALL, LARGE], prices=[1.0]), "1 prices for 2 clusters"),
    (dict(clusters=[SMALL], prices=[-1.0]), "positive"),
    (dict(clusters=[]), "at least one cluster"),
])
def test_bad_comparisons_are_refused(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        compare_clusters(planner().graph, global_batch=GLOBAL_BATCH, **kwargs)


def test_a_cluster_the_model_does_not_fit_is_a_row_not_a_crash(tmp_path):
    tiny = tmp_path / "tiny.toml"
    tiny.write_text('preset = "dgx-a100-80g"\ngpus_per_node = 2\n[device]\nmemory_gib = 0.0001\n')
    result = compare_clusters(planner().graph, global_batch=GLOBAL_BATCH, clusters=[SMALL, str(tiny)],
                              prices=[1.0, 0.1])
    assert result.options[1].plan is None and "does not fit" in result.options[1].error
    assert result.fastest is result.options[0] and result.cheapest is result.options[0]
    assert "does not fit" in comparison_text(result)


def test_cli_json(capsys):
    code = main(["compare", "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128", "--global-batch", str(GLOBAL_BATCH),
                 "--clusters", SMALL, "--price-per-gpu-hour", "2", "--tokens", "1e9", "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fastest"] == data["cheapest"] == SMALL
    assert data["clusters"][0]["cost"] == pytest.approx(2 * 2 * data["clusters"][0]["time_s"] / 3600)
