"""A check that code does not read device values on the host, runnable on a machine without a GPU.

Inside :func:`no_host_reads`, under :func:`~lightning_gradcomp.core.device.accelerator_path`
(CPU tensors take the accelerator path), any ATen call that reads a value on the host or sizes a
result by the data fails: ``aten._local_scalar_dense`` (``bool(t)``, ``t.item()``, ``float(t)``),
``aten.nonzero``, ``aten.masked_select``, indexing with a boolean mask, and ``Tensor.tolist``. On a GPU
each of these is a host synchronisation.

Dispatch modes are per thread, so the check is entered around every piece of the exchange that runs
code, in whatever thread runs it (:func:`checking_the_exchange`): the hook's entry point and every step
of the engine's bucket protocol (compression, merging, decoding, memory).
"""

from __future__ import annotations

import threading
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Generator, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_gradcomp.core.device import accelerator_path
from lightning_gradcomp.ddp.hook import GradCompHookState
from lightning_gradcomp.exchange.engine import ExchangeEngine
from lightning_gradcomp.exchange.session import ExchangeSession

HOST_READS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::nonzero_static"}


class HostReadError(AssertionError):
    """A host read of a device value inside the checked code."""


class _NoHostReads(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        name = func._schema.name
        if name in HOST_READS:
            raise HostReadError(f"host synchronisation inside the exchange: {func}")
        if name == "aten::index" and any(isinstance(index, torch.Tensor) and index.dtype == torch.bool
                                         for index in (args[1] if len(args) > 1 else []) if index is not None):
            raise HostReadError("host synchronisation inside the exchange: indexing with a boolean mask")
        if name == "aten::segment_reduce" and not (kwargs or {}).get("unsafe", False):
            # its checks of the lengths read them on the host (inside the kernel, invisible to this mode)
            raise HostReadError("host synchronisation inside the exchange: segment_reduce without unsafe=True")
        return func(*args, **(kwargs or {}))


_inside = threading.local()


@contextmanager
def no_host_reads() -> Iterator[None]:
    """Fail on any host read in this thread (see the module's docstring; ``Tensor.tolist`` is caught
    only while :func:`checking_the_exchange` is active)."""
    _inside.depth = getattr(_inside, "depth", 0) + 1
    try:
        with _NoHostReads():
            yield
    finally:
        _inside.depth -= 1


def _checked_protocol(protocol: Generator) -> Generator:
    """``protocol`` with every step of it run under :func:`no_host_reads` (in whichever thread)."""
    result = None
    while True:
        with no_host_reads():
            try:
                turn = protocol.send(result)
            except StopIteration as stop:
                return stop.value
        result = yield turn


@contextmanager
def checking_the_exchange() -> Iterator[None]:
    """Take the accelerator path and check, in every thread, the hook's entry point and every step of
    every bucket protocol for host reads."""
    bucket: Callable = ExchangeEngine.bucket
    exchange_bucket: Callable = GradCompHookState.exchange_bucket  # DDP's hook
    exchange: Callable = ExchangeSession.exchange  # every mode's entry: register_fsdp's hook, local updates' syncs
    tolist: Callable = torch.Tensor.tolist

    def checked_tolist(self: torch.Tensor) -> Any:
        if getattr(_inside, "depth", 0):
            raise HostReadError("host synchronisation inside the exchange: Tensor.tolist")
        return tolist(self)

    def checked_bucket(self: ExchangeEngine, *args: Any, **kwargs: Any) -> Generator:
        return _checked_protocol(bucket(self, *args, **kwargs))

    def checked_exchange_bucket(self: GradCompHookState, *args: Any, **kwargs: Any) -> Any:
        with no_host_reads():
            return exchange_bucket(self, *args, **kwargs)

    def checked_exchange(self: ExchangeSession, *args: Any, **kwargs: Any) -> Any:
        with no_host_reads():
            return exchange(self, *args, **kwargs)

    with ExitStack() as stack:
        stack.enter_context(accelerator_path())
        ExchangeEngine.bucket = checked_bucket  # type: ignore[method-assign]
        GradCompHookState.exchange_bucket = checked_exchange_bucket  # type: ignore[method-assign]
        ExchangeSession.exchange = checked_exchange  # type: ignore[method-assign]
        torch.Tensor.tolist = checked_tolist  # type: ignore[method-assign]
        try:
            yield
        finally:
            ExchangeEngine.bucket = bucket  # type: ignore[method-assign]
            GradCompHookState.exchange_bucket = exchange_bucket  # type: ignore[method-assign]
            ExchangeSession.exchange = exchange  # type: ignore[method-assign]
            torch.Tensor.tolist = tolist  # type: ignore[method-assign]
