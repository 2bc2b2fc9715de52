"""benchmarks/published_moe.py: how a row of shared/reference/published_moe.csv is read (the
configuration as run, the load imbalance its routing implies) and how a predicted step time is
put in the source's unit (tokens/s per GPU, or TFLOP/s per GPU by Megatron-Core's counting)."""

from pathlib import Path

import pytest

from benchmarks.published_moe import REFERENCE, model_spec, read_runs, recompute_mode, shape_fields, zero_stage

HEADER = ("id,source,table,model,layers,hidden,heads,kv_heads,dense_layers,ffn_hidden,expert_ffn_hidden,num_experts,"
          "top_k,shared_experts,vocab,seq,gpus,gpu,cluster,global_batch,microbatch,tp,pp,virtual_stages,cp,ep,etp,dp,"
          "optimizer_sharding,recompute,precision,routing,metric,published,flop_counting,notes")


def _write(tmp_path: Path, *rows: str) -> Path:
    path = tmp_path / "moe.csv"
    path.write_text("# a comment line\n" + HEADER + "\n" + "\n".join(rows) + "\n")
    return path


def test_a_row_is_read_as_it_ran(tmp_path):
    path = _write(tmp_path,
                  'a,"src, with comma",T,Mixtral-8x22B,4,64,4,2,0,,128,8,2,0,100,32,16,H100,dgx-h100,64,2,2,2,2,,4,1,4,'
                  'distributed optimizer (ZeRO-1),none,bf16,token-drop with capacity factor 1.1,tflops_per_gpu,400,'
                  '"Megatron-Core model FLOPs (routed top-k experts only)",x',
                  'b,s,T,gpt-oss-120b,2,64,8,2,0,,64,4,2,0,100,32,8,H100,dgx-h100,16,1,1,1,,1,2,1,8,none,'
                  '"selective (layernorm, MoE activation)",bf16,force-balanced dropless,tokens_per_s_per_gpu,5000,m,'
                  '"head_dim 16 (heads x head_dim != hidden); sliding window 128"',
                  'c,s,T,Qwen3-30B-A3B,2,64,4,4,1,96,32,8,2,0,100,32,8,H100,dgx-h100,16,1,1,1,,1,2,1,8,none,none,bf16,'
                  'dropless,tokens_per_s_per_gpu,1,m,')
    a, b, c = read_runs(path)
    assert (a.id, a.source, a.family, a.num_nodes, a.cluster_spec) == ("a", "src, with comma", "MixtralConfig", 2,
                                                                      "dgx-h100:nodes=2")
    assert (a.tp, a.pp, a.virtual_stages, a.cp, a.ep, a.etp, a.dp, a.microbatch) == (2, 2, 2, 1, 4, 1, 4, 2)
    assert (a.zero, a.recompute, a.head_dim) == (1, "gathers", 16)  # Megatron's SP keeps shards (tp 2)
    assert a.load_imbalance == pytest.approx(1.1)  # token dropping caps the busiest rank at the capacity
    assert (b.family, b.zero, b.recompute, b.head_dim, b.sliding_window) == (
        "GptOssConfig", 0, "modules:layernorm,moe_act", 16, 128)
    assert b.load_imbalance == 1.0 and b.virtual_stages == 1
    assert c.family == "Qwen3MoeConfig" and c.load_imbalance == 1.25  # dropless real routing: the default
    fields = shape_fields(c)
    assert fields["mlp_only_layers"] == [0] and fields["moe_intermediate_size"] == 32 and fields["intermediate_size"] == 96
    assert shape_fields(a)["num_local_experts"] == 8 and shape_fields(a)["intermediate_size"] == 128


def test_optimizer_sharding_and_recompute_as_run():
    assert zero_stage("distributed optimizer with overlapped grad reduce / param gather") == 1
    assert zero_stage("none") == 0
    assert recompute_mode("none") == "none"
    assert recompute_mode("selective (layernorm, MoE activation)") == "modules:layernorm,moe_act"
    assert recompute_mode("selective") == "selective"


def test_step_times_are_put_in_the_sources_unit(tmp_path):
    path = _write(tmp_path,
                  'a,s,T,Mixtral-8x22B,2,64,4,2,0,,128,8,2,0,100,32,16,H100,dgx-h100,8,1,1,1,,1,2,1,16,none,none,'
                  'bf16,force-balanced,tflops_per_gpu,1,"Megatron-Core model FLOPs",x',
                  'q,s,T,Mixtral-8x22B,2,64,4,2,0,,128,8,2,0,100,32,16,H100,dgx-h100,8,1,1,1,,1,2,1,16,none,none,'
                  'bf16,force-balanced,tflops_per_gpu,1,"routed experts, causal attention halved",x',
                  't,s,T,Mixtral-8x22B,2,64,4,2,0,,128,8,2,0,100,32,16,H100,dgx-h100,8,1,1,1,,1,2,1,16,none,none,'
                  'bf16,force-balanced,tokens_per_s_per_gpu,1,m,x')
    full, halved, tokens = read_runs(path)
    b, s, h, layers, ffn, k, vocab = 8, 32, 64, 2, 128, 2, 100
    # per layer forward: Q, K, V, O projections (kv 2 of 4 heads) + scores, and top-k SwiGLU experts; logits.
    attention = 2 * b * s * h * h * (2 + 2 * 2 / 4) + 4 * b * s * s * h
    experts = 3 * 2 * b * s * h * ffn * k
    flops = 3 * (layers * (attention + experts) + 2 * b * s * h * vocab)
    assert full.flops_per_step() == pytest.approx(flops)
    assert halved.flops_per_step() == pytest.approx(flops - 3 * layers * 2 * b * s * s * h)
    assert full.in_unit(2.0) == pytest.approx(flops / 2.0 / 16 / 1e12)
    assert tokens.in_unit(2.0) == pytest.approx(b * s / 2.0 / 16)


@pytest.mark.skipif(not REFERENCE.exists(), reason="reference data not present")
def test_the_reference_rows_parse():
    runs = read_runs()
    assert runs and all(run.ep > 1 and run.dp * run.tp * run.pp * run.cp == run.gpus for run in runs)
    assert all(run.flops_per_step() > 0 and run.load_imbalance >= 1.0 for run in runs)


def test_the_dispatcher_and_the_parameter_gather_are_read_as_their_recipes_ran(tmp_path):
    """The flex dispatcher (DeepEP, HybridEP; every Megatron-LM moe_recipes recipe) sorts the rows
    inside its all-to-all, the all-to-all dispatcher does not; the distributed optimizer's gather
    overlaps the next forward where the row or its framework's recipes say so (Megatron-LM's
    default otherwise: after the optimizer step)."""
    from benchmarks.published_runs import param_gather_overlapped

    row = ('{id},"{source}",T,Qwen3-30B-A3B,2,64,4,4,0,,32,8,2,0,100,32,8,H100,dgx-h100,16,1,1,1,,1,2,1,8,'
           '{sharding},none,bf16,force-balanced,tokens_per_s_per_gpu,1,m,"{notes}"')
    path = _write(tmp_path, row.format(id="a", source="Megatron-LM examples/moe_recipes", sharding="x", notes=""),
                  row.format(id="b", source="s", sharding="x", notes="all-to-all dispatcher"),
                  row.format(id="c", source="s", sharding="x", notes="HybridEP"))
    assert [run.fused_permute for run in read_runs(path)] == [True, False, True]
    assert param_gather_overlapped("distributed optimizer with overlapped grad reduce / param gather")
    assert param_gather_overlapped("NVIDIA NeMo Megatron-Bridge performance summary")
    assert param_gather_overlapped("Megatron-Core; NVIDIA's Megatron-MoE-ModelZoo script")
    assert not param_gather_overlapped("Megatron-LM; distributed optimizer (ZeRO-1)")


def test_a_row_becomes_a_builtin_moe_spec_with_its_shape(tmp_path):
    from autopar.models import build_model

    path = _write(tmp_path,
                  'a,s,T,Mixtral-8x22B,4,64,4,2,0,,128,8,2,0,100,32,16,H100,dgx-h100,64,2,2,2,2,,4,1,4,none,none,'
                  'bf16,token-drop with capacity factor 1.1,tflops_per_gpu,400,m,x',
                  'c,s,T,Qwen3-30B-A3B,2,64,4,4,1,96,32,8,2,0,100,32,8,H100,dgx-h100,16,1,1,1,,1,2,1,8,none,none,'
                  'bf16,force-balanced,tflops_per_gpu,200,m,"head_dim 32"')
    dropping, balanced = read_runs(path)
    spec = model_spec(balanced)
    assert spec.startswith("moe:layers=2,hidden=64,heads=4,kv_heads=4,head_dim=32,seq=32,vocab=100,ffn_hidden=96,"
                           "dense_layers=1,num_experts=8,top_k=2,expert_ffn_hidden=32,")
    assert "capacity_factor=0," in spec  # force-balanced dropless
    assert "capacity_factor=1.1," in model_spec(dropping)  # token-drop at the row's capacity factor
    for run in (dropping, balanced):
        assert build_model(model_spec(run)).model is not None  # the spec is a valid model


def test_the_rows_beyond_the_shared_sample_parse_and_split_their_experts_on_tp():
    """benchmarks/published_moe_more.csv: DGX Cloud's Grok 1 recipes (Megatron-Core's experts
    tensor-parallel over tp, etp = tp, ep over the data-parallel ranks) and DeepSeek-V3 recipes
    (MoE parallel folding, etp = 1; latent attention and the sigmoid router from its public
    config; Megatron-Core's first and last stage layer counts)."""
    from benchmarks.published_moe import MORE
    from benchmarks.published_runs import framework_split

    runs = read_runs(MORE)
    assert runs and len({run.id for run in runs}) == len(runs)
    assert all(run.dp * run.tp * run.pp * run.cp == run.gpus and run.load_imbalance == 1.0 for run in runs)
    grok = [run for run in runs if run.model_name == "Grok-1"]
    assert grok and all(run.etp == run.tp > 1 and run.dp % run.ep == 0 for run in grok)
    deepseek = [run for run in runs if run.model_name == "DeepSeek-V3"]
    assert deepseek and all(run.etp == 1 and (run.dp * run.tp) % run.ep == 0 for run in deepseek)
    assert all(",router=sigmoid,attention=mla,q_lora_rank=1536" in model_spec(run) for run in deepseek)
    assert {framework_split(run, 61, run.pp) for run in deepseek} == {"first=7,last=6", "first=3,last=2"}


@pytest.mark.slow
def test_a_grok_row_is_priced_with_megatrons_tensor_parallel_experts_and_tp_share_dispatch():
    """As Megatron-Core runs it: gate/up column-parallel and down row-parallel on tp (no
    [rows, 2 x expert_ffn_hidden] intermediate between the tp ranks), each tp rank dispatching its
    share of the rows and the tp group gathering them after the all-to-all."""
    from benchmarks.published_moe import MORE, evaluate_run

    run = next(run for run in read_runs(MORE) if run.id == "dgxc-grok1-8")
    outcome = evaluate_run(run, plan=False)
    assert outcome.published_fits and outcome.published_step_s > 0
    assert outcome.breakdown["ep.tp_all_gather"] > 0 and outcome.breakdown["ep.tp_reduce_scatter"] > 0
    assert outcome.breakdown["ep.tp_rows_replaced"] < 0  # the plan's own gather and reduction of the layer
    assert outcome.breakdown["tp.reduce_scatter"] < outcome.breakdown["compute"] / 20


@pytest.mark.slow
def test_a_grok_fp8_row_runs_its_experts_as_transformer_engine_float8_linears():
    """DGX Cloud's Grok 1 FP8 table ran the bf16 table's configurations with TransformerEngine's
    FP8: its rows read as fp8, priced with Megatron's float8 linears and SequentialMLP experts cast
    as TE casts its linears (no torchao grouped casts, no padding copies), faster than bf16."""
    from benchmarks.published_moe import MORE, evaluate_run

    runs = {run.id: run for run in read_runs(MORE)}
    fp8, bf16 = runs["dgxc-grok1-8-fp8"], runs["dgxc-grok1-8"]
    assert (fp8.precision, bf16.precision) == ("fp8", "bf16")
    outcome = evaluate_run(fp8, plan=False)
    terms = outcome.breakdown
    assert terms["fp8.matmul.experts"] > 0 and terms["fp8.cast.experts"] > 0 and "fp8.copy.experts" not in terms
    assert outcome.published_step_s < evaluate_run(bf16, plan=False).published_step_s
