"""How fast planning is: whole `autopar plan` runs, and the intra-op ILP on GPT-3 175B's block.

    .venv/bin/python benchmarks/planner_speed.py                 # both plans, then the ILP table
    .venv/bin/python benchmarks/planner_speed.py --full-capture  # also time capturing every layer

Prints one row per end-to-end plan (what `autopar plan MODEL --cluster C --global-batch B`
does: capture, search, building the plan), then one table for the ILP (the 96 identical layers
are condensed to two and solved once) on several meshes. `--full-capture` adds rows that trace
every layer instead of three (block_reuse.py), interleaved with the others.
"""

from __future__ import annotations

import argparse
import time

from autopar import api
from autopar.condense import condense
from autopar.mesh import Mesh
from autopar.solver.search import Constraints
from autopar.solver.sharding import solve_sharding

MESHES = ((("tp",), (8,)), (("dp", "tp"), (4, 8)), (("dp", "tp"), (16, 8)), (("dp", "tp"), (128, 8)))
PLANS = (
    ("gpt3-175b", "dgx-a100-80g:nodes=128", 1536),
    ("llama:layers=126,hidden=16384,heads=128,kv_heads=8,ffn_hidden=53248,seq=8192,vocab=128256",
     "dgx-h100:nodes=2048", 2048),
)


def timed_plan(spec: str, cluster: str, global_batch: int, *, reuse_blocks: bool = True) -> dict:
    """One `autopar plan`: capture, then search and building the plan (seconds of each)."""
    started = time.perf_counter()
    graph = api.capture_for_planning(spec, reuse_blocks=reuse_blocks)
    planner = api.planner_for(graph, None, cluster, global_batch=global_batch)
    captured = time.perf_counter()
    plan = api.plan_with(planner)
    done = time.perf_counter()
    return dict(planner=planner, plan=plan, num_nodes=len(graph.nodes), capture_s=captured - started,
                search_s=done - captured, total_s=done - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full-capture", action="store_true", help="also time capture of every layer")
    args = parser.parse_args()
    print("| model | cluster | global batch | capture | nodes | capture (s) | search + plan (s) | total (s) "
          "| configs priced | intra-op solves | chosen | step (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    runs = {}
    for spec, cluster, batch in PLANS:
        for reuse in (True, False) if args.full_capture else (True,):
            run = timed_plan(spec, cluster, batch, reuse_blocks=reuse)
            runs.setdefault(spec, run)
            plan, search = run["plan"], run["plan"].search
            label = spec if len(spec) < 20 else spec.split(",")[0] + ",..."
            cp = f" cp={plan.mesh['cp']}" if plan.mesh.get("cp", 1) > 1 else ""
            chosen = (f"pp={plan.mesh['pp']} dp={plan.mesh['dp']}{cp} tp={plan.mesh['tp']} "
                      f"mb={plan.microbatch_size} {plan.schedule}(v={plan.virtual_stages}) {plan.recompute} "
                      f"zero={plan.zero_stage}")
            print(f"| {label} | {cluster} | {batch} | {'3 blocks traced' if reuse else 'every layer'} | "
                  f"{run['num_nodes']:,} | {run['capture_s']:.1f} | {run['search_s']:.1f} | {run['total_s']:.1f} | "
                  f"{search['configs_priced']:,} | {search['sharding_solves']} | {chosen} | "
                  f"{plan.predicted.step_time_s:.2f} |", flush=True)
    planner = runs[PLANS[0][0]]["planner"]
    condensed = condense(planner.graph).with_batch(1)
    print(f"\ngpt3-175b: {len(planner.graph.nodes):,} nodes; condensed to {len(condensed.nodes):,} nodes "
          "(2 of 96 blocks, weighted)\n")
    print("| mesh | ILP variables | edges | build (s) | solve (s) | status | gap |")
    print("|---|---|---|---|---|---|---|")
    for names, shape in MESHES:
        mesh = Mesh(axis_names=names, shape=shape, devices_per_node=8)
        result = solve_sharding(condensed, mesh, planner.cluster)
        print(f"| {mesh.describe()} | {result.num_variables} | {result.num_edges} | {result.build_time_s:.2f} | "
              f"{result.solve_time_s:.2f} | {result.solution.status} | {100 * result.solution.gap:.2f}% |")


if __name__ == "__main__":
    main()
