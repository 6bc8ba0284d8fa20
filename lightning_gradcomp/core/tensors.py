"""Tensor helpers every layer uses: finiteness (without host reads on accelerators), norms, item sizes."""

from __future__ import annotations

import functools
import math
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from lightning_gradcomp.core.device import device_constant, host_reads_allowed

#: Whether a gradient is finite: a Python bool on CPU, a 0-d bool tensor on accelerators (no host sync).
Finite = Union[bool, Tensor]


def all_finite(tensor: Tensor) -> Finite:
    """Whether every element of ``tensor`` is finite, in one reduction pass.

    A sum is NaN or infinite whenever an element is (``inf - inf`` is NaN), so one sum (in fp32 for 16-bit
    inputs) decides; a sum that overflows although every element is finite (values near 1e38) also
    counts as non-finite, which the averaged result would be anyway. On CPU the answer is a bool; on
    other devices a 0-d tensor, so that the hook never waits for the device
    (:func:`~lightning_gradcomp.core.device.host_reads_allowed`).
    """
    total = tensor.sum(dtype=torch.float32) if tensor.dtype in (torch.float16, torch.bfloat16) else tensor.sum()
    finite = torch.isfinite(total)
    return bool(finite) if host_reads_allowed(tensor.device) else finite


def all_finite_many(tensors: Sequence[Tensor]) -> list[Finite]:
    """:func:`all_finite` of several tensors: on the CPU one sum each (the fastest pass there); elsewhere in
    a fixed number of operations (one multi-tensor max-norm, a few kernels), as 0-d tensors (views of one
    flag tensor)."""
    if not tensors:
        return []
    if host_reads_allowed(tensors[0].device):
        return [all_finite(tensor) for tensor in tensors]
    return list(finite_vector(tensors).unbind())


def finite_vector(tensors: Sequence[Tensor]) -> Tensor:
    """Whether each tensor is finite, as one bool vector on the tensors' device, in three operations: a
    multi-tensor max-norm (NaN or infinite exactly when an element is; it cannot overflow), a stack, a
    comparison (``NaN < inf`` is false); two for a single tensor. No host read."""
    peaks = torch._foreach_norm(list(tensors), math.inf)
    if len(peaks) == 1:
        return peaks[0].reshape(1).lt(math.inf)
    if len({peak.dtype for peak in peaks}) > 1:
        peaks = [peak.float() if peak.dtype != torch.float64 else peak for peak in peaks]
    return torch.stack(peaks).lt(math.inf)


def flag_vector(flags: Sequence[Tensor]) -> Tensor:
    """0-d flags as one vector: the vector they were unbound from when they are all of its elements in
    order (:func:`finite_vector`'s, no copy), else a stack."""
    base = flags[0]._base
    if base is not None and base.dim() == 1 and base.numel() == len(flags) and all(
            flag._base is base and flag.storage_offset() - base.storage_offset() == index * base.stride(0)
            for index, flag in enumerate(flags)):
        return base
    return torch.stack([flag.reshape(()) for flag in flags])


def keep_if_finite(new: Tensor, previous: Optional[Tensor], finite: Finite, in_place: bool = False
                   ) -> Optional[Tensor]:
    """``new`` if ``finite``, else ``previous`` (``None``: nothing yet): state is never replaced by the
    result of a non-finite gradient. With a tensor flag, an element-wise select (no host sync): one pass
    that reads both and writes the result, whatever the flag says (on a GPU the flag is not known on the
    host; for a bucket's residual, 12 bytes per fp32 element). ``in_place``: the select writes into ``new``
    (which the caller gives up), not into a tensor of its own: the same values, one buffer fewer."""
    if finite is True:
        return new
    if finite is False:
        return previous
    fallback = previous if previous is not None and previous.shape == new.shape else torch.zeros_like(new)
    return torch.where(finite, new, fallback, out=new) if in_place else torch.where(finite, new, fallback)


def both_finite(first: Finite, second: Finite) -> Finite:
    """``first and second`` for flags that are bools or 0-d bool tensors (no host read)."""
    if first is False or second is False:
        return False
    if first is True:
        return second
    if second is True:
        return first
    return first & second


def index_sum_(out: Tensor, index: Tensor, values: Tensor, alpha: float = 1.0) -> Tensor:
    r"""``out[index[i]] += alpha · values[i]`` for every ``i`` (``out`` 1-D), where ``index`` may repeat — several
    workers' coordinates summed in one operation — with the same sums on every run and on every rank.

    On the CPU this is ``index_add_``, which adds in order. On a GPU ``index_add_`` adds repeated indices by
    atomics in no fixed order, so ranks decoding the same payloads would drift apart (DDP never
    re-synchronises its replicas): there the values go through ``index_put_(accumulate=True)``, whose CUDA
    (and ROCm) kernel sorts the indices stably and adds each one's repeats in a fixed order (PyTorch's
    deterministic implementation, see ``torch.use_deterministic_algorithms``: the same bits on GPUs of one
    model and software stack; MPS adds by atomics even there). The values are scaled first (``alpha ≠ 1``):
    in fp32 and fp64 a coordinate with fewer than 32 repeats gets the numbers of ``index_add_`` in order; a
    16-bit output gets the product rounded to its dtype, and CUDA sums the repeats in fp32 before one
    rounding. The indices go as int64, which that kernel sorts.
    """
    if host_reads_allowed(out.device):
        return out.index_add_(0, index, values, alpha=alpha)
    return out.index_put_((index.long(),), values if alpha == 1.0 else values * alpha, accumulate=True)


def row_scatter_sum_(out: Tensor, index: Tensor, values: Tensor) -> Tensor:
    """``out[r, index[r, j]] += values[r, j]`` for every ``r, j`` (``out`` 2-D, ``index`` and ``values`` of
    one shape), where a row's indices may repeat, with the same sums on every run and on every rank: on
    the CPU ``scatter_add_`` along dim 1, on accelerators ``index_put_(accumulate=True)`` with the row
    numbers broadcast against ``index`` (see :func:`index_sum_`). The same sums on both paths for fp32 and
    fp64 ``out`` (DeMo sums in fp32); in 16 bits the CPU's ``scatter_add_`` accumulates in fp32 first."""
    if host_reads_allowed(out.device):
        return out.scatter_add_(1, index, values)
    rows = device_constant(("row-numbers", out.shape[0]), out.device,
                           lambda: torch.arange(out.shape[0]).unsqueeze(1))
    return out.index_put_((rows, index.long()), values, accumulate=True)


def squared_norm(tensor: Tensor) -> Tensor:
    """``‖tensor‖²`` as a 0-d float64 tensor on the tensor's device (one pass, no copy)."""
    return torch.linalg.vector_norm(tensor).double() ** 2


@functools.lru_cache(maxsize=None)
def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()
