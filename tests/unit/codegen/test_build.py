"""Building this rank's programs from a plan (codegen/build.py): the pipeline chunks are the plan's."""

from types import SimpleNamespace

from autopar.codegen.build import plan_chunks
from autopar.plans import planning
from report_plans import planner


def test_the_runtime_builds_the_chunks_the_plan_records_whatever_split_made_them():
    """Codegen reads the chunks from the plan's stages (no cut of its own): a split by count
    (solver/pipeline.py) is what runs, in pipeline order, under 1F1B and interleaved alike."""
    graph = planner().graph
    for split, schedule, pp, virtual in (("first=1,last=3", "1f1b", 4, None), ("uniform", "interleaved", 2, 2),
                                         ("balanced", "1f1b", 2, None)):
        config = planning.fixed_config(planner(), tp=1, pp=pp, dp=None, microbatch_size=1, schedule=schedule,
                                       virtual_stages=virtual, layers_per_virtual_stage=None, recompute="none",
                                       zero_stage=0, pipeline_split=split)
        plan = planning.evaluate_with(planner(), config)
        chunks = plan_chunks(plan, SimpleNamespace(graph=graph))
        recorded = [chunk for stage in plan.stages for chunk in (stage.chunks or (stage.segments,))]
        assert sorted(map(tuple, chunks)) == sorted(recorded)
        assert [name for chunk in chunks for name in chunk] == [segment.name for segment in graph.segments]
        if split == "first=1,last=3":
            assert [len(chunk) for chunk in chunks] == [2, 2, 2, 4]
        if split == "uniform":
            assert chunks == [["prologue", "layers.0", "layers.1"], ["layers.2", "layers.3"], ["layers.4", "layers.5"],
                              ["layers.6", "layers.7", "epilogue"]]
