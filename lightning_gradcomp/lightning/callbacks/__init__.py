"""Lightning callbacks that drive and observe compression."""

from lightning_gradcomp.lightning.callbacks.adaptive import AdaptiveCompression, GradientNormTrigger
from lightning_gradcomp.lightning.callbacks.monitor import CompressionMonitor
from lightning_gradcomp.lightning.callbacks.warmup import DGCWarmup

__all__ = ["AdaptiveCompression", "CompressionMonitor", "DGCWarmup", "GradientNormTrigger"]
