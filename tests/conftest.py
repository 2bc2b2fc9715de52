"""Shared fixtures: reference data from ../shared/reference (tests may read it; the product may not)."""

import csv
from pathlib import Path

import pytest

REFERENCE_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "reference"


def reference_rows(name: str) -> list[dict[str, str]]:
    """Rows of a reference CSV, '#' comment lines skipped."""
    path = REFERENCE_DIR / name
    if not path.exists():
        pytest.skip(f"reference data {path} not present")
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    return list(csv.DictReader(lines))
