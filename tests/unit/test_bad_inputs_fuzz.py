"""Random bad input: whatever a hand edit or a typo makes of a plan, a cluster spec or a cluster
file, autopar either accepts it (and can then report it) or raises its own error, in time.

The catalogue in test_bad_inputs_*.py names cases; these properties cover the ones nobody wrote.
"""

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.cluster import cluster_from_toml, parse_cluster
from autopar.errors import AutoparError, PlanMismatchError
from autopar.plans.plan import Plan
from bad_input_harness import FOUR_GPUS, TINY, deadline

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20) | st.just("x" * 20_000),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=6)


@pytest.fixture(scope="module")
def plan_data():
    import autopar

    return autopar.evaluate(TINY, cluster=FOUR_GPUS, global_batch=8, tp=2, pp=2, microbatch_size=2).to_dict()


def _paths(value, prefix=()):
    """Every path to a value inside nested dicts and lists."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, prefix + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, prefix + (index,))


def _replace(data, path, new):
    if not path:
        return new
    copy = json.loads(json.dumps(data))
    target = copy
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = new
    return copy


@SETTINGS
@given(choice=st.integers(0, 10**6), new=json_values)
def test_any_edit_of_a_plan_loads_or_is_refused_clearly(plan_data, choice, new):
    paths = [path for path in _paths(plan_data) if path and path[0] not in ("search",)]
    path = paths[choice % len(paths)]
    edited = _replace(plan_data, path, new)
    with deadline(30):
        try:
            plan = Plan.from_dict(json.loads(json.dumps(edited)), source="edited.json")
        except PlanMismatchError as error:
            assert len(str(error)) < 2000
            return
        plan.summary()  # an accepted plan can be reported
        plan.to_json()


@SETTINGS
@given(keys=st.lists(st.sampled_from(["nodes", "gpus_per_node", "procs", "profile", "num_nodes", "node", ""]),
                     max_size=4),
       values=st.lists(st.sampled_from(["0", "1", "2", "-1", "8", "1.5", "abc", "", "1e3", "9" * 30, "٣", "x.toml",
                                        "p.json", "+4", " 3 ", "="]), max_size=4),
       preset=st.sampled_from(["dgx-h100", "cpu", "dgx-a100-80g", "", "dgx", "x" * 500, "a.toml", "./none"]))
def test_any_cluster_spec_parses_or_is_refused_clearly(keys, values, preset):
    spec = preset + (":" + ",".join(f"{key}={value}" for key, value in zip(keys, values)) if keys else "")
    with deadline(30):
        try:
            cluster = parse_cluster(spec)
        except AutoparError as error:
            assert len(str(error)) < 2000
            return
    assert 1 <= cluster.num_devices <= 1_048_576


toml_scalars = (st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.floats(allow_nan=True)
                | st.text(max_size=10))


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value == math.inf else "-inf" if value == -math.inf
                                                else repr(value))
    if isinstance(value, int):
        return str(value)
    return json.dumps(value)


@SETTINGS
@given(top=st.dictionaries(st.sampled_from(["nodes", "gpus_per_node", "procs", "preset"]),
                           toml_scalars.filter(lambda v: v is not None), max_size=3),
       device=st.dictionaries(st.sampled_from(["name", "memory_gib", "bf16_tflops", "matmul_efficiency",
                                               "kernel_overhead_us", "memory_bandwidth_gbs"]),
                              toml_scalars.filter(lambda v: v is not None), max_size=3),
       link=st.dictionaries(st.sampled_from(["name", "bandwidth_gbs", "latency_us", "efficiency"]),
                            toml_scalars.filter(lambda v: v is not None), max_size=3))
def test_any_cluster_file_parses_or_is_refused_clearly(tmp_path, top, device, link):
    lines = [f'preset = "dgx-h100"'] if "preset" not in top else []
    lines += [f"{key} = {_toml_value(value)}" for key, value in top.items()]
    lines += ["[device]"] + [f"{key} = {_toml_value(value)}" for key, value in device.items()]
    lines += ["[inter_node]"] + [f"{key} = {_toml_value(value)}" for key, value in link.items()]
    path = tmp_path / "cluster.toml"
    path.write_text("\n".join(lines) + "\n")
    with deadline(30):
        try:
            cluster = cluster_from_toml(path)
        except AutoparError as error:
            assert len(str(error)) < 2000
            return
    cluster.describe()
    assert math.isfinite(cluster.device.memory_bytes) and cluster.device.memory_bytes > 0
