"""Saved activations of a GPT layer under tensor/sequence parallelism and recomputation, against
Korthikanti et al. (arXiv 2205.05198; shared/reference/formulas.md), 16-bit, batch 1."""

import pytest

from autopar import api
from autopar.cluster import Cluster
from autopar.mesh import Mesh
from autopar.solver.sharding import solve_sharding
from cost_model.memory import BF16_ADAM, MEGATRON_BF16

S, B, H, A = 2048, 1, 4096, 32
MIB = 2**20


@pytest.fixture(scope="module")
def graph():
    return api.capture_for_planning(f"gpt:layers=3,hidden={H},heads={A},seq={S},vocab=51200").with_batch(B)


def layer(graph, tp: int, policy=MEGATRON_BF16):
    """Layer 1's costs as Megatron-LM runs it (bf16 weights used as they are: the formulas' runtime)."""
    mesh = Mesh(axis_names=("tp",), shape=(tp,), devices_per_node=8)
    result = solve_sharding(graph, mesh, Cluster.from_spec("dgx-a100-80g"), policy=policy)
    return next(segment for segment in result.segments if segment.name == "layers.1")


def test_no_parallelism(graph):
    assert layer(graph, 1).saved_bytes == pytest.approx(S * B * H * (34 + 5 * A * S / H), rel=0.05)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_and_sequence_parallel(graph, tp):
    """The solver picks sequence parallelism; Korthikanti's s b h / t (34 + 5 a s / h) assumes the
    column-parallel linears keep their sequence-sharded input and all-gather it again in backward.
    DTensor's linear keeps the gathered input instead: 2 s b h (1 - 1/t) more for each of the two
    gathers per layer (attention input, MLP input)."""
    formula = S * B * H / tp * (34 + 5 * A * S / H)
    gathered_inputs = 2 * 2 * S * B * H * (1 - 1 / tp)
    assert layer(graph, tp).saved_bytes == pytest.approx(formula + gathered_inputs, rel=0.05)


@pytest.mark.parametrize("tp", [1, 8])
def test_full_recomputation_keeps_the_layer_input(graph, tp):
    assert layer(graph, tp).input_bytes == pytest.approx(2 * S * B * H / tp, rel=1e-6)


def test_selective_recomputation_drops_the_attention_matrices(graph):
    kept = layer(graph, 1).selective_saved_bytes
    assert kept < S * B * H * 40  # none of the 5 a s^2 b attention-score bytes
    assert kept == pytest.approx(S * B * H * 34, rel=0.10)


@pytest.mark.parametrize("tp", [2, 8])
def test_regathering_keeps_the_sequence_shards(graph, tp):
    """The "gathers" mode keeps the gathered inputs as the shards they came from, as Megatron-LM
    does: Korthikanti's s b h / t (34 + 5 a s / h) exactly, at one more all-gather per gathered
    input in backward."""
    segment = layer(graph, tp)
    formula = S * B * H / tp * (34 + 5 * A * S / H)
    assert segment.regathered_saved_bytes() == pytest.approx(formula, rel=0.05)
    gathers = [event for event in segment.comm if event.op == "all_gather" and event.phase == "fwd"]
    assert segment.regather_s() == pytest.approx(sum(event.time_s for event in gathers), rel=1e-6)


def test_selective_recomputation_with_sequence_parallelism_regathers(graph):
    """Korthikanti's 34 s b h / t: selective recomputation with the gathered inputs kept sharded."""
    segment = layer(graph, 8)
    kept = segment.regathered_saved_bytes(segment.selective_kept)
    assert kept == pytest.approx(S * B * H * 34 / 8, rel=0.10)
    assert segment.regather_s(segment.selective_kept) > 0


@pytest.mark.parametrize("tp", [1, 8])
def test_op_level_selective_keeps_every_other_matmul(graph, tp):
    """torchtitan's op policy on this GPT layer (q, k, v, o, fc_in, fc_out projections; eager
    attention, which is not a fused kernel, so recomputed): the layer input (2 h bytes a token),
    q's and v's outputs (2 h each) and fc_in's (8 h) are kept, and under sequence parallelism the
    two reduce-scatter outputs (2 h each); k, o and fc_out and everything else run again."""
    segment = layer(graph, tp)
    per_token = (2 + 2 + 2 + 8) / tp + (4 / tp if tp > 1 else 0)
    assert segment.op_saved_bytes == pytest.approx(S * B * H * per_token, rel=0.02)
    assert 0 < segment.op_recompute.matmul_s < 0.8 * segment.forward.matmul_s


@pytest.mark.parametrize("tp", [1, 4])
def test_autopar_runtime_casts_weight_gradients_per_microbatch_and_keeps_no_copy_per_microbatch(graph, tp):
    """autopar's codegen keeps fp32 parameters behind bf16 copies made once per step: a segment's
    forward reads the step's copies as Megatron-LM reads its bf16 weights (same cost, nothing more
    saved per microbatch), and its backward casts each weight gradient back to fp32 (6 bytes per
    element, one kernel per weight). The step's cast and copies are priced per stage (step_model)."""
    megatron, autopar = layer(graph, tp), layer(graph, tp, BF16_ADAM)
    cluster = Cluster.from_spec("dgx-a100-80g")
    bandwidth = cluster.device.memory_bandwidth_bytes_per_s * cluster.device.memory_efficiency
    numel = autopar.param_numel
    assert numel == megatron.param_numel == pytest.approx(12 * H * H / tp, rel=0.01)
    assert autopar.forward.total_s == pytest.approx(megatron.forward.total_s, rel=1e-12)
    assert autopar.backward.memory_s - megatron.backward.memory_s == pytest.approx(6 * numel / bandwidth, rel=1e-6)
    assert autopar.backward.overhead_s > megatron.backward.overhead_s
    assert autopar.cast.total_s == pytest.approx(autopar.backward.total_s - megatron.backward.total_s, rel=1e-9)
    assert autopar.saved_bytes == megatron.saved_bytes
    assert autopar.selective_saved_bytes == megatron.selective_saved_bytes
    assert autopar.op_recompute.total_s == pytest.approx(megatron.op_recompute.total_s, rel=1e-12)


def test_a_saved_view_of_a_weight_is_no_activation():
    """Hugging Face's grouped-matmul experts read a transpose of the expert weight and save it for
    backward: that keeps the weight itself, not an activation."""
    transformers = pytest.importorskip("transformers")
    from hf_meta import capture_causal_lm

    config = transformers.MixtralConfig(use_cache=False, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                        num_local_experts=8, num_experts_per_tok=2)
    graph = capture_causal_lm(transformers.MixtralForCausalLM, config)
    cluster = Cluster.from_spec("dgx-h100")
    result = solve_sharding(graph, Mesh(axis_names=("tp",), shape=(1,), devices_per_node=8), cluster)
    weights = {node.name for node in graph.nodes if node.kind == "param"}
    saved = {root: size for segment in result.segments for root, size in segment.saved_by_root.items() if size}
    assert saved and not set(saved) & weights


@pytest.mark.parametrize("tp", [1, 2])
def test_linear_weights_can_accumulate_their_gradients_inside_the_gemms_on_gpus(graph, tp):
    """On a CUDA cluster the four linear weights of a layer (12 H^2 / tp: column- and row-parallel
    under tp) can accumulate their gradients inside the weight-gradient GEMMs (codegen/fused_wgrad.py):
    the saving per microbatch is their cast (6 bytes per element), the GEMMs at this size staying
    compute-bound with their fp32 epilogue. The biases and norm weights keep the cast. On a CPU
    cluster nothing fuses."""
    autopar = layer(graph, tp, BF16_ADAM)
    cluster = Cluster.from_spec("dgx-a100-80g")
    bandwidth = cluster.device.memory_bandwidth_bytes_per_s * cluster.device.memory_efficiency
    assert autopar.fused_wgrad_numel == pytest.approx(12 * H * H / tp, rel=1e-9)
    assert autopar.fused_wgrad_saving.memory_s == pytest.approx(6 * autopar.fused_wgrad_numel / bandwidth, rel=1e-6)
    assert autopar.fused_wgrad_saving.matmul_s == 0.0
    assert 0 < autopar.fused_wgrad_saving.total_s < autopar.cast.total_s
    cpu = Mesh(axis_names=("tp",), shape=(tp,), devices_per_node=8)
    on_cpu = solve_sharding(graph, cpu, Cluster.from_spec("cpu:procs=8"), policy=BF16_ADAM)
    assert all(segment.fused_wgrad_numel == 0 for segment in on_cpu.segments)


@pytest.mark.parametrize("tp", [1, 8])
def test_the_loss_backward_holds_two_gradients_and_loss_parallel_one_temporary_more(graph, tp):
    """The epilogue's gradient workspace is the cross-entropy's backward: aten's fused kernels hold
    the log-probabilities' and the logits' gradients (2 L of the fp32 logits on this device);
    DTensor's loss_parallel (the vocab strategy, chosen at tp 8) also exp(x) beside its scattered
    zeros (3 L). Measured on the CPU: benchmarks/vocab_parallel_loss.py --memory."""
    mesh = Mesh(axis_names=("tp",), shape=(tp,), devices_per_node=8)
    result = solve_sharding(graph, mesh, Cluster.from_spec("dgx-a100-80g"), policy=MEGATRON_BF16)
    loss = next(node for node in graph.nodes if node.target == "aten.cross_entropy_loss.default")
    strategy = result.strategies[loss.name]
    assert (strategy.name == "vocab") == (tp > 1)
    local_fp32_logits = graph[loss.inputs[0]].output.numel * 4 / tp
    epilogue = next(segment for segment in result.segments if loss.name in segment.node_kept_bytes)
    assert epilogue.grad_workspace_bytes == pytest.approx((3 if tp > 1 else 2) * local_fp32_logits, rel=0.01)
