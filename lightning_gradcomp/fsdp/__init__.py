"""Sharded models: FSDP2 inside a replica; between replicas the compressed exchange of gradients every
step (HSDP, :func:`register_fsdp`) or of outer gradients every ``H`` steps (local updates on shards,
:func:`local_updates` with ``mesh=``). Plain PyTorch (no Lightning here)."""

from lightning_gradcomp.fsdp.handle import FSDPHandle, register_fsdp
from lightning_gradcomp.fsdp.local_updates import ShardedLocalUpdateHandle, ShardedLocalUpdateLoop, local_updates

__all__ = ["FSDPHandle", "ShardedLocalUpdateHandle", "ShardedLocalUpdateLoop", "local_updates", "register_fsdp"]
