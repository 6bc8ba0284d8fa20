"""CUDA's order of accumulation, emulated on the CPU, so that a machine without a GPU can check that every
rank decodes the same bucket.

On a GPU, ``index_add_`` and ``scatter_add_`` add the sources that land on one index by atomics, in an
order that changes from run to run — and from rank to rank: two ranks that decode the same gathered
payloads may round differently wherever three or more workers chose the same coordinate (two add in
either order to the same number). ``index_put_(accumulate=True)`` sorts its indices and adds each one's
repeats in a fixed order (PyTorch's deterministic kernel). On the CPU ``index_add_`` and ``scatter_add_``
add in order, and so does ``index_put_(accumulate=True)`` below 32768 values or on one thread (above,
with several threads, it adds by atomics too).

Inside :class:`AtomicOrder`, each ``index_add`` and ``scatter_add`` call adds its sources in a random
order drawn from the mode's generator, as atomics might; ``index_put_(accumulate=True)`` runs in PyTorch's
deterministic mode (sorted and in order on the CPU too, as on a GPU). Code whose results depend on the
order of atomic adds gives different results under two seeds. Operations that are not deterministic on a
GPU whatever their inputs (``put_``, ``scatter_reduce``, ``index_reduce``, ``bincount``, ``histc``, a
floating-point ``cumsum``) fail at once, and so do ``index_copy``, ``scatter`` and ``index_put_`` without
accumulation given a repeated index and several values (which of the writes lands is not fixed on a GPU
either).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.utils.deterministic
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

#: operations whose results on a GPU depend on the order of atomics whatever their inputs (PyTorch's
#: ``torch.use_deterministic_algorithms`` lists them)
NOT_DETERMINISTIC = {"put_", "put", "scatter_reduce_", "scatter_reduce", "index_reduce_", "index_reduce", "bincount",
                     "histc"}


class AtomicOrder(TorchDispatchMode):
    """Every ``index_add``/``scatter_add`` adds its sources in a random order (see the module)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(seed)
        self.shuffled = 0  #: calls whose sources were shuffled

    def _order(self, count: int, device: torch.device) -> torch.Tensor:
        self.shuffled += 1
        return torch.randperm(count, generator=self.generator).to(device)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in (aten.index_add_.default, aten.index_add.default, aten.index_add.out):
            target, dim, index, source = args[:4]
            order = self._order(index.numel(), index.device)
            return func(target, dim, index[order], source.index_select(dim, order), *args[4:], **kwargs)
        if func in (aten.scatter_add_.default, aten.scatter_add.default, aten.scatter_add.out):
            target, dim, index, source = args[:4]
            source = source[tuple(slice(0, size) for size in index.shape)]  # scatter_add reads src up to index
            order = self._order(index.shape[dim], index.device)
            return func(target, dim, index.index_select(dim, order), source.index_select(dim, order), *args[4:],
                        **kwargs)
        if func in (aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default):
            accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
            if accumulate:  # sorted and in order, as CUDA's kernel (and not by atomics on several CPU threads)
                with deterministic_algorithms():
                    return func(*args, **kwargs)
            indices = [index for index in args[1] if index is not None]
            if (len(indices) == 1 and indices[0].dtype != torch.bool and args[2].numel() > 1
                    and _repeats_along(indices[0].reshape(-1), 0)):  # one value written everywhere lands alike
                raise AssertionError(f"{func} with a repeated index: which write lands differs between runs on a GPU")
        if func in (aten.index_copy_.default, aten.index_copy.default, aten.scatter_.src, aten.scatter.src):
            dim, index = args[1], args[2]
            if _repeats_along(index, dim):
                raise AssertionError(f"{func} with a repeated index: which write lands differs between runs on a GPU")
        name = func._schema.name.removeprefix("aten::")
        if name in NOT_DETERMINISTIC or (name == "cumsum" and args[0].is_floating_point()):
            raise AssertionError(f"{func} is not deterministic on a GPU")
        return func(*args, **kwargs)


def _repeats_along(index: torch.Tensor, dim: int) -> bool:
    """Whether ``index`` repeats a value along ``dim`` (a 1-D index: anywhere)."""
    dim = 0 if index.dim() == 1 else dim
    length = index.shape[dim] - 1 if index.dim() else 0
    if length < 1:
        return False
    ordered = index.sort(dim=dim).values
    return bool((ordered.narrow(dim, 1, length) == ordered.narrow(dim, 0, length)).any())


@contextlib.contextmanager
def deterministic_algorithms() -> Iterator[None]:
    """PyTorch's deterministic mode with uninitialised memory filled (NaN for floats), as Lightning's
    ``Trainer(deterministic=True)`` sets it; restored after."""
    enabled, fill = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled)
        torch.utils.deterministic.fill_uninitialized_memory = fill
