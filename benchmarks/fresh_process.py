"""Run one measurement of a benchmark script in a fresh Python process.

Peak RSS never goes down within a process and imports warm caches, so the capture benchmarks
measure each model in a process of its own: the script runs itself with `--child NAME`, the
child prints its result as one JSON line, the parent reads it back.

    def main(argv):
        if child_main(argv, measure):   # in the child: print measure(NAME) as JSON
            return
        rows = [run_child(__file__, name) for name in names]
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def peak_rss_bytes() -> int:
    """This process's peak resident set (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child_main(argv: list[str], measure: Callable[[str], dict]) -> bool:
    """In a child (`--child NAME`): print `measure(NAME)` as JSON and return True; else False."""
    if argv[:1] != ["--child"]:
        return False
    sys.path.insert(0, str(REPO_ROOT))
    print(json.dumps(measure(argv[1])))
    return True


def run_child(script: str, name: str) -> dict:
    """`script --child NAME` in a fresh interpreter: its JSON result, or {"name", "error"} with
    the last line of its stderr when it failed."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, script, "--child", name], capture_output=True, text=True, env=env,
                            cwd=REPO_ROOT, check=False)
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines() or [f"exit code {result.returncode}"]
        return dict(name=name, error=lines[-1][:300], stderr=result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])
