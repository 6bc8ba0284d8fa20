"""The vocabulary of an exchange protocol: what a compressor asks of the other workers, round by round.

A compressor's exchange of one tensor is a Python generator (see
:meth:`~lightning_gradcomp.compressors.Compressor.exchange` and docs/adding-a-compressor.md)::

    results = yield Round([Mean(p_matrix)])                    # an intermediate round
    results = yield Round([Gather(parts)], last=True)          # the last round
    return Outcome(count, subtract, write)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generator, NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor


@dataclass
class Mean:
    """Average ``tensor`` over workers (one ``all_reduce`` sum of ``tensor / N``: a 16-bit sum stays in range
    whenever each worker's value does). Result: a tensor of the same shape and dtype."""

    tensor: Tensor


@dataclass
class Gather:
    """Every worker's ``parts`` (1-D tensors), packed into one ``all_gather`` with the bucket's others.
    Result: a list, one :class:`Received` per worker (in rank order).

    Attributes:
        parts: the tensors to send.
        count: the data-dependent coordinate count of these parts, or ``None`` when their sizes are the
            same on every worker.
        part_numels: with ``count``: ``count -> numel of each part``, to read another worker's parts.
    """

    parts: tuple[Tensor, ...]
    count: Optional[int] = None
    part_numels: Optional[Callable[[int], Sequence[int]]] = None

    def __post_init__(self) -> None:
        if self.count is not None and self.part_numels is None:
            raise ValueError("Gather: `part_numels` is required when `count` is given")


@dataclass
class AllToAll:
    """Send ``parts[c]`` (1-D tensors) to worker ``c``, for every worker ``c``; receive the parts every
    worker sends to this one (a reduce-scatter's first half: each worker owns one chunk). The sizes sent
    to a given worker must be the same on every worker. Result: a list, one :class:`Received` per source
    worker (in rank order, ``count`` ``None``)."""

    parts: Sequence[tuple[Tensor, ...]]


class Received(NamedTuple):
    """One worker's parts of a :class:`Gather` (views into the gathered buffer) and its ``count``
    (``None`` when sizes are the same on every worker)."""

    parts: tuple[Tensor, ...]
    count: Optional[int]


Request = Union[Mean, Gather, AllToAll]


def stacked(rows: Sequence[Received], index: int) -> Tensor:
    """Part ``index`` of every worker's :class:`Received`, as one ``(N, numel)`` tensor (:func:`stack_views`).
    Read-only, like every result."""
    return stack_views([row.parts[index] for row in rows])


def stack_views(parts: Sequence[Tensor]) -> Tensor:
    """Tensors of one shape as one ``(N, numel)`` tensor: a strided view without a copy when they lie at a
    constant distance in one buffer (as the rows of a gathered buffer do), else a stack."""
    first = parts[0]
    if len(parts) > 1 and first.numel() and all(
            part.dtype == first.dtype and part.shape == first.shape and part.is_contiguous()
            and part.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for part in parts):
        step = parts[1].storage_offset() - first.storage_offset()
        if step >= first.numel() and all(part.storage_offset() - first.storage_offset() == worker * step
                                          for worker, part in enumerate(parts)):
            return first.as_strided((len(parts), first.numel()), (step, 1), first.storage_offset())
    return torch.stack([part.reshape(-1) for part in parts])


@dataclass
class Round:
    """The requests of one round of a protocol; ``last`` marks the protocol's final round. Its results, one per
    request in order, are **read-only** (in the simulation every worker receives the same tensor). The rounds
    and their requests (kinds, dtypes, and sizes where no ``count`` is given) must not depend on the data, so
    that they are the same on every worker."""

    requests: Sequence[Request]
    last: bool = False


@dataclass
class Outcome:
    """What one worker's exchange of one tensor did.

    Attributes:
        count: coordinates (values) sent for the tensor; ``count / numel`` is its density.
        subtract: ``residual -= what was sent on this worker's behalf``, in place: error feedback
            ``e = p − C(p)`` applies it to ``p``. Sparsifiers make ``residual`` exactly zero where they sent.
        write: ``out = the aggregated result`` (the average over workers of the decoded payloads), in place.
        payload: the compressor's own record of what it sent (for its :meth:`compression_error`).
    """

    count: int
    subtract: Callable[[Tensor], None]
    write: Callable[[Tensor], None]
    payload: Any = None


@dataclass
class SegmentsOutcome:
    """What one worker's exchange of a whole bucket did (a compressor's
    :meth:`~lightning_gradcomp.compressors.base.Compressor.exchange_segments`): :class:`Outcome`'s
    fields for every tensor at once, on flat buffers laid out by
    :class:`~lightning_gradcomp.core.segments.Segments`.

    Attributes:
        counts: coordinates sent per tensor.
        subtract: ``flat -= what was sent``, in place on the flat input (gaps may be left as they are).
        write: ``flat = the aggregated result``, in place on a zero-filled flat buffer of the layout (gaps:
            any value; with ``overwrites``, possibly a buffer holding anything, such as the gradient itself).
        error: optional ``(‖p − C(p)‖², ‖p‖²)`` per tensor (1-D tensors), for telemetry of compressors
            without the generic error feedback; ``None``: measured from ``subtract``.
        gaps_stay_zero: ``subtract`` leaves the gaps' zeros as they are (what it subtracts there is 0), so
            the engine need not zero them again.
        overwrites: ``write`` sets every element of its buffer, gaps included, so the buffer need not be
            zero-filled first (the engine may then hand it the gradient itself).
        adds: ``write`` only adds into its buffer (scatter-adds, and element-wise operations that keep NaN
            NaN): a buffer filled with ``v`` comes out as ``v`` plus the result. The engine then fills it with
            the bucket's verdict flag (0, or NaN when some worker's gradients were not finite) instead of
            zeros, and the results need no pass of their own to be made NaN.
    """

    counts: Sequence[int]
    subtract: Callable[[Tensor], None]
    write: Callable[[Tensor], None]
    error: Optional[Callable[[], tuple[Tensor, Tensor]]] = None
    gaps_stay_zero: bool = False
    overwrites: bool = False
    adds: bool = False


#: What :meth:`Compressor.exchange` returns: yields rounds, receives their results, returns the outcome.
Protocol = Generator[Round, list, Outcome]
#: What :meth:`Compressor.exchange_segments` returns.
SegmentsProtocol = Generator[Round, list, SegmentsOutcome]
