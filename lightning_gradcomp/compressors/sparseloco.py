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

On accelerators a whole bucket is compressed at once (:meth:`SparseLoCo.exchange_segments`), with the same
values as per tensor, bit for bit (both paths reduce the statistics by segmented reductions).

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

from lightning_gradcomp.compressors.base import CompressContext, Compressor, Payload, take_verdict
from lightning_gradcomp.compressors.bitpack import pack, pack_rows, packed_nbytes, unpack, unpack_rows
from lightning_gradcomp.core.checks import check_number
from lightning_gradcomp.core.checks import check_int
from lightning_gradcomp.core.device import device_constant, to_device
from lightning_gradcomp.core.protocol import Gather, Outcome, Round, SegmentsOutcome, SegmentsProtocol, stacked
from lightning_gradcomp.core.segments import Segments, SegmentsState, index_dtype
from lightning_gradcomp.core.tensors import index_sum_

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
    capabilities = frozenset({"whole_bucket"})  # the bucket's flat buffer as it is (the base's segment_alignment)
    owns_residual = True  # the accumulator A

    def __init__(self, chunk: int = 4096, k: int = 64, bits: Optional[int] = 2, decay: float = 0.95,
                 aggregate: Literal["chosen", "all"] = "chosen") -> None:
        self.chunk = check_int(chunk, "chunk", 2)
        self.k = check_int(k, "k", 1)
        if self.k > self.chunk:
            raise ValueError(f"`k` must be at most `chunk` ({self.chunk}), got {k!r}")
        self.bits = None if bits is None else check_int(bits, "bits", 1, 8)
        self.decay = check_number(decay, "decay", "a number in [0, 1]", lambda value: 0.0 <= value <= 1.0)
        if aggregate not in ("chosen", "all"):
            raise ValueError(f"`aggregate` must be 'chosen' or 'all', got {aggregate!r}")
        self.aggregate = aggregate

    @property
    def averages_over_senders(self) -> bool:
        return self.aggregate == "chosen"

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
        numel = values.numel()  # one segment, its length kept on the device (no host copy in the steady state)
        mean, std = _mean_and_deviation(values, device_constant(("one segment", numel), values.device,
                                                                lambda: torch.tensor([numel])))
        step = (std * (6.0 / levels)).clamp_min(torch.finfo(torch.float32).tiny)
        # nan_to_num: a non-finite input (voided by the bucket's verdict) must still give valid codes
        codes = ((values - mean) / step + levels // 2).nan_to_num_(0.0).round_().clamp_(0, levels - 1).to(torch.int64)
        sums = index_sum_(values.new_zeros(levels), codes, values)  # a bin's values in a fixed order on GPUs too
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
    def segments_fit(self, numels: Sequence[int], align: int) -> bool:
        return True  # any sizes: the plan of groups handles each tensor's shape

    def exchange_segments(self, flat: Tensor, segments: Segments, contexts: Sequence[CompressContext],
                          state: SegmentsState) -> SegmentsProtocol:
        """:meth:`compress` and :meth:`exchange` of every tensor of a bucket: ``A ← β·A + p`` on the flat
        state, then per group of tensors with one chunk length (:class:`_ChunkGroups`) their chunks as the
        rows of one matrix (a view of the bucket, or one ``cat``), one ``topk``, the quantisation with each
        tensor's mean, deviation and lookup from segmented reductions, and on the way back two
        scatter-adds per group into the bucket's sums and counts."""
        plan: _ChunkGroups = segments.constant(("sparseloco", self.chunk, self.k), flat.device,
                                               lambda device: _ChunkGroups(self, segments, device))
        previous = state.get(ACCUMULATOR)
        accumulator = flat.clone() if previous is None else torch.add(flat, previous, alpha=self.decay)
        magnitudes = accumulator.abs() if plan.padded else None  # of every padded group's chunks: read once
        wire = contexts[0].wire_dtype(flat)
        parts: list[Tensor] = []
        sent: list[tuple[Tensor, Tensor]] = []  # per group: this worker's (positions, decoded values)
        for group in plan.groups:
            chunks = plan.chunks(group, accumulator, 0.0)  # padding: value 0
            # padding: magnitude -1, never chosen over a real entry
            ranked = plan.chunks(group, magnitudes, -1.0) if group.padded else chunks.abs()
            within = ranked.topk(group.k, dim=1, sorted=False).indices
            values = chunks.gather(1, within)
            positions = group.positions(within).view(-1)
            parts.append(pack_rows(within.view(-1), group.index_bits))
            if self.bits is None:
                parts.append(values.view(-1).to(wire))
                decoded = parts[-1].to(values.dtype)  # padding: 0 already
            else:
                codes, keys, lookup = self._quantise_segments(values, group, plan.ones)
                parts += [pack_rows(codes.view(-1), self.bits), lookup]
                decoded = lookup.index_select(0, keys.view(-1))
                if group.short:  # a chosen padding entry decodes to its bin's value: not sent
                    decoded = torch.where(group.real(within).view(-1), decoded, 0.0)
            sent.append((positions, decoded))
            accumulator.index_add_(0, positions, decoded.to(accumulator.dtype), alpha=-1.0)  # padding: 0 added
        state.commit(ACCUMULATOR, accumulator)
        (gathered,) = yield Round([Gather(tuple(parts))], last=True)
        step = 2 if self.bits is None else 3
        chosen_mean = self.aggregate == "chosen"

        def write(out: Tensor) -> None:
            workers = len(gathered)
            if chosen_mean:  # the mean over the workers that chose each coordinate (and a spare slot for padding)
                shape = (2, segments.total + plan.spare)
                verdict = take_verdict(contexts)  # NaN for a void bucket: both sums start NaN, so every mean is
                sums, chosen = (torch.zeros(shape, dtype=torch.float32, device=out.device) if verdict is None
                                else verdict.to(torch.float32).expand(shape).clone(
                                    memory_format=torch.contiguous_format)).unbind()
            for number, group in enumerate(plan.groups):
                within = unpack_rows(stacked(gathered, step * number), group.index_bits, group.count)
                within = within.view(workers, group.rows, group.k)
                # chosen padding entries: counted in the spare slot past the bucket's end, or adding 0
                positions = group.positions(within, segments.total if chosen_mean else None)
                if self.bits is None:
                    values = stacked(gathered, step * number + 1).float().reshape(-1)
                else:
                    codes = unpack_rows(stacked(gathered, step * number + 1), self.bits, group.count)
                    keys = codes.view(workers, group.rows, group.k).add_(group.key_base).view(workers, -1)
                    values = stacked(gathered, step * number + 2).gather(1, keys).view(-1)  # each worker's lookups
                if chosen_mean:
                    index_sum_(sums, positions.view(-1), values)  # the same sums on every rank (counts are exact)
                    chosen.index_add_(0, positions.view(-1), plan.ones.expand(values.numel()))
                    continue
                # a chosen padding entry adds 0, past its member (values sent as they are: its own 0)
                if group.short and self.bits is not None:
                    values = torch.where(group.real(within).view(-1), values, 0.0)
                # as per tensor: out += v / N, worker after worker
                index_sum_(out, positions.view(-1), values.to(out.dtype), alpha=1.0 / workers)
            if chosen_mean:
                torch.div(sums[:segments.total], chosen[:segments.total].clamp_min_(1.0), out=out)

        def subtract(residual: Tensor) -> None:
            for positions, decoded in sent:
                residual.index_add_(0, positions, decoded.to(residual.dtype), alpha=-1.0)

        # the mean over choosers is divided into every element; the mean over all workers is scatter-added
        return SegmentsOutcome(plan.counts, subtract, write, overwrites=chosen_mean, adds=not chosen_mean)

    def _quantise_segments(self, values: Tensor, group: "_ChunkGroup", ones: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`_quantise` of every member tensor's selected values (``(rows, k)``, a row per chunk) at once
        (segmented mean and deviation, one lookup of ``2^bits`` per member): ``(codes, keys, lookups)`` with
        ``keys = member·2^bits + code``, the index of each value's decoded value in ``lookups`` (``ones``: a
        kept 1.0, expanded to count the values of each code)."""
        levels = 2 ** self.bits
        values = values.float()  # as per tensor: fp32 statistics and lookups, also for fp64 gradients
        mean, std = _mean_and_deviation(values, group.value_lengths, group.member)
        step = (std * (6.0 / levels)).clamp_min_(torch.finfo(torch.float32).tiny)
        codes = ((values - mean.index_select(0, group.member).unsqueeze(1))
                 / step.index_select(0, group.member).unsqueeze(1) + levels // 2)
        codes = codes.nan_to_num_(0.0).round_().clamp_(0, levels - 1)
        codes = codes.to(torch.int64)
        keys = (codes + group.key_base).view(-1)
        sums, counts = values.new_zeros(2, group.members * levels).unbind()
        index_sum_(sums, keys, values.view(-1))
        counts.index_add_(0, keys, ones.expand(keys.numel()))
        return codes, keys, sums.div_(counts.clamp_min_(1.0))


def _mean_and_deviation(values: Tensor, lengths: Tensor, member: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Per segment of ``values`` (``lengths``), the mean ``μ`` and the deviation ``σ = √(mean((v − μ)²))``, by
    segmented reductions: one tensor's statistics are the same numbers per tensor and in a bucket (the same
    reduction over the same values). ``values``: 1-D for one segment, or ``(rows, k)`` with ``member`` the
    segment of each row (needed for more than one)."""
    mean = torch.segment_reduce(values.reshape(-1), "mean", lengths=lengths, unsafe=True)
    centered = values - (mean if member is None else mean.index_select(0, member).unsqueeze(1))
    return mean, torch.segment_reduce(centered.square().view(-1), "mean", lengths=lengths, unsafe=True).sqrt_()


@dataclass
class _ChunkGroup:
    """The tensors of a bucket with one chunk length: their chunks as the rows of one ``(rows, length)``
    matrix, in the bucket's order.

    The matrix is a view of the bucket's flat buffer where the members lie end to end and fill whole
    chunks (:attr:`pieces` is one run of elements), else one ``cat`` of runs of the buffer and of the
    padding that completes each member's last chunk. Everything else is kept per row (a chunk): where it
    starts in the bucket (a chosen entry's position is that plus its index in the chunk), how many of its
    entries are real, its member: a few bytes per chunk, no index per element."""

    length: int
    k: int
    index_bits: int
    rows: int  # chunks of all members
    members: int
    pieces: tuple[tuple[int, int, int], ...]  # (start, stop, padding): the matrix is these runs, each then padded
    base: Tensor  # (rows, 1) where each chunk starts in the bucket
    valid: Optional[Tensor]  # (rows, 1) real entries of each chunk, where some chunk may have padding chosen
    last: Optional[int]  # the bucket's last position, where a chosen padding entry's could lie past it
    member: Tensor  # (rows,) which member each chunk belongs to
    key_base: Tensor  # (rows, 1) member·2^bits, the first key of each chunk's member's lookup
    value_lengths: Tensor  # (members,) selected values per member

    @property
    def count(self) -> int:
        return self.rows * self.k

    @property
    def padded(self) -> bool:
        """Whether a member's last chunk is padded."""
        return any(padding for _, _, padding in self.pieces)

    @property
    def short(self) -> bool:
        """Whether a chunk has fewer than ``k`` real entries, so that padding may be chosen (else it never is:
        its magnitude, -1, ranks below every real entry)."""
        return self.valid is not None

    def chunks(self, flat: Tensor, fill: Optional[Tensor]) -> Tensor:
        """``(rows, length)``: the members' chunks in ``flat`` (laid out as the bucket), padded from ``fill``
        (a kept tensor of the padding's value, as long as any padding; ``None`` without padding): a view of
        ``flat``, or one ``cat``."""
        if len(self.pieces) == 1 and not self.padded:
            start, stop, _ = self.pieces[0]
            return flat[start:stop].view(self.rows, self.length)
        pieces: list[Tensor] = []
        for start, stop, padding in self.pieces:
            pieces.append(flat[start:stop])
            if padding:
                pieces.append(fill[:padding])  # type: ignore[index]
        return torch.cat(pieces).view(self.rows, self.length)

    def positions(self, within: Tensor, spare: Optional[int] = None) -> Tensor:
        """Positions in the bucket of entries ``within`` their chunks (``(..., rows, k)``). A chosen padding
        entry's (short groups) is ``spare`` if given, else one past its member's end, inside the bucket: its
        value must add 0 there."""
        positions = within + self.base
        if self.valid is None:
            return positions
        if spare is not None:
            return torch.where(self.real(within), positions, spare)
        return positions.clamp_max_(self.last) if self.last is not None else positions

    def real(self, within: Tensor) -> Tensor:
        """Whether entries ``within`` their chunks (``(..., rows, k)``) are real, not padding (short groups)."""
        return within < self.valid


class _ChunkGroups:
    """Constants of SparseLoCo's bucket-wise exchange for one layout: each tensor's chunk layout, the tensors
    grouped by chunk length (in order of first appearance)."""

    def __init__(self, compressor: SparseLoCo, segments: Segments, device: torch.device) -> None:
        layouts = [compressor._layout(numel) for numel in segments.numels]
        self.counts = [chunks * k for _, chunks, k, _ in layouts]
        levels = 2 ** compressor.bits if compressor.bits is not None else 1
        members: dict[int, list[int]] = {}
        for index, (length, _, _, _) in enumerate(layouts):
            members.setdefault(length, []).append(index)
        self.groups = [self._group(segments, layouts, indices, levels, device) for indices in members.values()]
        self.padded = any(group.padded for group in self.groups)
        #: a slot past the bucket's end for the counts of chosen padding entries
        self.spare = int(any(group.short for group in self.groups))
        self.ones = to_device(torch.ones(1), device)  # expanded: a count of 1 per value, without a tensor of them
        self._device = device
        self._fills: dict[tuple[float, torch.dtype], Tensor] = {}

    @staticmethod
    def _group(segments: Segments, layouts: list[tuple[int, int, int, int]], indices: list[int], levels: int,
               device: torch.device) -> _ChunkGroup:
        """The :class:`_ChunkGroup` of the tensors ``indices`` (one chunk length). Planned on the host from
        the layout alone (nothing read from a tensor)."""
        length, _, k, index_bits = layouts[indices[0]]
        pieces: list[list[int]] = []  # [start, stop, padding]
        base: list[int] = []
        valid: list[int] = []
        member: list[int] = []
        short = overhang = False
        for position, index in enumerate(indices):
            start, numel, chunks = segments.starts[index], segments.numels[index], layouts[index][1]
            padding = chunks * length - numel
            if pieces and not pieces[-1][2] and pieces[-1][1] == start:  # follows on from the previous run
                pieces[-1][1:] = [start + numel, padding]
            else:
                pieces.append([start, start + numel, padding])
            base += [start + chunk * length for chunk in range(chunks)]
            valid += [length] * (chunks - 1) + [length - padding]
            member += [position] * chunks
            if length - padding < k:  # the last chunk: padding may be chosen, its position past the member
                short = True
                overhang = overhang or start + chunks * length > segments.total

        def as_row(values: list[int], dtype: torch.dtype) -> Tensor:  # one value per chunk, as (rows, 1)
            return to_device(torch.tensor(values, dtype=dtype).view(-1, 1), device)

        return _ChunkGroup(
            length=length, k=k, index_bits=index_bits, rows=len(base), members=len(indices),
            pieces=tuple((start, stop, padding) for start, stop, padding in pieces),
            base=as_row(base, index_dtype(segments.total)),
            valid=as_row(valid, torch.int32) if short else None,
            last=segments.total - 1 if overhang else None,
            member=as_row(member, torch.int32).view(-1),
            key_base=as_row([position * levels for position in member], index_dtype(len(indices) * levels)),
            value_lengths=to_device(torch.tensor([layouts[index][1] * k for index in indices]), device))

    def chunks(self, group: _ChunkGroup, flat: Tensor, padding: float) -> Tensor:
        """``group``'s chunks in ``flat`` (:meth:`_ChunkGroup.chunks`), padded with the value ``padding``."""
        return group.chunks(flat, self._fill(padding, flat.dtype) if group.padded else None)

    def _fill(self, value: float, dtype: torch.dtype) -> Tensor:
        """A kept tensor of ``value``, as long as the longest padding: what a ``cat`` puts after a run."""
        key = (value, dtype)
        if key not in self._fills:
            length = max(padding for group in self.groups for _, _, padding in group.pieces)
            self._fills[key] = to_device(torch.full((length,), value, dtype=dtype), self._device)
        return self._fills[key]
