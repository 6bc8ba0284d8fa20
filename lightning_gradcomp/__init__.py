"""lightning-gradcomp: gradient compression for PyTorch Lightning DDP in one line.

``import lightning_gradcomp`` registers the ``"gradcomp"`` strategies with Lightning.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_gradcomp.compressors import (
    BF16,
    DGC,
    FP16,
    QSGD,
    Compressor,
    HardThreshold,
    NoCompression,
    PowerSGD,
    RandomK,
    TopK,
    get_compressor,
)
from lightning_gradcomp.exchange.drivers import CollectiveError
from lightning_gradcomp.hook import GradCompHookState, gradcomp_hook
from lightning_gradcomp.stats import StepStats
from lightning_gradcomp.simulation import GradCompSimStrategy
from lightning_gradcomp.strategy import GradCompStrategy

__version__ = "0.1.0"

GradCompStrategy.register_strategies(StrategyRegistry)
GradCompSimStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "BF16",
    "CollectiveError",
    "DGC",
    "FP16",
    "QSGD",
    "Compressor",
    "GradCompHookState",
    "GradCompSimStrategy",
    "GradCompStrategy",
    "HardThreshold",
    "NoCompression",
    "PowerSGD",
    "RandomK",
    "StepStats",
    "TopK",
    "get_compressor",
    "gradcomp_hook",
]
