"""SparseLoCo's compressor: chunk-wise Top-k of a decaying error-feedback accumulator, 2-bit values.

Sarfi et al. 2025, "Communication Efficient LLM Pre-training with SparseLoCo" (arXiv 2508.15706), the
outer-gradient compressor of its Algorithm 1, per tensor ``p`` (the outer gradient ``Δ``, or a gradient
when used every step)::

    A ← β·A + p                                  error feedback with decay β (0.95)
    per chunk of L elements (4096): the k (64) entries of A of largest |A|
    values: μ, σ = mean, std of the selected values; s = 6σ / 2^b;
            code = clamp(round((v − μ)/s + 2^(b−1)), 0, 2^b − 1);  sent: codes (b bits each) and the
            per-bin lookup m_c = mean of the selected values with code c (2^b fp32)
    A ← A − decode(sent)                         what was sent, quantisation included, leaves A
    aggregate: at each coordinate, the mean of the decoded values of the workers that chose it
               (``aggregate="chosen"``, the reference's scatter-mean) or of all N (``"all"``)

Indices within a chunk take ⌈log₂ L⌉ bits (12 for 4096), bit-packed. At the defaults an fp32 tensor
costs 64·(12 + 2)/8 bytes + 16 per tensor per 4096 elements: about 146x fewer bytes than fp32.

On accelerators a whole bucket is compressed at once (:meth:`SparseLoCo.exchange_segments`): the tensors
grouped by chunk length, each group's chunks gathered into one matrix, selected by one ``topk``, the
per-tensor statistics and lookups by segmented reductions (the per-tensor path reduces its statistics
the same way): the same values as per tensor, bit for bit.

Chunks here are contiguous runs of ``L`` elements of the flattened tensor (the paper tiles 2-D weights
in 64 x 64 blocks; for a row-major weight whose rows hold at least ``L`` elements the two coincide
up to the block's shape); the last chunk of a tensor whose size ``L`` does not divide is padded, and
the padding is never selected while the chunk holds ``k`` real entries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Optional, Sequence

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import CompressContext, Compressor, Payload
from lightning_gradcomp.compressors.bitpack import pack, pack_rows, packed_nbytes, unpack, unpack_rows
from lightning_gradcomp.core.checks import check_int
from lightning_gradcomp.core.device import device_constant, to_device
from lightning_gradcomp.core.protocol import Gather, Outcome, Round, SegmentsOutcome, SegmentsProtocol, stacked
from lightning_gradcomp.core.segments import Segments, SegmentsState

#: the compressor state key of the error-feedback accumulator ``A``
ACCUMULATOR = "accumulator"


class SparseLoCo(Compressor):
    """Chunk-wise Top-k with a decaying accumulator and ``bits``-bit values (SparseLoCo).

    Args:
        chunk: ``L``, the elements of a chunk (the paper's 4096).
        k: entries sent per chunk (64: density 1/64).
        bits: bits per value, 1 to 8 (2, the paper's), or ``None`` to send values in the gradient's dtype.
        decay: ``β``, the accumulator's decay in ``[0, 1]`` (0.95; 1 is plain error feedback).
        aggregate: ``"chosen"`` (the mean over the workers that chose a coordinate, the reference's) or
            ``"all"`` (the mean over all workers, an unbiased estimate of the average when each worker's
            message is).
    """

    name = "sparseloco"
    owns_residual = True  # the accumulator A

    def __init__(self, chunk: int = 4096, k: int = 64, bits: Optional[int] = 2, decay: float = 0.95,
                 aggregate: Literal["chosen", "all"] = "chosen") -> None:
        self.chunk = check_int(chunk, "chunk", 2)
        self.k = check_int(k, "k", 1)
        if self.k > self.chunk:
            raise ValueError(f"`k` must be at most `chunk` ({self.chunk}), got {k!r}")
        self.bits = None if bits is None else check_int(bits, "bits", 1, 8)
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay <= 1.0:
            raise ValueError(f"`decay` must be a number in [0, 1], got {decay!r}")
        self.decay = float(decay)
        if aggregate not in ("chosen", "all"):
            raise ValueError(f"`aggregate` must be 'chosen' or 'all', got {aggregate!r}")
        self.aggregate = aggregate

    def hparams(self) -> dict[str, Any]:
        return {"chunk": self.chunk, "k": self.k, "bits": self.bits, "decay": self.decay,
                "aggregate": self.aggregate}

    # ------------------------------------------------------------------ the wire format
    def _layout(self, numel: int) -> tuple[int, int, int, int]:
        """``(chunk length, chunks, entries per chunk, index bits)`` of a tensor of ``numel`` elements."""
        length = min(self.chunk, numel)
        chunks = -(-numel // length)
        return length, chunks, min(self.k, length), max(1, math.ceil(math.log2(length)))

    def static_count(self, numel: int) -> Optional[int]:
        _, chunks, k, _ = self._layout(numel)
        return chunks * k

    def part_dtypes(self, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        return (torch.uint8, torch.uint8, torch.float32) if self.bits is not None else (torch.uint8, dtype)

    def payload_numels(self, numel: int, count: int) -> tuple[int, ...]:
        index_bits = self._layout(numel)[3]
        if self.bits is None:
            return (packed_nbytes(count, index_bits), count)
        return (packed_nbytes(count, index_bits), packed_nbytes(count, self.bits), 2 ** self.bits)

    # ------------------------------------------------------------------ compress and decode
    def compress(self, tensor: Tensor, ctx: CompressContext) -> Payload:
        numel = tensor.numel()
        length, chunks, k, index_bits = self._layout(numel)
        previous = ctx.state.get(ACCUMULATOR)
        grad = tensor.float() if tensor.dtype not in (torch.float32, torch.float64) else tensor
        accumulator = grad.clone() if previous is None or previous.shape != grad.shape else \
            torch.add(grad, previous, alpha=self.decay)
        padded = accumulator.new_zeros(chunks * length)
        padded[:numel] = accumulator
        magnitudes = padded.abs()
        magnitudes[numel:] = -1.0  # padding is never chosen over a real entry
        within = magnitudes.view(chunks, length).topk(k, dim=1, sorted=False).indices
        values = padded.view(chunks, length).gather(1, within).reshape(-1)
        parts: tuple[Tensor, ...] = (pack(within.reshape(-1), index_bits),)
        if self.bits is None:
            parts += (values.to(ctx.wire_dtype(tensor)),)
        else:
            codes, lookup = self._quantise(values)
            parts += (pack(codes, self.bits), lookup)
        payload = Payload(parts, numel, chunks * k)
        sent = torch.zeros_like(accumulator)
        self.accumulate(payload, sent)
        ctx.commit(ACCUMULATOR, accumulator.sub_(sent))
        return payload

    def _quantise(self, values: Tensor) -> tuple[Tensor, Tensor]:
        """``bits``-bit codes of ``values`` around their mean in steps of ``6σ / 2^bits``, and the mean of
        the values of each code (the decoder's lookup; 0 for an empty bin). No host read."""
        levels = 2 ** self.bits
        values = values.float()
        mean, std = _mean_and_deviation(values, _one_segment(values.numel(), values.device))
        step = (std * (6.0 / levels)).clamp_min(torch.finfo(torch.float32).tiny)
        # nan_to_num: a non-finite input (voided by the bucket's verdict) must still give valid codes
        codes = ((values - mean) / step + levels // 2).nan_to_num_(0.0).round_().clamp_(0, levels - 1).to(torch.int64)
        sums = values.new_zeros(levels).index_add_(0, codes, values)
        counts = values.new_zeros(levels).index_add_(0, codes, torch.ones_like(values))
        return codes, sums / counts.clamp_min(1.0)

    def _decode(self, payload: Payload) -> tuple[Tensor, Tensor, Tensor]:
        """Positions in the tensor, decoded fp32 values, and 1 for every real entry (0 for padding, whose
        position is mapped to 0 and its value to 0)."""
        numel, count = payload.numel, payload.count
        length, chunks, k, index_bits = self._layout(numel)
        within = unpack(payload.parts[0], index_bits, count).view(chunks, k)
        offsets = torch.arange(chunks, device=within.device).mul_(length).unsqueeze(1)
        positions = (within + offsets).reshape(-1)
        if self.bits is None:
            values = payload.parts[1].float()
        else:
            values = payload.parts[2][unpack(payload.parts[1], self.bits, count)]
        if chunks * length == numel:
            return positions, values, torch.ones_like(values)
        real = positions < numel
        return positions.where(real, 0), values.where(real, 0.0), real.float()

    def accumulate(self, payload: Payload, out: Tensor, alpha: float = 1.0) -> None:
        positions, values, _ = self._decode(payload)
        out.index_add_(0, positions, values.to(out.dtype), alpha=alpha)

    def exchange(self, tensor: Tensor, ctx: CompressContext):
        """One gather; with ``aggregate="chosen"`` each coordinate is the mean over the workers that sent it."""
        if self.aggregate == "all":
            return (yield from super().exchange(tensor, ctx))
        payload = self.compress(tensor, ctx)
        self.check_payload(payload, ctx.wire_dtype(tensor), ctx.name)
        (rows,) = yield Round([Gather(payload.parts)], last=True)
        received = [Payload(row.parts, payload.numel, payload.count) for row in rows]

        def write(out: Tensor) -> None:
            sums = torch.zeros(out.numel(), dtype=torch.float32, device=out.device)
            chosen = torch.zeros_like(sums)
            for item in received:
                positions, values, real = self._decode(item)
                sums.index_add_(0, positions, values)
                chosen.index_add_(0, positions, real)
            out.copy_(sums.div_(chosen.clamp_min_(1.0)))

        return Outcome(payload.count, lambda residual: self.accumulate(payload, residual, alpha=-1.0), write, payload)

    # ------------------------------------------------------------------ a whole bucket at once
    def segment_alignment(self, device: torch.device) -> Optional[int]:
        return self._whole_flat_buffer_on_accelerators(device, SparseLoCo)

    def segments_fit(self, numels: Sequence[int], align: int) -> bool:
        return True  # any sizes: the plan of groups handles each tensor's shape

    def exchange_segments(self, flat: Tensor, segments: Segments, contexts: Sequence[CompressContext],
                          state: SegmentsState) -> SegmentsProtocol:
        """:meth:`compress` and :meth:`exchange` of every tensor of a bucket: ``A ← β·A + p`` on the flat
        state, then per group of tensors with one chunk length (:class:`_ChunkGroups`) one gather of their
        chunks, one ``topk``, the quantisation with each tensor's mean, deviation and lookup from segmented
        reductions, and on the way back two scatter-adds per group into the bucket's sums and counts."""
        plan: _ChunkGroups = segments.constant(("sparseloco", self.chunk, self.k), flat.device,
                                               lambda device: _ChunkGroups(self, segments, device))
        previous = state.get(ACCUMULATOR)
        accumulator = flat.clone() if previous is None else torch.add(flat, previous, alpha=self.decay)
        wire = contexts[0].wire_dtype(flat)
        parts: list[Tensor] = []
        sent: list[tuple[Tensor, Tensor]] = []  # per group: this worker's (positions, decoded values)
        for group in plan.groups:
            chunks = accumulator.index_select(0, group.gather).view(group.rows, group.length)
            magnitudes = chunks.abs()
            if group.keep is not None:  # padding: value 0, never chosen over a real entry
                chunks = chunks.mul(group.keep.view(group.rows, group.length))
                magnitudes.masked_fill_(group.padding, -1.0)
            within = magnitudes.topk(group.k, dim=1, sorted=False).indices
            values = chunks.gather(1, within).view(-1)
            positions = group.gather.view(group.rows, group.length).gather(1, within).view(-1)
            parts.append(pack_rows(within.view(-1), group.index_bits))
            if self.bits is None:
                parts.append(values.to(wire))
                decoded = parts[-1].to(values.dtype)  # padding: 0 already
            else:
                codes, keys, lookup = self._quantise_segments(values, group)
                parts += [pack_rows(codes, self.bits), lookup]
                decoded = lookup.index_select(0, keys)
                if group.keep is not None:  # a chosen padding entry decodes to its bin's value: not sent
                    decoded = decoded.mul_(group.keep.view(group.rows, group.length).gather(1, within).view(-1))
            sent.append((positions, decoded))
            accumulator.index_add_(0, positions, decoded.to(accumulator.dtype), alpha=-1.0)  # padding: 0 added
        state.commit(ACCUMULATOR, accumulator)
        (gathered,) = yield Round([Gather(tuple(parts))], last=True)
        step = 2 if self.bits is None else 3

        def write(out: Tensor) -> None:
            workers = len(gathered)
            chosen_mean = self.aggregate == "chosen"
            if chosen_mean:  # the mean over the workers that chose each coordinate
                sums, chosen = torch.zeros(2, segments.total, dtype=torch.float32, device=out.device).unbind()
            for number, group in enumerate(plan.groups):
                within = unpack_rows(stacked(gathered, step * number), group.index_bits, group.count)
                within = within.view(workers, group.rows, group.k)
                chunk_positions = group.gather.view(1, group.rows, group.length).expand(workers, -1, -1)
                positions = chunk_positions.gather(2, within).view(-1)
                if self.bits is None:
                    values = stacked(gathered, step * number + 1).float().reshape(-1)
                else:
                    codes = unpack_rows(stacked(gathered, step * number + 1), self.bits, group.count)
                    lookups = stacked(gathered, step * number + 2).reshape(-1)
                    values = lookups.index_select(0, codes.add_(group.worker_key_base(workers)).reshape(-1))
                real = None if group.keep is None else \
                    group.keep.view(1, group.rows, group.length).expand(workers, -1, -1).gather(2, within).view(-1)
                if real is not None:  # a chosen padding entry adds 0 (at a real position)
                    values = values * real
                if not chosen_mean:  # as per tensor: out += v / N, worker after worker
                    out.index_add_(0, positions, values.to(out.dtype), alpha=1.0 / workers)
                    continue
                sums.index_add_(0, positions, values)
                chosen.index_add_(0, positions, torch.ones_like(values) if real is None else real)
            if chosen_mean:
                torch.div(sums, chosen.clamp_min_(1.0), out=out)

        def subtract(residual: Tensor) -> None:
            for positions, decoded in sent:
                residual.index_add_(0, positions, decoded.to(residual.dtype), alpha=-1.0)

        return SegmentsOutcome(plan.counts, subtract, write)

    def _quantise_segments(self, values: Tensor, group: "_ChunkGroup") -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`_quantise` of every member tensor's selected values at once (segmented mean and deviation,
        one lookup of ``2^bits`` per member): ``(codes, keys, lookups)`` with ``keys = member·2^bits + code``,
        the index of each value's decoded value in ``lookups``."""
        levels = 2 ** self.bits
        values = values.float()  # as per tensor: fp32 statistics and lookups, also for fp64 gradients
        member = group.member_of_value
        mean, std = _mean_and_deviation(values, group.value_lengths, member)
        step = (std * (6.0 / levels)).clamp_min_(torch.finfo(torch.float32).tiny)
        codes = ((values - mean.index_select(0, member)) / step.index_select(0, member) + levels // 2)
        codes = codes.nan_to_num_(0.0).round_().clamp_(0, levels - 1)
        codes = codes.to(torch.int64)
        keys = codes + group.key_base
        sums, counts = values.new_zeros(2, group.members * levels).unbind()
        sums.index_add_(0, keys, values)
        counts.index_add_(0, keys, torch.ones_like(values))
        return codes, keys, sums.div_(counts.clamp_min_(1.0))


def _mean_and_deviation(values: Tensor, lengths: Tensor, member: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Per segment of ``values`` (``lengths``; ``member``: each value's segment, needed for more than one),
    the mean ``μ`` and the deviation ``σ = √(mean((v − μ)²))``, by segmented reductions: one tensor's
    statistics are the same numbers per tensor and in a bucket (the same reduction over the same values)."""
    mean = torch.segment_reduce(values, "mean", lengths=lengths, unsafe=True)
    centered = values - (mean if member is None else mean.index_select(0, member))
    return mean, torch.segment_reduce(centered.square(), "mean", lengths=lengths, unsafe=True).sqrt_()


def _one_segment(numel: int, device: torch.device) -> Tensor:
    """``[numel]`` as a segment length on ``device``, kept (no host copy in the steady state)."""
    return device_constant(("one segment", numel), device, lambda: torch.tensor([numel]))


@dataclass
class _ChunkGroup:
    """The tensors of a bucket with one chunk length: their chunks as the rows of one matrix."""

    length: int
    k: int
    index_bits: int
    rows: int  # chunks of all members
    members: int
    gather: Tensor  # (rows·length,) flat position of every chunk element (padding: a real position)
    keep: Optional[Tensor]  # (rows·length,) 1.0 for a real element, 0.0 for padding; None without padding
    padding: Optional[Tensor]  # keep == 0 as a (rows, length) bool mask
    member_of_value: Tensor  # (rows·k,) which member each selected value belongs to
    value_lengths: Tensor  # (members,) selected values per member
    key_base: Tensor  # (rows·k,) member·2^bits, the first key of each value's lookup
    levels: int
    _worker_bases: dict

    @property
    def count(self) -> int:
        return self.rows * self.k

    def worker_key_base(self, workers: int) -> Tensor:
        """``(workers, rows·k)`` keys' bases into every worker's lookups laid end to end, kept per count."""
        if workers not in self._worker_bases:
            offsets = torch.arange(workers, device=self.key_base.device).view(-1, 1) * (self.members * self.levels)
            self._worker_bases[workers] = self.key_base.view(1, -1) + offsets
        return self._worker_bases[workers]


class _ChunkGroups:
    """Constants of SparseLoCo's bucket-wise exchange for one layout: each tensor's chunk layout, and the
    tensors grouped by chunk length (in order of first appearance)."""

    def __init__(self, compressor: SparseLoCo, segments: Segments, device: torch.device) -> None:
        layouts = [compressor._layout(numel) for numel in segments.numels]
        self.counts = [chunks * k for _, chunks, k, _ in layouts]
        levels = 2 ** compressor.bits if compressor.bits is not None else 1
        members: dict[int, list[int]] = {}
        for index, (length, _, _, _) in enumerate(layouts):
            members.setdefault(length, []).append(index)
        self.groups: list[_ChunkGroup] = []
        for length, indices in members.items():
            _, _, k, index_bits = layouts[indices[0]]
            gather, keep, member_rows = [], [], []
            for position, index in enumerate(indices):
                numel, chunks = segments.numels[index], layouts[index][1]
                offsets = torch.arange(chunks * length)
                real = offsets < numel
                gather.append(torch.where(real, offsets + segments.starts[index], segments.starts[index]))
                keep.append(real.float())
                member_rows.append(torch.full((chunks,), position))
            keep_all = torch.cat(keep)
            padded = any(layouts[index][1] * length > segments.numels[index] for index in indices)
            rows = sum(layouts[index][1] for index in indices)
            member_of_value = torch.cat(member_rows).repeat_interleave(k)
            self.groups.append(_ChunkGroup(
                length=length, k=k, index_bits=index_bits, rows=rows, members=len(indices),
                gather=to_device(torch.cat(gather), device),
                keep=to_device(keep_all, device) if padded else None,
                padding=to_device((keep_all == 0).view(rows, length), device) if padded else None,
                member_of_value=to_device(member_of_value, device),
                value_lengths=to_device(torch.tensor([layouts[index][1] * k for index in indices]), device),
                key_base=to_device(member_of_value * levels, device), levels=levels, _worker_bases={}))
