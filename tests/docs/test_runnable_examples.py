"""The commands the README and the CLI reference mark as runnable (fenced blocks whose info
string is `bash runnable`) run and exit 0: one fresh folder per page, the lines in order, so that a
later line may read a file an earlier one wrote."""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", REPO / "docs" / "cli.md"]
TIMEOUT_S = 240


def runnable_commands(page: Path) -> list[str]:
    commands, inside = [], False
    for line in page.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            inside = not inside and stripped[3:].strip() == "bash runnable"
            continue
        if inside and stripped and not stripped.startswith("#"):
            commands.append(stripped)
    return commands


def test_both_pages_mark_runnable_examples():
    for page in PAGES:
        assert runnable_commands(page), f"{page.name} marks no example as runnable"


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_runnable_examples_exit_zero(page, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    for command in runnable_commands(page):
        words = shlex.split(command)
        assert words[0] == "autopar", f"{page.name}: a runnable line runs autopar alone, got: {command}"
        done = subprocess.run([sys.executable, "-m", "autopar.cli", *words[1:]], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=TIMEOUT_S)
        assert done.returncode == 0, f"{page.name}: `{command}` exited {done.returncode}:\n{done.stderr[-2000:]}"
