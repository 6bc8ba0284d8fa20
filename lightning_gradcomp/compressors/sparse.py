"""Sparsifiers: send some coordinates, as values and indices.

Wire format of a sparse payload: ``values`` in the gradient's dtype and ``indices`` as int32 (a single
tensor of 2**31 elements or more is refused by the hook), so an fp32 gradient at density ``k/d`` costs
``8k`` bytes instead of ``4d``: density 0.01 is a 50x ratio, 0.001 a 500x ratio (Harris 2020, §3.1.1; see docs/references.md).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Literal, Optional, Sequence

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import (
    CompressContext,
    Compressor,
    Payload,
    check_bool,
    check_density,
    sparse_count,
)
from lightning_gradcomp.compressors.selection import (
    CONTIGUOUS_BLOCK,
    check_selection,
    peak_magnitudes,
    segmented_topk,
    select_threshold,
    select_topk,
)
from lightning_gradcomp.core.checks import check_number
from lightning_gradcomp.core.device import host_reads_allowed, shared_draw_generator_device, to_device
from lightning_gradcomp.core.protocol import Gather, Mean, Round, SegmentsOutcome, SegmentsProtocol, stacked
from lightning_gradcomp.core.segments import Segments, SegmentsState, index_dtype
from lightning_gradcomp.core.tensors import index_sum_


class _ValuesAndIndices(Compressor):
    """Shared wire format and decoder of the gathered sparsifiers."""

    def part_dtypes(self, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        return (dtype, torch.int32)

    def payload_numels(self, numel: int, count: int) -> tuple[int, ...]:
        return (count, count)

    @staticmethod
    def _payload(tensor: Tensor, indices: Tensor, ctx: CompressContext) -> Payload:
        """The values at ``indices`` (in the gradient's dtype) and the indices as int32."""
        values = tensor[indices].to(ctx.wire_dtype(tensor))
        return Payload((values, indices.to(torch.int32)), tensor.numel(), indices.numel())

    def accumulate(self, payload: Payload, out: Tensor, alpha: float = 1.0) -> None:
        values, indices = payload.parts
        out.index_add_(0, indices, values.to(out.dtype), alpha=alpha)


def sparse_segments_protocol(flat: Tensor, positions: Tensor, segments: Segments, counts: Sequence[int],
                             wire_dtype: torch.dtype, values: Optional[Tensor] = None) -> SegmentsProtocol:
    """The exchange of a whole bucket's sparse payloads (see
    :meth:`~lightning_gradcomp.compressors.base.Compressor.exchange_segments`): the values at
    ``positions`` of ``flat`` (or ``values``) in ``wire_dtype`` and their indices within their tensors
    as int32, ``counts[t]`` for tensor ``t``, in one gather; every worker's scatter-added with weight
    ``1/N`` in one operation (:func:`~lightning_gradcomp.core.tensors.index_sum_`: the same sums on every rank
    where workers chose the same coordinate). The same values, indices and sums as each tensor's
    :class:`_ValuesAndIndices` payload, tensor after tensor."""
    starts = _slot_starts(segments, tuple(counts), flat.device)
    sent = (flat[positions] if values is None else values).to(wire_dtype)
    local = (positions - starts).to(torch.int32)
    (rows,) = yield Round([Gather((sent, local))], last=True)

    def write(out: Tensor) -> None:  # out is zero
        indices = stacked(rows, 1) + starts
        received = stacked(rows, 0).to(out.dtype)
        index_sum_(out, indices.view(-1), received.reshape(-1), alpha=1.0 / len(rows))

    return _sent_from(positions, sent, counts, write)


def _sent_from(positions: Tensor, sent: Tensor, counts: Sequence[int], write) -> SegmentsOutcome:
    """The outcome of a bucket's payload ``sent`` from ``positions`` of the flat buffer (subtracted there from the
    residual), whose ``write`` scatter-adds into its buffer."""
    return SegmentsOutcome(counts, lambda residual: residual.index_add_(0, positions, sent.to(residual.dtype),
                                                                        alpha=-1.0), write, adds=True)


def _slot_starts(segments: Segments, counts: tuple[int, ...], device: torch.device) -> Tensor:
    """Per sent coordinate, the start of its tensor in the flat buffer (a constant of the layout; int32 while
    the buffer's positions fit, half the memory)."""
    dtype = index_dtype(segments.total)
    return segments.constant(("slot-starts", counts), device, lambda device: to_device(torch.repeat_interleave(
        torch.tensor(segments.starts, dtype=dtype), torch.tensor(counts)), device))


class HasDensity:
    """A ``density`` hyper-parameter in (0, 1], validated on every change (schedules move it)."""

    _density: float

    @property
    def density(self) -> float:
        """Fraction of coordinates sent, in (0, 1]; a schedule may change it between steps."""
        return self._density

    @density.setter
    def density(self, value: float) -> None:
        self._density = check_density(value)

    def static_count(self, numel: int) -> Optional[int]:
        return sparse_count(self.density, numel)


class TopK(HasDensity, _ValuesAndIndices):
    r"""Top-k sparsification: keep the fraction ``density`` of coordinates with the largest magnitude.

    .. math:: C(p)_i = p_i \text{ if } |p_i| \text{ is among the } k = \lceil\rho d\rfloor \text{ largest, else } 0

    Biased; used with error feedback (Aji & Heafield 2017; Stich et al. 2018; Harris 2020, §3.1.1).

    Args:
        density: fraction of coordinates sent, in (0, 1].
        selection: how the ``k`` largest are found (:mod:`~lightning_gradcomp.compressors.selection`):
            ``"blocks"`` (default; block maxima prune the search, always the exact top-k set, about 8x
            cheaper than ``torch.topk`` on CPU at density 0.001), ``"exact"`` (``torch.topk``) or
            ``"sampled"`` (DGC's sampled threshold). All three send the same coordinates (up to ties).
    """

    name = "topk"
    checks_finite = True  # from the block peaks (see selection.select_topk)
    capabilities = frozenset({"whole_bucket"})

    def __init__(self, density: float = 0.01, selection: Literal["blocks", "exact", "sampled"] = "blocks") -> None:
        self.density = density
        self.selection = check_selection(selection)

    def hparams(self) -> dict[str, Any]:
        return {"density": self.density, "selection": self.selection}

    def compress(self, tensor: Tensor, ctx: CompressContext) -> Payload:
        k = sparse_count(self.density, tensor.numel())
        generator = ctx.generator(tensor.device, per_rank=True) if self.selection == "sampled" else None
        chosen = select_topk(tensor, k, self.selection, generator)
        ctx.finite = chosen.finite
        return self._payload(tensor, chosen.indices, ctx)

    def segment_alignment(self, device: torch.device) -> Optional[int]:
        """Rows of 64 for the block selection (:func:`~lightning_gradcomp.compressors.selection.segmented_topk`)
        on accelerators, where kernel launches are the cost. On the CPU the per-tensor selection stays: it
        prunes candidates by reading a count (free there) and picks strided blocks at higher densities,
        3-5x fewer passes over memory than the whole-bucket selection. ``"exact"`` stays per tensor."""
        return None if self.selection == "exact" or host_reads_allowed(device) else CONTIGUOUS_BLOCK

    def exchange_segments(self, flat: Tensor, segments: Segments, contexts: Sequence[CompressContext],
                          state: SegmentsState) -> SegmentsProtocol:
        """Every tensor's top-``k`` at once (:func:`~lightning_gradcomp.compressors.selection.segmented_topk`),
        one gather of values and indices."""
        counts = [sparse_count(self.density, numel) for numel in segments.numels]
        positions, finite = segmented_topk(flat, segments, counts)
        flags = finite.tolist() if host_reads_allowed(flat.device) else finite.unbind()
        for ctx, flag in zip(contexts, flags):
            ctx.finite = flag
        return (yield from sparse_segments_protocol(flat, positions, segments, counts, contexts[0].wire_dtype(flat)))


class RandomK(HasDensity, _ValuesAndIndices):
    r"""Random-k sparsification: keep ``k = \lceil\rho d\rfloor`` coordinates drawn uniformly without
    replacement.

    With ``shared_indices=True`` (default) every worker draws the same indices from a generator seeded
    by ``(seed, step, parameter)``, so only values cross the wire and they are summed by all-reduce
    (``4k`` bytes: density 0.01 is a 100x ratio). With ``shared_indices=False`` each worker draws its own
    indices and sends them too. Biased without the ``d/k`` rescaling, so error feedback is on by default
    (Harris 2020, §3.1.1; Stich et al. 2018). The global RNG is never used.

    Indices are drawn on the CPU (O(k log k), no host synchronisation of the device) and copied to the
    device without blocking: identical on every worker whatever its GPU model, and equal to a CPU run's.
    On accelerators a whole bucket is exchanged at once (:meth:`exchange_segments`): each tensor's indices
    drawn as above from its own generator (the same draws), one copy of all of them to the device, one
    gather, one all-reduce (or all-gather) and one scatter-add for the bucket.
    """

    name = "randomk"
    capabilities = frozenset({"whole_bucket"})

    def __init__(self, density: float = 0.01, shared_indices: bool = True) -> None:
        self.density = density
        self.shared_indices = check_bool(shared_indices, "shared_indices")

    def hparams(self) -> dict[str, Any]:
        return {"density": self.density, "shared_indices": self.shared_indices}

    @property
    def all_reducible(self) -> bool:
        return self.shared_indices

    def part_dtypes(self, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        return (dtype,) if self.shared_indices else (dtype, torch.int32)

    def payload_numels(self, numel: int, count: int) -> tuple[int, ...]:
        return (count,) if self.shared_indices else (count, count)

    def compress(self, tensor: Tensor, ctx: CompressContext) -> Payload:
        numel = tensor.numel()
        k = sparse_count(self.density, numel)
        generator = ctx.generator(shared_draw_generator_device(), per_rank=not self.shared_indices)
        indices = to_device(sample_without_replacement(numel, k, generator), tensor.device)
        if not self.shared_indices:
            return self._payload(tensor, indices, ctx)
        return Payload((tensor[indices].to(ctx.wire_dtype(tensor)),), numel, k, meta=indices)

    def accumulate(self, payload: Payload, out: Tensor, alpha: float = 1.0) -> None:
        if not self.shared_indices:
            return super().accumulate(payload, out, alpha)
        out.index_add_(0, payload.meta, payload.parts[0].to(out.dtype), alpha=alpha)

    # ------------------------------------------------------------------ a whole bucket at once
    def exchange_segments(self, flat: Tensor, segments: Segments, contexts: Sequence[CompressContext],
                          state: SegmentsState) -> SegmentsProtocol:
        """The bucket's flat buffer as it is (the base's :meth:`segment_alignment`). Every tensor's indices drawn on the CPU from its own generator, as :meth:`compress` draws them
        (:func:`sample_many_without_replacement`), copied to the device at once; one gather of the values;
        shared indices: one ``Mean`` and one scatter-add (the same sums as per tensor: the indices are
        distinct), else the gathered format of Top-k (:func:`sparse_segments_protocol`)."""
        counts = [sparse_count(self.density, numel) for numel in segments.numels]
        draws = shared_draw_generator_device()
        local = sample_many_without_replacement(
            segments.numels, counts, [ctx.generator(draws, per_rank=not self.shared_indices) for ctx in contexts])
        positions = to_device(local, flat.device).add_(_slot_starts(segments, tuple(counts), flat.device))
        wire = contexts[0].wire_dtype(flat)
        if not self.shared_indices:
            return (yield from sparse_segments_protocol(flat, positions, segments, counts, wire))
        sent = flat[positions].to(wire)
        (mean,) = yield Round([Mean(sent)], last=True)

        def write(out: Tensor) -> None:  # out holds the verdict flag (adds): NaN results for a void bucket
            out.index_add_(0, positions, mean.to(out.dtype))

        return _sent_from(positions, sent, counts, write)


def sample_without_replacement(n: int, k: int, generator: torch.Generator) -> Tensor:
    """``k`` distinct indices drawn uniformly from ``range(n)``, on the generator's device (the CPU: the
    loop reads sizes).

    For ``k`` well below ``n``: draw a few more than ``k`` with replacement, drop repeats, and keep a
    random ``k`` of the distinct ones (O(k log k), where ``randperm(n)`` costs O(n)). Each ``k``-subset
    is equally likely: the distinct draws are a uniform random subset, and so is a random part of it.
    """
    device = generator.device
    if k * 8 > n:
        return torch.randperm(n, generator=generator, device=device)[:k]
    distinct = _distinct_draws(n, k, generator)
    keep = torch.randperm(distinct.numel(), generator=generator, device=device)[:k]
    return distinct[keep]


def _distinct_draws(n: int, k: int, generator: torch.Generator) -> Tensor:
    """At least ``k`` distinct indices of ``range(n)``, sorted: a few more than ``k`` draws with replacement
    without their repeats (twice as many draws while fewer than ``k`` are distinct)."""
    device = generator.device
    draws = k + max(16, k // 8)
    while True:
        distinct = torch.unique(torch.randint(0, n, (draws,), generator=generator, device=device))
        if distinct.numel() >= k:
            return distinct
        draws *= 2


#: ``0 .. n-1`` on the CPU, grown as needed: the first ``k`` places of a permutation (no op per use)
_FIRST: list[Tensor] = [torch.arange(0)]


def _first(k: int) -> Tensor:
    if _FIRST[0].numel() < k:
        _FIRST[0] = torch.arange(max(k, 2 * _FIRST[0].numel()))
    return _FIRST[0][:k]


def sample_many_without_replacement(numels: Sequence[int], ks: Sequence[int],
                                    generators: Sequence[torch.Generator]) -> Tensor:
    """:func:`sample_without_replacement` of several tensors (``numels[t]``, ``ks[t]``, ``generators[t]``), the
    same draws from the same generators, joined (``ks[t]`` indices each, tensor after tensor; CPU generators):
    per tensor its draws (``randint``, ``unique``, ``randperm``; one ``randperm`` where ``k > n/8``), and for
    all of them one join and one gather instead of a gather per tensor."""
    if len(numels) == 1:
        return sample_without_replacement(numels[0], ks[0], generators[0])
    pools, picks, starts, start = [], [], [], 0
    for n, k, generator in zip(numels, ks, generators):
        if k * 8 > n:  # a permutation of every index: its first k
            pool, pick = torch.randperm(n, generator=generator, device=generator.device), _first(k)
        else:  # distinct draws: a random k of them
            pool = _distinct_draws(n, k, generator)
            pick = torch.randperm(pool.numel(), generator=generator, device=generator.device)[:k]
        pools.append(pool)
        picks.append(pick)
        starts.append(start)
        start += pool.numel()
    shift = torch.repeat_interleave(torch.tensor(starts), torch.tensor(list(ks)), output_size=sum(ks))
    return torch.cat(pools)[torch.cat(picks).add_(shift)]


class HardThreshold(_ValuesAndIndices):
    r"""Hard-threshold sparsification: send every coordinate with ``|p_i| >= \lambda``.

    .. math:: C(p)_i = p_i \cdot \mathbb{1}[|p_i| \ge \lambda]

    The count ``k_t`` varies from step to step (and may be zero). Under error feedback it minimises the
    *total* compression error :math:`\sum_t \|e_{t+1}\|^2` for a total budget, where Top-k minimises each
    step's error alone (Sahu et al., NeurIPS 2021, "Rethinking gradient sparsification as total error
    minimization"). The authors' rule of thumb for an expected per-step count ``k`` over the
    whole model is :math:`\lambda = 1 / (2\sqrt{k})`.
    """

    name = "threshold"
    checks_finite = True  # from the block peaks (see selection.select_threshold)
    capabilities = frozenset({"whole_bucket"})

    def __init__(self, threshold: float = 1e-3) -> None:
        self.threshold = threshold

    @property
    def threshold(self) -> float:
        """The magnitude ``λ >= 0`` a coordinate must reach to be sent."""
        return self._threshold

    @threshold.setter
    def threshold(self, value: float) -> None:
        self._threshold = check_number(value, "threshold", "a finite number >= 0", lambda number: 0 <= number < math.inf)

    def hparams(self) -> dict[str, Any]:
        return {"threshold": self.threshold}

    def static_count(self, numel: int) -> Optional[int]:
        return None

    def compress(self, tensor: Tensor, ctx: CompressContext) -> Payload:
        """The coordinates at or above the threshold
        (:func:`~lightning_gradcomp.compressors.selection.select_threshold`: where the host may not read device
        values, two reads of a data-dependent size per tensor, the blocks that hold a selected element and then
        the elements; the bucket-wise path, :meth:`exchange_segments`, reads one count per bucket)."""
        chosen = select_threshold(tensor, self.threshold)
        ctx.finite = chosen.finite
        return self._payload(tensor, chosen.indices, ctx)

    # ------------------------------------------------------------------ a whole bucket at once
    def segment_alignment(self, device: torch.device) -> Optional[int]:
        """Rows of 64 on accelerators (their peaks say whether each tensor is finite, as per tensor), where the
        per-tensor selection would read two sizes per tensor on the host; per tensor on the CPU, where reading a
        size is free and the blocks prune the work."""
        return None if host_reads_allowed(device) else CONTIGUOUS_BLOCK

    def exchange_segments(self, flat: Tensor, segments: Segments, contexts: Sequence[CompressContext],
                          state: SegmentsState) -> SegmentsProtocol:
        """Every tensor's coordinates at or above the threshold, with **one host read per bucket**: the
        counts per tensor (one small copy of ``P`` numbers to the host, a synchronisation on a GPU), then the
        positions by ``nonzero_static`` of the known total (no second read). One gather of the values and of
        their positions in the bucket (int32) with one count per worker in the engine's header; every
        worker's scatter-added with weight ``1/N`` in one operation. The same coordinates, sums, residuals
        and counts as :meth:`compress` per tensor (the payload names positions in the bucket, not in the
        tensor: the same number of bytes, one header count per bucket instead of one per tensor)."""
        device = flat.device
        grid = flat.view(-1, CONTIGUOUS_BLOCK)
        # a peak is NaN or infinite exactly when an element of its row is; NaN < inf is false too
        finite = torch.segment_reduce(peak_magnitudes(grid, 1), "max", lengths=segments.row_lengths(device),
                                      unsafe=True).lt(math.inf)
        for ctx, flag in zip(contexts, finite.unbind()):
            ctx.finite = flag
        magnitude = flat.abs()
        segments.fill_gaps(magnitude, -1.0)  # a gap's zeros are never sent, even at threshold 0
        mask = magnitude >= self.threshold  # NaN is not (as per tensor)
        per_row = mask.view(segments.rows, -1).sum(1, dtype=torch.float64)  # exact: at most 64 per row
        per_tensor = torch.segment_reduce(per_row, "sum", lengths=segments.row_lengths(device), unsafe=True)
        counts = [int(count) for count in per_tensor.tolist()]  # the bucket's one host read
        positions = torch.nonzero_static(mask, size=sum(counts)).view(-1)
        sent = flat[positions].to(contexts[0].wire_dtype(flat))
        request = Gather((sent, positions.to(torch.int32)), sum(counts), partial(self.payload_numels, segments.total))
        (rows,) = yield Round([request], last=True)

        def write(out: Tensor) -> None:  # out holds the verdict flag (adds): NaN results for a void bucket
            values = torch.cat([row.parts[0] for row in rows]).to(out.dtype)
            indices = torch.cat([row.parts[1] for row in rows])
            index_sum_(out, indices, values, alpha=1.0 / len(rows))

        return _sent_from(positions, sent, counts, write)
