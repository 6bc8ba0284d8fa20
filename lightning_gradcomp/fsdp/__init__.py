"""Compressed HSDP: FSDP2 inside a replica, and between replicas the compressed exchange of each step's
gradients (:func:`register_fsdp`; local updates on shards are :func:`lightning_gradcomp.local_updates` with
``mesh=``). Plain PyTorch (no Lightning here)."""

from lightning_gradcomp.fsdp.handle import FSDPHandle, register_fsdp

__all__ = ["FSDPHandle", "register_fsdp"]
