"""`autopar tune MODEL --cluster SPEC --global-batch B --trials k`, run under torchrun.

Every process builds MODEL with the same seeded weights; rank 0 plans the k best predicted
candidates and shares them; all ranks run the trials (trials.py); rank 0 writes the winner,
with every candidate's predicted and measured step time, and prints the report. The plan file
is written before the process group is torn down, so an abort while the processes exit cannot
lose it.
"""

from __future__ import annotations

import os
import sys

from autopar.errors import ConfigError


def tune(model_spec: str, *, cluster: str, global_batch: int, num_trials: int, steps: int = 5,
         constraints: dict | None = None, precision: str = "fp32", out: str | None = None,
         as_json: bool = False, optimizer: str | None = None) -> int:
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ConfigError("`autopar tune` runs the candidate plans on the job's processes: launch it with torchrun, "
                          "e.g. `torchrun --nproc-per-node 4 -m autopar.cli tune MODEL --cluster cpu:procs=4 ...`")
    import torch
    import torch.distributed as dist

    from autopar.plans import planning
    from autopar.codegen.runtime import ensure_process_group, run_on_rank0
    from autopar.models import build_model
    from autopar.solver.search import SearchOptions
    from autopar.tune.trials import TrialOptions, record_trials, run_trials, select_winner

    rank, world = ensure_process_group()
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    bundle = build_model(model_spec, device=device, seed=0, batch_size=global_batch)
    candidates = run_on_rank0(lambda: planning.candidate_plans(
        bundle.model, bundle.example_inputs, cluster, global_batch=global_batch, num_candidates=num_trials,
        constraints=constraints, loss_fn=bundle.loss_fn, example_targets=bundle.example_targets,
        precision=precision, options=SearchOptions(optimizer=optimizer)))
    if candidates[0].num_devices != world:
        raise ConfigError(f"the cluster '{cluster}' has {candidates[0].num_devices} devices but torchrun started "
                          f"{world} processes: plan for this job (e.g. cpu:procs={world})")
    say = lambda message: print(f"autopar: {message}", file=sys.stderr, flush=True)  # noqa: E731
    results = run_trials(bundle.model, tuple(bundle.example_inputs), bundle.example_targets, bundle.loss_fn,
                         candidates, options=TrialOptions(steps=steps), progress=say)
    winner = select_winner(results)
    chosen = record_trials(candidates[winner], results, winner)
    if rank == 0:
        if out:
            chosen.save(out)
        print(chosen.to_json() if as_json else chosen.summary(), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0

