"""How fast planning is: whole `autopar plan` runs, and the intra-op ILP on GPT-3 175B's block.

    .venv/bin/python benchmarks/planner_speed.py                 # both plans, then the ILP table
    .venv/bin/python benchmarks/planner_speed.py --full-capture  # also time capturing every layer

Prints rows per end-to-end plan (what `autopar plan MODEL --cluster C --global-batch B`
does: capture, search, building the plan; wall seconds with CPU seconds in brackets, the
search's worker processes included), the same capture searched again in one process (jobs=1),
then one table for the ILP (the 96 identical layers
are condensed to two and solved once) on several meshes. Each plan runs twice: cold (traced in
this process, which also pays torch.export's import on the first one; the capture is stored in a
temporary capture cache) and cached (a fresh process, as `autopar plan` run again, that loads
the capture from that cache). Then the command itself, `python -m autopar.cli plan ...` in a fresh
process (Python's start, imports and exit included, the search's workers in its CPU seconds):
cold (AUTOPAR_CAPTURE_CACHE=0) and with the capture cached. `--full-capture` adds rows that
trace every layer instead of three (block_reuse.py), interleaved with the others. The user's
own capture cache is not touched.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

from autopar import api
from autopar.capture import cache as capture_cache
from autopar.solver.condense import condense
from autopar.mesh import Mesh
from autopar.solver.constraints import Constraints
from autopar.solver.parallel_search import search_jobs
from autopar.solver.search import SearchOptions
from autopar.solver.sharding import solve_sharding

MESHES = ((("tp",), (8,)), (("dp", "tp"), (4, 8)), (("dp", "tp"), (16, 8)), (("dp", "tp"), (128, 8)))
PLANS = (
    ("gpt3-175b", "dgx-a100-80g:nodes=128", 1536),
    ("llama:layers=126,hidden=16384,heads=128,kv_heads=8,ffn_hidden=53248,seq=8192,vocab=128256",
     "dgx-h100:nodes=2048", 2048),
    # DeepSeek-V3 (671B, 256 experts) on its own cluster: 2,048 H800 (clusters/h800-deepseek-v3.toml).
    ("deepseek-v3", os.path.join(os.path.dirname(os.path.abspath(__file__)), "clusters", "h800-deepseek-v3.toml"),
     15360),
    ("mixtral-8x7b", "dgx-h100:nodes=16", 512),
)


def cpu_s() -> float:
    """CPU seconds of this process and of its ended children (the search's workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def timed_plan(spec: str, cluster: str, global_batch: int, *, reuse_blocks: bool = True,
               cache: bool = False, graph=None, jobs: int | None = None) -> dict:
    """One `autopar plan`: capture (unless `graph` is given), then search and building the plan
    (wall and CPU seconds of each; `jobs`: SearchOptions.jobs)."""
    started, started_cpu = time.perf_counter(), cpu_s()
    graph = graph or api.capture_for_planning(spec, reuse_blocks=reuse_blocks, cache=cache)
    planner = api.planner_for(graph, None, cluster, global_batch=global_batch, options=SearchOptions(jobs=jobs))
    captured, captured_cpu = time.perf_counter(), cpu_s()
    plan = api.plan_with(planner)
    done, done_cpu = time.perf_counter(), cpu_s()
    return dict(planner=planner, plan=plan, graph=graph, num_nodes=len(graph.nodes), capture_s=captured - started,
                search_s=done - captured, total_s=done - started, capture_cpu_s=captured_cpu - started_cpu,
                search_cpu_s=done_cpu - captured_cpu, jobs=search_jobs(jobs, planner.candidates.meshes(Constraints())))


def cached_plan(spec: str, cluster: str, global_batch: int) -> dict:
    """The same plan in a fresh process that finds the capture in the (temporary) cache."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--cached-one", json.dumps([spec, cluster, global_batch])],
                          capture_output=True, text=True, check=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]), wall_s=time.perf_counter() - started)


def cli_plan(spec: str, cluster: str, global_batch: int, *, cached: bool) -> dict:
    """`autopar plan` as a command, in a fresh process: wall and CPU seconds (its workers included)."""
    env = dict(os.environ, **{capture_cache.SWITCH_ENV: "1" if cached else "0"})
    started, started_cpu = time.perf_counter(), children_cpu_s()
    subprocess.run([sys.executable, "-m", "autopar.cli", "plan", spec, "--cluster", cluster, "--global-batch",
                    str(global_batch)], capture_output=True, text=True, check=True, env=env)
    return dict(wall_s=time.perf_counter() - started, cpu_s=children_cpu_s() - started_cpu)


def children_cpu_s() -> float:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return children.ru_utime + children.ru_stime


def _cached_one(request: str) -> None:
    spec, cluster, global_batch = json.loads(request)
    run = timed_plan(spec, cluster, global_batch, cache=True)
    print(json.dumps(dict(capture_s=run["capture_s"],
                          search_s=run["search_s"], total_s=run["total_s"], num_nodes=run["num_nodes"],
                          step_time_s=run["plan"].predicted.step_time_s)))


def row(spec: str, cluster: str, batch: int, how: str, run: dict) -> str:
    plan, search = run["plan"], run["plan"].search
    label = spec if len(spec) < 20 else spec.split(",")[0] + ",..."
    cp = f" cp={plan.mesh['cp']}" if plan.mesh.get("cp", 1) > 1 else ""
    chosen = (f"pp={plan.mesh['pp']} dp={plan.mesh['dp']}{cp} tp={plan.mesh['tp']} "
              f"mb={plan.microbatch_size} {plan.schedule}(v={plan.virtual_stages}) {plan.recompute} "
              f"zero={plan.zero_stage}")
    return (f"| {label} | {cluster} | {batch} | {how} | {run['num_nodes']:,} | {run['capture_s']:.1f} "
            f"({run['capture_cpu_s']:.1f}) | {run['search_s']:.1f} ({run['search_cpu_s']:.1f}, jobs={run['jobs']}) | "
            f"{run['total_s']:.1f} | {search['configs_priced']:,} | "
            f"{search['sharding_solves']} | {chosen} | {plan.predicted.step_time_s:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full-capture", action="store_true", help="also time capture of every layer")
    parser.add_argument("--jobs", type=int, help="processes of the search (default: autopar plan's default)")
    parser.add_argument("--cached-one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cached_one:
        _cached_one(args.cached_one)
        return
    with tempfile.TemporaryDirectory(prefix="planner-speed-cache-") as folder:  # never the user's cache
        os.environ[capture_cache.DIR_ENV] = folder
        os.environ[capture_cache.SWITCH_ENV] = "1"
        _tables(args)


def _tables(args) -> None:
    print("| model | cluster | global batch | capture | nodes | capture: wall (CPU) s | search + plan: wall (CPU) s "
          "| total (s) | configs priced | intra-op solves | chosen | step (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    runs = {}
    for spec, cluster, batch in PLANS:
        for reuse in (True, False) if args.full_capture else (True,):
            run = timed_plan(spec, cluster, batch, reuse_blocks=reuse, cache=reuse, jobs=args.jobs)
            runs.setdefault(spec, run)
            print(row(spec, cluster, batch, "cold, 3 blocks traced" if reuse else "cold, every layer", run), flush=True)
        if args.jobs != 1:  # the same capture searched in one process, for comparison
            alone = timed_plan(spec, cluster, batch, graph=runs[spec]["graph"], jobs=1)
            same = alone["plan"].predicted.step_time_s == runs[spec]["plan"].predicted.step_time_s
            print(row(spec, cluster, batch, f"same capture, searched in 1 process (same plan: {same})", alone),
                  flush=True)
        cached = cached_plan(spec, cluster, batch)
        label = spec if len(spec) < 20 else spec.split(",")[0] + ",..."
        print(f"| {label} | {cluster} | {batch} | cached (fresh process: {cached['wall_s']:.1f} s wall with Python and imports) | "
              f"{cached['num_nodes']:,} | {cached['capture_s']:.1f} | {cached['search_s']:.1f} | "
              f"{cached['total_s']:.1f} | | | same plan: {abs(cached['step_time_s'] - runs[spec]['plan'].predicted.step_time_s) < 1e-9} "
              f"| {cached['step_time_s']:.2f} |", flush=True)
        for cached in (False, True):
            command = cli_plan(spec, cluster, batch, cached=cached)
            print(f"| {label} | {cluster} | {batch} | `autopar plan` command, {'capture cached' if cached else 'cold'}: "
                  f"{command['wall_s']:.1f} s wall ({command['cpu_s']:.1f} CPU s) | | | | | | | | |", flush=True)
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
