"""CUDA's order of accumulation, emulated on the CPU, so that a machine without a GPU can check that every
rank decodes the same bucket.

On a GPU, ``index_add_`` and ``scatter_add_`` add the sources that land on one index by atomics, in an
order that changes from run to run — and from rank to rank: two ranks that decode the same gathered
payloads may round differently wherever three or more workers chose the same coordinate (two add in
either order to the same number). ``index_put_(accumulate=True)`` sorts its indices and adds each one's
repeats in a fixed order (PyTorch's deterministic kernel). On the CPU every one of these adds in order.

Inside :class:`AtomicOrder`, each ``index_add`` and ``scatter_add`` call adds its sources in a random
order drawn from the mode's generator, as atomics might; ``index_put_`` is left as it is. Code whose
results depend on the order of atomic adds gives different results under two seeds. ``index_copy`` and
``scatter`` with a repeated index (which of the writes lands is not fixed on a GPU either) fail at once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


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
        if func in (aten.index_copy_.default, aten.index_copy.default, aten.scatter_.src, aten.scatter.src,
                    aten.scatter_.value, aten.scatter.value):
            dim, index = args[1], args[2]
            if _repeats_along(index, dim):
                raise AssertionError(f"{func} with a repeated index: which write lands differs between runs on a GPU")
        return func(*args, **kwargs)


def _repeats_along(index: torch.Tensor, dim: int) -> bool:
    """Whether ``index`` repeats a value along ``dim`` (a 1-D index: anywhere)."""
    dim = 0 if index.dim() == 1 else dim
    length = index.shape[dim] - 1 if index.dim() else 0
    if length < 1:
        return False
    ordered = index.sort(dim=dim).values
    return bool((ordered.narrow(dim, 1, length) == ordered.narrow(dim, 0, length)).any())
