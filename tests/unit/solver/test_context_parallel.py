"""Context parallelism in the planner: the cost formulas, the per-segment split, the cp axis
of the search and of plans (cost_model/context_parallel.py, solver/context_parallel.py)."""

import json

import pytest

import autopar
from autopar import api
from autopar.cluster import Cluster
from autopar.errors import ConfigError, PlanMismatchError
from autopar.plans.plan import Plan
from autopar.solver.constraints import Constraints
from autopar.solver.context_parallel import KV_ALL_GATHER, KV_REDUCE_SCATTER, AttentionCost, split_sequence
from autopar.solver.costing import CommEvent
from autopar.solver.evaluate import SegmentCost
from cost_model.comm import CommModel
from cost_model.compute import ComputeTime
from cost_model.context_parallel import causal_work_share, exposed_kv_exchange_s, ring_step_bytes

LLAMA = "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn_hidden=128,seq=32,vocab=128"
CLUSTER = "dgx-h100:gpus_per_node=4"


# --- cost_model/context_parallel.py ---------------------------------------------------------------

def test_load_balanced_causal_attention_gives_every_rank_an_equal_share():
    assert causal_work_share(4, load_balanced=True) == pytest.approx(1 / 4)
    # Contiguous chunks: the last rank attends to the whole prefix, (2 cp - 1) / cp^2 of the work.
    assert causal_work_share(4, load_balanced=False) == pytest.approx(7 / 16)
    assert causal_work_share(1, load_balanced=False) == 1.0


def test_kv_exchange_is_exposed_only_beyond_the_attention_it_overlaps():
    # all-gather: the rank's own block (1 / cp of its attention) runs while the gather is in flight
    assert exposed_kv_exchange_s(method="all_gather", collective_s=1.0, attention_s=4.0, num_ranks=4) == 0.0
    assert exposed_kv_exchange_s(method="all_gather", collective_s=3.0, attention_s=4.0, num_ranks=4) == \
        pytest.approx(2.0)
    # ring: each of cp - 1 steps overlaps one block's attention
    assert exposed_kv_exchange_s(method="ring", collective_s=2.0, attention_s=4.0, num_ranks=4) == pytest.approx(3.0)
    assert ring_step_bytes(8.0, 4, backward=True) == 4.0
    with pytest.raises(ValueError, match="unknown KV exchange"):
        exposed_kv_exchange_s(method="ulysses", collective_s=1.0, attention_s=1.0, num_ranks=2)


# --- solver/context_parallel.py -------------------------------------------------------------------

def _segment() -> SegmentCost:
    return SegmentCost(name="layers.0", forward=ComputeTime(matmul_s=4.0, memory_s=2.0, overhead_s=1.0),
                       backward=ComputeTime(matmul_s=8.0, memory_s=4.0, overhead_s=1.0),
                       comm=[CommEvent(op="all_reduce", axis=0, message_bytes=1e6, time_s=1.0, phase="fwd"),
                             CommEvent(op="all_reduce", axis=0, message_bytes=1e6, time_s=1.0, phase="grad")],
                       param_numel=100.0, saved_bytes=1000.0, output_bytes=80.0, input_bytes=80.0,
                       selective_kept={"x": 400.0})


def test_split_sequence_divides_per_token_work_and_adds_the_kv_exchange():
    cluster = Cluster.from_spec("dgx-h100:nodes=2")
    attention = AttentionCost(node="sdpa", kv_bytes=2e9, forward=ComputeTime(matmul_s=1e-3),
                              backward=ComputeTime(matmul_s=2e-3), causal=True)
    split = split_sequence(_segment(), [attention], cp=4, tp=2, comm=CommModel(cluster), devices_per_node=8)
    assert split.forward.matmul_s == pytest.approx(1.0) and split.forward.overhead_s == 1.0  # launches stay
    assert split.param_numel == 100.0  # parameters are replicated over cp
    assert split.output_bytes == pytest.approx(20.0) and split.selective_kept["x"] == pytest.approx(100.0)
    # the gathered K, V are kept for the backward (3/4 of them come from other ranks)
    assert split.saved_bytes == pytest.approx(250.0 + 1.5e9)
    by_op = {(event.op, event.phase): event for event in split.comm}
    assert by_op[("all_reduce", "fwd")].message_bytes == pytest.approx(2.5e5)
    assert by_op[("all_reduce", "grad")].message_bytes == 1e6  # a weight gradient's reduction is unchanged
    gather, scatter = by_op[(KV_ALL_GATHER, "fwd")], by_op[(KV_REDUCE_SCATTER, "bwd")]
    # 2 GB over 4 ranks cannot hide behind a quarter of 1 ms of attention
    assert gather.message_bytes == 2e9 and gather.time_s > 1e-3
    assert scatter.time_s > 0


def test_split_sequence_keeps_the_weight_gradients_cast_whole():
    """The backward cast of the weights' gradients to fp32 (autopar's runtime) depends on the
    weights, not on the tokens: a cp rank pays all of it."""
    cast = ComputeTime(memory_s=0.5, overhead_s=0.1)
    segment = _segment()
    segment.backward = segment.backward + cast
    segment.cast = cast
    split = split_sequence(segment, [], cp=4, tp=2, comm=CommModel(Cluster.from_spec("dgx-h100")), devices_per_node=8)
    plain = split_sequence(_segment(), [], cp=4, tp=2, comm=CommModel(Cluster.from_spec("dgx-h100")), devices_per_node=8)
    assert split.forward.total_s == pytest.approx(plain.forward.total_s)
    assert split.backward.total_s == pytest.approx(plain.backward.total_s + 0.6)
    assert split.op_recompute.total_s == pytest.approx(plain.op_recompute.total_s)
    assert split.saved_bytes == pytest.approx(plain.saved_bytes)


def test_split_sequence_is_the_identity_without_cp():
    segment = _segment()
    assert split_sequence(segment, [], cp=1, tp=2, comm=None, devices_per_node=8) is segment


# --- the cp axis in the search and in plans -------------------------------------------------------

@pytest.fixture(scope="module")
def planner():
    return api.planner_for(LLAMA, None, Cluster.from_spec(CLUSTER), global_batch=4)


def test_cp_constraint_plans_a_sequence_split(planner):
    plan = api.plan_with(planner, Constraints(cp=2, tp=1, pp=1))
    assert plan.mesh == {"pp": 1, "dp": 2, "cp": 2, "tp": 1}
    assert plan.predicted.breakdown_s[KV_ALL_GATHER] >= 0
    assert plan.predicted.collectives_per_microbatch[KV_ALL_GATHER] == 2  # one per attention op (2 layers)
    assert plan.predicted.collectives_per_microbatch[KV_REDUCE_SCATTER] == 2
    assert "cp=2" in plan.summary()


def test_cp_halves_activations_and_keeps_parameters(planner):
    def evaluate(cp):
        config = api.fixed_config(planner, tp=1, pp=1, dp=4 // cp, cp=cp, microbatch_size=1, schedule="1f1b",
                                  virtual_stages=None, layers_per_virtual_stage=None, recompute="none", zero_stage=0)
        return api.evaluate_with(planner, config)

    whole, split = evaluate(1), evaluate(2)
    assert split.predicted.memory_bytes["parameters"] == whole.predicted.memory_bytes["parameters"]
    # the tokens' activations halve; the step's bf16 weight copies (autopar's runtime) do not
    assert split.predicted.memory_bytes["activations"] < 0.75 * whole.predicted.memory_bytes["activations"]
    assert split.predicted.memory_bytes["weight_copies"] == whole.predicted.memory_bytes["weight_copies"] > 0
    # the same tokens per rank and step: half a sequence in each of twice the microbatches, each
    # cheaper (not half: this tiny model's kernels are mostly launch time, which does not shrink)
    assert split.num_microbatches == 2 * whole.num_microbatches
    per_microbatch = [plan.predicted.breakdown_s["compute"] / plan.num_microbatches for plan in (whole, split)]
    assert per_microbatch[1] < per_microbatch[0]


def test_split_compute_at_cp_1_is_what_the_sharding_priced(planner):
    from autopar.solver.context_parallel import split_compute
    from autopar.solver.sharding import cost_context

    sharding = planner.sharding(1, 1)
    graph = planner.condensed.with_batch(1)
    compute = split_compute(graph, sharding.strategies, cost_context(sharding.mesh, planner.cluster), 1)
    for segment in sharding.segments:
        if segment.name in compute:
            # the ops' kernels; the weight gradients' cast (evaluate.py) is the segment's own, not per token
            assert compute[segment.name].forward.total_s == pytest.approx(segment.forward.total_s)
            assert compute[segment.name].backward.total_s + segment.cast.total_s == \
                pytest.approx(segment.backward.total_s)


def test_cp_plans_round_trip_and_version_1_plans_load_with_cp_1(planner, tmp_path):
    plan = api.plan_with(planner, Constraints(cp=2, tp=1, pp=1))
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path).to_dict() == plan.to_dict()
    data = json.loads(path.read_text())
    data.update(schema_version=1, mesh={"pp": 1, "dp": 2, "tp": 2})
    path.write_text(json.dumps(data))
    assert Plan.load(path).mesh["cp"] == 1
    data["mesh"] = {"pp": 1, "dp": 2, "cp": 3, "tp": 1}
    path.write_text(json.dumps(data))
    with pytest.raises(PlanMismatchError, match="cp"):
        Plan.load(path)


def test_cp_that_does_not_split_the_sequence_is_refused(planner):
    with pytest.raises(ConfigError, match="2 x cp"):
        planner.check_cp(32)


@pytest.mark.parametrize("model, reason", [
    ("gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128", "no scaled_dot_product_attention"),  # eager attention
    ("mlp", "no token sequence"),
])
def test_models_whose_sequence_cannot_be_split_say_why(model, reason):
    with pytest.raises(ConfigError, match=reason):
        autopar.plan(model, cluster=CLUSTER, global_batch=4, constraints={"cp": 2})


def test_cli_cp_flag(capsys):
    from autopar.cli import main

    assert main(["plan", LLAMA, "--cluster", CLUSTER, "--global-batch", "4", "--cp", "2", "--tp", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mesh"]["cp"] == 2


def test_cp_plans_show_their_kv_exchange_in_the_timeline(planner):
    from autopar.report.timeline import layout

    plan = api.plan_with(planner, Constraints(cp=2, tp=1, pp=1))
    timeline = layout(plan)
    assert timeline.end_s == pytest.approx(plan.predicted.step_time_s, rel=0.05)
    parts = plan.stages[0].chunk_times_s[0]
    assert {"cp.kv_all_gather.forward", "cp.kv_reduce_scatter.backward"} <= set(parts)


# --- codegen/context_parallel.py (what needs no process group) ------------------------------------

def test_load_balanced_chunks_cover_the_sequence_once():
    import torch

    from autopar.codegen.context_parallel import chunk_positions

    ranks = [chunk_positions(16, 4, rank) for rank in range(4)]
    assert ranks[0].tolist() == [0, 1, 14, 15] and ranks[3].tolist() == [6, 7, 8, 9]
    assert sorted(torch.cat(ranks).tolist()) == list(range(16))
    with pytest.raises(ConfigError, match="2 x cp"):
        chunk_positions(12, 4, 0)


# --- grouped-query attention: only the kv heads are gathered --------------------------------------

class RepeatedKV:
    """Grouped-query attention written without enable_gqa: K and V repeated for every query head
    (repeat_interleave, or Hugging Face's expand + reshape), then causal sdpa."""

    @staticmethod
    def build(style: str):
        import torch
        import torch.nn.functional as F
        from torch import nn

        class Attention(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embed = nn.Embedding(64, 32)
                self.q, self.k, self.v = nn.Linear(32, 32), nn.Linear(32, 16), nn.Linear(32, 16)
                self.out = nn.Linear(32, 64)

            def forward(self, tokens):
                x = self.embed(tokens)
                batch, seq = tokens.shape
                query = self.q(x).view(batch, seq, 4, 8).transpose(1, 2)
                key = self.k(x).view(batch, seq, 2, 8).transpose(1, 2)
                value = self.v(x).view(batch, seq, 2, 8).transpose(1, 2)
                if style == "repeat_interleave":
                    key, value = key.repeat_interleave(2, dim=1), value.repeat_interleave(2, dim=1)
                elif style == "expand":
                    key = key[:, :, None].expand(batch, 2, 2, seq, 8).reshape(batch, 4, seq, 8)
                    value = value[:, :, None].expand(batch, 2, 2, seq, 8).reshape(batch, 4, seq, 8)
                attended = F.scaled_dot_product_attention(query, key, value, is_causal=True,
                                                          enable_gqa=style == "enable_gqa")
                return self.out(attended.transpose(1, 2).flatten(-2))

        return Attention()


@pytest.mark.parametrize("style, repeats", [("repeat_interleave", 2), ("expand", 2), ("enable_gqa", 1)])
def test_repeated_kv_heads_are_found(style, repeats):
    import torch

    from autopar.capture.export import capture
    from autopar.strategies.attention import attention_nodes, kv_repeats

    graph = capture(RepeatedKV.build(style), (torch.randint(0, 64, (2, 16)),))
    (attention,) = attention_nodes(graph)
    assert kv_repeats(graph, attention) == repeats


def test_cp_prices_the_gather_of_the_kv_heads_only():
    """The built-in Llama passes its kv heads (enable_gqa); a model that repeats them is priced
    for gathering its kv heads too (the runtime takes every r-th head): 4 of 8 query heads' K, V."""
    import torch

    from autopar.solver.context_parallel import attention_costs
    from autopar.solver.sharding import cost_context

    def kv_bytes(model, inputs):
        planner = api.planner_for(model, inputs, Cluster.from_spec(CLUSTER), global_batch=2)
        sharding = planner.sharding(1, 1)
        graph = planner.condensed.with_batch(1)
        costs = attention_costs(graph, sharding.strategies, cost_context(sharding.mesh, planner.cluster))
        return [cost.kv_bytes for segment in costs.values() for cost in segment]

    tokens = (torch.randint(0, 64, (2, 16)),)
    # K and V of one sample: 16 tokens, 2 kv heads of 8 dims, bf16 (the planner's precision)
    for style in ("repeat_interleave", "expand", "enable_gqa"):
        assert kv_bytes(RepeatedKV.build(style), tokens) == [2 * 16 * 2 * 8 * 2], style
    llama = kv_bytes(LLAMA, None)  # kv_heads=2 of head dim 16, bf16
    assert llama == [2 * 32 * 2 * 16 * 2] * 2


def test_cp_attention_gathers_every_rth_head_and_matches_the_repeated_attention(one_process_group):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from autopar.codegen.context_parallel import ContextParallelOps

    torch.manual_seed(0)
    query = torch.randn(2, 4, 8, 8, requires_grad=True)
    kv = torch.randn(2, 2, 2, 8, 8, requires_grad=True)
    def run(repeats):
        ops = ContextParallelOps(seq_len=8, cp=1, rank=0, group=dist.group.WORLD, device=torch.device("cpu"),
                                 table_placeholders=set(), kv_repeats={"sdpa": repeats} if repeats > 1 else {})
        key, value = (tensor.repeat_interleave(2, dim=1) for tensor in kv.unbind(0))
        node = type("Node", (), {"name": "sdpa"})()
        output = ops.attention(node, (query, key, value, None, 0.0, True), {})
        grads = torch.autograd.grad(output.square().sum(), (query, kv))
        return output, grads, ops

    whole, whole_grads, _ = run(1)
    grouped, grouped_grads, _ = run(2)
    expected = F.scaled_dot_product_attention(query, *(t.repeat_interleave(2, dim=1) for t in kv.unbind(0)),
                                              is_causal=True)
    torch.testing.assert_close(whole, expected)
    torch.testing.assert_close(grouped, expected)
    for got, want in zip(grouped_grads, whole_grads):
        torch.testing.assert_close(got, want)


# --- torch's context_parallel as it runs (methods "torch", "torch_compiled") ----------------------

def test_torch_ring_makes_a_causal_diagonal_and_non_causal_blocks():
    from cost_model.context_parallel import torch_ring_steps

    steps = torch_ring_steps(4, causal=True)
    assert [step.causal for step in steps] == [True, False, False, False]
    # torch's count is the whole square: the diagonal is 1/16 of it (half of that is work), each
    # non-causal c x 2c block 1/32 (all work): together a quarter of the causal work
    assert steps[0].flops_fraction == pytest.approx(1 / 16)
    assert steps[0].flops_fraction / 2 + sum(step.flops_fraction for step in steps[1:]) == pytest.approx(1 / 8)
    assert [step.causal for step in torch_ring_steps(2, causal=False)] == [False, False]


def test_torch_exchange_is_exposed_whole_when_compiled():
    from cost_model.context_parallel import torch_dkv_sends_exposed_s, torch_gather_exposed_s

    assert torch_gather_exposed_s(method="torch_compiled", gather_s=1.0, diagonal_s=5.0) == 1.0
    assert torch_gather_exposed_s(method="torch", gather_s=1.0, diagonal_s=5.0) == 0.0
    assert torch_dkv_sends_exposed_s(method="torch_compiled", send_s=1.0, step_s=5.0, num_ranks=4) == 4.0
    # eager: each send hides behind the next step's backward, the last one waits
    assert torch_dkv_sends_exposed_s(method="torch", send_s=1.0, step_s=5.0, num_ranks=4) == 1.0
    assert torch_dkv_sends_exposed_s(method="torch", send_s=2.0, step_s=1.5, num_ranks=4) == pytest.approx(3.5)


def test_torch_context_parallel_moves_every_query_heads_kv_and_passes_fp32_dkv():
    from autopar.solver.context_parallel import DKV_RING
    from autopar.solver.search import SearchOptions

    def plan(method):
        planner = api.planner_for(LLAMA, None, Cluster.from_spec(CLUSTER), global_batch=4,
                                  options=SearchOptions(cp_kv_exchange=method))
        return api.plan_with(planner, Constraints(cp=2, tp=1, pp=1, recompute="none"))

    compiled, eager = plan("torch_compiled"), plan("torch")
    assert compiled.predicted.collectives_per_microbatch[DKV_RING] == 2  # one per attention op
    assert compiled.predicted.collectives_per_microbatch[KV_ALL_GATHER] == 4  # forward and backward
    assert KV_REDUCE_SCATTER not in compiled.predicted.collectives_per_microbatch
    exchange = [sum(value for key, value in result.predicted.breakdown_s.items() if key.startswith("cp."))
                for result in (compiled, eager)]
    assert exchange[0] > exchange[1] >= 0  # compiled, nothing overlaps the exchange


def test_torch_context_parallel_gathers_kv_at_every_query_head(planner):
    """torchtitan's Llama repeats its kv heads before SDPA, and torch's ring moves what SDPA gets:
    4 query heads' K, V where autopar's runtime gathers the 2 kv heads."""
    from autopar.solver.context_parallel import attention_costs
    from autopar.solver.sharding import cost_context

    sharding = planner.sharding(1, 1)
    ctx = cost_context(sharding.mesh, planner.cluster)
    costs = attention_costs(planner.condensed.with_batch(1), sharding.strategies, ctx, cp=2, method="torch_compiled")
    cost = next(iter(costs.values()))[0]
    assert cost.sdpa_kv_bytes == 2 * cost.kv_bytes and cost.torch_ring is not None
    assert cost.torch_ring.merge_forward.memory_s > 0 and cost.torch_ring.merge_backward.memory_s > 0
