"""Local-update training (DiLoCo and its family): workers take ``H`` optimizer steps alone, then exchange
compressed outer gradients through the exchange session; whole models and FSDP2 shards alike. Plain PyTorch; the Lightning strategies build
on it (``local_updates=`` of :class:`~lightning_gradcomp.GradCompStrategy`)."""

import importlib
from typing import Any

from lightning_gradcomp.local.config import LocalUpdates, diloco_outer_optimizer
from lightning_gradcomp.local.fault_tolerance import FaultTolerance
from lightning_gradcomp.local.handle import LocalUpdateHandle
from lightning_gradcomp.local.loop import LocalUpdateLoop
from lightning_gradcomp.local.outer import OuterModel
from lightning_gradcomp.local.sharded import ShardedLocalUpdateHandle, ShardedLocalUpdateLoop
from lightning_gradcomp.local.simulated import SimulatedLocalUpdates

__all__ = ["FaultTolerance", "LocalUpdateHandle", "LocalUpdateLoop", "LocalUpdates", "OuterModel",
           "ShardedLocalUpdateHandle", "ShardedLocalUpdateLoop", "SimulatedLocalUpdates", "diloco_outer_optimizer",
           "local_updates"]


def __getattr__(name: str) -> Any:
    """``local_updates``, kept at this public path: it is the wiring layer's (:mod:`lightning_gradcomp.wiring`), which
    sits above this package, so it is looked up when first asked for, never imported with this package."""
    if name == "local_updates":
        return importlib.import_module("lightning_gradcomp.wiring").local_updates
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
