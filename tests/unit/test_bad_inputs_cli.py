"""Bad command lines: every one exits 2 with one paragraph naming what to change.

Cluster specs, model specs, argument types and ranges, and combinations that cannot work on the
cluster. Files (TOML, plans, profiles, model files) are in test_bad_inputs_files.py, the Python
API in test_bad_inputs_api.py.
"""

import pytest

from bad_input_harness import FOUR_GPUS, TINY, cli_error, run_cli


def plan_argv(*extra, model=TINY, cluster=FOUR_GPUS, batch="8"):
    return ["plan", model, "--cluster", cluster, "--global-batch", batch, *extra]


def evaluate_argv(*extra, tp="1", pp="1", mbs="1", cluster=FOUR_GPUS, batch="8"):
    return ["evaluate", TINY, "--cluster", cluster, "--global-batch", batch, "--tp", tp, "--pp", pp,
            "--microbatch-size", mbs, *extra]


# --- cluster spec strings -------------------------------------------------------------------

CLUSTER_CASES = [
    ("dgx-h100:nodes=99999999999999999999", ["nodes", "at most"]),
    ("dgx-h100:nodes=1000000000", ["nodes", "at most"]),
    ("dgx-h100:nodes=0", ["nodes", ">= 1"]),
    ("dgx-h100:nodes=-3", ["nodes", ">= 1"]),
    ("dgx-h100:nodes=abc", ["nodes", "integer"]),
    ("dgx-h100:nodes=1.5", ["nodes", "integer"]),
    ("dgx-h100:nodes=1e3", ["nodes", "integer"]),
    ("dgx-h100:nodes=2,nodes=4", ["nodes", "twice"]),
    ("dgx-h100:num_nodes=2,nodes=4", ["nodes", "twice"]),
    ("dgx-h100:gpus_per_node=0", ["gpus_per_node", ">= 1"]),
    ("dgx-h100:gpus_per_node=16", ["gpus_per_node=16", "8 gpus"]),
    ("cpu:procs=0", ["procs", ">= 1"]),
    ("cpu:procs=100000000", ["procs", "at most"]),
    ("cpu:procs=2,profile=x.toml", ["profile", "x.toml"]),
    ("cpu:procs=2,profile=does-not-exist.json", ["cannot read profile"]),
    ("a" * 300, ["unknown preset"]),
    ("a" * 300 + ".toml", ["cluster file"]),
    ("dgx-h100:nodes=2," + "x" * 100_000 + "=1", ["unknown key"]),
    ("", ["cluster", "empty"]),
    ("   ", ["cluster", "empty"]),
    (":nodes=2", ["preset"]),
    ("dgx-h100:nodes", ["key=value"]),
    ("dgx-h100:nodes=", ["key=value"]),
    ("dgx-h100:=2", ["key=value"]),
    ("dgx-h100:nodse=2", ["did you mean 'nodes'"]),
    ("dgx-h100:procs=2", ["procs"]),
    ("dgx-h1000", ["did you mean"]),
    ("cpu:gpus_per_node=2,procs=4", ["procs"]),
    ("dgx-h100:nodes=٣", ["nodes", "integer"]),
    ("dgx-h100:nodes=2:gpus_per_node=4", ["nodes", "integer"]),
]


@pytest.mark.parametrize("spec, fragments", CLUSTER_CASES, ids=[f"cluster{i}" for i in range(len(CLUSTER_CASES))])
def test_bad_cluster_spec(capsys, spec, fragments):
    outcome = cli_error(capsys, plan_argv(cluster=spec), *fragments)
    assert "x" * 1000 not in outcome.err  # long values are truncated


# --- model spec strings ---------------------------------------------------------------------

MODEL_CASES = [
    ("gpt:layers=100000", ["layers", "at most"]),
    ("llama:layers=50000", ["layers", "at most"]),
    ("bert-base:layers=100000", ["layers", "at most"]),
    ("gpt:hidden=1000000000000,heads=7", ["hidden", "at most"]),
    ("gpt:seq=1000000000", ["seq", "at most"]),
    ("gpt:vocab=1000000000000", ["vocab", "at most"]),
    ("moe:num_experts=1000000000", ["num_experts", "at most"]),
    ("mlp:in_features=99999999999999999999", ["in_features", "at most"]),
    ("gpt:layers=0", ["layers", "positive"]),
    ("gpt:layers=-1", ["layers", "positive"]),
    ("gpt:heads=0", ["heads", "positive"]),
    ("gpt:hidden=65,heads=4", ["divisible"]),
    ("gpt:dropout=1.5", ["dropout", "[0, 1)"]),
    ("gpt:dropout=nan", ["dropout"]),
    ("gpt:dropout=inf", ["dropout"]),
    ("gpt:layers=abc", ["layers", "int"]),
    ("gpt:layers=2,layers=4", ["layers", "twice"]),
    ("gpt:depth=4", ["no field 'depth'"]),
    ("gtp", ["did you mean 'gpt'"]),
    ("gpt:attention=flash", ["attention"]),
    ("llama:rope_theta=-1", ["rope_theta", "positive"]),
    ("llama:heads=6,kv_heads=4", ["divisible"]),
    ("moe:top_k=9,num_experts=4", ["top_k"]),
    ("vit:image_size=30,patch=16", ["divisible"]),
    ("z" * 100_000, ["unknown model"]),
    (":layers=2", ["no model name"]),
    ("gpt:layers", ["key=value"]),
]


@pytest.mark.parametrize("spec, fragments", MODEL_CASES, ids=[f"model{i}" for i in range(len(MODEL_CASES))])
def test_bad_model_spec(capsys, spec, fragments):
    outcome = cli_error(capsys, plan_argv(model=spec), *fragments)
    assert "z" * 1000 not in outcome.err


def test_bad_recompute_modules_in_evaluate(capsys):
    cli_error(capsys, evaluate_argv("--recompute-modules", "norms"), "--recompute-modules", "'norms'", "layernorm")
    cli_error(capsys, evaluate_argv("--recompute-modules", "moe"), "moe", "not found", "top-k")


def test_bad_model_spec_in_graph_command(capsys):
    cli_error(capsys, ["graph", "gpt:layers=100000"], "layers", "at most")


# --- argument types and ranges --------------------------------------------------------------

PLAN_ARGUMENT_CASES = [
    (["--tp", "0"], ["--tp", ">= 1"]),
    (["--dp", "0"], ["--dp", ">= 1"]),
    (["--pp", "0"], ["--pp", ">= 1"]),
    (["--microbatch-size", "0"], ["--microbatch-size", ">= 1"]),
    (["--layers-per-virtual-stage", "0"], ["--layers-per-virtual-stage", ">= 1"]),
    (["--tp", "-2"], ["--tp", ">= 1"]),
    (["--tp", "two"], ["--tp", "integer"]),
    (["--tp", "2.0"], ["--tp", "integer"]),
    (["--tp", "99999999999999999999999"], ["--tp", "at most"]),
    (["--microbatch-size", "100000000000000000000"], ["--microbatch-size", "at most"]),
    (["--zero", "5"], ["--zero"]),
    (["--schedule", "zigzag"], ["--schedule"]),
    (["--recompute", "some"], ["--recompute"]),
    (["--recompute-modules", "layernorm,attention"], ["--recompute-modules", "'attention'", "core_attn", "moe_act"]),
    (["--recompute-modules", ","], ["--recompute-modules", "layernorm"]),
    (["--recompute-modules", "layernorm", "--recompute", "full"], ["--recompute full", "--recompute-modules", "one"]),
    (["--recompute-modules", "moe_act"], ["moe_act", "not found", "expert matmuls"]),
    (["--recompute-blocks", "0"], ["--recompute-blocks", ">= 1"]),
    (["--recompute-blocks", "two"], ["--recompute-blocks", "integer"]),
    (["--recompute-blocks", "1", "--recompute-modules", "layernorm"], ["--recompute-modules", "--recompute-blocks", "one"]),
    (["--recompute-blocks", "1", "--recompute", "op"], ["--recompute-blocks 1", "--recompute op", "drop one"]),
    (["--recompute-blocks", "99"], ["blocks:99", "holds", "fewer than 99"]),
    (["--precision", "fp8"], ["--precision"]),
    (["--tp", "3"], ["tp=3", "divide"]),
    (["--tp", "8"], ["tp=8", "4 devices"]),
    (["--pp", "8"], ["pp=8"]),
    (["--tp", "4", "--dp", "4"], ["dp", "tp", "4 devices"]),
    (["--dp", "3"], ["dp=3"]),
    (["--tp", "2", "--pp", "4"], ["4 devices"]),
    (["--microbatch-size", "3"], ["microbatch size 3"]),
    (["--layers-per-virtual-stage", "3", "--schedule", "interleaved", "--pp", "2"], ["layers"]),
    (["--schedule", "interleaved", "--pp", "1"], ["interleaved", "pp"]),
    (["--schedule", "interleaved", "--pp", "2"], ["interleaved", "chunks", "pp=2"]),
    (["--moe-load-imbalance", "0.9"], ["--moe-load-imbalance", ">= 1.0", "0.9"]),
    (["--moe-load-imbalance", "nan"], ["--moe-load-imbalance", "finite"]),
    (["--moe-load-imbalance", "inf"], ["--moe-load-imbalance", "finite"]),
    (["--moe-load-imbalance", "lots"], ["--moe-load-imbalance", "number", "'lots'"]),
]


@pytest.mark.parametrize("extra, fragments", PLAN_ARGUMENT_CASES,
                         ids=[f"plan{i}" for i in range(len(PLAN_ARGUMENT_CASES))])
def test_bad_plan_argument(capsys, extra, fragments):
    outcome = cli_error(capsys, plan_argv(*extra), *fragments)
    assert "Constraints(" not in outcome.err  # a reason, not a dataclass dump


@pytest.mark.parametrize("extra, fragments", [
    (["--layers-per-virtual-stage", "3"], ["4 layers on 2 stages", "chunks of 3 layers"]),
    (["--layers-per-virtual-stage", "2"], ["interleaved", "2 or more model chunks", "1f1b"]),
])
def test_interleaving_that_cannot_be_met_is_refused(capsys, extra, fragments):
    """Chunks of 3 layers from 2 layers a stage, or one chunk a device, is not an interleaved
    schedule: refused with the reason, never planned as something else."""
    model = "gpt:layers=4,hidden=64,heads=4,seq=32,vocab=128"
    cli_error(capsys, plan_argv("--pp", "2", "--schedule", "interleaved", *extra, model=model), *fragments)


def test_pipeline_the_batch_cannot_fill(capsys):
    outcome = cli_error(capsys, plan_argv("--pp", "4", "--dp", "1", "--tp", "1", batch="2"), "pp=4", "microbatches")
    assert "Constraints(" not in outcome.err


def test_tp_larger_than_a_node_is_refused(capsys):
    cli_error(capsys, plan_argv("--tp", "16", cluster="dgx-h100:nodes=2"), "tp=16", "8 gpus")


def test_more_stages_than_segments(capsys):
    cli_error(capsys, plan_argv("--pp", "8", cluster="dgx-h100"), "pp=8", "segments", "use pp <= 4")
    cli_error(capsys, evaluate_argv(pp="8", cluster="dgx-h100"), "pp=8", "segments")


def test_dp_that_does_not_divide_batch(capsys):
    cli_error(capsys, plan_argv("--dp", "4", batch="6"), "global batch 6")


@pytest.mark.parametrize("batch, fragments", [
    ("0", ["--global-batch", ">= 1"]), ("-8", ["--global-batch", ">= 1"]), ("eight", ["--global-batch", "integer"]),
    ("1" + "0" * 30, ["--global-batch", "at most"]), ("", ["--global-batch", "integer"]),
])
def test_bad_global_batch(capsys, batch, fragments):
    cli_error(capsys, plan_argv(batch=batch), *fragments)


EVALUATE_CASES = [
    (dict(tp="0"), ["--tp", ">= 1"]),
    (dict(pp="0"), ["--pp", ">= 1"]),
    (dict(mbs="0"), ["--microbatch-size", ">= 1"]),
    (dict(mbs="-1"), ["--microbatch-size", ">= 1"]),
    (dict(tp="16", cluster="dgx-h100:nodes=2"), ["tp=16", "8 gpus"]),
    (dict(tp="3"), ["tp=3", "divide"]),
    (dict(mbs="3"), ["microbatch"]),
    (dict(pp="4", mbs="8"), ["microbatches", "pipeline"]),
    (dict(pp="8"), ["pp=8"]),
]


@pytest.mark.parametrize("values, fragments", EVALUATE_CASES, ids=[f"evaluate{i}" for i in range(len(EVALUATE_CASES))])
def test_bad_evaluate_argument(capsys, values, fragments):
    cli_error(capsys, evaluate_argv(**values), *fragments)


@pytest.mark.parametrize("extra, fragments", [
    (["--dp", "0"], ["--dp", ">= 1"]),
    (["--dp", "3"], ["dp=3", "divide"]),
    (["--dp", "1", "--tp", "1", "--pp", "2"], ["dp x tp x pp", "4 devices"]),
    (["--layers-per-virtual-stage", "0", "--schedule", "interleaved"], ["--layers-per-virtual-stage", ">= 1"]),
    (["--schedule", "interleaved"], ["interleaved", "pp"]),
    (["--moe-load-imbalance", "-1"], ["--moe-load-imbalance", ">= 1.0"]),
])
def test_bad_evaluate_option(capsys, extra, fragments):
    cli_error(capsys, evaluate_argv(*extra), *fragments)


# --- output files: checked before any capture or measurement ---------------------------------

def test_plan_out_into_missing_folder(capsys, tmp_path):
    outcome = cli_error(capsys, plan_argv("--out", tmp_path / "missing" / "plan.json", "-v"), "--out", "folder")
    assert "capture:" not in outcome.err  # refused before planning


def test_plan_out_onto_a_folder(capsys, tmp_path):
    outcome = cli_error(capsys, plan_argv("--out", tmp_path, "-v"), "--out", "folder")
    assert "capture:" not in outcome.err


def test_plan_out_empty(capsys):
    cli_error(capsys, plan_argv("--out", ""), "--out", "empty")


def test_evaluate_out_into_missing_folder(capsys, tmp_path):
    cli_error(capsys, evaluate_argv("--out", tmp_path / "nope" / "plan.json"), "--out", "folder")


@pytest.mark.parametrize("make_out, fragments", [
    (lambda tmp: "", ["--out", "empty"]),
    (lambda tmp: tmp / "missing" / "profile.json", ["--out", "folder"]),
    (lambda tmp: tmp, ["--out", "folder"]),
    (lambda tmp: "p" * 5000 + ".json", ["--out", "too long"]),
])
def test_profile_out_checked_before_measuring(capsys, tmp_path, make_out, fragments):
    outcome = cli_error(capsys, ["profile", "--device", "cpu", "--quick", "--out", make_out(tmp_path)], *fragments)
    assert "%" not in outcome.err  # no progress bar: nothing was measured


@pytest.mark.parametrize("nproc, fragments", [
    ("0", ["--nproc", ">= 1"]), ("-1", ["--nproc", ">= 1"]), ("100000", ["--nproc", "at most"]),
    ("two", ["--nproc", "integer"]),
])
def test_profile_bad_nproc(capsys, tmp_path, nproc, fragments):
    cli_error(capsys, ["profile", "--device", "cpu", "--nproc", nproc, "--out", tmp_path / "p.json"], *fragments)


def test_unknown_command_and_option(capsys):
    cli_error(capsys, ["plan-it"], "invalid choice")
    cli_error(capsys, plan_argv("--tensor-parallel", "2"), "unrecognized")


# --- output contract on success: progress on stderr, --json a single object -----------------

def test_verbose_json_keeps_stdout_one_object(capsys):
    import json

    outcome = run_cli(capsys, plan_argv("--json", "-v"))
    assert outcome.code == 0, outcome.err
    json.loads(outcome.out)  # one object, nothing else
    assert "capture:" in outcome.err
