"""Scratch tensors for a compressor's temporaries, reused from call to call on CPU.

On CPU, a fresh tensor of tens of MB is a fresh ``mmap`` whose pages fault in as they are first written:
measured here, allocating a 40 MB temporary costs about two extra passes over memory, more than the
arithmetic that fills it. :func:`scratch` hands out a buffer per ``(tag, dtype)`` and thread instead,
grown to the largest size asked for and kept for the next call. A scratch tensor is valid until the
next call with the same tag in the same thread, so it must not outlive the compressor call that asked
for it (never part of a payload). On accelerators the caching allocator already reuses memory, and a
fresh tensor is returned.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

_local = threading.local()


def scratch(tag: str, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A 1-D tensor of ``numel`` elements, uninitialised; on CPU the same memory for the same ``tag``
    and ``dtype`` in this thread (see the module's docstring)."""
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    pool: dict[tuple[str, torch.dtype], Tensor] = _local.__dict__.setdefault("pool", {})
    buffer = pool.get((tag, dtype))
    if buffer is None or buffer.numel() < numel:
        buffer = pool[(tag, dtype)] = torch.empty(numel, dtype=dtype)
    return buffer[:numel]

