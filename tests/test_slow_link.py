"""Ordering on a rate-limited link: several DDP buckets in flight, multi-round and count-exchanging
protocols, 2 real gloo processes in a private network namespace whose loopback is shaped to 100 Mbit/s
(root, ``ip`` and ``tc`` needed; skipped otherwise). Collectives issued in different orders on the two
ranks would pair mismatched messages here and abort."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.multiprocess

SCRIPT = Path(__file__).parent / "scripts" / "multi_bucket.py"


@pytest.fixture
def shaped_netns():
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("needs root, ip and tc for a rate-limited network namespace")
    name = f"gctest{os.getpid()}"
    created = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if created.returncode:
        pytest.skip(f"cannot create a network namespace: {created.stderr.strip()}")
    try:
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
        subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate",
                        "100mbit", "burst", "256kb", "latency", "100ms"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def test_several_buckets_of_multi_round_protocols_stay_in_order_on_a_slow_link(shaped_netns, tmp_path) -> None:
    out = tmp_path / "result.pt"
    proc = subprocess.run(["ip", "netns", "exec", shaped_netns, sys.executable, str(SCRIPT), "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    results = torch.load(out, weights_only=False)
    for name, result in results.items():
        assert result["step"] == 4, name
        assert result["hook_calls"] > 2 * 4, f"{name}: several buckets per step ({result['hook_calls']} calls)"
        rank0, rank1 = result["params"]
        assert torch.isfinite(rank0).all() and torch.equal(rank0, rank1), f"{name}: ranks diverged"
