"""The hand-run benchmarks still run (tiny sizes; their figures are not checked, only that they print)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("script,arguments", [
    ("compression_overhead.py", ["--sizes", "2e4", "--repeats", "1"]),
    ("selection_cost.py", ["--sizes", "2e4", "--repeats", "1"]),
    ("op_count.py", ["--tensors", "1"]),
])
def test_benchmark_prints_its_table(script: str, arguments: list[str]) -> None:
    result = subprocess.run([sys.executable, str(BENCHMARKS / script), *arguments], capture_output=True, text=True,
                            timeout=300, cwd=BENCHMARKS)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "|---|" in result.stdout
