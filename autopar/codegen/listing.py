"""`ParallelModule.generated_code()`: the rank-local program, with its collectives."""

from __future__ import annotations

import torch

from autopar.codegen.build import ChunkSpec
from autopar.codegen.placements import parse_node_placements
from autopar.codegen.program import GraphParts
from autopar.plans.plan import Plan
from autopar.strategies.placement import transition

_COLLECTIVE_NAMES = {"all_gather": "all-gather", "all_reduce": "all-reduce", "reduce_scatter": "reduce-scatter",
                     "all_to_all": "all-to-all"}


def program_listing(plan: Plan, parts: GraphParts, placements: dict[str, str], specs: list[ChunkSpec],
                    coordinate: dict[str, int]) -> str:
    mesh = plan.mesh
    lines = [f"# rank at pp={coordinate['pp']} dp={coordinate['dp']} tp={coordinate['tp']} of mesh "
             f"pp={mesh['pp']} x dp={mesh['dp']} x tp={mesh['tp']}",
             f"# data parallel: {_data_parallel(plan)}",
             f"# microbatches: {plan.num_microbatches} x {plan.microbatch_size}; recompute: {plan.recompute}"]
    output_of = {name: parse_node_placements(text)[0] for name, text in placements.items()}
    for placeholder, fqn in parts.param_of.items():
        output_of.setdefault(placeholder, plan.param_placements.get(fqn, "R"))
    for spec in specs:
        lines.append(f"\n# chunk {spec.index}: {', '.join(spec.segments)}")
        if spec.inputs:
            lines.append(f"#   receives: {', '.join(spec.inputs)}")
        for segment in spec.segments:
            lines.append(f"  # segment {segment}")
            for name in next(s.nodes for s in parts.graph.segments if s.name == segment):
                lines += _node_lines(parts.fx_nodes[name], placements, output_of, parts.param_of)
        lines.append(f"#   sends: {', '.join(spec.outputs)}")
    return "\n".join(lines)


def _data_parallel(plan: Plan) -> str:
    if plan.mesh["dp"] == 1:
        return "none"
    if plan.zero_stage == 0:
        return "replicated parameters, gradient all-reduce over dp after the step"
    return f"FSDP2 (ZeRO-{plan.zero_stage}) over dp, one unit per segment"


def _node_lines(node: torch.fx.Node, placements, output_of, param_of) -> list[str]:
    output, wanted = parse_node_placements(placements.get(node.name, ""))
    lines = []
    arguments = []
    position = 0
    for source in node.all_input_nodes:
        if source.name not in output_of and source.op != "placeholder":
            arguments.append(source.name)
            continue
        need = wanted[position] if position < len(wanted) else "R"
        position += 1
        have = output_of.get(source.name, "R")
        op = transition(have, need)
        if op is not None:
            lines.append(f"    {source.name} = redistribute({source.name}, {have} -> {need})  "
                         f"# {_COLLECTIVE_NAMES.get(op, op)} over tp")
        arguments.append(f"{param_of.get(source.name, source.name)}<{need}>")
    target = str(node.target).removeprefix("aten.")
    lines.append(f"    {node.name} = {target}({', '.join(arguments)})" + (f" -> {output}" if output else ""))
    return lines
