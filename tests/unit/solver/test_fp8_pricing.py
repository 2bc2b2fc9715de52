"""The fp8 terms of a step (solver/fp8_pricing.py), on datasheet clusters."""

from __future__ import annotations

import pytest

import autopar

SPEC = "gpt:layers=2,hidden=1024,heads=16,seq=512,vocab=1024"


def every_linear(fqn: str, shape: tuple[int, ...]) -> bool:
    """A filter: the planner keeps every eligible linear in float8 (no choice of its own)."""
    return True


def terms(cluster: str, precision: str = "fp8", **config):
    chosen = {"fp8_filter": every_linear} if precision == "fp8" else {}
    plan = autopar.evaluate(SPEC, cluster=cluster, global_batch=8, precision=precision, **chosen,
                            **{"tp": 1, "pp": 1, "microbatch_size": 1, **config})
    return plan, {name: seconds for name, seconds in plan.predicted.breakdown_s.items() if name.startswith("fp8")}


def test_fp8_adds_named_terms_to_the_bf16_step(monkeypatch):
    from autopar.solver.step_model import StepModel

    plan, fp8 = terms("dgx-h100:gpus_per_node=2")
    # fp8 plans run every linear through torchao, unfused: compared with bf16 priced unfused too
    # (codegen/fused_wgrad.py)
    monkeypatch.setattr(StepModel, "_fuses_wgrad", lambda self, config: False)
    bf16, _ = terms("dgx-h100:gpus_per_node=2", "bf16")
    assert fp8["fp8.matmul"] > 0 and fp8["fp8.cast"] > 0  # eager casts
    assert "fp8.amax" not in fp8  # nothing sharded over tp: every scale is local
    # The float8 linears' matmuls leave `compute` at the bf16 rate and come back at twice the rate.
    moved = bf16.predicted.breakdown_s["compute"] - plan.predicted.breakdown_s["compute"]
    assert fp8["fp8.matmul"] < moved < 2.5 * fp8["fp8.matmul"]
    assert plan.predicted.step_time_s == pytest.approx(bf16.predicted.step_time_s + sum(fp8.values()) - moved,
                                                       rel=1e-9)
    assert all(seconds >= 0 for seconds in plan.predicted.breakdown_s.values())
    assert plan.predicted.memory_bytes["fp8.copies"] > 0
    assert plan.predicted.peak_memory_bytes > bf16.predicted.peak_memory_bytes


def test_tensor_parallel_scales_all_reduce_and_fsdp_gathers_float8():
    _, sharded = terms("dgx-h100:gpus_per_node=4", tp=2, zero_stage=3)
    assert sharded["fp8.amax"] > 0
    assert sharded["fp8.cast.all_gather"] > 0 and "fp8.all_gather" not in sharded
    bf16, _ = terms("dgx-h100:gpus_per_node=4", "bf16", tp=2, zero_stage=3)
    plan, _ = terms("dgx-h100:gpus_per_node=4", tp=2, zero_stage=3)
    gathered = [name for name in bf16.predicted.breakdown_s if name.startswith("dp.all_gather")]
    assert gathered and all(plan.predicted.breakdown_s[name] < bf16.predicted.breakdown_s[name] for name in gathered)
    assert any("float8 weights at 1 byte per element" in note for note in plan.notes)


def test_the_rowwise_recipe_gathers_in_bf16():
    plan = autopar.evaluate(SPEC, cluster="dgx-h100:gpus_per_node=2", global_batch=8, precision="fp8",
                            fp8_recipe="rowwise", tp=1, pp=1, microbatch_size=1, zero_stage=3,
                            fp8_filter=every_linear)
    assert "fp8.cast.all_gather" not in plan.predicted.breakdown_s and "fp8.cast" in plan.predicted.breakdown_s


def test_rowwise_under_tensor_parallelism_says_what_was_measured():
    """torchtitan measured rowwise under TP 8 at bf16's speed (torchtitan#1207): a plan with rowwise
    float8 on tp > 1 says so; tensorwise there, or rowwise without tp, does not."""
    from autopar.solver.fp8_pricing import ROWWISE_UNDER_TP_NOTE

    def notes(recipe: str, tp: int):
        plan = autopar.evaluate(SPEC, cluster="dgx-h100:gpus_per_node=2", global_batch=8, precision="fp8",
                                fp8_recipe=recipe, tp=tp, pp=1, microbatch_size=1, fp8_filter=every_linear)
        return plan.notes

    assert ROWWISE_UNDER_TP_NOTE in notes("rowwise", 2)
    assert ROWWISE_UNDER_TP_NOTE not in notes("tensorwise", 2)
    assert ROWWISE_UNDER_TP_NOTE not in notes("rowwise", 1)


def test_cpus_emulate_float8_without_a_faster_matmul():
    _, fp8 = terms("cpu:procs=2")
    assert "fp8.matmul" not in fp8 and fp8["fp8.cast"] > 0


def test_full_recomputation_casts_the_forward_again():
    _, plain = terms("dgx-h100:gpus_per_node=2")
    _, full = terms("dgx-h100:gpus_per_node=2", recompute="full")
    assert full["fp8.cast"] > plain["fp8.cast"] and full["fp8.matmul"] > plain["fp8.matmul"]


def _with_handling(handling: str, everything: bool = False, spec: str = SPEC, recipe: str = "tensorwise", **config):
    """The fp8 terms (`everything`: all terms) of SPEC with every linear in float8, the casts run
    as `handling` runs them."""
    from dataclasses import replace

    from autopar.plans.planning import planner_for
    from autopar.solver.search import Planner

    planner = planner_for(spec, None, "dgx-h100:gpus_per_node=4", global_batch=8, precision="fp8",
                          fp8_filter=every_linear)
    # the float8 terms apart from the layout copies of sequence-parallel collectives (test_costing),
    # which would turn the solve away from sequence parallelism at this size
    again = Planner(planner.graph, planner.cluster, global_batch=8, precision="fp8",
                    policy=replace(planner.policy, sp_layout_copies="none"),
                    fp8=replace(planner.fp8, handling=handling, recipe=recipe))
    estimate, _ = again.evaluate(autopar_config(again, **config))
    return {name: seconds for name, seconds in estimate.breakdown_s.items() if everything or name.startswith("fp8")}


def autopar_config(planner, **config):
    from autopar import api

    settings = dict(tp=1, pp=1, dp=None, microbatch_size=1, schedule="1f1b", virtual_stages=None,
                    layers_per_virtual_stage=None, recompute="none", zero_stage=0)
    settings.update(config)
    return api.fixed_config(planner, **settings)


def test_the_cast_handling_is_an_input_of_the_price():
    eager, compiled = _with_handling("eager", zero_stage=3), _with_handling("compiled", zero_stage=3)
    assert compiled["fp8.cast"] < eager["fp8.cast"] / 4  # 5 of eager's 33 bytes per element, 2 of 9 kernels
    assert compiled["fp8.matmul"] == pytest.approx(eager["fp8.matmul"])
    assert compiled["fp8.cast.all_gather"] < eager["fp8.cast.all_gather"]
    # TransformerEngine: no float8 FSDP gather (Megatron gathers bf16), a chunk's amaxes in one all-reduce.
    te = _with_handling("te", tp=2, zero_stage=1)
    assert "fp8.cast.all_gather" not in te and te["fp8.cast"] > 0
    assert te["fp8.amax"] < _with_handling("eager", tp=2, zero_stage=1)["fp8.amax"]


def test_an_unknown_cast_handling_is_refused_with_the_choices():
    from autopar.errors import ConfigError
    from autopar.solver.fp8 import Fp8Choice
    from autopar.solver.fp8_pricing import Fp8Pricing

    with pytest.raises(ConfigError, match="'jit' is not one of .*eager"):
        Fp8Pricing(None, Fp8Choice(handling="jit"), compute=None, comm=None, devices_per_node=8,
                   memory_budget_bytes=1.0)


LLAMA = "llama:layers=2,hidden=2048,heads=16,kv_heads=4,ffn_hidden=5632,vocab=1024,seq=4096"


def test_torchtitans_float8_tensor_parallelism_gathers_float8_inputs_cast_on_their_shard():
    """Under "torchtitan" (Float8ColwiseParallel) a column-parallel linear's sequence-parallel
    input is cast on its shard and all-gathered at 1 byte per element; autopar's runtime, eager or
    compiled, gathers bf16 and casts the gathered input."""
    eager = _with_handling("eager", everything=True, spec=LLAMA, tp=2)
    titan = _with_handling("torchtitan", everything=True, spec=LLAMA, tp=2)
    assert titan["tp.all_gather"] < eager["tp.all_gather"]
    # Only the forward gathers of float8 inputs move at half the bytes, not the backward's gathers of
    # the gradients of reduce-scattered outputs: 5 of 9 gathered tensors here (4 layer inputs, the head's).
    assert titan["tp.all_gather"] == pytest.approx(eager["tp.all_gather"] * (1 - 5 / 9 / 2))
    assert titan["tp.reduce_scatter"] == pytest.approx(eager["tp.reduce_scatter"])
    compiled = _with_handling("compiled", everything=True, spec=LLAMA, tp=2)
    assert compiled["tp.all_gather"] == pytest.approx(eager["tp.all_gather"])
    assert titan["fp8.cast"] < compiled["fp8.cast"] < eager["fp8.cast"]  # torchtitan casts the inputs' shards
    # Transformer Engine gathers them in float8 too: its norm writes the float8 input on the shard
    # and LayerNormLinear all-gathers that (TE 1.12 and 2.x, layernorm_linear.py).
    te = _with_handling("te", everything=True, spec=LLAMA, tp=2)
    assert te["tp.all_gather"] == pytest.approx(titan["tp.all_gather"])


def test_transformer_engine_keeps_float8_weights_and_saves_float8_inputs():
    """TE casts each weight once per step and keeps it with its transpose (2 bytes per weight
    element), and saves the float8 input for backward (half the bf16 bytes of the inputs only
    float8 linears save); torchao (eager, compiled, torchtitan) does neither."""
    from dataclasses import replace

    from autopar.plans.planning import planner_for
    from autopar.solver.search import Planner

    base = planner_for(SPEC, None, "dgx-h100:gpus_per_node=4", global_batch=8, precision="fp8",
                       fp8_filter=every_linear)
    memory = {}
    for handling in ("eager", "te"):
        planner = Planner(base.graph, base.cluster, global_batch=8, policy=base.policy, precision="fp8",
                          fp8=replace(base.fp8, handling=handling))
        estimate, _ = planner.evaluate(autopar_config(planner))
        memory[handling] = estimate.memory_bytes
    per_layer = 4 * 1024 * 1024 + 2 * 1024 * 4096  # q, k, v, o; fc_in, fc_out (every linear, by the filter)
    assert memory["te"]["fp8.weights"] == 2 * 2 * per_layer  # two layers, two float8 layouts
    assert 0 < -memory["te"]["fp8.saved_inputs"] < memory["te"]["activations"] / 2
    assert "fp8.weights" not in memory["eager"] and "fp8.saved_inputs" not in memory["eager"]


def test_transformer_engines_current_scaling_pays_amax_passes_and_reductions_and_gathers_float8(monkeypatch):
    """TE's current scaling ("te-current") casts with an amax pass first (after a norm, the norm's
    amax: the cast pass alone) and all-reduces the amax of a sequence-parallel input or grad_output
    over tp before each cast; it gathers sequence-parallel inputs in float8 as delayed scaling does;
    linears reading one input (q, k, v; gate, up: Megatron's fused QKV and fc1) cast it once."""
    from dataclasses import replace

    from cost_model import fp8

    delayed = _with_handling("te", everything=True, spec=LLAMA, tp=2)
    current = _with_handling("te-current", everything=True, spec=LLAMA, tp=2)
    assert current["fp8.cast"] > delayed["fp8.cast"]
    assert current["fp8.amax"] > delayed["fp8.amax"] > 0  # one per cast against one per model chunk
    assert current["tp.all_gather"] == pytest.approx(delayed["tp.all_gather"])  # both gather float8 inputs
    assert current["fp8.matmul"] == pytest.approx(delayed["fp8.matmul"])
    unfused = replace(fp8.HANDLINGS["te-current"], name="te-unfused", shared_input_cast_once=False)
    monkeypatch.setitem(fp8.HANDLINGS, "te-unfused", unfused)
    separate = _with_handling("te-unfused", everything=True, spec=LLAMA, tp=2)
    assert separate["fp8.cast"] > current["fp8.cast"] and separate["fp8.amax"] > current["fp8.amax"]


def test_delayed_scaling_reduces_each_chunks_amaxes_over_the_stages_tensor_and_data_parallel_ranks():
    """TE's delayed scaling all-reduces the amaxes one model chunk's casts recorded when the chunk's
    forward ends and again in its backward, every microbatch, blocking, over the stage's
    tp x dp x cp ranks (Megatron's amax reduction group, FP8GlobalStateManager.
    reduce_and_update_fp8_tensors): none on a rank alone, more over more ranks and more chunks."""
    from autopar.plans.planning import planner_for
    from autopar.solver.configs import ParallelConfig
    from cost_model.fp8 import HANDLINGS

    planner = planner_for(LLAMA, None, "dgx-h100:nodes=4", global_batch=64, precision="fp8", fp8_filter=every_linear)
    planner.pricing.fp8.handling = HANDLINGS["te"]
    amax = planner.pricing.fp8._region_amax_s

    def config(**mesh):
        return ParallelConfig(microbatch_size=1, num_microbatches=8, **mesh)

    assert amax(14, config(dp=1, tp=1, pp=2)) == 0.0
    node = config(dp=4, tp=2, pp=2)  # the stage's 8 ranks in one node
    nodes = config(dp=16, tp=2, pp=1)  # 32 ranks over 4 nodes
    assert 0 < amax(14, node) < amax(14, nodes)
    two_chunks = config(dp=4, tp=2, pp=2, schedule="interleaved", virtual_stages=2)
    assert amax(14, two_chunks) > amax(14, node)


def test_transformer_engine_regathers_its_float8_shards_in_float8():
    """Under Megatron's "gathers" recomputation the saved sequence shard of a column-parallel input
    is gathered again in backward; TE saved it in float8, so the re-gather moves 1 byte per element."""
    bf16 = _with_handling("eager", everything=True, spec=LLAMA, tp=2, recompute="gathers", sequence_parallel=True)
    te = _with_handling("te", everything=True, spec=LLAMA, tp=2, recompute="gathers", sequence_parallel=True)
    assert 0 < te["tp.all_gather.regather"] < bf16["tp.all_gather.regather"]


@pytest.mark.parametrize("recompute", ["none", "gathers"])
def test_transformer_engine_saves_float8_inputs_also_as_sequence_shards(recompute):
    """Megatron keeps a sequence-parallel linear's input as its shard ("gathers", as priced for
    Megatron's runs); TE's shard is float8 too, so the saving applies without recomputation either way."""
    from dataclasses import replace

    from autopar.plans.planning import planner_for
    from autopar.solver.search import Planner

    base = planner_for(SPEC, None, "dgx-h100:gpus_per_node=4", global_batch=8, precision="fp8",
                       fp8_filter=every_linear)
    planner = Planner(base.graph, base.cluster, global_batch=8, policy=base.policy, precision="fp8",
                      fp8=replace(base.fp8, handling="te"))
    estimate, _ = planner.evaluate(autopar_config(planner, tp=2, recompute=recompute, sequence_parallel=True))
    assert 0 < -estimate.memory_bytes["fp8.saved_inputs"] < estimate.memory_bytes["activations"] / 2


def test_torchtitans_compiled_blocks_cast_a_shared_input_once():
    """torchtitan compiles each block whole: q, k, v (and gate, up) read one tensor and share its
    casts, forward and backward; autopar's runtime compiles each linear alone. Before torchao's
    2025-01-13 rework the float8 input and weight were saved: fewer casts still."""
    compiled = _with_handling("compiled", spec=LLAMA)
    titan = _with_handling("torchtitan", spec=LLAMA)
    before = _with_handling("torchtitan-2024", spec=LLAMA)
    assert before["fp8.cast"] < titan["fp8.cast"] < compiled["fp8.cast"]


def test_a_float8_matmul_moves_its_operands_at_one_byte():
    from autopar.solver.fp8_pricing import _matmul_bytes
    from cost_model.fp8 import Fp8LinearElements

    linear = Fp8LinearElements(input=10.0, weight=100.0, grad_output=20.0)
    # each matmul reads two of the three and writes the third (in the compute dtype)
    assert _matmul_bytes(linear, "output") == (260.0, 130.0 + 20.0)
    assert _matmul_bytes(linear, "grad_input") == (260.0, 130.0 + 10.0)
    assert _matmul_bytes(linear, "grad_weight") == (260.0, 130.0 + 100.0)


def test_rowwise_backward_matmuls_pay_their_rescale_passes_where_they_run_apart(monkeypatch):
    """torchao rescales rowwise's backward matmul outputs in a pass of their own
    (CastHandling.rowwise_rescale_bytes): autopar's compiled linears both outputs; torchtitan's
    compiled blocks the weight gradients, and the input gradient only of the linear fed by
    attention (o_proj), whose backward is an extern kernel."""
    from autopar.plans.planning import planner_for
    from cost_model.fp8 import CastHandling

    planner = planner_for(LLAMA, None, "dgx-h100:gpus_per_node=4", global_batch=8, precision="fp8",
                          fp8_filter=every_linear)
    after_attention = {linear.fqn.split(".")[-2] for linear in planner.pricing.fp8.linears
                       if linear.after_tensor_cores}
    assert after_attention == {"o_proj"}
    def rowwise_matmuls():
        return {name: _with_handling(name, spec=LLAMA, recipe="rowwise")["fp8.matmul"]
                for name in ("compiled", "torchtitan")}

    priced = rowwise_matmuls()
    monkeypatch.setattr(CastHandling, "rescale_pass_s", lambda self, *args, **kwargs: 0.0)
    bare = rowwise_matmuls()
    assert bare["compiled"] == pytest.approx(bare["torchtitan"])
    assert bare["torchtitan"] < priced["torchtitan"] < priced["compiled"]
    assert _with_handling("compiled", spec=LLAMA)["fp8.matmul"] == pytest.approx(
        _with_handling("torchtitan", spec=LLAMA)["fp8.matmul"])  # tensorwise scales inside the GEMM


def test_the_forward_float8_matmul_runs_at_the_profiles_fast_accumulation_rate(tmp_path):
    """torchao's and TE's float8 linears run their forward matmul with fast accumulation and the
    two backward ones split (cost_model/fp8.py FAST_ACCUMULATION_MATMULS): with a profile that
    measured both, a third of the float8 matmul FLOPs run at the fast rate."""
    from cost_model.profile import SCHEMA_VERSION, HardwareProfile, MatmulPoint

    def matmul_s(rates: dict[str, float]) -> float:
        points = tuple(MatmulPoint(dtype=dtype, flops=flops, achieved_flops_per_s=rate)
                       for dtype, rate in rates.items() for flops in (1e6, 1e12))
        path = tmp_path / f"{len(rates)}.json"
        HardwareProfile(schema_version=SCHEMA_VERSION, device_name="H100", device_kind="cuda", num_processes=1,
                        memory_bytes=80e9, matmul=points, memory_bandwidth_bytes_per_s=3e12,
                        kernel_overhead_s=5e-6).save(path)
        return terms(f"dgx-h100:nodes=1,gpus_per_node=1,profile={path}")[1]["fp8.matmul"]

    split = matmul_s({"bf16": 50e12, "fp8": 100e12})
    both = matmul_s({"bf16": 50e12, "fp8": 100e12, "fp8_fast": 200e12})
    assert both == pytest.approx(split * (1 / 3 * 0.5 + 2 / 3), rel=1e-3)
