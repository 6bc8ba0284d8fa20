"""Clean exits: short real 2-process torchrun jobs with the gradcomp hook end with status 0, even when the
script leaves its process group alive (the full 50 + 10 run check is tests/scripts/stress_exit.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess


def test_short_exit_stress() -> None:
    script = Path(__file__).parent / "scripts" / "stress_exit.py"
    proc = subprocess.run([sys.executable, str(script), "--torchrun", "2", "--lightning", "0"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "2 passed, 0 failed" in proc.stdout
