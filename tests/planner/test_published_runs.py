"""The cost model against published, measured runs (shared/reference/published_runs.csv).

A sample of the rows (the full table is benchmarks/published_runs.py, recorded in BENCHMARKS.md):
Korthikanti et al.'s 22B GPT with and without SP + selective recomputation (tensor parallelism,
one capture for both; the baseline priced without sequence parallelism, as it ran) and torchtitan's FSDP2 Llama 3 8B on 64 A100s (ZeRO-3 across 8 nodes) and
on 8 H100s with op-level selective AC, whose memory the source measured (one capture for both).
Each is predicted within 10% of the published figure in the source's unit, and fits in memory,
since it ran. Rows are data; every number comes from the cost model."""

import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.published_runs import REFERENCE, evaluate_run, read_runs

pytestmark = pytest.mark.slow

if not REFERENCE.exists():
    pytest.skip(f"reference data {REFERENCE} not present", allow_module_level=True)

SAMPLE = ("kor-22b-full", "kor-22b-sel", "tt-a100-l3-8b", "tt-8b-fsdp-8")
RUNS = {run.id: run for run in read_runs() if run.id in SAMPLE}


@pytest.fixture(scope="module")
def outcomes():
    with tempfile.TemporaryDirectory() as directory:
        return {name: evaluate_run(run, Path(directory)) for name, run in RUNS.items()}


@pytest.mark.parametrize("name", [name for name in SAMPLE if name in RUNS])
def test_published_run_is_predicted_within_10_percent_and_fits(outcomes, name):
    outcome = outcomes[name]
    assert abs(outcome.error) <= 0.10, (f"{name}: predicted {outcome.predicted:.4g} {outcome.run.metric}, "
                                        f"published {outcome.run.published:g}")
    assert outcome.estimate.fits, f"{name} ran, so it must be predicted to fit: {outcome.estimate.memory_bytes}"


def test_rows_whose_notes_say_tp_without_sp_are_priced_without_it(outcomes):
    """Korthikanti et al.'s full-recompute baselines ran tensor parallelism without sequence
    parallelism (the notes say so): all-reduces, no reduce-scatter; their SP rows keep it."""
    if "kor-22b-full" not in outcomes or "kor-22b-sel" not in outcomes:
        pytest.skip("rows not in the reference file")
    full, selective = outcomes["kor-22b-full"], outcomes["kor-22b-sel"]
    assert "TP without sequence parallelism" in full.run.notes
    assert (full.run.sequence_parallel, selective.run.sequence_parallel) == (False, True)
    assert full.estimate.config.sequence_parallel is False
    assert "tp.reduce_scatter" not in full.estimate.breakdown_s and full.estimate.breakdown_s["tp.all_reduce"] > 0
    assert selective.estimate.breakdown_s["tp.reduce_scatter"] > 0


def test_fsdp_run_shows_its_exposed_collectives_and_memory_terms(outcomes):
    if "tt-a100-l3-8b" not in outcomes:
        pytest.skip("row not in the reference file")
    estimate = outcomes["tt-a100-l3-8b"].estimate
    assert estimate.breakdown_s["dp.all_gather"] > 0  # at least the first unit's gather
    assert any(note.startswith("FSDP2 (ZeRO-3, dp=64)") for note in estimate.notes)
    for term in ("fsdp_unsharded", "fragmentation", "cuda_context"):
        assert estimate.memory_bytes[term] > 0


def test_measured_memory_is_predicted_within_10_percent(outcomes):
    """torchtitan's 81.9 GiB (Llama 3.1 8B, FSDP on 8 H100, local batch 2, seq 8192, op-level
    selective AC): priced with autopar's "op" mode, the loss's fp32 gradient workspace included."""
    if "tt-8b-fsdp-8" not in outcomes:
        pytest.skip("row not in the reference file")
    outcome = outcomes["tt-8b-fsdp-8"]
    assert outcome.run.recompute_mode == "op"
    measured = outcome.run.measured_memory_bytes
    assert abs(outcome.estimate.peak_memory_bytes / measured - 1) <= 0.10, outcome.estimate.memory_bytes



def test_a_power_cap_the_source_states_is_set_on_the_device():
    if "tt-8b-fsdp-8" not in RUNS:
        pytest.skip("row not in the reference file")
    run = RUNS["tt-8b-fsdp-8"]
    assert "power-capped at 500 W" in run.notes  # the figure read is the one the notes state
    assert run.cluster_overrides["device"]["power_limit_w"] == 500
    from autopar.cluster import Cluster

    with tempfile.TemporaryDirectory() as directory:
        device = Cluster.from_spec(run.cluster_spec(Path(directory))).device
    uncapped = Cluster.from_spec(run.cluster).device
    assert 0.85 < device.peak_flops("bf16") / uncapped.peak_flops("bf16") < 0.95  # between NVL and SXM
    assert device.memory_bandwidth_bytes_per_s == pytest.approx(2400e9)  # the row's own override


@pytest.fixture(scope="module")
def llama3_405b():
    """Llama 3 405B as Meta ran it (tp8 pp16 dp128, 16 microbatches of one 8K sequence, no
    recomputation), evaluated at full size (block reuse: two blocks traced)."""
    from benchmarks.published_runs import RAN

    (run,) = [run for run in RAN if run.id == "llama3-405b"]
    with tempfile.TemporaryDirectory() as directory:
        return evaluate_run(run, Path(directory)).estimate


def test_llama3_405b_as_published_is_priced_with_the_tensors_torch_keeps(llama3_405b):
    """Every pipeline rank but the first and last holds all 16 microbatches of its 8 layers (one
    per virtual stage), each token and layer keeping what the built-in Llama's ops save on a tp8
    rank under sequence parallelism with gathered inputs kept sharded (bf16 bytes, h = 16384, kv
    dim 1024, SwiGLU width f = 53248): norm inputs and sharded norm outputs 4 x 2h/8 (fused
    rms_norm: no float32 copy), attention q, k, v (kv heads only), output and log-sum-exp
    2 (2h + 2 kv) / 8 + 4 x 16, SwiGLU's gate, up and their product 3 x 2f/8 (silu's output is
    run again from the gate in backward, as Megatron-LM's fused SwiGLU does: autopar/
    activation_saves.py; eager PyTorch would keep it too, 78.4 KB in all). Gradients are
    sharded (ZeRO-2) and accumulated unsharded in fp32 from a chunk's first backward: at the peak,
    that first backward has filled one layer's and freed one layer-microbatch."""
    h, kv, f, tp = 16384, 1024, 53248, 8
    per_token_layer = 4 * 2 * h / tp + 2 * (2 * h + 2 * kv) / tp + 4 * 16 + 3 * 2 * f / tp
    assert per_token_layer == 65088
    middle = llama3_405b.stages[1]
    assert [len(chunk) for chunk in middle.chunks] == [1] * 8
    assert middle.memory_bytes["activations"] == pytest.approx((16 * 8 - 1) * 8192 * per_token_layer, rel=0.01)
    layer_numel = (2 * h * h + 2 * h * kv + 3 * h * f) / tp  # q, o, k, v, w1, w2, w3 (norms: 2h, negligible)
    assert middle.memory_bytes["gradients"] == pytest.approx(4 * layer_numel, rel=0.01)
    first, last = llama3_405b.stages[0], llama3_405b.stages[-1]
    assert first.chunks[0] == ("prologue",) and last.chunks[-1] == ("epilogue",)  # Meta's layout


def test_llama3_405b_as_published_fits_80_gb(llama3_405b):
    """It ran. 65.1 KB per token and layer x 127 layer-microbatches is 63 GiB of activations on a
    middle rank; with eager SwiGLU's fourth tensor (78.4 KB) it was 89.6 GiB in all and did not fit."""
    assert llama3_405b.fits, llama3_405b.memory_bytes


def test_torchtitan_rows_step_adamw_as_torchtitan_did_when_they_ran():
    """torchtitan's AdamW was foreach until 2025-02 (pytorch/torchtitan#881), fused since; the
    run's date is the earliest the source gives. Megatron-LM's Adam is fused."""
    from benchmarks.published_runs import policy_of, run_month
    from cost_model.optimizer import adamw_io_bytes_per_param

    assert run_month("Liang et al. TorchTitan (ICLR 2025; arXiv 2410.06511)") == (2024, 10)
    assert run_month("pytorch/torchtitan docs/performance.md (commit 3faaa1a0d; Apr-Aug 2024)") == (2024, 4)
    assert run_month("torchtitan docs, 2025-06") == (2025, 6) and run_month("no date") is None
    foreach, fused = adamw_io_bytes_per_param("foreach"), adamw_io_bytes_per_param("fused")
    for run in RUNS.values():
        expected = foreach if "torchtitan" in run.source.lower() else fused
        assert policy_of(run).optimizer_io_bytes_per_param == expected, run.id
    later = next(run for run in RUNS.values() if "torchtitan" in run.source.lower())
    assert policy_of(replace(later, source="torchtitan docs, 2025-06")).optimizer_io_bytes_per_param == fused



def test_torchtitan_rows_wrap_fsdp_units_as_torchtitan_did_when_they_ran():
    """The embedding and head in the root unit until pytorch/torchtitan#1094 (2025-07-28), units of
    their own since; Megatron-LM rows have no FSDP2 wrapping to price."""
    from benchmarks.published_runs import policy_of

    for run in RUNS.values():
        assert policy_of(run).fsdp_root_ends == ("torchtitan" in run.source.lower()), run.id
    later = next(run for run in RUNS.values() if "torchtitan" in run.source.lower())
    assert not policy_of(replace(later, source="torchtitan docs, 2025-08")).fsdp_root_ends
    assert policy_of(replace(later, source="torchtitan docs, 2025-07")).fsdp_root_ends

def test_torchtitan_fsdp_under_pipelining_is_priced_as_gathered_once_for_the_step():
    """torchtitan does not reshard after forward under pipelining and torch's PipelineStage not after
    backward: its ZeRO-3 rows with pp > 1 are priced as autopar's ZeRO-2 under pipelining; without
    pp, and Megatron-LM's rows, as stated."""
    torchtitan = RUNS["tt-8b-fsdp-8"]
    assert torchtitan.zero_as_run == 3
    assert replace(torchtitan, pp=8).zero_as_run == 2
    assert replace(torchtitan, pp=8, zero=1).zero_as_run == 1
    assert replace(RUNS["kor-22b-sel"], pp=8, zero=3).zero_as_run == 3


def test_megatrons_sequence_parallelism_keeps_shards_without_recomputation():
    """Megatron-LM's and Transformer Engine's sequence-parallel linears save their input's shard and
    gather it again in backward: a Megatron row without recomputation under tp is autopar's
    "gathers" mode; torchtitan's (DTensor keeps the gathered input), tp 1 and other modes stay."""
    megatron = RUNS["kor-22b-sel"]
    assert replace(megatron, recompute="none").recompute_mode == "gathers"
    assert replace(megatron, recompute="none", tp=1).recompute_mode == "none"
    assert megatron.recompute_mode == "selective"
    assert replace(RUNS["tt-8b-fsdp-8"], recompute="none", tp=8).recompute_mode == "none"


def test_a_compiled_row_with_an_eager_measurement_has_an_eager_twin():
    from benchmarks.published_runs import eager_twin

    if "tt-8b-fsdp-8" not in RUNS or "tt-a100-l3-8b" not in RUNS:
        pytest.skip("rows not in the reference file")
    twin = eager_twin(RUNS["tt-8b-fsdp-8"])
    assert twin is not None and twin.float32_norm and twin.published == 6258  # the notes' eager figure
    run = RUNS["tt-8b-fsdp-8"]
    assert twin.model.endswith(",norm=float32") and twin.recompute_mode == run.recompute_mode == "op"
    assert (twin.dp, twin.microbatch, twin.zero, twin.cluster_overrides) == (run.dp, run.microbatch, run.zero,
                                                                            run.cluster_overrides)
    assert eager_twin(RUNS["tt-a100-l3-8b"]) is None  # ran eager already


def test_rows_whose_notes_say_tp_comm_overlap_are_priced_with_it():
    """NeMo's runs overlapped tensor-parallel communication with the GEMMs (the notes say "TP
    comm overlap on"): their handling overlaps it (solver/tp_overlap.py); Megatron-LM's 2022
    rows did not, and torchtitan's FSDP rows have no TP."""
    from benchmarks.published_runs import policy_of

    rows = {run.id: run for run in read_runs()}
    for run in rows.values():
        assert policy_of(run).tp_comm_overlap == ("TP comm overlap on" in run.notes), run.id
    kor = next(iter(RUNS.values()))
    assert not kor.tp_comm_overlap
    assert replace(kor, notes="NeMo; TP comm overlap on").tp_comm_overlap


def test_gpt_rows_run_by_nemo_or_megatron_core_are_priced_with_fused_attention():
    """Transformer Engine's attention (Megatron-Core, NeMo) keeps no s x s scores; Megatron-LM's
    2022 runs materialised them (the GPT family's eager attention)."""
    kor = next(run for run in RUNS.values() if run.family == "gpt")
    assert not kor.fused_attention and "attention=" not in kor.model
    nemo = replace(kor, source="NVIDIA DGX Cloud Benchmarking performance recipes (NeMo 24.12 container)")
    assert nemo.fused_attention and nemo.model.endswith(",attention=sdpa")
    llama = next(run for run in RUNS.values() if run.family == "llama")
    assert "attention=" not in replace(llama, source=nemo.source).model  # the built-in Llama is SDPA always


def test_megatron_bf16_rows_hold_fp32_main_gradients():
    """Megatron-LM forces fp32 gradient accumulation under bf16 and NeMo's bf16_mixed() sets
    grad_reduce_in_fp32: 4 bytes per gradient; fp16 ("mixed") rows keep 2. NeMo 1.0's distributed
    fused Adam holds them in its grad_sync_dtype instead (tests/planner/test_published_bf16.py)."""
    from benchmarks.published_runs import policy_of

    for run in read_runs():
        if "torchtitan" in run.source.lower() or run.precision == "fp32" or run.distributed_fused_adam:
            continue
        assert policy_of(run).grad_bytes == (4.0 if run.precision == "bf16" else 2.0), run.id


def test_torchtitan_rows_name_sdpas_flash_backend_where_the_device_documents_it():
    """torch's SDPA ran FlashAttention-2 on Hopper in 2024-2025 (cuDNN came first only in torch
    2.11): torchtitan's H100 rows are priced at its documented rates; on A100 (no documented
    rates) and for the other frameworks attention stays a matmul of torch's count."""
    from autopar.cluster import Cluster
    from benchmarks.published_runs import attention_kernel_of, with_attention_kernel

    rows = {run.id: run for run in read_runs()}
    for run in rows.values():
        assert attention_kernel_of(run) == ("flash2" if "torchtitan" in run.source.lower() else ""), run.id
    assert with_attention_kernel(Cluster.from_spec("dgx-h100"), "flash2").device.attention.name == "flash2"
    assert with_attention_kernel(Cluster.from_spec("dgx-a100-80g"), "flash2").device.attention is None


def test_nemo_rows_overlap_their_interleaved_sends():
    """NeMo's MegatronCommOverlapCallback, and Megatron-Bridge's CommOverlapConfig after it, set
    overlap_p2p_comm whenever virtual pipelining is on; Megatron-LM's 2022 rows waited on their sends."""
    from benchmarks.published_fp8 import read_fp8_runs
    from benchmarks.published_runs import policy_of

    runs = read_runs() + read_fp8_runs()
    assert any("Megatron-Bridge" in run.source for run in runs)
    for run in runs:
        if run.precision != "fp32":
            framework = "NeMo" in run.source or "Megatron-Bridge" in run.source
            assert policy_of(run).p2p_overlap == framework, run.id


def test_context_parallel_rows_exchange_kv_as_their_framework_did():
    """Megatron-Core runs Transformer Engine's ring (cp_comm_type "p2p" by default: nothing gathered
    kept for the backward); torchtitan torch's `context_parallel`, compiled."""
    from benchmarks.published_fp8 import read_fp8_runs
    from benchmarks.published_runs import cp_kv_exchange_of

    runs = [run for run in read_runs() + read_fp8_runs() if run.cp > 1]
    assert {cp_kv_exchange_of(run) for run in runs if "torchtitan" in run.source} == {"torch_compiled"}
    megatron = [run for run in runs if "torchtitan" not in run.source]
    assert megatron and {cp_kv_exchange_of(run) for run in megatron} == {"ring"}


def test_nemo_rows_gather_their_parameters_inside_the_next_forward():
    """NeMo 2.0's recipes set overlap_param_gather; Megatron-LM's default gathers after the step."""
    from benchmarks.published_runs import policy_of

    for run in read_runs():
        if run.precision != "fp32" and "torchtitan" not in run.source.lower():
            assert policy_of(run).param_gather_overlap == ("NeMo" in run.source), run.id


def test_pipelined_rows_are_cut_as_their_framework_cut_them(capsys):
    """Megatron-LM / Megatron-Core put num_layers / (pp x vp) layers on each chunk, and so does
    Megatron-DeepSpeed ('type:transformer') unless its notes count the two embeddings as layers
    ('type:transformer|embedding': 70 + 2 = 12 x 6); torchtitan split layers before
    pytorch/torchtitan#1416 and weighs the embedding and output as a layer each since; a split the
    layers do not divide cannot have run, so the row keeps the balanced cut and says so."""
    from types import SimpleNamespace

    from benchmarks.published_runs import framework_split, split_as_run

    kor = next(run for run in RUNS.values() if run.family == "gpt")
    assert framework_split(kor, 96, 24) == "uniform"
    assert framework_split(replace(kor, notes="NeMo; account-for-loss-in-pipeline-split"), 96, 24) == "uniform:head"
    deepspeed = replace(kor, source="a 2022 run; Megatron-DeepSpeed")
    assert framework_split(deepspeed, 72, 12) == "uniform"  # GPTModelPipe: partition_method='type:transformer'
    bloom = replace(deepspeed, notes="--pp-partition-method 'type:transformer|embedding'")
    assert framework_split(bloom, 70, 12) == "uniform:embedding,head"
    titan = next(run for run in RUNS.values() if "torchtitan" in run.source.lower())
    assert framework_split(titan, 126, 8) == "first=15,last=15"  # generate_split_points: 15, 16 x 6, 15
    assert framework_split(replace(titan, source="torchtitan docs, 2025-08"), 126, 8) == "uniform:embedding,head"
    graph = SimpleNamespace(segments=[SimpleNamespace(block_group=None)] + [SimpleNamespace(block_group=0)] * 70
                            + [SimpleNamespace(block_group=None)])
    assert split_as_run(replace(bloom, pp=12, virtual_stages=1), graph) == "uniform:embedding,head"
    assert split_as_run(replace(kor, pp=12, virtual_stages=1), graph) == "balanced"
    assert "70 repeated blocks does not divide by 12" in capsys.readouterr().err
    assert split_as_run(replace(kor, pp=1), graph) == "balanced"
