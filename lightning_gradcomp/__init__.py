"""lightning-gradcomp: gradient compression for PyTorch Lightning DDP in one line.

``import lightning_gradcomp`` registers the ``"gradcomp"`` strategies with Lightning's Trainer and with
Lightning Fabric, without importing Lightning itself: the registration happens when Lightning is (or
already was) imported, and the Lightning classes below are loaded when first used (see
:mod:`lightning_gradcomp._registration`). A plain-PyTorch script never loads Lightning. Three ways in:

* Trainer: ``Trainer(strategy="gradcomp")`` or ``Trainer(strategy=GradCompStrategy(compressor=...))``;
* Fabric: ``Fabric(strategy="gradcomp")`` or ``Fabric(strategy=GradCompFabricStrategy(compressor=...))``;
* plain PyTorch: ``gradcomp = lightning_gradcomp.register(ddp_model, compressor=TopK(0.01))``;
  local updates (DiLoCo): ``lightning_gradcomp.local_updates(model, optimizer, sync_every=100)``.
"""

import importlib
from typing import Any

from lightning_gradcomp import _registration
from lightning_gradcomp.compressors import (
    BF16,
    DGC,
    FP16,
    DeMo,
    QSGD,
    Compressor,
    EFSignSGD,
    FP4AllReduce,
    FP8AllReduce,
    HardThreshold,
    Int4AllReduce,
    Int8AllReduce,
    NoCompression,
    PowerSGD,
    RandomK,
    SignSGD,
    SparseLoCo,
    TernGrad,
    TopK,
    get_compressor,
)
from lightning_gradcomp.exchange.checkpoint import CheckpointTimeout
from lightning_gradcomp.ddp.handle import GradCompHandle
from lightning_gradcomp.ddp.hook import GradCompHookState, exchange_failures, gradcomp_hook
from lightning_gradcomp.exchange.agreement import ScheduleMismatch, SettingsMismatch
from lightning_gradcomp.exchange.waits import WaitTimeout
from lightning_gradcomp.exchange.drivers import CollectiveError
from lightning_gradcomp.exchange.session import ExchangeSession
from lightning_gradcomp.exchange.options import ExchangeOptions
from lightning_gradcomp.fsdp import FSDPHandle
from lightning_gradcomp.local import FaultTolerance, LocalUpdates, SimulatedLocalUpdates
from lightning_gradcomp.metrics.netmodel import Network
from lightning_gradcomp.metrics.stats import StepStats
from lightning_gradcomp.wiring import local_updates, register, register_fsdp

__version__ = "0.2.0"

#: The public names that need Lightning, and the modules they come from (imported when first used).
LIGHTNING_NAMES = _registration.STRATEGY_CLASSES


def __getattr__(name: str) -> Any:
    """The Lightning strategies, imported when first asked for (``lightning_gradcomp.GradCompStrategy``)."""
    module = LIGHTNING_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_gradcomp' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(LIGHTNING_NAMES))


_registration.install()

__all__ = [
    "BF16",
    "CheckpointTimeout",
    "CollectiveError",
    "Compressor",
    "DeMo",
    "DGC",
    "EFSignSGD",
    "exchange_failures",
    "ExchangeOptions",
    "ExchangeSession",
    "FaultTolerance",
    "FP16",
    "FP4AllReduce",
    "FP8AllReduce",
    "FSDPHandle",
    "get_compressor",
    "gradcomp_hook",
    "GradCompFabricFSDPStrategy",
    "GradCompFabricStrategy",
    "GradCompFSDPStrategy",
    "GradCompHandle",
    "GradCompHookState",
    "GradCompSimStrategy",
    "GradCompStrategy",
    "HardThreshold",
    "Int4AllReduce",
    "Int8AllReduce",
    "local_updates",
    "LocalUpdates",
    "Network",
    "NoCompression",
    "PowerSGD",
    "QSGD",
    "RandomK",
    "register",
    "register_fsdp",
    "ScheduleMismatch",
    "SettingsMismatch",
    "SignSGD",
    "SimulatedLocalUpdates",
    "SparseLoCo",
    "StepStats",
    "TernGrad",
    "TopK",
    "WaitTimeout",
]
