"""Lightning callbacks that drive and observe compression (a public import path; they live in
:mod:`lightning_gradcomp.lightning.callbacks`)."""

from lightning_gradcomp.lightning.callbacks import AdaptiveCompression, CompressionMonitor, DGCWarmup, GradientNormTrigger

__all__ = ["AdaptiveCompression", "CompressionMonitor", "DGCWarmup", "GradientNormTrigger"]
