"""Plan Hugging Face models at their real sizes, on meta (no weights, nothing downloaded).

    .venv/bin/python benchmarks/hf_real_sizes.py                 # every model below
    .venv/bin/python benchmarks/hf_real_sizes.py Llama-3-8B ...  # some of them

Each model is built with `from_config` under `autopar.models.on_meta()` (meta as the default
device, weight initializers skipped) from the figures of its public config.json (written out
below), with transformers' defaults otherwise (SDPA attention),
and planned with `autopar.plan` for CLUSTER at GLOBAL_BATCH, its loss reading `out.logits`.
Each runs in a fresh process (peak RSS is per process). Columns: build time (config and
`from_config` on meta, after transformers' model module is imported), capture time (export +
probing of the model with its loss), whether identical blocks were traced once per period and
copied (block_reuse.py: "3 of 32" children traced) or every layer, planning time (search), each
as wall time and as this process's CPU time (which a busy machine inflates far less than wall
time), parameters, and the plan chosen.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.fresh_process import child_main, peak_rss_bytes, run_child  # noqa: E402

CLUSTER = "dgx-h100:nodes=16"
GLOBAL_BATCH = 512

# config class, model class, sequence length, fields from the model's public config.json.
MODELS = {
    "Llama-3-8B": ("LlamaConfig", "LlamaForCausalLM", 4096, dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "Mistral-7B": ("MistralConfig", "MistralForCausalLM", 4096, dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768, sliding_window=4096,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "Mixtral-8x7B": ("MixtralConfig", "MixtralForCausalLM", 4096, dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768, num_local_experts=8,
        num_experts_per_tok=2, rope_theta=1e6, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "Qwen2-72B": ("Qwen2Config", "Qwen2ForCausalLM", 4096, dict(
        hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, vocab_size=152064, max_position_embeddings=32768, rope_theta=1e6,
        rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "Gemma2-27B": ("Gemma2Config", "Gemma2ForCausalLM", 4096, dict(
        hidden_size=4608, intermediate_size=36864, num_hidden_layers=46, num_attention_heads=32,
        num_key_value_heads=16, head_dim=128, vocab_size=256000, max_position_embeddings=8192,
        sliding_window=4096, query_pre_attn_scalar=144, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, rms_norm_eps=1e-6)),
    "T5-11B": ("T5Config", "T5ForConditionalGeneration", 512, dict(
        d_model=1024, d_ff=65536, d_kv=128, num_heads=128, num_layers=24, vocab_size=32128,
        feed_forward_proj="relu", relative_attention_num_buckets=32, decoder_start_token_id=0)),
}


def _token_loss(output, targets):
    import torch.nn.functional as F

    return F.cross_entropy(output.logits.flatten(0, -2).float(), targets.flatten())


def measure(name: str) -> dict:
    """Runs in the child process."""
    import torch
    import transformers

    from autopar import api
    from autopar.plans.planning import PRECISIONS, capture_for_planning, plan_with
    from autopar.capture.block_match import repeated_blocks
    from autopar.cluster import Cluster
    from autopar.models import on_meta
    from autopar.solver.search import Planner, SearchOptions

    torch.set_num_threads(1)
    config_name, model_name, seq, fields = MODELS[name]
    model_class = getattr(transformers, model_name)  # imports the model's module
    building, building_cpu = time.perf_counter(), time.process_time()
    config = getattr(transformers, config_name)(use_cache=False, **fields)
    with on_meta():
        model = model_class(config)
    build_s, build_cpu_s = time.perf_counter() - building, time.process_time() - building_cpu
    reused = []
    reusing = api.capture_reusing_blocks

    def recorded(*args, **kwargs):
        graph = reusing(*args, **kwargs)
        reused.append(graph is not None)
        return graph

    api.capture_reusing_blocks = recorded
    layouts = repeated_blocks(model)
    batch = 1
    tokens = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    inputs = dict(input_ids=tokens)
    if "decoder_start_token_id" in fields:
        inputs["decoder_input_ids"] = tokens
    started, started_cpu = time.perf_counter(), time.process_time()
    graph = capture_for_planning(model, inputs, loss_fn=_token_loss, example_targets=tokens, cache=False)  # cold
    captured, captured_cpu = time.perf_counter(), time.process_time()
    planner = Planner(graph, Cluster.from_spec(CLUSTER), global_batch=GLOBAL_BATCH, policy=PRECISIONS["bf16"],
                      precision="bf16", options=SearchOptions())
    plan = plan_with(planner)
    planned, planned_cpu = time.perf_counter(), time.process_time()
    traced = " + ".join(f"{blocks.num_captured} of {blocks.num_children}" for blocks in layouts) \
        if reused == [True] else "every layer"
    return dict(name=name, attention=config._attn_implementation, seq=seq, num_nodes=len(graph.nodes),
                build_s=build_s, build_cpu_s=build_cpu_s, traced=traced, capture_s=captured - started,
                capture_cpu_s=captured_cpu - started_cpu,
                plan_s=planned - captured, plan_cpu_s=planned_cpu - captured_cpu, num_params=graph.num_params,
                mesh=plan.mesh, microbatch_size=plan.microbatch_size, schedule=plan.schedule, recompute=plan.recompute,
                zero_stage=plan.zero_stage, step_time_s=plan.predicted.step_time_s,
                peak_gib=plan.predicted.peak_memory_bytes / 2**30, fits=plan.predicted.fits,
                peak_rss_gb=peak_rss_bytes() / 1e9)


def table(rows: list[dict]) -> str:
    header = ("model", "attention", "seq", "nodes", "build (s)", "build CPU (s)", "children traced", "capture (s)",
              "capture CPU (s)", "plan (s)",
              "plan CPU (s)", "parameters", "mesh pp x dp x tp", "microbatch", "schedule", "recompute", "ZeRO",
              "step (s)", "peak (GiB)", "peak RSS (GB)")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['name']} | failed: {row['error']} |")
            continue
        mesh = row["mesh"]
        cells = (row["name"], row["attention"], str(row["seq"]), f"{row['num_nodes']:,}", f"{row['build_s']:.1f}",
                 f"{row['build_cpu_s']:.2f}", row["traced"], f"{row['capture_s']:.1f}", f"{row['capture_cpu_s']:.1f}", f"{row['plan_s']:.1f}",
                 f"{row['plan_cpu_s']:.1f}",
                 f"{row['num_params'] / 1e9:.2f} B", f"{mesh['pp']} x {mesh['dp']} x {mesh['tp']}",
                 str(row["microbatch_size"]), row["schedule"], row["recompute"], str(row["zero_stage"]),
                 f"{row['step_time_s']:.2f}", f"{row['peak_gib']:.1f}", f"{row['peak_rss_gb']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if child_main(argv, measure):
        return
    rows = [run_child(__file__, name) for name in (argv or list(MODELS))]
    print(table(rows))
    import torch
    import transformers

    print(f"\n{CLUSTER}, global batch {GLOBAL_BATCH}, bf16; torch {torch.__version__}, transformers "
          f"{transformers.__version__}, {os.cpu_count()} CPUs, one torch thread, each model in a fresh process")


if __name__ == "__main__":
    main(sys.argv[1:])
