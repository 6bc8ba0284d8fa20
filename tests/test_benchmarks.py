"""The hand-run benchmarks still run (tiny sizes; their figures are not checked, only that they print)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests._processes import run_script

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("script,arguments", [
    ("compression_overhead.py", ["--sizes", "2e4", "--repeats", "1"]),
    ("selection_cost.py", ["--sizes", "2e4", "--repeats", "1"]),
    ("op_count.py", ["--tensors", "1"]),
    ("time_boxed_windows.py", ["--simulate", "--steps", "10", "--seeds", "0"]),
])
def test_benchmark_prints_its_table(script: str, arguments: list[str], tmp_path: Path) -> None:
    code, output = run_script(BENCHMARKS / script, arguments, tmp_path, dict(os.environ), timeout=300)
    assert code == 0, output[-2000:]
    assert "|---|" in output
