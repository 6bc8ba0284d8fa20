"""Lightning callbacks that drive and observe compression."""

from lightning_gradcomp.callbacks.adaptive import AdaptiveCompression, GradientNormTrigger
from lightning_gradcomp.callbacks.monitor import CompressionMonitor
from lightning_gradcomp.callbacks.warmup import DGCWarmup

__all__ = ["AdaptiveCompression", "CompressionMonitor", "DGCWarmup", "GradientNormTrigger"]
