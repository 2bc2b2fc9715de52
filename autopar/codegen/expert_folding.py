"""MoE parallel folding at run time (etp = 1 with tp > 1; solver/expert_folding.py prices it).

Each MoE layer's token-local region (router, sort by expert, experts, un-sort, weighted sum) runs
on each tp rank's own tokens as plain tensors, not DTensors: sorting one rank's rows is not a
shard of the global sort. The region's nodes have static shapes (reshape sizes, arange lengths)
at the global token count, so they run from the model exported again at seq / tp tokens
(`local_nodes`; the nodes keep their names, which are checked against the program's).

    entry   the region's inputs from outside, placed as planned (the sequence-sharded residual
            stream: Shard(1)), taken as this rank's local tensor; replicated weights (the router,
            the norm) are taken locally with a Partial gradient: each rank's tokens give their
            share, summed over tp once per step (data_parallel.reduce_partial_gradients)
    inside  the nodes of the local program on local tensors; the expert ops dispatch and combine
            over the folded ep group (codegen/experts.py's ExpertRunner, with no tp mesh): ep
            consecutive ranks of the (dp, tp) grid, tp innermost (runtime.folded_expert_device_mesh)
    exit    the last node's local output becomes a DTensor again, sharded as planned

Expert weights are split by expert over that ep group and replicated over the dp x tp / ep ranks
holding the same experts: their gradients sum the tokens of every rank of the group, so they
are summed over those replicas and divided by dp (ZeRO-0), or averaged by FSDP over them and
scaled by tp / ep (ZeRO-1/2/3: `expert_gradient_divisor`).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.fx.node import map_aggregate

from autopar.codegen.placements import parse_node_placements, to_dtensor_placement
from autopar.codegen.runtime import factories_on
from autopar.errors import ConfigError
from autopar.solver.expert_folding import runtime_blocker, token_local_region
from autopar.solver.experts import find_expert_ops

_CHECKS = (torch.ops.aten._assert_tensor_metadata.default,)
"""Consumers that check a tensor and produce nothing (export's dtype asserts)."""
SEQUENCE_DIM = 1
"""The dim the region's entry and exit are split along on tp: the sequence of (batch, seq, ...)."""


def folds_experts(plan) -> bool:
    """Whether `plan` runs MoE parallel folding (etp = 1 with tp > 1 and ep > 1)."""
    return plan.etp == 1 and plan.mesh["tp"] > 1 and plan.ep > 1


def folding_blocker(plan) -> str:
    """Why the runtime cannot run this folded plan ("" when it can): solver/expert_folding.py's rule."""
    return runtime_blocker(plan.mesh.get("cp", 1), plan.recompute)


def expert_gradient_divisor(plan) -> float:
    """What FSDP's average of an expert gradient over its replicas is divided by so that it is the
    average over dp (module docstring): ep without folding, ep / tp with it."""
    return plan.ep / plan.mesh["tp"] if folds_experts(plan) else plan.ep


def region_of(graph) -> tuple[str, ...]:
    """The nodes of every MoE layer's token-local region of `graph` (solver/expert_folding.py)."""
    region = token_local_region(graph, find_expert_ops(graph))
    if not region:
        raise ConfigError("the plan folds the experts (etp=1), but an MoE layer of this model is not token-local "
                          "(its expert ops are not inside one region from the residual add to the layer's output): "
                          "use etp=tp")
    return region


def local_nodes(model, inputs: tuple, keywords: dict, seq_len: int, tp: int, region: tuple[str, ...], program,
                device: torch.device, precision: str = "fp32") -> dict[str, torch.fx.Node]:
    """The region's nodes of the model exported at seq / tp tokens (as the plan's `precision` runs
    it, as the program was), by name (same targets as the program's nodes of the same name)."""
    from autopar.capture.compute_dtype import capture_for_codegen

    if seq_len % tp:
        raise ConfigError(f"MoE parallel folding splits each sequence of {seq_len} tokens over tp={tp} ranks: use a "
                          "tp dividing the sequence, or etp=tp")
    local_keywords = dict(zip(keywords, _first_tokens(tuple(keywords.values()), seq_len, seq_len // tp)))
    local_program, _ = capture_for_codegen(model, _first_tokens(tuple(inputs), seq_len, seq_len // tp),
                                           local_keywords, precision=precision)
    factories_on(local_program.graph, device)
    found = {node.name: node for node in local_program.graph.nodes if node.name in set(region)}
    local_all = {node.name: node for node in local_program.graph.nodes}
    program_all = {node.name: node for node in program.graph.nodes}
    differing = [name for name in region if name not in found or not _same_op(found[name], program_all[name], local_all,
                                                                             program_all)]
    if differing:
        raise ConfigError(f"MoE parallel folding: the model exported at {seq_len // tp} tokens per sequence has other "
                          f"ops than at {seq_len} (first: {differing[0]}); its MoE layers cannot run on each tp "
                          "rank's tokens: use etp=tp")
    return found


def _same_op(local: torch.fx.Node, node: torch.fx.Node, local_all: dict, program_all: dict) -> bool:
    """Whether the local export's node is the program's node of the same name: the same op, reading
    the nodes of the same names (sizes may differ), which are the same ops, read by the same nodes."""
    def names(value):
        found = []
        map_aggregate(value, lambda arg: found.append(arg.name) if isinstance(arg, torch.fx.Node) else None)
        return found

    inputs = names((local.args, dict(local.kwargs)))
    if local.target != node.target or inputs != names((node.args, dict(node.kwargs))):
        return False
    if {user.name for user in local.users} != {user.name for user in node.users}:
        return False
    return all(name in local_all and name in program_all and local_all[name].target == program_all[name].target
               for name in inputs)


def _first_tokens(values: tuple, seq_len: int, tokens: int) -> tuple:
    """Example inputs cut to their first `tokens` positions ((batch, seq, ...) tensors only)."""
    return tuple(value[:, :tokens] if isinstance(value, torch.Tensor) and value.dim() >= 2
                 and value.shape[1] == seq_len else value for value in values)


def _reads(user: torch.fx.Node) -> bool:
    """Whether a consumer outside the region uses what it reads: not export's dtype asserts, not a
    getitem of a tuple output that nothing reads (topk's unused values)."""
    return user.target not in _CHECKS and (user.op == "output" or bool(user.users))


class FoldedRegions:
    """Runs the region nodes for the interpreter (see the module docstring)."""

    def __init__(self, nodes: dict[str, torch.fx.Node], placements: dict[str, str], tp_mesh, runner) -> None:
        from autopar.codegen.interpreter import PlannedInterpreter

        self.nodes = nodes
        """Region node name -> the node of the local program."""
        self.placements = {name: parse_node_placements(text) for name, text in placements.items()}
        self.exits = {name for name, node in nodes.items() if any(user.name not in nodes and _reads(user)
                                                                  for user in node.users)}
        self.tp_mesh = tp_mesh
        self.local = PlannedInterpreter({}, tp_mesh)
        self.local.distributed = False  # plain tensors; expert ops with no tp mesh
        self.local.experts = runner
        self._check_exits()

    def _check_exits(self) -> None:
        for name in self.exits:
            output = self.placements.get(name, ("R", []))[0]
            if output != f"S{SEQUENCE_DIM}":
                raise ConfigError(f"MoE parallel folding: the MoE layer's output {name} is planned {output} on tp; the "
                                  f"runtime runs it on each rank's sequence shard (S{SEQUENCE_DIM}) only: use etp=tp")

    def run(self, name: str, env: dict, place) -> object:
        """The output of region node `name`: local inside the region, a DTensor at its exit.
        `place(value, placement)` places an input from outside the region as planned."""
        node = self.nodes[name]
        wanted = self.placements.get(name, (None, []))[1]
        local_env: dict = {}
        position = 0

        def visit(arg):
            nonlocal position
            if not isinstance(arg, torch.fx.Node) or (arg.op == "get_attr" and arg.name not in env):
                return arg  # a higher-order op's body (a no_grad region): the local interpreter takes it
            if isinstance(env.get(arg.name), torch.Tensor):
                placement = wanted[position] if position < len(wanted) else None
                position += 1
                local_env[arg.name] = self._scalar(arg, env) if self._recomputed(arg, env) else \
                    self._localized(env[arg.name], placement, place)
            else:
                local_env[arg.name] = self._scalar(arg, env)
            return arg

        map_aggregate(node.args, visit)
        map_aggregate(dict(node.kwargs), visit)
        self.local.run_nodes([node], local_env)
        result = local_env[name]
        if name in self.exits:
            placement = to_dtensor_placement(self.placements[name][0])
            return DTensor.from_local(result, self.tp_mesh, [placement], run_check=False)
        return result

    def _recomputed(self, node: torch.fx.Node, env: dict) -> bool:
        """Whether `node` (from outside the region) is a size, or a tensor made from sizes only (an
        arange over the rows): no tensor in, so the local program's node makes this rank's."""
        if node.name in self.nodes or node.op != "call_function":
            return False
        return not any(isinstance(env.get(source.name), torch.Tensor) for source in node.all_input_nodes)

    def _scalar(self, node: torch.fx.Node, env: dict):
        """An input from outside the region that is a size or a tensor made from sizes only (an
        arange over the layer's rows): computed again by the local program's nodes, whose static
        sizes are this rank's token counts (batch sizes are the same on every tp rank); others
        (a region node's tuple of local tensors) as they are."""
        if not self._recomputed(node, env):
            return env[node.name]
        args = map_aggregate(node.args, lambda arg: self._scalar(arg, env) if isinstance(arg, torch.fx.Node) else arg)
        kwargs = map_aggregate(dict(node.kwargs),
                               lambda arg: self._scalar(arg, env) if isinstance(arg, torch.fx.Node) else arg)
        return node.target(*args, **kwargs)

    def _localized(self, value: torch.Tensor, placement: str | None, place) -> torch.Tensor:
        if not isinstance(value, DTensor) or value.device_mesh != self.tp_mesh:
            return value  # local already, or an expert weight (on the expert mesh: the runner takes its block)
        if placement is not None and placement.startswith("S"):
            value = place(value, placement)
            if not isinstance(value.placements[0], Shard) or value.placements[0].dim != SEQUENCE_DIM:
                raise ConfigError(f"MoE parallel folding: an input of the MoE layer is planned {placement} on tp; the "
                                  f"runtime runs the layer on each rank's sequence shard (S{SEQUENCE_DIM}) only: use "
                                  "etp=tp")
            return value.to_local()
        value = place(value, "R") if placement == "R" else value
        if value.placements[0].is_replicate() and value.requires_grad:
            return value.to_local(grad_placements=[Partial()])  # each rank's tokens: a share of the gradient
        return value.to_local()
