"""What the exchange may ask of the device: host reads, state dtypes, shared random draws.

On an accelerator, reading a value on the host (``bool(t)``, ``t.item()``, ``t.tolist()``, a size that
depends on the data such as ``nonzero``'s) waits for every kernel queued before it: a host
synchronisation. Inside a DDP communication hook that stalls backward once per read. The compressors
and the engine therefore choose between two code paths:

* where :func:`host_reads_allowed` (on CPU, where a read costs nothing), finiteness flags are Python
  bools and data-dependent sizes prune work;
* everywhere else, flags stay 0-d device tensors and every size is fixed before the data is seen.
  Compressors whose payload size depends on the data (the hard threshold) still read their counts
  (the bucket's counts once, then every worker's from the engine's header); all others issue no host
  synchronisation at all.

:func:`accelerator_path` makes CPU tensors take the accelerator path, so that tests on a machine
without a GPU check that path (for instance with a ``TorchDispatchMode`` that fails on
``aten._local_scalar_dense`` and ``aten.nonzero``).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Hashable, Iterator, Optional

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


@contextmanager
def on_stream(stream: "Optional[torch.cuda.Stream]") -> Iterator[None]:
    """Make ``stream`` current (nothing for ``None``), with its device made current first.

    On a thread whose current device is another one (a new thread's is 0: the exchange thread, gloo's
    callback threads), ``torch.cuda.stream`` alone would switch to the stream's device and back to
    device 0 on leaving, which creates a CUDA context on device 0 in every process. ``torch.cuda.device``
    restores the previous device only where that device already has a context."""
    if stream is None:
        yield
        return
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        yield


_matmul_lock = threading.Lock()
_matmul_depth = 0
_matmul_saved: Any = None


@contextmanager
def full_precision_matmuls() -> Iterator[None]:
    """fp32 matrix products inside, whatever ``torch.set_float32_matmul_precision`` says (``"high"``: TF32 on
    CUDA, which Lightning suggests on recent GPUs; ``"medium"``: bf16 on the CPU's oneDNN).

    PowerSGD's Gram–Schmidt and DeMo's DCT round trip need the fp32 products: TF32 keeps 10 bits of mantissa,
    so ``P̂`` is no longer orthonormal and ``IDCT(DCT(x)) ≠ x``, and error feedback then carries the
    difference. PyTorch's setting is process-wide, not per thread, so it is changed for the span of the
    products only (a few kernel launches) and restored when the last user leaves; a product another thread
    launches meanwhile runs in fp32 too (slower, not less accurate)."""
    global _matmul_depth, _matmul_saved
    with _matmul_lock:
        if _matmul_depth == 0:
            _matmul_saved = _read_matmul_precision()
            _write_matmul_precision(None)
        _matmul_depth += 1
    try:
        yield
    finally:
        with _matmul_lock:
            _matmul_depth -= 1
            if _matmul_depth == 0:
                _write_matmul_precision(_matmul_saved)


def _matmul_backends() -> list[Any]:
    return [backend for backend in (getattr(torch.backends, "cuda", None), getattr(torch.backends, "mkldnn", None))
            if backend is not None and hasattr(getattr(backend, "matmul", None), "fp32_precision")]


def _read_matmul_precision() -> tuple[str, Any]:
    """The matmul precision as the user set it: through the legacy call where it answers, else per backend
    (PyTorch refuses the legacy read once its newer per-backend settings were used)."""
    try:
        return "legacy", torch.get_float32_matmul_precision()
    except RuntimeError:
        return "backends", [backend.matmul.fp32_precision for backend in _matmul_backends()]


def _write_matmul_precision(saved: Optional[tuple[str, Any]]) -> None:
    """Restore ``saved`` (:func:`_read_matmul_precision`), or with ``None`` make every product fp32 through the
    same API the user's setting was read with."""
    kind, value = saved if saved is not None else (_matmul_saved[0], None)
    if kind == "legacy":
        torch.set_float32_matmul_precision(value if value is not None else "highest")
        return
    for backend, precision in zip(_matmul_backends(), value if value is not None else
                                  ["ieee"] * len(_matmul_backends())):
        backend.matmul.fp32_precision = precision
