"""Real multi-process runs for the tests: gloo process groups, Lightning and Fabric jobs, and the
constants of the digits runs that several test modules compare."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SCRIPTS = Path(__file__).parent / "scripts"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _gloo_entry(rank: int, world_size: int, port: int, fn: Callable[..., None], args: tuple) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_gloo(fn: Callable[..., None], world_size: int = 2, *args: Any) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` real processes joined by a gloo group.

    ``fn`` must be importable (module level). An assertion failing in any rank fails the test.
    """
    mp.start_processes(_gloo_entry, args=(world_size, free_port(), fn, args), nprocs=world_size,
                       start_method="spawn")


def run_lightning(tmp_path: Path, name: str, *args: str, timeout: float = 300,
                  script: str = "train_digits.py") -> tuple[list[dict], str]:
    """Run ``tests/scripts/<script>`` (a real multi-process Lightning or Fabric job); return every rank's
    results and the combined output."""
    out = tmp_path / name
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / script), "--out", str(out), *args],
        capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=env,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    results = [torch.load(path, weights_only=False) for path in sorted(tmp_path.glob(f"{name}.rank*.pt"))]
    assert results, output[-4000:]
    return results, output


#: The digits runs of tests/scripts/train_digits.py and fabric_digits.py.
EPOCHS = "10"
STEPS_PER_EPOCH = 22  # 1348 training images / 2 ranks / batch 32, rounded up


def params_equal(a: dict, b: dict) -> bool:
    """Two runs' final parameters, equal bit for bit."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
