"""Compressed HSDP: FSDP2 inside a replica, and between replicas the compressed exchange of each step's
gradients (:func:`~lightning_gradcomp.register_fsdp` builds it; local updates on shards are :func:`lightning_gradcomp.local_updates` with
``mesh=``). Plain PyTorch (no Lightning here)."""

from lightning_gradcomp.fsdp.handle import FSDPHandle

__all__ = ["FSDPHandle"]
