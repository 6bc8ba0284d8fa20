"""Sharded models: FSDP2 inside a replica, the compressed exchange between replicas (HSDP). Plain
PyTorch (no Lightning here)."""

from lightning_gradcomp.fsdp.handle import FSDPHandle, register_fsdp

__all__ = ["FSDPHandle", "register_fsdp"]
