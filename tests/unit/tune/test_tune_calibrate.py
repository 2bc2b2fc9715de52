"""calibrate.py's fixed set of configurations: every mesh, and points that tell the terms apart."""

from autopar.tune.calibrate import MAX_CONFIGS, calibration_configs


def _meshes(configs):
    return {(c["dp"], c["tp"], c["pp"]) for c in configs}


def test_four_processes_cover_every_mesh_and_recompute_a_tensor_parallel_one():
    configs = calibration_configs(4, 16, num_layers=4, num_heads=4)
    assert len(configs) <= MAX_CONFIGS
    assert _meshes(configs) == {(4, 1, 1), (2, 2, 1), (1, 4, 1), (2, 1, 2), (1, 2, 2), (1, 1, 4)}
    recomputed = [c for c in configs if c.get("recompute") == "full"]
    # One without tensor parallelism (eager recomputation) and one with: recomputing, a tp stage
    # runs every op on DTensors, which moves the DTensor term apart from the collectives'.
    assert {c["tp"] > 1 for c in recomputed} == {True, False}
    assert all(c["pp"] == 1 and c["zero_stage"] == 0 for c in recomputed)


def test_heads_that_do_not_divide_leave_tensor_parallelism_out():
    configs = calibration_configs(4, 16, num_layers=4, num_heads=3)
    assert all(c["tp"] == 1 for c in configs)
    assert [c.get("recompute") for c in configs].count("full") == 1
