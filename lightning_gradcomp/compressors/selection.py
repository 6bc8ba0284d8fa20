"""Choosing the ``k`` largest magnitudes: exactly, by block maxima, or through a sampled threshold.

Exact ``torch.topk`` over a large tensor costs far more than a pass over memory (about 20 copies of the
tensor on CPU). Three methods return the indices of the ``k`` largest ``|x_i|`` (unsorted):

* ``"blocks"`` (:func:`block_topk`, the default): split the tensor into blocks of ``b`` elements, take
  each block's peak ``max |x_i|`` (a max and a min per block, no ``|x|`` materialised), keep the ``k``
  blocks with the largest peaks and choose among their ``k·b`` elements. The result is *always* an
  exact top-``k`` set: with ``β`` the smallest kept peak, the ``k`` kept blocks hold at least ``k``
  elements ``>= β``, so the ``k``-th largest magnitude ``τ >= β``, and any element above ``β`` lies in
  a block whose peak exceeds ``β``, which is kept. Blocks are 64 consecutive elements at densities up
  to 1/512, else ``b ≈ 1/√density`` elements apart, which balances the ``d/b`` peaks against the
  ``k·b`` candidates (:func:`block_layout`). No host synchronisation on accelerators.
* ``"sampled"`` (:func:`sampled_topk`): Deep Gradient Compression's threshold estimated from a random
  sample of about 1% of the elements (Lin et al., ICLR 2018, §3 and its reference code), refined so
  that the result is exactly Top-k whenever at least ``k`` elements pass (then the true top ``k`` are
  among the candidates, and a ``topk`` over the few candidates picks them), the usual case; when
  fewer pass, the threshold is lowered to a lower rank of the same sample and the comparison repeated.
* ``"exact"``: ``torch.topk`` over ``|x|``.

The three choose the same set up to ties at the ``k``-th magnitude, so training is bit for bit the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


@dataclass(frozen=True)
class Selection:
    """The outcome of a selection: the chosen indices and how many elements passed the threshold."""

    indices: Tensor
    candidates: int


#: The selection methods, for the ``selection`` argument of Top-k and DGC.
SELECTIONS = ("blocks", "sampled", "exact")


def check_selection(selection: str) -> str:
    """Validate a ``selection`` argument."""
    if selection not in SELECTIONS:
        raise ValueError(f"`selection` must be one of {', '.join(repr(s) for s in SELECTIONS)}, got {selection!r}")
    return selection


def topk_indices(values: Tensor, k: int, selection: str = "blocks", generator: Optional[torch.Generator] = None,
                 sample_fraction: float = 0.01) -> Tensor:
    """Indices of the ``k`` largest ``|values_i|`` of a 1-D tensor (unsorted), by ``selection``."""
    if selection == "blocks":
        return block_topk(values, k)
    if selection == "sampled":
        return sampled_topk(values.abs(), k, generator, sample_fraction=sample_fraction).indices
    return exact_topk(values.abs(), k)


def exact_topk(magnitude: Tensor, k: int) -> Tensor:
    """Indices of the ``k`` largest entries of ``magnitude`` (unsorted)."""
    return torch.topk(magnitude, k, sorted=False).indices


#: Contiguous blocks of this many elements where the density allows (see :func:`block_topk`).
CONTIGUOUS_BLOCK = 64


def block_layout(k: int, numel: int) -> tuple[int, bool]:
    """``(b, contiguous)`` for :func:`block_topk`: contiguous blocks of 64 elements at densities up to
    1/512 (row maxima are one pass there, and the kept blocks are read as whole cache lines), else
    strided blocks of a power of two near ``1/√density`` in [8, 32] (``k·b`` candidates against ``d/b``
    peaks), whose maxima are vectorised across blocks."""
    if k * CONTIGUOUS_BLOCK <= numel // 8:
        return CONTIGUOUS_BLOCK, True
    return int(min(32, max(8, 2 ** round(math.log2(math.sqrt(numel / k)))))), False


def peak_magnitudes(grid: Tensor, dim: int) -> Tensor:
    """``max |x|`` along ``dim``: a max and a min (vectorised reductions), no ``|x|`` materialised."""
    return torch.maximum(grid.amax(dim=dim), grid.amin(dim=dim).neg_())


def _with_tail(values: Tensor, full: int, candidates: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """Append the elements after the last whole block (``values[full:]``) to the candidates."""
    if full == values.numel():
        return candidates, positions
    tail = torch.arange(full, values.numel(), device=values.device)
    return torch.cat([candidates, values[full:]]), torch.cat([positions, tail])


def block_topk(values: Tensor, k: int, prune: Optional[bool] = None) -> Tensor:
    """Indices of the ``k`` largest ``|values_i|`` (unsorted), chosen among the ``k`` blocks with the
    largest peaks and the tail (see the module's docstring for why the set is exact).

    Blocks (:func:`block_layout`) are either ``b`` consecutive elements (``x`` viewed as rows of ``b``)
    or ``b`` elements ``m = d/b`` apart (``x`` viewed as ``b`` rows of ``m``, block ``j`` is column
    ``j``); the last ``d mod b`` elements are always candidates. Cost on CPU at density 0.001: about 2
    copies of the tensor, against about 20 for ``torch.topk``. Falls back to exact ``topk`` where blocks
    would not prune (``k·b > d/4``).

    ``prune`` (default: on CPU only) drops the candidates below the smallest kept peak before the last
    ``topk``; its size depends on the data, a host synchronisation on accelerators, where the last
    ``topk`` runs over all ``k·b`` candidates instead. Both give a top-``k`` set.
    """
    numel = values.numel()
    block, contiguous = block_layout(k, numel)
    if k * block > numel // 4:
        return exact_topk(values.abs(), k)
    count = numel // block
    full = count * block
    offsets = torch.arange(block, device=values.device)
    if contiguous:
        grid = values[:full].view(count, block)
        top = torch.topk(peak_magnitudes(grid, 1), k, sorted=False)
        candidates = grid.index_select(0, top.indices).view(-1)
        positions = (top.indices.unsqueeze(1) * block + offsets).view(-1)
    else:
        grid = values[:full].view(block, count)
        top = torch.topk(peak_magnitudes(grid, 0), k, sorted=False)
        candidates = grid.index_select(1, top.indices).view(-1)
        positions = (top.indices.unsqueeze(0) + offsets.unsqueeze(1) * count).view(-1)
    candidates, positions = _with_tail(values, full, candidates, positions)
    magnitude = candidates.abs().to(torch.float32)
    if values.device.type == "cpu" if prune is None else prune:
        passed = torch.nonzero(magnitude >= top.values.min()).view(-1)
        if passed.numel() >= k:  # always, unless the tensor holds NaN
            positions, magnitude = positions.index_select(0, passed), magnitude.index_select(0, passed)
    return positions[torch.topk(magnitude, k, sorted=False).indices]


def threshold_indices(values: Tensor, threshold: float) -> Tensor:
    """Indices of every ``|values_i| >= threshold``, in increasing order (as ``torch.nonzero``).

    Blocks of 64 consecutive elements whose peak is below the threshold are skipped: one read pass for
    the peaks, then work on the blocks that hold a selected element only (all of them, at worst).
    """
    numel = values.numel()
    count = numel // CONTIGUOUS_BLOCK
    full = count * CONTIGUOUS_BLOCK
    grid = values[:full].view(count, CONTIGUOUS_BLOCK)
    blocks = torch.nonzero(peak_magnitudes(grid, 1) >= threshold).view(-1)
    if blocks.numel() * 4 > count:  # dense: pruning would not pay
        return torch.nonzero(values.abs() >= threshold).view(-1)
    offsets = torch.arange(CONTIGUOUS_BLOCK, device=values.device)
    candidates, positions = _with_tail(values, full, grid.index_select(0, blocks).view(-1),
                                       (blocks.unsqueeze(1) * CONTIGUOUS_BLOCK + offsets).view(-1))
    return positions[torch.nonzero(candidates.abs() >= threshold).view(-1)]


def sampled_topk(
    magnitude: Tensor,
    k: int,
    generator: Optional[torch.Generator] = None,
    sample_fraction: float = 0.01,
    min_sample_hits: int = 16,
    oversample: float = 1.5,
    max_tries: int = 4,
) -> Selection:
    """Indices of (at most, and almost always exactly) the ``k`` largest entries of ``magnitude``.

    Args:
        magnitude: 1-D non-negative tensor (``|p|``).
        k: number of elements wanted.
        generator: source of the sample positions.
        sample_fraction: share of elements sampled (DGC uses 0.1% to 1%).
        min_sample_hits: the sample is enlarged until about this many of its elements are expected
            above the threshold, so that the estimate is stable at any density.
        oversample: the threshold is the magnitude of the ``oversample * k``-th largest element
            expected, so that at least ``k`` pass.
        max_tries: times the threshold is lowered (to the sample's next ``oversample``-times larger
            rank) when fewer than ``k`` elements pass; after that, exact ``topk``.

    Small tensors (where the sample would be the whole tensor) use exact ``topk``.
    """
    numel = magnitude.numel()
    density = k / numel
    samples = max(math.ceil(sample_fraction * numel), math.ceil(min_sample_hits / density))
    if samples >= numel // 2 or k >= numel // 4:
        return Selection(exact_topk(magnitude, k), numel)
    positions = torch.randint(0, numel, (samples,), generator=generator, device=magnitude.device)
    hits = max(1, math.ceil(samples * density * oversample))
    deepest = min(samples, math.ceil(hits * oversample**max_tries))
    ranked = torch.topk(magnitude[positions], deepest, sorted=True).values  # the sample's largest, descending
    for _ in range(max_tries + 1):
        if hits > deepest:
            return Selection(exact_topk(magnitude, k), numel)
        candidates = torch.nonzero(magnitude >= ranked[hits - 1]).view(-1)
        if candidates.numel() >= k:
            break
        hits = math.ceil(hits * oversample)  # too few passed: a lower threshold from the same sample
    else:
        return Selection(exact_topk(magnitude, k), numel)
    count = candidates.numel()
    if count > k:
        candidates = candidates[torch.topk(magnitude[candidates], k, sorted=False).indices]
    return Selection(candidates, count)
