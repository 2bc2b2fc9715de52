"""benchmarks/checkpoint_overhead.py: a save's cost is what its steps took beyond the run's median
step, up to the step that saw the checkpoint published; the window spans whole intervals."""

from itertools import accumulate

from benchmarks.checkpoint_overhead import Run, durations_s, save_costs_s, window_s


def _run(durations_s: list[float], published_at: dict[int, int]) -> Run:
    return Run(starts_s=[0.0, *accumulate(durations_s)], published_at=published_at)


def test_an_async_save_costs_its_step_and_the_steps_its_write_overlapped():
    # every = 4, two intervals: saves after steps 4 and 8 (the last, after step 12, is not timed).
    # Step 4 copies the state (+30 ms), step 5 runs beside the write (+20 ms), step 6 sees it published.
    durations = [0.1] * 12
    durations[3], durations[4] = 0.13, 0.12
    durations[7] = 0.11  # a synchronous-looking save: published at the next step
    one = _run(durations, {4: 6, 8: 9})
    costs = save_costs_s(one, every=4)
    assert [round(cost, 6) for cost in costs] == [0.05, 0.01]
    assert len(durations_s(one)) == 12


def test_one_slow_step_of_the_machine_outside_the_saves_leaves_their_cost_alone():
    durations = [0.1] * 12
    durations[3] = 0.13
    durations[9] = 5.0  # the machine's load, not the checkpoint
    one = _run(durations, {4: 5})
    assert round(save_costs_s(one, every=4)[0], 6) == 0.03
    assert round(window_s(one, every=4, intervals=1), 6) == round(0.13 + 0.1 * 3, 6)
