"""Same numerics as one device: loss, every gradient and a short SGD run, under forced plans.

Each case builds a model with a fixed seed, runs it on one device (the reference, on every rank)
and under a forced configuration (dp, tp, pp, ZeRO stage, recomputation, schedule) as
`autopar.parallelize` builds it (the cases of one model in one job reuse its captures:
one_process.py), then compares:
  - the first step's loss, and every parameter gradient, gathered with `full_tensor()` and
    matched by its name in the original model (with pp, each rank checks the parameters it holds;
    together the ranks must cover all of them);
  - the losses of 5 SGD steps (same learning rate, different batches each step);
  - `eval_step` after them (forward only, every schedule) against the trained copy's loss.
Everything runs in fp32, so the tolerance is float round-off: 1e-5 (1e-6 for the gradients of
the cases of a weight two chunks of one rank read).

Plans are made for `tiny_model_cluster` (see harness.py), on which the planner gives these tiny
models real tensor parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness import case_outcome, tiny_model_cluster  # noqa: F401 (a fixture)
from one_process import CaseTable, call, case_param, parallelize_reusing_captures, train_one_process, train_parallel

pytestmark = pytest.mark.dist

GLOBAL_BATCH = 8
NUM_STEPS = 5
LEARNING_RATE = 0.5
TOLERANCE = 1e-5
GPT_SPEC = "gpt:layers=2,hidden=32,heads=4,seq=16,vocab=64,dropout=0.0"
LLAMA_SPEC = "llama:layers=2,hidden=32,heads=4,kv_heads=2,ffn_hidden=64,seq=16,vocab=64"


# --- models (built identically on every rank) -----------------------------------------------------

class ResidualBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc_in = nn.Linear(width, 4 * width)
        self.fc_out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc_out(F.gelu(self.fc_in(self.norm(x))))


class UserMLP(nn.Module):
    """A user's model, not from autopar's registry: residual MLP blocks in a ModuleList."""

    def __init__(self, *, features: int = 16, width: int = 32, depth: int = 4, classes: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.blocks = nn.ModuleList(ResidualBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = self.embed(features)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class OuterResidualMLP(UserMLP):
    """The same blocks without their residual, which the parent adds: `x = x + block(x)`."""

    def __init__(self, *, width: int = 32, depth: int = 4) -> None:
        super().__init__(width=width, depth=depth)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(depth))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = self.embed(features)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


class TiedEncoderDecoder(nn.Module):
    """One weight read three times, as T5's and BART's shared embedding is: the encoder's input
    embedding, the decoder's input embedding (between the encoder's blocks and the decoder's) and
    the output head. Interleaved over 2 ranks, some rank runs two of its readers in two chunks."""

    def __init__(self, *, vocab: int = 64, width: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.shared = nn.Embedding(vocab, width)
        self.encoder = nn.ModuleList(ResidualBlock(width) for _ in range(depth))
        self.decoder = nn.ModuleList(ResidualBlock(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        nn.init.normal_(self.shared.weight, std=width ** -0.5)  # logits of unit scale

    def forward(self, tokens: torch.Tensor, decoder_tokens: torch.Tensor) -> torch.Tensor:
        x = self.shared(tokens)
        for block in self.encoder:
            x = block(x)
        y = self.shared(decoder_tokens) + x
        for block in self.decoder:
            y = block(y)
        return F.linear(self.norm(y), self.shared.weight)


class HFCausalLM(nn.Module):
    """Hugging Face GPT-2 (tiny) returning the logits tensor instead of a ModelOutput."""

    def __init__(self, attention: str = "eager") -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
                            attn_implementation=attention)
        self.model = GPT2LMHeadModel(config)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=token_ids).logits


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


@dataclass
class Workload:
    model: nn.Module
    loss_fn: object
    batches: list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]
    """NUM_STEPS global batches (inputs, targets), the same on every rank."""


def _token_batches(vocab: int, seq: int, generator: torch.Generator):
    return [((torch.randint(0, vocab, (GLOBAL_BATCH, seq), generator=generator),),
             torch.randint(0, vocab, (GLOBAL_BATCH, seq), generator=generator)) for _ in range(NUM_STEPS)]


def make_workload(name: str) -> Workload:
    from autopar.models import build_model

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    if name in ("gpt", "llama"):
        bundle = build_model(GPT_SPEC if name == "gpt" else LLAMA_SPEC, device="cpu", seed=0, batch_size=GLOBAL_BATCH)
        return Workload(bundle.model, bundle.loss_fn, _token_batches(64, 16, generator))
    if name in ("mlp", "mlp_outer_residual"):
        batches = [((torch.randn(GLOBAL_BATCH, 16, generator=generator),),
                    torch.randint(0, 8, (GLOBAL_BATCH,), generator=generator)) for _ in range(NUM_STEPS)]
        return Workload(UserMLP() if name == "mlp" else OuterResidualMLP(), F.cross_entropy, batches)
    if name == "tied3":
        batches = [((torch.randint(0, 64, (GLOBAL_BATCH, 16), generator=generator),
                     torch.randint(0, 64, (GLOBAL_BATCH, 16), generator=generator)),
                    torch.randint(0, 64, (GLOBAL_BATCH, 16), generator=generator)) for _ in range(NUM_STEPS)]
        return Workload(TiedEncoderDecoder(), token_cross_entropy, batches)
    if name in ("hf_gpt2", "hf_gpt2_sdpa"):
        model = HFCausalLM("eager" if name == "hf_gpt2" else "sdpa")
        return Workload(model, token_cross_entropy, _token_batches(64, 16, generator))
    raise ValueError(f"unknown model '{name}'")


# --- one case, on every rank -------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    model: str
    world_size: int
    constraints: dict = field(default_factory=dict)
    known_error: str = ""
    """What the failure of a case marked with a known bug says."""
    grad_tolerance: float = TOLERANCE
    """Largest difference allowed in a first-step gradient."""
    locally_tied: str = ""
    """A parameter the case exists for: some rank must hold it in two of its pipeline chunks (else
    the case no longer tests that layout)."""
    tied_across_ranks: bool = False
    """`locally_tied` is also held on another pipeline rank (its gradient summed over both)."""

    @property
    def cluster(self) -> str:
        return tiny_model_cluster(self.world_size)


def numerics_case(case: Case) -> dict:
    """The parallel run's losses and first-step gradient errors against one process, and the plan.

    Cases of one model in one job reuse its captures (`parallelize_reusing_captures`): the
    module is what `autopar.parallelize(model, cluster, inputs, loss_fn=..., example_targets=...,
    constraints=...)` builds."""
    workload = make_workload(case.model)
    reference = train_one_process(workload.model, workload.loss_fn, workload.batches, LEARNING_RATE)
    (inputs, targets), *_ = workload.batches
    module = parallelize_reusing_captures(case.model, workload.model, case.cluster, inputs, loss_fn=workload.loss_fn,
                                          example_targets=targets, constraints=case.constraints)
    run = train_parallel(module, workload.batches, LEARNING_RATE, reference)
    eval_loss = module.eval_step(inputs, targets).item()  # after training: the trained weights, forward only
    with torch.no_grad():
        reference_eval_loss = workload.loss_fn(call(reference.model, inputs), targets).item()
    plan = module.plan
    groups = [stage._get_fsdp_state()._fsdp_param_group for stage in module.stages if hasattr(stage, "_get_fsdp_state")]
    return dict(offload_policies=sorted({type(group.offload_policy).__name__ for group in groups if group}),
                losses=run.losses, reference_losses=reference.losses, grad_errors=run.grad_errors,
                eval_loss=eval_loss, reference_eval_loss=reference_eval_loss,
                all_parameters=sorted(reference.grads), mismatches=dict(module.stats.mismatches),
                kept=dict(module.stats.kept), local=dict(module.stats.local),
                in_several_chunks=_in_several_chunks(module),
                recomputed_in_full=sum(getattr(segment, "recompute", "") == "full" for stage in module.stages
                                       for segment in getattr(stage, "segments", ())),
                tied_across_ranks=sorted(module.tied_groups),
                sliced_boundaries=sorted({name for stage in module.stages for name in getattr(stage, "wires", {})}),
                plan=dict(mesh=plan.mesh, microbatch_size=plan.microbatch_size, schedule=plan.schedule,
                          virtual_stages=plan.virtual_stages, recompute=plan.recompute, zero_stage=plan.zero_stage,
                          offload=plan.offload,
                          sharded_parameters=sorted(name for name, placement in plan.param_placements.items()
                                                    if placement != "R")))


def _in_several_chunks(module) -> list[str]:
    """Names of the parameters this rank holds in more than one of its pipeline chunks."""
    name_of = {id(param): name for name, param in module.named_model_parameters().items()}
    counts: dict[int, int] = {}
    for stage in module.stages:
        for held in {id(param) for param in stage.parameters()}:
            counts[held] = counts.get(held, 0) + 1
    return sorted(name_of[held] for held, count in counts.items() if count > 1)


# --- the cases --------------------------------------------------------------------------------------

def _case(model: str, world_size: int, *, grad_tolerance: float = TOLERANCE, locally_tied: str = "",
          tied_across_ranks: bool = False, **constraints):
    return case_param(Case(model, world_size, constraints, grad_tolerance=grad_tolerance, locally_tied=locally_tied,
                           tied_across_ranks=tied_across_ranks),
                      f"{model}-{world_size}-" + "-".join(f"{key}{value}" for key, value in constraints.items()))


# Every configuration at least once, every model at least twice, the built-in GPT the most.
# Constraints fix the whole mesh (and the microbatch size where pipelining needs several
# microbatches) so each case tests what its name says.
TABLE = CaseTable([
    # 2 processes
    _case("gpt", 2, dp=2, tp=1, pp=1, zero_stage=0),
    _case("gpt", 2, dp=1, tp=2, pp=1),
    _case("gpt", 2, dp=1, tp=1, pp=2, microbatch_size=2, schedule="1f1b"),
    _case("gpt", 2, dp=2, tp=1, pp=1, zero_stage=1, microbatch_size=2),
    _case("gpt", 2, dp=2, tp=1, pp=1, zero_stage=2, microbatch_size=2),
    _case("gpt", 2, dp=2, tp=1, pp=1, zero_stage=3, microbatch_size=2),
    _case("gpt", 2, dp=1, tp=1, pp=2, microbatch_size=2, schedule="gpipe"),
    _case("gpt", 2, dp=1, tp=1, pp=2, microbatch_size=1, schedule="interleaved", virtual_stages=2),
    _case("gpt", 2, dp=1, tp=1, pp=2, microbatch_size=1, schedule="zb1p"),
    _case("gpt", 2, dp=1, tp=1, pp=2, microbatch_size=2, schedule="zbv"),
    _case("gpt", 2, dp=2, tp=1, pp=1, zero_stage=3, microbatch_size=2, offload=True),
    _case("gpt", 2, dp=1, tp=2, pp=1, recompute="full"),
    _case("gpt", 2, dp=1, tp=2, pp=1, recompute="selective"),
    _case("gpt", 2, dp=1, tp=2, pp=1, recompute="gathers"),
    _case("gpt", 2, dp=1, tp=2, pp=1, recompute="op"),
    _case("llama", 2, dp=2, tp=1, pp=1, zero_stage=3, recompute="op"),
    # "blocks:1": the first of the two blocks recomputed in full, the other as "none" (under pipelining the
    # search lets a stage that fits run lighter, as these tiny ones do: test_recompute.py runs a fixed plan)
    _case("llama", 2, dp=1, tp=2, pp=1, recompute="blocks:1"),
    _case("llama", 2, dp=1, tp=2, pp=1),
    _case("llama", 2, dp=2, tp=1, pp=1, zero_stage=3),
    _case("mlp", 2, dp=2, tp=1, pp=1, zero_stage=0),
    _case("mlp", 2, dp=1, tp=2, pp=1),
    _case("mlp", 2, dp=1, tp=1, pp=2, microbatch_size=2, schedule="gpipe"),
    # 4 processes
    _case("gpt", 4, dp=1, tp=4, pp=1),
    _case("gpt", 4, dp=2, tp=2, pp=1, zero_stage=0),
    _case("gpt", 4, dp=2, tp=2, pp=1, zero_stage=3),
    _case("gpt", 4, dp=1, tp=2, pp=2, microbatch_size=2),
    _case("gpt", 4, dp=2, tp=1, pp=2, microbatch_size=1),
    # ZeRO-3 under pipelining: each unit resharded after every microbatch's backward (codegen's
    # reshard_zero3_under_pipelining against the stage's own setting), gradients accumulated unsharded
    _case("gpt", 4, dp=2, tp=1, pp=2, microbatch_size=1, zero_stage=3),
    _case("gpt", 4, dp=1, tp=2, pp=2, microbatch_size=1, schedule="interleaved", virtual_stages=2),
    _case("gpt", 4, dp=1, tp=2, pp=2, microbatch_size=1, schedule="zbv", recompute="selective"),
    _case("gpt", 4, dp=2, tp=2, pp=1, zero_stage=1, microbatch_size=2, recompute="full"),
    _case("llama", 4, dp=1, tp=2, pp=2, microbatch_size=2, recompute="selective"),
    # Without sequence parallelism a stage's replicated output goes as each tp rank's slice and is
    # all-gathered by the next stage (Megatron-LM's scatter/gather)
    _case("gpt", 4, dp=1, tp=2, pp=2, microbatch_size=2, sequence_parallel=False),
    _case("llama", 4, dp=1, tp=2, pp=2, microbatch_size=1, schedule="zbv", sequence_parallel=False),
    # A weight two chunks of one rank read: T5's and BART's three-way tie interleaved (its gradient
    # was divided by the microbatch count once per chunk), a tied embedding under ZB-V with ZeRO-1
    # (FSDP sharded it once per chunk: two weights)
    _case("tied3", 4, dp=1, tp=2, pp=2, microbatch_size=1, schedule="interleaved", virtual_stages=2,
          grad_tolerance=1e-6, locally_tied="shared.weight", tied_across_ranks=True),
    _case("gpt", 4, dp=2, tp=1, pp=2, microbatch_size=1, schedule="zbv", zero_stage=1, grad_tolerance=1e-6,
          locally_tied="wte.weight"),
    _case("mlp", 4, dp=2, tp=1, pp=2, microbatch_size=1, zero_stage=1),
    # A pipeline split by count (solver/pipeline.py) as Llama 3 405B's: the embedding and the head
    # (tied to it) counted as a layer each, so the first stage holds the embedding alone and the last
    # the head and the loss alone
    _case("gpt", 4, dp=1, tp=1, pp=4, microbatch_size=1, pipeline_split="uniform:embedding,head"),
    # once known bugs: size arithmetic outside the segments (HF GPT-2 reads input_ids.shape),
    # the planner's own microbatch choice under pp, residual adds between blocks, and HF's SDPA
    # path that traces differently on meta than on the CPU
    _case("hf_gpt2", 2, dp=1, tp=2, pp=1),
    _case("hf_gpt2", 4, dp=2, tp=2, pp=1, zero_stage=3),
    _case("gpt", 4, dp=1, tp=2, pp=2),
    _case("mlp_outer_residual", 2, dp=2, tp=1, pp=1),
    _case("hf_gpt2_sdpa", 2, dp=2, tp=1, pp=1),
])
CASES = TABLE.cases


@TABLE.parametrize
def test_matches_one_device(case_name, case_outcome):
    case, results = TABLE.results(case_outcome, numerics_case, case_name)
    plan = results[0]["plan"]
    for axis in ("dp", "tp", "pp"):
        assert plan["mesh"][axis] == case.constraints[axis], plan
    for key in ("zero_stage", "recompute", "microbatch_size", "schedule", "offload"):
        if key in case.constraints:
            assert plan[key] == case.constraints[key], plan
    if case.constraints.get("offload"):
        assert results[0]["offload_policies"] == ["CPUOffloadPolicy"], results[0]["offload_policies"]
    if case.constraints["tp"] > 1:
        assert plan["sharded_parameters"], "the plan shards no parameter: the tp case tests nothing"
    # The op policy's own rule ran (not a silent fallback to a full recompute). The tiny models
    # plan all-reduces, not sequence parallelism, so "gathers" has nothing to re-gather here:
    # tests/dist/test_recompute.py checks that mechanism.
    if case.constraints.get("sequence_parallel") is False:
        assert any(result["sliced_boundaries"] for result in results), "no boundary was sent as slices"
    if case.constraints["tp"] > 1 and case.constraints.get("recompute", "none") == "none":
        # Ops the plan makes local ran on local tensors after their first run (codegen/local_runs.py).
        assert sum(results[0]["local"].values()) > 0, results[0]["local"]
    if case.constraints.get("recompute") == "op":
        assert results[0]["kept"].get("op", 0) > 0, results[0]["kept"]
    if str(case.constraints.get("recompute", "")).startswith("blocks:"):  # some segments ran checkpointed
        assert sum(result["recomputed_in_full"] for result in results) > 0, results

    reference = results[0]["reference_losses"]
    for rank, result in enumerate(results):
        assert result["losses"] == pytest.approx(reference, rel=TOLERANCE, abs=TOLERANCE), f"rank {rank}'s losses"
        assert result["eval_loss"] == pytest.approx(result["reference_eval_loss"], rel=TOLERANCE, abs=TOLERANCE), \
            f"rank {rank}'s eval_step loss"
        for name, error in result["grad_errors"].items():
            assert error is not None, f"rank {rank}: {name} has no gradient"
            assert error["max_abs"] <= case.grad_tolerance, f"rank {rank}: gradient of {name} differs: {error}"
            assert error["norm"] <= case.grad_tolerance * max(error["reference_norm"], 1.0), \
                f"rank {rank}: {name}: {error}"
    if case.locally_tied:
        held = [result["in_several_chunks"] for result in results]
        assert any(case.locally_tied in names for names in held), f"no rank holds {case.locally_tied} twice: {held}"
        tied = [result["tied_across_ranks"] for result in results]
        assert not case.tied_across_ranks or all(case.locally_tied in names for names in tied), tied
    checked = set().union(*(result["grad_errors"] for result in results))
    assert checked == set(results[0]["all_parameters"]), "parameters no rank holds: " \
        f"{sorted(set(results[0]['all_parameters']) - checked)}"
