"""Expert parallelism against one process: MoE models with their experts split over ep ranks.

Each case trains a tiny MoE for a few SGD steps under a forced expert-parallel plan and compares
the losses and the first step's gradients with one process (fp32: round-off tolerance), and
counts the all-to-alls the first step runs (one microbatch): they must be the plan's predicted
all-to-alls. Models: the built-in MoE (4 experts, top-2, capacity-padded GShard routing: even
exchanges), Hugging Face Mixtral from the zoo (4 experts, top-2, dropless grouped matmuls:
uneven exchanges) and, for context parallelism, DroplessMoE below. Expert parallelism is run
with ZeRO-0/1/2/3, tp, every pipeline schedule and cp.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from harness import case_outcome, tiny_model_cluster  # noqa: F401 (a fixture)
from one_process import CaseTable, case_param, parallelize_reusing_captures, train_one_process, train_parallel

pytestmark = pytest.mark.dist

GLOBAL_BATCH = 8
NUM_STEPS = 3
LEARNING_RATE = 0.5
TOLERANCE = 1e-5
MOE_SPEC = "moe:router=gshard,layers=2,hidden=32,heads=4,seq=16,vocab=64,num_experts=4,dropout=0.0"


@dataclass(frozen=True)
class Case:
    model: str
    """"moe" (built-in), "dropless" (DroplessMoE) or an architecture of hf_zoo.py ("Mixtral")."""
    world_size: int
    constraints: dict = field(default_factory=dict)
    known_error: str = ""
    cluster: str = ""
    """The cluster the plan is made for ("": tiny_model_cluster, on which tp shards the tiny models)."""
    all_to_all: int = 0
    """The all-to-alls of one microbatch where known (0: not checked): with each layer's expert
    ops chained, 4 per layer (dispatch, combine, both backward), 5 when dropless (the counts)."""
    timeout_s: float = 120.0
    """Per case (harness.case_outcome): planning + capture + 3 steps, slow when 4 processes share 2 cores."""


def _grouped_mm():
    """transformers' grouped matmul custom op (fp32 on CPU; torch._grouped_mm traces bf16 only)."""
    import transformers.integrations.moe  # noqa: F401 (registers the op)

    return torch.ops.transformers.grouped_mm_fallback


class DroplessExperts(torch.nn.Module):
    """Top-2 token choice over 4 experts without capacity (Mixtral's routing): the rows of each
    token's experts sorted by expert, two grouped matmuls, the rows weighted and summed back."""

    def __init__(self, hidden: int = 32, ffn: int = 64, num_experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = torch.nn.Linear(hidden, num_experts, bias=False)
        self.w_in = torch.nn.Parameter(torch.randn(num_experts, hidden, ffn) * 0.1)
        self.w_out = torch.nn.Parameter(torch.randn(num_experts, ffn, hidden) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        weights, experts = self.router(tokens).softmax(dim=-1).topk(self.top_k, dim=-1)
        order = experts.reshape(-1).argsort(stable=True)
        rows = tokens[order // self.top_k]
        counts = (experts.reshape(-1, 1) == torch.arange(self.w_in.shape[0], device=x.device)).sum(dim=0)
        offsets = counts.cumsum(0).to(torch.int32)
        grouped_mm = _grouped_mm()
        hidden = torch.nn.functional.gelu(grouped_mm(rows, self.w_in, offsets))
        out = grouped_mm(hidden, self.w_out, offsets) * weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(tokens).index_add(0, order // self.top_k, out).reshape(x.shape)


class DroplessMoE(torch.nn.Module):
    """Embedding, 2 pre-norm blocks of causal sdpa attention and DroplessExperts, a head."""

    def __init__(self, vocab: int = 64, hidden: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(hidden) for _ in range(2 * layers))
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(hidden, 3 * hidden) for _ in range(layers))
        self.experts = torch.nn.ModuleList(DroplessExperts(hidden) for _ in range(layers))
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for index, (qkv, experts) in enumerate(zip(self.qkv, self.experts)):
            q, k, v = qkv(self.norms[2 * index](x)).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4).unbind(0)
            x = x + torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
            x = x + experts(self.norms[2 * index + 1](x))
        return self.head(x).transpose(1, 2)  # [batch, vocab, seq]: cross_entropy's class dim


def _batches(generator: torch.Generator):
    return [((torch.randint(0, 64, (GLOBAL_BATCH, 16), generator=generator),),
             torch.randint(0, 64, (GLOBAL_BATCH, 16), generator=generator)) for _ in range(NUM_STEPS)]


def _workload(name: str):
    """(model, loss_fn, batches of (inputs, targets)); inputs a tuple or a dict of keywords."""
    generator = torch.Generator().manual_seed(1)
    if name == "dropless":
        torch.manual_seed(0)
        return DroplessMoE(), torch.nn.functional.cross_entropy, _batches(generator)
    if name == "moe":
        from autopar.models import build_model

        bundle = build_model(MOE_SPEC, device="cpu", seed=0, batch_size=GLOBAL_BATCH)
        return bundle.model, bundle.loss_fn, _batches(generator)
    import hf_zoo

    arch = hf_zoo.BY_NAME[name]
    torch.manual_seed(0)
    model = arch.build()
    return model, hf_zoo.loss_for(arch), [hf_zoo.batch(arch, GLOBAL_BATCH, generator) for _ in range(NUM_STEPS)]


class _AllToAllCalls:
    """Counts torch.distributed.all_to_all_single calls while entered (as CommDebugMode's counts)."""

    def __init__(self) -> None:
        self.calls = 0

    def __enter__(self):
        import torch.distributed as dist

        self.original = dist.all_to_all_single

        def counted(*args, **kwargs):
            self.calls += 1
            return self.original(*args, **kwargs)

        dist.all_to_all_single = counted
        return self

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        dist.all_to_all_single = self.original

    def get_comm_counts(self) -> dict:
        return {"all_to_all_single": self.calls}


def experts_case(case: Case) -> dict:
    from torch.distributed.tensor.debug import CommDebugMode

    model, loss_fn, batches = _workload(case.model)
    reference = train_one_process(model, loss_fn, batches, LEARNING_RATE)
    (inputs, targets), *_ = batches
    # What autopar.parallelize builds; rank 0 exports the model for codegen and the other ranks
    # load it (one_process.py), and the 4-process cases reuse the 2-process cases' captures.
    cluster = case.cluster or tiny_model_cluster(case.world_size)
    module = parallelize_reusing_captures(case.model, model, cluster, inputs,
                                          loss_fn=loss_fn, example_targets=targets, constraints=case.constraints)
    # CommDebugMode's module hooks break pipelining, and under cp its dispatch mode breaks sdpa's
    # CausalBias: there the all-to-alls are counted where codegen/experts.py calls them.
    counter = None if case.constraints.get("pp", 1) > 1 else \
        CommDebugMode() if case.constraints.get("cp", 1) == 1 else _AllToAllCalls()
    run = train_parallel(module, batches, LEARNING_RATE, reference, first_step=counter)
    ran = Counter()
    for op, count in (counter.get_comm_counts() if counter is not None else {}).items():
        if "alltoall" in str(op) or "all_to_all" in str(op):
            ran["all_to_all"] += count
    plan = module.plan
    return dict(losses=run.losses, reference_losses=reference.losses, grad_errors=run.grad_errors,
                all_parameters=sorted(reference.grads), ep=plan.ep, etp=plan.etp, ep_params=list(plan.ep_params),
                mesh=dict(plan.mesh), num_microbatches=plan.num_microbatches,
                predicted_all_to_all=plan.predicted.collectives_per_microbatch.get("all_to_all", 0),
                ran_all_to_all=ran["all_to_all"])


_FOUR = pytest.mark.skipif(not os.environ.get("AUTOPAR_EP_ALL"), reason="4-process cases: set AUTOPAR_EP_ALL=1")
TABLE = CaseTable([
    case_param(Case("moe", 2, dict(dp=2, tp=1, pp=1, ep=2, zero_stage=0, microbatch_size=4), all_to_all=2 * 4),
               "moe-dp2-ep2"),
    case_param(Case("Mixtral", 2, dict(dp=2, tp=1, pp=1, ep=2, zero_stage=0, microbatch_size=4), all_to_all=2 * 5),
               "mixtral-dp2-ep2"),
    # ZeRO-1/2/3: expert weights FSDP-sharded over the dp ranks holding the same experts (here
    # one: dp_rep = 1), the rest over dp.
    *[case_param(Case(model, 2, dict(dp=2, tp=1, pp=1, ep=2, zero_stage=zero, microbatch_size=4)),
                 f"{model.lower()}-dp2-ep2-zero{zero}") for model in ("moe", "Mixtral") for zero in (1, 2, 3)],
    # The mixtures of experts of 2025-2026 as Hugging Face builds them, under ZeRO-3 (GPT-OSS adds
    # a bias gathered per row between its expert matmuls: not chained, 5 all-to-alls each).
    *[case_param(Case(model, 2, dict(dp=2, tp=1, pp=1, ep=2, zero_stage=3, microbatch_size=4),
                      all_to_all=2 * 2 * 5 if model == "GPT-OSS" else 0),
                 f"{model.lower()}-dp2-ep2-zero3") for model in ("Qwen3-MoE", "OLMoE", "GPT-OSS", "DeepSeek-V3")],
    # Recomputed chains: the whole layer again in backward (its forward dispatch and combine too:
    # 2 more all-to-alls per layer, which the price counts, solver/prepared.py, and the plan's
    # collective counts leave out), or the gelu between the expert einsums, on the dispatched tokens.
    case_param(Case("moe", 2, dict(dp=2, tp=1, pp=1, ep=2, zero_stage=0, microbatch_size=4, recompute="full"),
                    all_to_all=2 * (4 + 2)), "moe-dp2-ep2-full"),
    case_param(Case("moe", 2, dict(dp=2, tp=1, pp=1, ep=2, zero_stage=0, microbatch_size=4,
                                   recompute="selective")), "moe-dp2-ep2-selective"),
    # 4 processes (minutes on 2 cores): AUTOPAR_EP_ALL=1 runs them.
    # dp4 x ep2 ZeRO-3: dp_rep = 2, the experts really sharded by FSDP.
    case_param(Case("moe", 4, dict(dp=4, tp=1, pp=1, ep=2, zero_stage=3, microbatch_size=2)), "moe-dp4-ep2-zero3",
               _FOUR),
    case_param(Case("Mixtral", 4, dict(dp=4, tp=1, pp=1, ep=2, zero_stage=3, microbatch_size=2)),
               "mixtral-dp4-ep2-zero3", _FOUR),
    # tp x ep x ZeRO: expert weights DTensors on (tp, ep), FSDP-sharded over dp_rep on top.
    # Mixtral at tp=2 on the test cluster: the search plans etp=1, priced faster here (MoE
    # parallel folding, codegen/expert_folding.py: the ep group over tp x dp, the experts unsplit).
    *[case_param(Case(model, 4, dict(dp=2, tp=2, pp=1, ep=2, zero_stage=zero, microbatch_size=4)),
                 f"{model.lower()}-dp2-ep2-tp2-zero{zero}", _FOUR)
      for model in ("moe", "Mixtral") for zero in (1, 3)],
    case_param(Case("moe", 4, dict(dp=2, tp=2, pp=1, ep=2, zero_stage=0, microbatch_size=4)), "moe-dp2-ep2-tp2", _FOUR),
    case_param(Case("moe", 4, dict(dp=4, tp=1, pp=1, ep=2, zero_stage=0, microbatch_size=2)), "moe-dp4-ep2", _FOUR),
    case_param(Case("moe", 4, dict(dp=2, tp=1, pp=2, ep=2, zero_stage=0, microbatch_size=2)), "moe-dp2-ep2-pp2", _FOUR),
    # On real figures every op of the tiny MoE stays replicated on tp: each layer's two expert
    # einsums then run as one chain (one dispatch, one combine), the gelu between them as a
    # DTensor on the tp mesh of the dispatched tokens.
    case_param(Case("moe", 4, dict(dp=2, tp=2, pp=1, ep=2, zero_stage=0, microbatch_size=4),
                    cluster="dgx-a100-80g:gpus_per_node=4", all_to_all=2 * 4), "moe-dp2-ep2-tp2-chained", _FOUR),
    case_param(Case("Mixtral", 4, dict(dp=2, tp=2, pp=1, ep=2, zero_stage=0, microbatch_size=4), all_to_all=2 * 5),
               "mixtral-dp2-ep2-tp2", _FOUR),
    # ep x cp: ep borrows dp ranks; each cp rank exchanges its sequence shard's tokens with the
    # ep ranks of its own cp index.
    # A dropless MoE with causal sdpa (DroplessMoE below: cp splits sdpa only, the zoo's Mixtral
    # passes sdpa an explicit mask, and the built-in MoE's GShard dispatch sums over the sequence).
    *[case_param(Case("dropless", 4, dict(dp=2, cp=2, tp=1, pp=1, ep=2, zero_stage=zero, microbatch_size=4)),
                 f"dropless-dp2-cp2-ep2-zero{zero}", _FOUR) for zero in (0, 3)],
    # ep x pp under every schedule, with ZeRO (pipelined FSDP2 units of experts and the rest).
    *[case_param(Case(model, 4, dict(dp=2, tp=1, pp=2, ep=2, microbatch_size=2, **extra)),
                 f"{model.lower()}-dp2-ep2-pp2-{name}", _FOUR)
      for model in ("moe", "Mixtral")
      for name, extra in (("1f1b-zero1", dict(schedule="1f1b", zero_stage=1)),
                          ("1f1b-zero3", dict(schedule="1f1b", zero_stage=3)),
                          ("interleaved-zero2", dict(schedule="interleaved", virtual_stages=2, zero_stage=2)),
                          ("zb1p-zero1", dict(schedule="zb1p", zero_stage=1)),
                          ("zbv-zero0", dict(schedule="zbv", zero_stage=0)))],
    # The 2025-2026 mixtures of experts (Hugging Face, tiny) under ep x pp and with their experts
    # tensor-parallel over the ep ranks' tp pair (etp = tp = 2).
    *[case_param(Case(model, 4, dict(dp=2, tp=1, pp=2, ep=2, microbatch_size=2, schedule="1f1b", zero_stage=1)),
                 f"{model.lower()}-dp2-ep2-pp2-1f1b-zero1", _FOUR)
      for model in ("Qwen3-MoE", "OLMoE", "GPT-OSS", "DeepSeek-V3")],
    *[case_param(Case(model, 4, dict(dp=2, tp=2, pp=1, ep=2, etp=2, zero_stage=0, microbatch_size=4)),
                 f"{model.lower()}-dp2-ep2-etp2", _FOUR)
      for model in ("Qwen3-MoE", "OLMoE", "GPT-OSS", "DeepSeek-V3")],
])
CASES = TABLE.cases


@TABLE.parametrize
def test_expert_parallel_matches_one_process(case_name, case_outcome):
    case, results = TABLE.results(case_outcome, experts_case, case_name)
    # Every parameter has its gradient checked on some rank (each pipeline rank holds its stages').
    assert set().union(*(result["grad_errors"] for result in results)) == set(results[0]["all_parameters"])
    for rank, result in enumerate(results):
        assert result["ep"] == case.constraints["ep"] and result["ep_params"], result
        if case.model == "Mixtral" and case.constraints["tp"] > 1:  # folded: see the table
            assert result["etp"] == 1, result
        if case.constraints.get("etp", 1) > 1:  # experts tensor-parallel over tp, not folded
            assert result["etp"] in (None, case.constraints["etp"]), result
        assert result["losses"] == pytest.approx(result["reference_losses"], rel=TOLERANCE, abs=TOLERANCE), \
            f"rank {rank}'s losses"
        for name, error in result["grad_errors"].items():
            assert error is not None, f"rank {rank}: {name} has no gradient"
            assert error["max_abs"] <= TOLERANCE, f"rank {rank}: gradient of {name} differs: {error}"
        assert result["predicted_all_to_all"] > 0
        if case.constraints["pp"] == 1:  # one microbatch: the step's all-to-alls are one microbatch's
            assert set(result["grad_errors"]) == set(result["all_parameters"])
            assert result["num_microbatches"] == 1
            if case.constraints.get("recompute") != "full":
                assert result["ran_all_to_all"] == result["predicted_all_to_all"], result
            assert case.all_to_all in (0, result["ran_all_to_all"]), result


@dataclass(frozen=True)
class ChainCase:
    world_size: int = 4
    timeout_s: float = 60.0


def chain_split_on_tp_case(case: ChainCase) -> dict:
    """One SwiGLU grouped-mm expert layer run by the interpreter as a chain on dp2 (= ep2) x tp2,
    row-parallel on tp as the planner prices Mixtral 8x22B at tp2 x ep8 (tokens and weights
    split on the hidden dim, partial outputs reduce-scattered on the dispatched rows before the
    silu): its output and gradients against the whole layer on one process."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.debug import CommDebugMode

    import autopar.models.grouped_mm  # noqa: F401 (registers autopar::grouped_mm)
    from autopar.codegen.experts import ExpertRunner
    from autopar.codegen.interpreter import PlannedInterpreter
    from autopar.codegen.runtime import build_runtime
    from autopar.solver.experts import ExpertOp

    experts, hidden, ffn, rows = 4, 8, 6, 10
    runtime = build_runtime(dict(pp=1, dp=2, tp=2), ep=2)
    rank = dist.get_rank()
    member, column = divmod(rank, 2)  # (ep rank, tp rank)

    def layer(x, w1, w2, offs):
        gate, up = torch.chunk(torch.ops.autopar.grouped_mm(x, w1, offs), 2, -1)
        return torch.ops.autopar.grouped_mm(F.silu(gate) * up, w2, offs)

    graph = torch.fx.symbolic_trace(layer)
    calls = [node for node in graph.graph.nodes if node.op == "call_function"]
    first, last = calls[0].name, calls[-1].name
    between = tuple(node.name for node in calls[1:-1])
    placements = {first: "P|S1;S1;R", last: "P|S1;S1;R", **{name: "P|P" for name in between[:3]},
                  between[3]: "S1|S1", between[4]: "S1|S1;S1"}
    ops = {first: ExpertOp(node=first, param="w1", weight_input=1, token_input=0, num_experts=experts,
                           token_expert_dim=0, token_split_dim=0, output_expert_dim=0, output_split_dim=0,
                           dropless=True, kind="grouped_mm", chain_to=last),
           last: ExpertOp(node=last, param="w2", weight_input=1, token_input=0, num_experts=experts,
                          token_expert_dim=0, token_split_dim=0, output_expert_dim=0, output_split_dim=0,
                          dropless=True, kind="grouped_mm", chain_from=first, between=between)}
    generator = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(experts, hidden, 2 * ffn, generator=generator), torch.randn(experts, ffn, hidden,
                                                                                     generator=generator)
    inputs = []
    for _ in range(2):  # each ep rank's tokens, sorted by expert (the last rows unused)
        counts = torch.randint(0, 3, (experts,), generator=generator)
        inputs.append((torch.randn(rows, hidden, generator=generator), counts.cumsum(0).to(torch.int32),
                       torch.randn(rows, hidden, generator=generator)))
    # One process: both ep ranks' tokens through the whole layer.
    whole = [w.clone().requires_grad_() for w in (w1, w2)]
    tokens = [x.clone().requires_grad_() for x, _, _ in inputs]
    outputs = [layer(x, *whole, offs) for x, (_, offs, _) in zip(tokens, inputs)]
    sum((y * g).sum() for y, (_, _, g) in zip(outputs, inputs)).backward()
    outputs = [y.detach() for y in outputs]

    # This rank: its experts' block of both weights, each split on the hidden dim (w1 dim 1, w2 dim 1).
    block = slice(member * experts // 2, (member + 1) * experts // 2)
    local_w1 = w1[block, column * hidden // 2:(column + 1) * hidden // 2].clone().requires_grad_()
    local_w2 = w2[block, column * ffn // 2:(column + 1) * ffn // 2].clone().requires_grad_()
    x, offs, g = inputs[member]
    x = x.clone().requires_grad_()
    interpreter = PlannedInterpreter(placements, runtime.tp_mesh)
    interpreter.experts = ExpertRunner(ops, runtime.ep_group, 2)
    placeholders = [node.name for node in graph.graph.nodes if node.op == "placeholder"]
    replicated = lambda value: DTensor.from_local(value, runtime.tp_mesh, [Replicate()], run_check=False)  # noqa: E731
    env = dict(zip(placeholders, (replicated(x), local_w1, local_w2, replicated(offs))))
    with CommDebugMode() as counter:
        interpreter.run_nodes(calls, env)
        output = env[last].redistribute(runtime.tp_mesh, [Replicate()]).to_local()
        (output * g).sum().backward()
    output = output.detach()
    exchanges = sum(count for op, count in counter.get_comm_counts().items()
                    if "alltoall" in str(op) or "all_to_all" in str(op))
    error = lambda a, b: float((a - b).abs().max() / b.abs().max().clamp(min=1.0))  # noqa: E731 (relative)
    return dict(all_to_all=exchanges, output=error(output, outputs[member]),
                token_grad=error(x.grad, tokens[member].grad),
                w1_grad=error(local_w1.grad, whole[0].grad[block, column * hidden // 2:(column + 1) * hidden // 2]),
                w2_grad=error(local_w2.grad, whole[1].grad[block, column * ffn // 2:(column + 1) * ffn // 2]))


@_FOUR
def test_a_chain_split_on_tp_runs_as_the_whole_layer(case_outcome):
    outcome = case_outcome(chain_split_on_tp_case, {"chain-tp2": ChainCase()}, "chain-tp2")
    assert outcome.ok, outcome.error
    for rank, errors in enumerate(outcome.values):
        # Counts, dispatch and combine forward; the output gradient dispatched, the token one combined.
        assert errors.pop("all_to_all") == 5, (rank, errors)
        assert all(error <= TOLERANCE for error in errors.values()), (rank, errors)
