"""``import lightning_gradcomp`` without Lightning: a plain-PyTorch script never loads it, and the strategies
are still registered the moment Lightning is imported after the package (issue 36, item 7)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._processes import free_port

SCRIPT = r'''
import os, sys
sys.modules["lightning"] = None          # importing Lightning fails in this process
import torch
import torch.distributed as dist
import lightning_gradcomp
from lightning_gradcomp.compressors import TopK

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['PORT']}", rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
ddp = torch.nn.parallel.DistributedDataParallel(model)
gradcomp = lightning_gradcomp.register(ddp, compressor=TopK(0.05), min_compress_numel=16)
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
for _ in range(3):
    ddp(torch.randn(8, 64)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
assert gradcomp.totals.steps == 3 and gradcomp.totals.bytes_sent > 0, gradcomp.totals

local = torch.nn.Linear(64, 64)
inner = torch.optim.AdamW(local.parameters(), lr=1e-3)
diloco = lightning_gradcomp.local_updates(local, inner, sync_every=2, compressor="int8")
for _ in range(4):
    local(torch.randn(8, 64)).sum().backward()
    inner.step()
    inner.zero_grad()
    diloco.step()
assert diloco.loop.outer.syncs == 2
assert sys.modules["lightning"] is None, "Lightning was imported"
dist.destroy_process_group()

del sys.modules["lightning"]              # now a Lightning user imports it, after the package
import lightning
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry
assert {"gradcomp", "gradcomp_sim"} <= set(StrategyRegistry), sorted(StrategyRegistry)
assert "gradcomp" in STRATEGY_REGISTRY, sorted(STRATEGY_REGISTRY)
assert lightning_gradcomp.GradCompStrategy is StrategyRegistry["gradcomp"]["strategy"]
print("ok")
'''


@pytest.mark.multiprocess
def test_register_and_local_updates_run_where_lightning_cannot_be_imported() -> None:
    """A fresh interpreter in which importing ``lightning`` fails runs ``register()`` and
    ``local_updates()`` on a gloo group; importing Lightning afterwards registers the strategies."""
    env = dict(os.environ, PORT=str(free_port()), PYTHONPATH=str(Path(__file__).parents[1]))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (proc.stdout + proc.stderr)[-4000:]


def test_the_lightning_names_are_loaded_on_first_use() -> None:
    import lightning_gradcomp
    from lightning_gradcomp.lightning.strategy import GradCompStrategy

    assert lightning_gradcomp.GradCompStrategy is GradCompStrategy
    assert "GradCompFabricStrategy" in dir(lightning_gradcomp)
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        lightning_gradcomp.NoSuchThing  # noqa: B018
