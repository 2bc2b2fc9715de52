"""benchmarks/moe_unpriced.py: the arithmetic of how Megatron-Core runs GPT-OSS's mechanisms, by the
shapes of a published row (which mechanism applies, how each scales)."""

from pathlib import Path

import pytest

from autopar.cluster import Cluster
from benchmarks.moe_unpriced import layer_costs_s
from benchmarks.published_moe import read_runs
from cost_model.compute import ComputeModel

HEADER = ("id,source,table,model,layers,hidden,heads,kv_heads,dense_layers,ffn_hidden,expert_ffn_hidden,num_experts,"
          "top_k,shared_experts,vocab,seq,gpus,gpu,cluster,global_batch,microbatch,tp,pp,virtual_stages,cp,ep,etp,dp,"
          "optimizer_sharding,recompute,precision,routing,metric,published,flop_counting,notes")
COMPUTE = ComputeModel(Cluster.from_spec("dgx-h100:nodes=1").device)


def _runs(tmp_path: Path, ep_oss: int):
    path = tmp_path / "moe.csv"
    path.write_text(HEADER + "\n" + "\n".join((
        f'o,s,T,gpt-oss-120b,4,2880,64,8,0,,2880,128,4,0,1000,4096,64,H100,dgx-h100,64,1,1,4,,1,{ep_oss},1,16,none,'
        'none,bf16,force-balanced dropless,tokens_per_s_per_gpu,1,m,"head_dim 64; sliding window 128"',
        'm,s,T,Mixtral-8x22B,4,2880,64,8,0,,2880,8,2,0,1000,4096,64,H100,dgx-h100,64,1,1,4,,1,8,1,16,none,none,bf16,'
        'force-balanced,tokens_per_s_per_gpu,1,m,x',
    )) + "\n")
    return read_runs(path)


def test_each_mechanism_applies_by_the_rows_features_and_shapes(tmp_path):
    oss, mixtral = _runs(tmp_path, ep_oss=8)
    costs = layer_costs_s(oss, COMPUTE)
    assert set(costs) == {"expert biases", "clamped GLU", "sliding windows"}  # the reorder is priced: ep.reorder
    assert costs["sliding windows"] < 0 < min(costs[name] for name in costs if name != "sliding windows")
    assert layer_costs_s(mixtral, COMPUTE) == {}  # no biases, no windows


def test_the_bias_loop_launches_kernels_per_local_expert(tmp_path):
    (eight, _), (four, _) = _runs(tmp_path, ep_oss=8), _runs(tmp_path, ep_oss=4)
    # ep 4: twice the local experts (7 more kernels each), the same rows per rank (force-balanced)
    extra = layer_costs_s(four, COMPUTE)["expert biases"] - layer_costs_s(eight, COMPUTE)["expert biases"]
    assert extra == pytest.approx(16 * 7 * COMPUTE.overhead_s)
