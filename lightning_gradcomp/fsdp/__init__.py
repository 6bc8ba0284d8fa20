"""Compressed HSDP: FSDP2 inside a replica, and between replicas the compressed exchange of each step's
gradients (:func:`~lightning_gradcomp.register_fsdp` builds it; local updates on shards are :func:`lightning_gradcomp.local_updates` with
``mesh=``). Plain PyTorch (no Lightning here)."""

import importlib
from typing import Any

from lightning_gradcomp.fsdp.handle import FSDPHandle

__all__ = ["FSDPHandle", "register_fsdp"]


def __getattr__(name: str) -> Any:
    """``register_fsdp``, kept at this public path: it is the wiring layer's (:mod:`lightning_gradcomp.wiring`), which
    sits above this package, so it is looked up when first asked for, never imported with this package."""
    if name == "register_fsdp":
        return importlib.import_module("lightning_gradcomp.wiring").register_fsdp
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
