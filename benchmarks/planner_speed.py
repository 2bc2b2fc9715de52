"""How fast planning is: the intra-op ILP on GPT-3 175B's block, and the whole search.

    .venv/bin/python benchmarks/planner_speed.py

Prints one table for the ILP (the 96 identical layers are condensed to two and solved once) on
several meshes, and one line for `autopar plan gpt3-175b` on 128 DGX-A100 nodes.
"""

from __future__ import annotations

import time

from autopar import api
from autopar.condense import condense
from autopar.mesh import Mesh
from autopar.solver.search import Constraints
from autopar.solver.sharding import solve_sharding

MESHES = ((("tp",), (8,)), (("dp", "tp"), (4, 8)), (("dp", "tp"), (16, 8)), (("dp", "tp"), (128, 8)))


def main() -> None:
    started = time.perf_counter()
    planner = api.planner_for("gpt3-175b", None, "dgx-a100-80g:nodes=128", global_batch=1536)
    capture_s = time.perf_counter() - started
    graph = planner.graph
    condensed = condense(graph).with_batch(1)
    print(f"gpt3-175b: {len(graph.nodes):,} nodes captured in {capture_s:.1f} s; condensed to "
          f"{len(condensed.nodes):,} nodes (2 of 96 blocks, weighted)\n")
    print("| mesh | ILP variables | edges | build (s) | solve (s) | status | gap |")
    print("|---|---|---|---|---|---|---|")
    for names, shape in MESHES:
        mesh = Mesh(axis_names=names, shape=shape, devices_per_node=8)
        result = solve_sharding(condensed, mesh, planner.cluster)
        print(f"| {mesh.describe()} | {result.num_variables} | {result.num_edges} | {result.build_time_s:.2f} | "
              f"{result.solve_time_s:.2f} | {result.solution.status} | {100 * result.solution.gap:.2f}% |")
    started = time.perf_counter()
    search = planner.search(Constraints())
    search_s = time.perf_counter() - started
    print(f"\nsearch over {search.num_configs:,} configurations ({search.num_sharding_solves} intra-op solves): "
          f"{search_s:.1f} s; capture + search {capture_s + search_s:.1f} s")
    print(f"chosen: {search.best.config.describe()}, {search.best.step_time_s:.2f} s per step")


if __name__ == "__main__":
    main()
