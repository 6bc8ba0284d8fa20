"""Choosing the ``k`` largest magnitudes: exactly, or through a threshold estimated from a sample.

Exact ``torch.topk`` on a large tensor costs far more than a pass over memory (hundreds of ms for 10M
elements on CPU). Deep Gradient Compression (Lin et al., ICLR 2018, §3 and its reference code) instead
estimates the threshold from a random sample of about 1% of the elements, selects everything above it
with one comparison, and corrects the rare case where far too many elements pass.

:func:`sampled_topk` does this so that its result is *exactly* Top-k whenever the estimated threshold
lets at least ``k`` elements through (then the true top ``k`` are among the candidates, and a
``topk`` over the few candidates picks them). The threshold is taken at ``oversample`` times the target
count of the sample, so this is the usual case; when fewer pass, the threshold is lowered to a lower
rank of the same sample and the comparison repeated.
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


def exact_topk(magnitude: Tensor, k: int) -> Tensor:
    """Indices of the ``k`` largest entries of ``magnitude`` (unsorted)."""
    return torch.topk(magnitude, k, sorted=False).indices


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
