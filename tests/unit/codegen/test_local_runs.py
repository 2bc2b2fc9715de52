"""codegen/local_runs.py: which ops run on local tensors, and their size arguments made local."""

from types import SimpleNamespace

import torch

from autopar.codegen.interpreter import RunStats
from autopar.codegen.local_runs import Local, LocalRuns

aten = torch.ops.aten


def _runs(placements: dict[str, tuple[str, list[str]]]) -> LocalRuns:
    interpreter = SimpleNamespace(placements=placements, overrides={}, replicated_targets=set(),
                                  recomputed_activations=frozenset(), parameter_inputs=None,
                                  mesh=SimpleNamespace(size=lambda: 2), stats=RunStats(), current_node=None,
                                  written_in_place=lambda node: False, fused_wgrad=None)
    return LocalRuns(interpreter)


def _graph():
    """x (an activation from another op) -> the ops under test; w a parameter placeholder."""
    graph = torch.fx.Graph()
    weight = graph.placeholder("w")
    source = graph.call_function(aten.relu.default, (weight,))
    nodes = {
        "view": graph.call_function(aten.view.default, (source, [4, 8, 6])),
        "unflatten": graph.call_function(aten.unflatten.int, (source, -1, [4, 16])),
        "sum": graph.call_function(aten.sum.dim_IntList, (source, [0])),
        "add": graph.call_function(aten.add.Tensor, (source, source)),
        "softmax": graph.call_function(aten.softmax.int, (source, -1)),
        "linear": graph.call_function(aten.linear.default, (source, weight)),
        "norm": graph.call_function(aten.layer_norm.default, (source, [16], weight)),
        "weight_view": graph.call_function(aten.t.default, (weight,)),
        "weight_add": graph.call_function(aten.add.Tensor, (source, weight)),
    }
    return source, nodes


def _by_name(nodes: dict, placements: dict) -> dict:
    return {nodes[key].name: value for key, value in placements.items()}


def test_ops_whose_placed_inputs_make_them_local_are_chosen():
    _, nodes = _graph()
    runs = _runs(_by_name(nodes, {
        "view": ("S2", ["S2"]), "unflatten": ("S2", ["S2"]), "sum": ("S1", ["S2"]), "add": ("R", ["R", "R"]),
        "softmax": ("S1", ["S1"]), "linear": ("S1", ["R", "S0"]),
    }))
    assert runs._eligible(nodes["view"]) and runs._eligible(nodes["unflatten"]) and runs._eligible(nodes["softmax"])
    assert runs._eligible(nodes["add"])  # replicated: every rank computes the whole op, whatever it is
    assert not runs._eligible(nodes["sum"])  # a reduction on shards: not one of the shard-local ops
    assert not runs._eligible(nodes["linear"])  # sharded output of a replicated input needing a gradient


def test_a_norm_reads_its_parameters_locally_but_views_of_parameters_stay_on_dtensors():
    _, nodes = _graph()
    runs = _runs(_by_name(nodes, {"norm": ("R", ["R", "R"]), "weight_view": ("R", ["R"]),
                                  "linear": ("R", ["R", "R"])}))
    assert runs._eligible(nodes["norm"])  # its scale's local tensor passes the gradient back as R
    assert not runs._eligible(nodes["weight_view"])  # would alias the parameter outside its DTensor
    passes = _runs(_by_name(nodes, {"weight_add": ("R", ["R", "R"])}))
    assert not passes._eligible(nodes["weight_add"])  # its output's gradient would become the weight's .grad
    assert runs._eligible(nodes["linear"])  # replicated, and no weight-gradient fusion runs it
    fused = _runs(_by_name(nodes, {"linear": ("R", ["R", "R"])}))
    fused.interpreter.fused_wgrad = object()
    assert not fused._eligible(nodes["linear"])  # fused_wgrad.py accumulates its weight gradient


def test_partial_placements_and_replicated_outputs_of_shards_stay_on_dtensors():
    _, nodes = _graph()
    runs = _runs(_by_name(nodes, {"add": ("P", ["P", "R"]), "view": ("R", ["S2"])}))
    assert not runs._eligible(nodes["add"]) and not runs._eligible(nodes["view"])


def test_view_sizes_become_the_local_ones_on_the_sharded_dim():
    runs = _runs({})
    x = torch.zeros(4, 8, 3)
    assert runs._rewritten(aten.view.default, (x, [4, 8, 6]), "S2", ["S2"])[1] == [4, 8, 3]
    assert runs._rewritten(aten.view.default, (x, [4, -1, 6]), "S2", ["S2"])[1] == [4, -1, 3]
    assert runs._rewritten(aten.unflatten.int, (x, -1, [4, 16]), "S2", ["S2"])[2] == [2, 16]
    assert runs._rewritten(aten.unflatten.int, (x, -1, [4, 16]), "S0", ["S0"])[2] == [4, 16]  # not the split dims
    assert runs._rewritten(aten.view.default, (x, [4, 8, 6]), "R", ["R"])[1] == [4, 8, 6]


def test_a_verified_node_runs_on_the_local_tensors_it_is_given():
    _, nodes = _graph()
    runs = _runs(_by_name(nodes, {"add": ("S1", ["S1", "S1"])}))
    node = nodes["add"]
    source = node.args[0].name
    env = {source: Local(torch.ones(2, 3), "S1")}
    assert runs.try_run(node, env, {}) is None  # the first run goes through DTensor
    runs.verified[node.name] = True
    result = runs.try_run(node, env, {})
    assert isinstance(result, Local) and result.placement == "S1" and torch.equal(result.value, torch.full((2, 3), 2.0))
    env[source] = Local(torch.ones(2, 3), "S0")  # placed otherwise than planned: DTensor redistributes it
    assert runs.try_run(node, env, {}) is None


def test_a_replicated_input_needing_a_gradient_keeps_a_sharded_op_on_dtensors():
    # Its gradient would be a partial sum on each rank (the causal mask, which needs none, is fine).
    graph = torch.fx.Graph()
    first, second = (graph.call_function(aten.relu.default, (graph.placeholder(name),)) for name in ("a", "b"))
    node = graph.call_function(aten.mul.Tensor, (first, second))
    runs = _runs({node.name: ("S1", ["S1", "R"])})
    runs.verified[node.name] = True
    env = {first.name: Local(torch.ones(2, 3), "S1"), second.name: Local(torch.ones(3, requires_grad=True), "R")}
    assert runs.try_run(node, env, {}) is None
    env[second.name] = Local(torch.ones(3), "R")
    assert isinstance(runs.try_run(node, env, {}), Local)
