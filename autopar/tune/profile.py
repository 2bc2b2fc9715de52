"""`autopar profile`: measure this machine for the cost model, with a progress bar."""

from __future__ import annotations

import sys
import time

from autopar.errors import ProfileError
from cost_model.errors import CostModelInputError
from cost_model.profile import HardwareProfile


class ProgressBar:
    """One line on stderr, redrawn as the sweep advances."""

    def __init__(self, width: int = 30) -> None:
        self.width = width
        self.started = time.perf_counter()

    def __call__(self, message: str, fraction: float) -> None:
        fraction = min(max(fraction, 0.0), 1.0)
        filled = int(self.width * fraction)
        elapsed = time.perf_counter() - self.started
        bar = "#" * filled + "-" * (self.width - filled)
        print(f"\r[{bar}] {100 * fraction:3.0f}% {elapsed:5.1f}s {message[:40]:<40}", end="", file=sys.stderr, flush=True)
        if fraction >= 1.0:
            print(file=sys.stderr, flush=True)


def profile_machine(*, device: str | None = None, num_processes: int = 1, out: str | None = None,
                    quick: bool = False, show_progress: bool = True) -> HardwareProfile:
    import torch

    from cost_model.profiler import ProfileOptions, run_profile

    from autopar.validation import check_output_path

    if out is not None:  # before measuring: a sweep takes minutes, a typo in the path a second
        check_output_path(out, "out")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        options = ProfileOptions(device=device, num_processes=num_processes, quick=quick)
        profile = run_profile(options, progress=ProgressBar() if show_progress else None)
    except CostModelInputError as error:
        raise ProfileError(str(error)) from None
    if out is not None:
        profile.save(out)
    return profile
