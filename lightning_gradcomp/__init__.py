"""lightning-gradcomp: gradient compression for PyTorch Lightning DDP in one line.

``import lightning_gradcomp`` registers the ``"gradcomp"`` strategies with Lightning's Trainer and with
Lightning Fabric. Three ways in:

* Trainer: ``Trainer(strategy="gradcomp")`` or ``Trainer(strategy=GradCompStrategy(compressor=...))``;
* Fabric: ``Fabric(strategy="gradcomp")`` or ``Fabric(strategy=GradCompFabricStrategy(compressor=...))``;
* plain PyTorch: ``gradcomp = lightning_gradcomp.register(ddp_model, compressor=TopK(0.01))``;
  local updates (DiLoCo): ``lightning_gradcomp.local_updates(model, optimizer, sync_every=100)``.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

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
from lightning_gradcomp.ddp.handle import GradCompHandle, register
from lightning_gradcomp.ddp.hook import GradCompHookState, exchange_failures, gradcomp_hook
from lightning_gradcomp.exchange.drivers import CollectiveError
from lightning_gradcomp.lightning.fabric import GradCompFabricStrategy
from lightning_gradcomp.lightning.simulation import GradCompSimStrategy
from lightning_gradcomp.lightning.strategy import GradCompStrategy
from lightning_gradcomp.local import LocalUpdates, SimulatedLocalUpdates, local_updates
from lightning_gradcomp.metrics.netmodel import Network
from lightning_gradcomp.metrics.stats import StepStats

__version__ = "0.2.0"

GradCompStrategy.register_strategies(StrategyRegistry)
GradCompSimStrategy.register_strategies(StrategyRegistry)
GradCompFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)

__all__ = [
    "BF16",
    "CollectiveError",
    "DGC",
    "DeMo",
    "EFSignSGD",
    "FP16",
    "FP4AllReduce",
    "FP8AllReduce",
    "QSGD",
    "Compressor",
    "GradCompFabricStrategy",
    "GradCompHandle",
    "GradCompHookState",
    "GradCompSimStrategy",
    "GradCompStrategy",
    "HardThreshold",
    "Int4AllReduce",
    "Int8AllReduce",
    "LocalUpdates",
    "Network",
    "NoCompression",
    "PowerSGD",
    "RandomK",
    "SignSGD",
    "SimulatedLocalUpdates",
    "SparseLoCo",
    "StepStats",
    "TernGrad",
    "TopK",
    "exchange_failures",
    "get_compressor",
    "gradcomp_hook",
    "local_updates",
    "register",
]
