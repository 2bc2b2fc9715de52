"""benchmarks/fp8_recipes.py: torchao's README float8 table (one configuration in bf16, tensorwise and
rowwise) priced on both H100 parts. No accuracy is asserted against the published figures
(BENCHMARKS.md records the table); what is checked is that the rows are one configuration and that
each recipe is priced as it runs."""

import pytest

from benchmarks import fp8_recipes
from benchmarks.published_fp8 import handling_of, read_fp8_runs

pytestmark = pytest.mark.slow

RUNS = read_fp8_runs(fp8_recipes.REFERENCE)


def test_the_rows_are_one_configuration_in_each_precision():
    assert sorted(run.precision for run in RUNS) == ["bf16", "fp8", "fp8-rowwise"]
    shapes = {(run.model, run.gpus, run.global_batch, run.microbatch, run.dp, run.recompute) for run in RUNS}
    assert len(shapes) == 1
    assert {handling_of(run) for run in RUNS if run.precision != "bf16"} == {"torchtitan"}


def test_each_part_prices_every_recipe_and_rowwise_buys_less(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["fp8_recipes.py"])
    assert fp8_recipes.main() == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| H100")]
    assert len(rows) == len(fp8_recipes.PARTS) * len(RUNS)
    for part in fp8_recipes.PARTS:
        gains = {row[2]: float(row[-1].rstrip(" |x")) for row in rows if row[0] == f"| {part}"}
        # rowwise casts every operand twice, gathers in bf16 and rescales its backward outputs
        assert gains["bf16"] == 1.0 < gains["rowwise"] < gains["tensorwise"]
