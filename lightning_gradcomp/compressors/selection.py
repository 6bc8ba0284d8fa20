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
Where the host may not read device values (accelerators, see
:func:`~lightning_gradcomp.core.device.host_reads_allowed`), ``"sampled"`` uses the blocks: its
candidate count depends on the data, a host synchronisation per tensor, and the set is the same.

:func:`select_topk` also says whether the tensor was finite: the block peaks are maxima, and a maximum is
NaN or infinite exactly when an element of its block is, so the check costs ``d/b`` elements instead of
a pass over the tensor (the engine then skips its own check, see
:attr:`~lightning_gradcomp.compressors.base.Compressor.checks_finite`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import Finite, all_finite
from lightning_gradcomp.core.device import host_reads_allowed, to_device
from lightning_gradcomp.core.segments import Segments, index_dtype


@dataclass(frozen=True)
class Selection:
    """The outcome of a selection: the chosen indices, how many elements passed the threshold, and
    (where the selection found it) whether every element of the tensor was finite."""

    indices: Tensor
    candidates: int
    finite: Optional[Finite] = None


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
    if selection == "blocks" or (selection == "sampled" and not host_reads_allowed(values.device)):
        return block_topk(values, k)
    if selection == "sampled":
        return sampled_topk(values.abs(), k, generator, sample_fraction=sample_fraction).indices
    return exact_topk(values.abs(), k)


def select_topk(values: Tensor, k: int, selection: str = "blocks", generator: Optional[torch.Generator] = None,
                sample_fraction: float = 0.01) -> Selection:
    """:func:`topk_indices`, and whether every element of ``values`` is finite (:attr:`Selection.finite`,
    as :func:`~lightning_gradcomp.compressors.base.all_finite` answers): from the block peaks where
    ``"blocks"`` prunes, else by one reduction."""
    if selection == "blocks" or (selection == "sampled" and not host_reads_allowed(values.device)):
        return block_topk(values, k, report=True)
    return Selection(topk_indices(values, k, selection, generator, sample_fraction), values.numel(),
                     all_finite(values))


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
    """``max |x|`` along ``dim`` (NaN where a NaN is): on the CPU a max and a min (vectorised reductions,
    no ``|x|`` materialised); elsewhere one reduction kernel, the max-norm."""
    if host_reads_allowed(grid.device):
        return torch.maximum(grid.amax(dim=dim), grid.amin(dim=dim).neg_())
    return torch.linalg.vector_norm(grid, math.inf, dim=dim)


def block_topk(values: Tensor, k: int, prune: Optional[bool] = None, report: bool = False) -> "Tensor | Selection":
    """Indices of the ``k`` largest ``|values_i|`` (unsorted), chosen among the ``k`` blocks with the
    largest peaks and the tail (see the module's docstring for why the set is exact).

    Blocks (:func:`block_layout`) are either ``b`` consecutive elements (``x`` viewed as rows of ``b``)
    or ``b`` elements ``m = d/b`` apart (``x`` viewed as ``b`` rows of ``m``, block ``j`` is column
    ``j``); the last ``d mod b`` elements are always candidates. Cost on CPU at density 0.001: about 2
    copies of the tensor, against about 20 for ``torch.topk``. Falls back to exact ``topk`` where blocks
    would not prune (``k·b > d/4``).

    ``prune`` (default: where host reads are allowed, i.e. on CPU) drops the candidates below the smallest kept peak before the last
    ``topk``; its size depends on the data, a host synchronisation on accelerators, where the last
    ``topk`` runs over all ``k·b`` candidates instead. Both give a top-``k`` set.

    ``report=True`` returns a :class:`Selection` that also says whether ``values`` was finite, read
    from the peaks and the tail.
    """
    numel = values.numel()
    block, contiguous = block_layout(k, numel)
    if k * block > numel // 4:
        indices = exact_topk(values.abs(), k)
        return Selection(indices, numel, all_finite(values)) if report else indices
    count = numel // block
    full = count * block
    if contiguous:
        grid = values[:full].view(count, block)
        peaks = peak_magnitudes(grid, 1)
        top = torch.topk(peaks, k, sorted=False)
        candidates = grid.index_select(0, top.indices).view(-1)
    else:
        grid = values[:full].view(block, count)
        peaks = peak_magnitudes(grid, 0)
        top = torch.topk(peaks, k, sorted=False)
        candidates = grid.index_select(1, top.indices).view(-1)

    def position(flat: Tensor) -> Tensor:
        """Where the candidates numbered ``flat`` lie in ``values``."""
        if contiguous:  # candidates are the kept rows: (k, block)
            return top.indices[flat // block] * block + flat % block
        return top.indices[flat % k] + (flat // k) * count  # the kept columns: (block, k)

    tail = values[full:]
    candidates = torch.cat([candidates, tail]) if tail.numel() else candidates
    magnitude = candidates.abs().to(torch.float32)
    chosen: Optional[Tensor] = None
    if host_reads_allowed(values.device) if prune is None else prune:
        passed = torch.nonzero(magnitude >= top.values.min()).view(-1)
        if passed.numel() >= k:  # always, unless the tensor holds NaN
            chosen = passed[torch.topk(magnitude.index_select(0, passed), k, sorted=False).indices]
    if chosen is None:
        chosen = torch.topk(magnitude, k, sorted=False).indices
    in_blocks = k * block
    if tail.numel():
        indices = torch.where(chosen < in_blocks, position(chosen.clamp(max=in_blocks - 1)), chosen - in_blocks + full)
    else:
        indices = position(chosen)
    if not report:
        return indices
    return Selection(indices, numel, _peaks_finite(peaks, tail))


def _peaks_finite(peaks: Tensor, tail: Tensor) -> Finite:
    """Whether a tensor is finite, from its block peaks (a maximum is NaN or infinite exactly when an
    element of its block is) and the elements after the last whole block."""
    finite = torch.isfinite(peaks.amax())  # a NaN peak makes the maximum NaN
    if tail.numel():
        finite = finite & torch.isfinite(tail).all()
    return bool(finite) if host_reads_allowed(peaks.device) else finite


def threshold_indices(values: Tensor, threshold: float) -> Tensor:
    """Indices of every ``|values_i| >= threshold``, in increasing order (as ``torch.nonzero``).

    Blocks of 64 consecutive elements whose peak is below the threshold are skipped: one read pass for
    the peaks, then work on the blocks that hold a selected element only (all of them, at worst).
    """
    return select_threshold(values, threshold).indices


def select_threshold(values: Tensor, threshold: float) -> Selection:
    """:func:`threshold_indices`, and whether ``values`` was finite (read from the block peaks)."""
    numel = values.numel()
    count = numel // CONTIGUOUS_BLOCK
    if count == 0:
        indices = torch.nonzero(values.abs() >= threshold).view(-1)
        return Selection(indices, indices.numel(), all_finite(values))
    full = count * CONTIGUOUS_BLOCK
    grid = values[:full].view(count, CONTIGUOUS_BLOCK)
    peaks = peak_magnitudes(grid, 1)
    finite = _peaks_finite(peaks, values[full:])
    blocks = torch.nonzero(peaks >= threshold).view(-1)
    if blocks.numel() * 4 > count:  # dense: pruning would not pay
        indices = torch.nonzero(values.abs() >= threshold).view(-1)
        return Selection(indices, indices.numel(), finite)
    offsets = torch.arange(CONTIGUOUS_BLOCK, device=values.device)
    candidates = grid.index_select(0, blocks).view(-1)
    positions = (blocks.unsqueeze(1) * CONTIGUOUS_BLOCK + offsets).view(-1)
    if full < numel:  # the elements after the last whole block are candidates too
        tail = torch.arange(full, numel, device=values.device)
        candidates, positions = torch.cat([candidates, values[full:]]), torch.cat([positions, tail])
    indices = positions[torch.nonzero(candidates.abs() >= threshold).view(-1)]
    return Selection(indices, indices.numel(), finite)


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


def segmented_topk(flat: Tensor, segments: Segments, ks: Sequence[int], report_finite: bool = True
                   ) -> tuple[Tensor, Optional[Tensor]]:
    """The top-``k_t`` of every tensor of a bucket laid out in one flat buffer (segments aligned to
    :data:`CONTIGUOUS_BLOCK`), in a fixed number of operations plus one batched ``topk`` per group of tensors
    of one size (so a fixed number for a bucket of equal shapes, and two per distinct size at most).

    The block method of :func:`block_topk` on rows of 64 elements of the whole buffer: one pass of row
    peaks for the bucket; for the tensors whose rows are pruned (``64·k_t <= d_t/4``), the ``k_t`` rows with
    the largest peaks, by one ``topk`` along the rows of every group of tensors of the same row count and
    ``k`` (their peaks side by side, a view where they are consecutive, else one gather of the peaks: 1/64
    of the bucket); one gather of the kept rows (all rows of the tensors not pruned), laid out group after
    group; per group of tensors with as many candidates and the same ``k``, one ``topk`` along their
    candidates. Every step is exact, so each tensor's set is its top-``k_t`` (up to ties), the set
    :func:`block_topk` chooses. No host synchronisation. When no tensor of the bucket prunes (densities
    above about 1/256), every row is a candidate: the magnitudes of the buffer as it is, no gather and no
    map back to positions, one ``topk`` per run of consecutive tensors of one size and ``k``.

    Returns ``(positions, finite)``: the chosen positions in ``flat`` (int64, tensor after tensor,
    ``k_t`` each, in no particular order within a tensor) and one bool per tensor, whether it was finite
    (read from the row peaks; ``None`` unless ``report_finite``).
    """
    block = CONTIGUOUS_BLOCK
    device = flat.device
    grid = flat.view(-1, block)
    plan = _segmented_plan(segments, tuple(ks), device)
    peaks = peak_magnitudes(grid, 1) if plan.pruned or report_finite else None
    # a peak is NaN or infinite exactly when an element of its row is; NaN < inf is false too
    finite = (torch.segment_reduce(peaks, "max", lengths=segments.row_lengths(device), unsafe=True).lt(math.inf)
              if peaks is not None and report_finite else None)
    total = sum(ks)
    chosen = torch.empty(total, dtype=torch.int64, device=device)
    if not plan.pruned:  # every row a candidate: the magnitudes in place, a position in them is one in flat
        magnitude = flat.abs()
        segments.fill_gaps(magnitude, -1.0)  # a gap's zeros must not be chosen: below every real magnitude
        values = torch.empty(total, dtype=flat.dtype, device=device)  # topk's values: unused
        for group in plan.chosen_groups:
            _group_topk(magnitude, group, values, chosen)
        return chosen.add_(plan.candidate_offsets), finite
    kept = plan.template.clone() if plan.unpruned else torch.empty_like(plan.template)
    values = torch.empty(max(total, kept.numel()), dtype=flat.dtype, device=device)  # topk's values: unused
    # the pruned tensors' peaks group after group: the peaks themselves where each group's tensors are
    # consecutive, else one gather of them (1/64 of the pruned tensors' elements)
    source = peaks if plan.peak_index is None else peaks.index_select(0, plan.peak_index)
    for group in plan.row_groups:  # the k rows of largest peaks of every tensor of the group, side by side
        _group_topk(source, group, values, kept)
        # rows of each tensor -> rows of flat
        kept[group.out:group.out + group.tensors * group.k].view(group.tensors, -1).add_(group.offsets)
    magnitude = grid.index_select(0, kept).abs_()
    # every candidate's position in flat: its row's first element plus its column
    candidates = torch.addcmul(plan.columns, kept.view(-1, 1), plan.block)
    if segments.padded:  # a gap's zeros must not be chosen: below every real magnitude
        magnitude.masked_fill_(candidates >= plan.ends, -1.0)
    for group in plan.chosen_groups:
        _group_topk(magnitude.view(-1), group, values, chosen)
    chosen += plan.candidate_offsets
    if plan.order is not None:  # the groups' order back to the tensors'
        chosen = chosen.index_select(0, plan.order)
    return candidates.view(-1)[chosen], finite


def _group_topk(magnitude: Tensor, group: "_Group", values: Tensor, chosen: Tensor) -> None:
    """The ``k`` largest of each of ``group.tensors`` consecutive runs of ``group.length`` magnitudes (one
    ``topk`` along the rows of their view), their places within each run into ``chosen`` (and the values,
    unused, into ``values``) from ``group.out`` on."""
    out, span = group.out, group.tensors * group.k
    torch.topk(magnitude[group.first:group.first + group.tensors * group.length].view(group.tensors, -1), group.k,
               dim=1, sorted=False, out=(values[out:out + span].view(group.tensors, -1),
                                         chosen[out:out + span].view(group.tensors, -1)))


@dataclass(frozen=True)
class _Group:
    """Tensors whose selection is one ``topk`` along the rows of a ``(tensors, length)`` view: ``length``
    values each, from ``first`` on, ``k`` chosen each, written from ``out`` on; ``offsets``: a
    ``(tensors, 1)`` constant added to the chosen rows (the first row of each tensor in the flat buffer)."""

    first: int
    tensors: int
    length: int
    k: int
    out: int
    offsets: Optional[Tensor] = None


@dataclass
class _SegmentedPlan:
    """The constants of :func:`segmented_topk` for one layout and set of ``k``."""

    pruned: list[int]  # tensors whose rows are chosen by their peaks
    unpruned: list[int]
    row_groups: list[_Group]  # the choice of rows by their peaks
    peak_index: Optional[Tensor]  # the rows whose peaks the row groups read, gathered (None: the peaks as they are)
    chosen_groups: list[_Group]  # the choice among the candidates
    template: Tensor  # the kept rows in flat (all rows of the tensors not pruned), group after group
    candidate_offsets: Tensor  # per chosen element: where its tensor's candidates begin
    order: Optional[Tensor]  # the chosen elements of the groups, tensor after tensor (None: already)
    columns: Tensor  # 0 .. block-1
    block: Tensor  # the block size, as a one-element int64 tensor
    ends: Tensor  # per kept row: where its tensor ends in the flat buffer


def _runs(tensors: Sequence[int], key) -> list[list[int]]:
    """``tensors`` cut into runs of consecutive items of equal ``key``."""
    runs: list[list[int]] = []
    for tensor in tensors:
        if runs and key(runs[-1][-1]) == key(tensor):
            runs[-1].append(tensor)
        else:
            runs.append([tensor])
    return runs


def _segmented_plan(segments: Segments, ks: tuple[int, ...], device: torch.device) -> _SegmentedPlan:
    def build(device: torch.device) -> _SegmentedPlan:
        block = CONTIGUOUS_BLOCK
        count = len(segments)
        rows = [segments.rows_of(index) for index in range(count)]
        first_row = [start // block for start in segments.starts]
        pruned = [index for index in range(count) if ks[index] * block <= segments.numels[index] // 4]
        is_pruned = set(pruned)
        unpruned = [index for index in range(count) if index not in is_pruned]
        # offsets added to int64 positions: int32 while they fit (half the memory kept per layout)
        offset = index_dtype(segments.total + block * sum(ks))
        if not pruned:  # candidates: every row, in place; one topk per run of tensors of one size and k
            chosen_groups, out = [], 0
            for run in _runs(range(count), lambda index: (rows[index], ks[index])):
                chosen_groups.append(_Group(segments.starts[run[0]], len(run), rows[run[0]] * block, ks[run[0]], out))
                out += len(run) * ks[run[0]]
            candidate_offsets = torch.cat([torch.full((ks[index],), segments.starts[index], dtype=offset)
                                           for index in range(count)])
            return _SegmentedPlan(pruned, unpruned, [], None, chosen_groups, torch.empty(0, dtype=torch.int64),
                                  to_device(candidate_offsets, device), None, torch.empty(0), torch.empty(0),
                                  torch.empty(0))
        kept_count = [ks[index] if index in is_pruned else rows[index] for index in range(count)]
        # the candidates group after group: tensors of as many candidates and one k side by side, and among
        # them the pruned ones of one row count together (their rows chosen by one topk)
        layout = sorted(range(count), key=lambda index: (kept_count[index], ks[index], index not in is_pruned,
                                                         rows[index], index))
        kept_start, kept_total = {}, 0
        for index in layout:
            kept_start[index] = kept_total
            kept_total += kept_count[index]
        row_runs = _runs([index for index in layout if index in is_pruned], lambda index: (rows[index], ks[index]))
        gathered = not all(later == earlier + 1 for run in row_runs for earlier, later in zip(run, run[1:]))
        row_groups, peak_index, read = [], None, 0
        for run in row_runs:
            row_offsets = torch.tensor([first_row[index] for index in run], dtype=offset).view(-1, 1)
            row_groups.append(_Group(read if gathered else first_row[run[0]], len(run), rows[run[0]], ks[run[0]],
                                     kept_start[run[0]], to_device(row_offsets, device)))
            read += len(run) * rows[run[0]]
        if gathered:
            peak_index = to_device(torch.cat([torch.arange(first_row[index], first_row[index] + rows[index],
                                                           dtype=index_dtype(segments.rows))
                                              for run in row_runs for index in run]), device)
        chosen_groups, out, chosen_order = [], 0, []
        for run in _runs(layout, lambda index: (kept_count[index], ks[index])):
            chosen_groups.append(_Group(kept_start[run[0]] * block, len(run), kept_count[run[0]] * block,
                                        ks[run[0]], out))
            out += len(run) * ks[run[0]]
            chosen_order += run
        template = torch.cat([torch.zeros(kept_count[index], dtype=torch.int64) if index in is_pruned
                              else torch.arange(first_row[index], first_row[index] + rows[index])
                              for index in layout])
        candidate_offsets = torch.cat([torch.full((ks[index],), kept_start[index] * block, dtype=offset)
                                       for index in layout])
        ends = torch.cat([torch.full((kept_count[index],), segments.starts[index] + segments.numels[index],
                                     dtype=offset) for index in layout])
        order = None
        if chosen_order != list(range(count)):  # where each tensor's chosen elements lie among the groups'
            where, position = [None] * count, 0
            for index in chosen_order:
                where[index] = torch.arange(position, position + ks[index], dtype=torch.int32)
                position += ks[index]
            order = to_device(torch.cat(where), device)
        return _SegmentedPlan(pruned, unpruned, row_groups, peak_index, chosen_groups, to_device(template, device),
                              to_device(candidate_offsets, device), order, torch.arange(block, device=device),
                              torch.full((1,), block, dtype=torch.int64, device=device),
                              to_device(ends.view(-1, 1), device))
    return segments.constant(("topk-plan", ks), device, build)  # type: ignore[arg-type]
