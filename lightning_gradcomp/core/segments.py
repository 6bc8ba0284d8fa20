"""A bucket's tensors laid end to end in one flat buffer, so that compression works per bucket.

On a GPU what decides the cost of compressing a DDP bucket is the number of kernels, not the bytes: a
few microseconds per launch, and a per-tensor implementation launches tens of kernels per parameter.
:class:`Segments` describes the bucket's compressed tensors as consecutive *segments* of one flat
buffer, each starting at a multiple of ``align`` elements (the gap after a tensor is zero). A compressor
that declares :meth:`~lightning_gradcomp.compressors.base.Compressor.segment_alignment` then works on
the whole buffer at once: element-wise arithmetic in one kernel, per-tensor quantities (a norm, a
scale, a top-``k``) by reductions over rows of ``align`` elements, which never straddle two tensors.

Constants that depend only on the layout (a segment id per row, the start of each segment) are built
once per device and kept (:meth:`Segments.constant`): the steady state allocates none. They are built on
the CPU and copied without blocking (:func:`~lightning_gradcomp.core.device.to_device`): no host
synchronisation even on the step that builds them.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from lightning_gradcomp.core.device import to_device


#: The smallest row for which :meth:`Segments.spread_rows` keeps an index of rows (4 bytes per row).
ROW_INDEX_ALIGN = 32


def index_dtype(largest: int) -> torch.dtype:
    """The dtype of a kept index (or offset) whose values stay below ``largest``: int32 where they fit, half
    the memory of int64 (``index_select`` and ``index_add_`` take it as an index; added to int64 positions,
    it gives int64)."""
    return torch.int32 if largest < 2**31 else torch.int64


@dataclass(frozen=True)
class Segments:
    """The layout of a bucket's compressed tensors in one flat buffer.

    Attributes:
        names: the parameters, in the bucket's (name) order.
        shapes: their shapes.
        align: every segment starts at a multiple of this many elements.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    align: int
    numels: tuple[int, ...] = field(init=False)
    starts: tuple[int, ...] = field(init=False)
    total: int = field(init=False)
    _constants: dict = field(init=False, default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        numels = tuple(math.prod(shape) for shape in self.shapes)
        starts, offset = [], 0
        for numel in numels:
            starts.append(offset)
            offset += -(-numel // self.align) * self.align
        object.__setattr__(self, "numels", numels)
        object.__setattr__(self, "starts", tuple(starts))
        object.__setattr__(self, "total", offset)

    def __len__(self) -> int:
        return len(self.names)

    @property
    def key(self) -> tuple:
        """What identifies the layout (the names, shapes and alignment)."""
        return (self.names, self.shapes, self.align)

    @property
    def padded(self) -> bool:
        """Whether some segment ends before the next multiple of :attr:`align` (a gap of zeros)."""
        return any(numel % self.align for numel in self.numels)

    @property
    def rows(self) -> int:
        """Rows of :attr:`align` elements: ``total / align``."""
        return self.total // self.align

    def rows_of(self, index: int) -> int:
        """Rows of segment ``index`` (its gap included)."""
        return -(-self.numels[index] // self.align)

    def views(self, flat: Tensor) -> list[Tensor]:
        """Each tensor's elements in ``flat`` (views, gaps left out)."""
        return [flat[start:start + numel] for start, numel in zip(self.starts, self.numels)]

    def gather(self, tensors: Sequence[Tensor], dtype: torch.dtype, out: "Tensor | None" = None) -> Tensor:
        """The tensors laid out in one flat buffer of ``dtype`` (one ``cat``; gaps zero)."""
        pieces: list[Tensor] = []
        for tensor, numel in zip(tensors, self.numels):
            pieces.append(tensor.reshape(-1))
            gap = -numel % self.align
            if gap:
                pieces.append(self.constant(("zeros", gap, tensor.dtype), tensor.device,
                                            lambda device, gap=gap, dtype=tensor.dtype: torch.zeros(gap, dtype=dtype,
                                                                                                 device=device)))
        if out is None:
            return torch.cat(pieces).to(dtype)
        return torch.cat(pieces, out=out)

    def zero_gaps(self, flat: Tensor) -> None:
        """Set the gaps between segments of ``flat`` to zero (one ``index_fill_``; nothing without gaps)."""
        self.fill_gaps(flat, 0)

    def fill_gaps(self, flat: Tensor, value: float) -> None:
        """Set the gaps between segments of ``flat`` to ``value`` (one ``index_fill_`` by a kept index of the
        gaps' elements, fewer than ``align`` per tensor; nothing without gaps)."""
        if not self.padded:
            return

        def build(device: torch.device) -> Tensor:
            gaps = [torch.arange(start + numel, start + self.rows_of(index) * self.align)
                    for index, (start, numel) in enumerate(zip(self.starts, self.numels))]
            return to_device(torch.cat(gaps), device)
        flat.index_fill_(0, self.constant("gaps", flat.device, build), value)

    @cached_property
    def coarse_rows(self) -> "Segments":
        """This layout in rows as long as its tensors' sizes allow (their greatest common divisor) when it has
        no gaps and rows shorter than :data:`ROW_INDEX_ALIGN`, else itself: the same elements, so that a value
        per tensor spreads over as few rows as the sizes allow (:meth:`expand`; with a divisor of 32 or more,
        one gather by a small kept index)."""
        if self.padded or self.align >= ROW_INDEX_ALIGN:
            return self
        return Segments(self.names, self.shapes, math.gcd(*self.numels))

    def constant(self, key: object, device: torch.device, build: Callable[[torch.device], Tensor]) -> Tensor:
        """A tensor that depends only on the layout, built by ``build(device)`` once per device and kept."""
        slot = (key, str(device))
        value = self._constants.get(slot)
        if value is None:
            value = self._constants[slot] = build(device)
        return value

    def per_row(self, values: Sequence[int], device: torch.device, name: str) -> Tensor:
        """A constant ``(rows, 1)`` integer tensor holding ``values[t]`` on every row of segment ``t`` (int32,
        half the memory of int64, while the values fit: an index for ``index_select``)."""
        def build(device: torch.device) -> Tensor:
            repeats = torch.tensor([self.rows_of(index) for index in range(len(self))])
            values_ = list(values)
            per_segment = torch.tensor(values_, dtype=index_dtype(max(values_, default=0) + 1))
            return to_device(torch.repeat_interleave(per_segment, repeats).view(-1, 1), device)
        return self.constant(("per_row", name), device, build)

    def row_segments(self, device: torch.device) -> Tensor:
        """A constant int32 tensor: the segment of every row (an index)."""
        return self.per_row(range(len(self)), device, "segment").view(-1)

    def row_lengths(self, device: torch.device) -> Tensor:
        """A constant int64 tensor: the rows of every segment (for ``torch.segment_reduce``)."""
        return self.constant("row_lengths", device, lambda device: to_device(torch.tensor(
            [self.rows_of(index) for index in range(len(self))], dtype=torch.int64), device))

    def expand(self, per_segment: Tensor) -> Tensor:
        """``per_segment`` (one value per tensor) as a ``(rows, 1)`` tensor, to broadcast over the flat
        buffer viewed as ``(rows, align)``."""
        return self.spread_rows(per_segment, 0).view(-1, 1)

    def spread_rows(self, per_segment: Tensor, dim: int) -> Tensor:
        """``per_segment`` (one value per tensor along ``dim``) repeated over each tensor's rows along
        ``dim``: one gather by the kept :meth:`row_segments` for rows of at least :data:`ROW_INDEX_ALIGN`
        elements (at most 4 bytes of index per 32 elements), else ``repeat_interleave`` by the tensors'
        row counts (an index made per call, 8 bytes per row while it lives: nothing per row kept; two ATen
        operations, a cumulative sum and a gather among their kernels; no host read)."""
        device = per_segment.device
        if self.align >= ROW_INDEX_ALIGN:
            return per_segment.index_select(dim, self.row_segments(device))
        return torch.repeat_interleave(per_segment, self.row_lengths(device), dim=dim, output_size=self.rows)


class SegmentsState(ABC):
    """A compressor's per-parameter state for a whole bucket, as flat buffers laid out like the bucket
    (per-name views of them are what is checkpointed; see
    :meth:`~lightning_gradcomp.exchange.memory.CompressionMemory.bucket_state`)."""

    @abstractmethod
    def get(self, key: str, layout: Optional[Segments] = None) -> Optional[Tensor]:
        """The flat state ``key`` (zero for tensors that have none yet), or ``None`` when no tensor has it.

        ``layout``: a layout of its own for this state (the same names, other shapes; each tensor's state
        is then a view of that shape), default the bucket's (1-D views)."""

    @abstractmethod
    def present(self, key: str, layout: Optional[Segments] = None) -> list[bool]:
        """For every tensor, whether it has state ``key`` of its layout's shape (no device work)."""

    @abstractmethod
    def commit(self, key: str, new: Tensor, layout: Optional[Segments] = None, check_result: bool = False) -> None:
        """Keep ``new`` as the flat state ``key``, the bucket-wise form of
        :meth:`~lightning_gradcomp.compressors.base.CompressContext.commit`: each tensor's part only if
        its context says the gradient was finite (else its previous part stays), without a host read;
        with ``check_result``, only if all of ``new`` is finite (an overflow in the exchange's arithmetic
        keeps the whole bucket's previous state)."""
