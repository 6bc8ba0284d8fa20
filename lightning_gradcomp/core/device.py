"""What the exchange may ask of the device: host reads, state dtypes, shared random draws.

On an accelerator, reading a value on the host (``bool(t)``, ``t.item()``, ``t.tolist()``, a size that
depends on the data such as ``nonzero``'s) waits for every kernel queued before it: a host
synchronisation. Inside a DDP communication hook that stalls backward once per read. The compressors
and the engine therefore choose between two code paths:

* where :func:`host_reads_allowed` (on CPU, where a read costs nothing), finiteness flags are Python
  bools and data-dependent sizes prune work;
* everywhere else, flags stay 0-d device tensors and every size is fixed before the data is seen.
  Compressors whose payload size depends on the data (the hard threshold) still read one count per
  bucket; all others issue no host synchronisation at all.

:func:`accelerator_path` makes CPU tensors take the accelerator path, so that tests on a machine
without a GPU check that path (for instance with a ``TorchDispatchMode`` that fails on
``aten._local_scalar_dense`` and ``aten.nonzero``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Hashable, Iterator

import torch
from torch import Tensor

_forced_accelerator_path = 0


def host_reads_allowed(device: torch.device) -> bool:
    """Whether code may read values of tensors on ``device`` on the host (CPU only, unless
    :func:`accelerator_path` is active)."""
    return device.type == "cpu" and not _forced_accelerator_path


@contextmanager
def accelerator_path() -> Iterator[None]:
    """Run the accelerator code path on CPU tensors too (for tests): no host reads, fixed sizes.

    Process-wide (the exchange thread sees it as well); nests."""
    global _forced_accelerator_path
    _forced_accelerator_path += 1
    try:
        yield
    finally:
        _forced_accelerator_path -= 1


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of residuals and compressor state for gradients of ``dtype``: fp32, or fp64 for fp64.

    Error feedback adds small gradients to a residual that can be much larger; in a 16-bit residual the
    sum rounds the gradient away (bf16 keeps 8 significant bits). Only what crosses the wire is cast."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def shared_draw_generator_device() -> torch.device:
    """Where draws shared by every worker are made (shared Random-k indices, PowerSGD's first ``Q``):
    the CPU. A device generator's stream depends on the GPU model (Philox's launch geometry), so two GPU
    types would draw different values and the all-reduce would sum unrelated coordinates; CPU draws are
    identical everywhere, and a CPU simulation draws what a GPU run draws."""
    return torch.device("cpu")


def to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor`` (on the CPU) on ``device`` without blocking the host: through pinned memory on CUDA."""
    if device.type == "cpu":
        return tensor
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


#: constants kept per (key, device) by :func:`device_constant`
_CONSTANTS: dict[tuple[Hashable, str], Any] = {}


def device_constant(key: Hashable, device: torch.device, build: Callable[[], Any]) -> Any:
    """A constant tensor (or tuple of tensors) that ``build()`` makes on the CPU, on ``device``, built
    once per ``(key, device)`` and kept; copied with :func:`to_device`, so no host synchronisation even
    the first time. Past 4096 keys the store starts over."""
    slot = (key, str(device))
    value = _CONSTANTS.get(slot)
    if value is None:
        if len(_CONSTANTS) >= 4096:
            _CONSTANTS.clear()
        built = build()
        value = tuple(to_device(part, device) for part in built) if isinstance(built, tuple) else \
            to_device(built, device)
        _CONSTANTS[slot] = value
    return value
