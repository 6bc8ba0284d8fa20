"""QSGD: unbiased stochastic quantisation with bit-packed codes (Alistarh et al., NeurIPS 2017)."""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import CompressContext, Compressor, Payload, check_int, take_verdict
from lightning_gradcomp.compressors.bitpack import pack, pack_grouped, packed_nbytes, unpack, unpack_grouped
from lightning_gradcomp.compressors.scratch import scratch
from lightning_gradcomp.core.device import device_constant, host_reads_allowed, to_device
from lightning_gradcomp.core.protocol import Gather, Round, SegmentsOutcome, SegmentsProtocol, stacked
from lightning_gradcomp.core.segments import Segments, SegmentsState

#: Largest ``bucket_size`` laid out as rows of the flat buffer; larger ones are one scale per tensor.
ROW_BUCKETS = 8192


class QSGD(Compressor):
    r"""QSGD with ``s = levels`` quantisation levels and one L2 norm per bucket of ``bucket_size``
    elements.

    For each bucket ``v`` of ``d`` elements and each element ``v_i``:

    .. math::
        Q_s(v_i) = \|v\|_2 \cdot \operatorname{sign}(v_i) \cdot \xi_i(v, s), \qquad
        l = \lfloor s |v_i| / \|v\|_2 \rfloor,

    where :math:`\xi_i = (l + 1)/s` with probability :math:`s|v_i|/\|v\|_2 - l` and :math:`l/s` otherwise,
    so :math:`\mathbb{E}[Q_s(v)] = v` (unbiased; error feedback is off by default). Kothari et al. (2021)
    print the two probabilities swapped, which is biased; this follows the original paper.

    Computed as one stochastic rounding of the signed level: with :math:`y_i = s v_i / \|v\|_2` and
    :math:`u_i \sim U[0, 1)`, the code is :math:`c_i = \lfloor s + y_i + u_i \rfloor \in [0, 2s]`, so
    :math:`c_i - s` is :math:`\lfloor y_i \rfloor + 1` with probability :math:`y_i - \lfloor y_i \rfloor`
    (the same distribution as rounding :math:`|y_i|` and keeping the sign), unbiased up to fp32 rounding.

    Wire: one fp32 norm per bucket and, per element, the code ``c_i`` (offset binary: the signed level
    plus ``s``) bit-packed in :math:`b = \lceil\log_2(2s+1)\rceil = \lceil\log_2(s+1)\rceil + 1` bits,
    so ``s = 64, 16, 4`` cost 8, 6 and 4 bits (Harris 2020 counts 7/5/3 by leaving the sign out). Randomness
    comes from a per-step, per-worker generator (on CPU at 16-bit resolution, see :func:`offset_uniform`).

    Args:
        levels: ``s >= 1`` (default 16).
        bucket_size: elements per norm; QSGD uses 512.
        bits: alternatively, the code width in bits (2 to 32), sign included: ``levels = 2**(bits - 1) - 1``
            (given both, they must agree).
    """

    name = "qsgd"
    capabilities = frozenset({"whole_bucket"})
    biased = False

    def __init__(self, levels: Optional[int] = None, bucket_size: int = 512, bits: Optional[int] = None) -> None:
        self.levels = 16 if levels is None else levels
        if bits is not None:
            self.bits = bits
            if levels is not None and self.levels != levels:
                raise ValueError(f"QSGD: `levels` ({levels}) and `bits` ({bits}, i.e. levels={self.levels}) disagree; "
                                 "allowed: one of them, or both describing the same quantiser")
        self.bucket_size = check_int(bucket_size, "bucket_size", 1)

    @property
    def levels(self) -> int:
        """Quantisation levels ``s >= 1``; a schedule may change it between steps."""
        return self._levels

    @levels.setter
    def levels(self, value: int) -> None:
        self._levels = check_int(value, "levels", 1, 2**31 - 1)

    @property
    def bits(self) -> int:
        r"""Bits per element on the wire: level bits plus a sign bit, :math:`\lceil\log_2(s+1)\rceil + 1`.

        Setting ``bits = b`` (2 to 32) picks ``levels = 2**(b - 1) - 1``, the most levels a ``b``-bit code
        holds: the ``b``-bit quantiser a schedule moves along (``bits=8`` is Tirupati et al.'s 8-bit baseline).
        """
        return math.ceil(math.log2(self.levels + 1)) + 1

    @bits.setter
    def bits(self, value: int) -> None:
        self.levels = 2 ** (check_int(value, "bits", 2, 32) - 1) - 1

    def hparams(self) -> dict[str, Any]:
        return {"levels": self.levels, "bucket_size": self.bucket_size}

    def part_dtypes(self, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        return (torch.float32, torch.uint8)

    def payload_numels(self, numel: int, count: int) -> tuple[int, ...]:
        return (-(-numel // self.bucket_size), packed_nbytes(numel, self.bits))

    @property
    def _work_dtype(self) -> torch.dtype:
        """fp32 holds every code exactly up to 2**24; more levels need fp64."""
        return torch.float32 if 2 * self.levels < 2**23 else torch.float64

    def compress(self, tensor: Tensor, ctx: CompressContext) -> Payload:
        numel = tensor.numel()
        flat = tensor.reshape(-1).to(self._work_dtype)
        norms = torch.cat([self._bucket_norms(rows) for rows, _ in self._buckets(flat)])
        scale = self.levels / norms.clamp_min(torch.finfo(norms.dtype).tiny)
        # c = floor(s + y + u) with y = s v / ||v|| in [-s, s]: one stochastic rounding of the signed level
        codes = offset_uniform(numel, self.levels, self._work_dtype,
                               ctx.generator(tensor.device, per_rank=True), tensor.device)  # s + u
        for (rows, where), (code_rows, _) in zip(self._buckets(flat), self._buckets(codes)):
            code_rows.addcmul_(rows, scale[where].unsqueeze(1))
        # The integer codes, padded with zeros to whole groups of 8 (so that pack copies nothing more);
        # the conversion truncates, which is floor for these non-negative values.
        padded = scratch("qsgd.codes", numel + (-numel) % 8, torch.uint8 if self.bits <= 8 else torch.int64,
                         tensor.device)
        padded[numel:].zero_()
        padded[:numel].copy_(codes)
        packed = pack(padded.clamp_(0, 2 * self.levels), self.bits)
        return Payload((norms.float(), packed), numel, numel)

    def accumulate(self, payload: Payload, out: Tensor, alpha: float = 1.0) -> None:
        norms, packed = payload.parts
        levels = unpack(packed, self.bits, payload.numel,
                        out=scratch("qsgd.levels", payload.numel, self._work_dtype, packed.device)).sub_(self.levels)
        weight = norms.to(levels.dtype) * (alpha / self.levels)
        target = out if out.dtype == levels.dtype else torch.zeros_like(levels)
        for (rows, where), (level_rows, _) in zip(self._buckets(target), self._buckets(levels)):
            rows.addcmul_(level_rows, weight[where].unsqueeze(1))
        if target is not out:
            out.add_(target.to(out.dtype))

    @staticmethod
    def _bucket_norms(rows: Tensor) -> Tensor:
        """The norm of each row (bucket) that scales its levels: ``||v||_2``."""
        return torch.linalg.vector_norm(rows, dim=1)

    # ------------------------------------------------------------------ a whole bucket at once
    def segment_alignment(self, device: torch.device) -> Optional[int]:
        """On accelerators, rows of ``bucket_size`` (one norm each) up to :data:`ROW_BUCKETS` elements, else
        rows of 64 with one scale per tensor; codes of at most 8 bits in fp32. Per tensor on the CPU, and
        for row sizes that are not a multiple of 8 (a tensor's codes are padded to whole bytes)."""
        if host_reads_allowed(device) or self.bits > 8 or self._work_dtype != torch.float32:
            return None
        if self.bucket_size > ROW_BUCKETS:
            return 64
        return self.bucket_size if self.bucket_size % 8 == 0 else None

    def segments_fit(self, numels: Sequence[int], align: int) -> bool:
        """One scale per tensor needs every tensor within one bucket of ``bucket_size``."""
        return self.bucket_size <= ROW_BUCKETS or all(numel <= self.bucket_size for numel in numels)

    def _tensor_norms(self, rows: Tensor, segments: Segments) -> Tensor:
        """``||v||_2`` per tensor from its rows."""
        squares = torch.linalg.vector_norm(rows, dim=1).square_()
        return torch.segment_reduce(squares, "sum", lengths=segments.row_lengths(rows.device), unsafe=True).sqrt_()

    def exchange_segments(self, flat: Tensor, segments: Segments, contexts: Sequence[CompressContext],
                          state: SegmentsState) -> SegmentsProtocol:
        """The same quantisation as :meth:`compress` for every tensor at once: norms by rows, each tensor's
        noise from its own generator (one draw per tensor, as per tensor), one stochastic rounding and one
        packing (:func:`~lightning_gradcomp.compressors.bitpack.pack_grouped`) for the bucket."""
        device, levels, bits = flat.device, self.levels, self.bits
        work = flat.to(self._work_dtype)
        row_count = segments.rows
        grid = work.view(row_count, -1)  # one norm per bucket of every tensor: the rows', or per tensor from them
        norms = self._bucket_norms(grid) if self.bucket_size <= ROW_BUCKETS else self._tensor_norms(grid, segments)
        per_row = norms if self.bucket_size <= ROW_BUCKETS else segments.expand(norms).view(-1)
        per_row = per_row.clamp_min(torch.finfo(norms.dtype).tiny)
        noise = torch.full((segments.total,), levels + 0.5, dtype=work.dtype, device=device)
        for ctx, view in zip(contexts, segments.views(noise)):
            view.uniform_(levels, levels + 1, generator=ctx.generator(device, per_rank=True))
        # c = s + u + s·v/‖v‖ (one fused division: may round differently from the per-tensor s/‖v‖ · v)
        codes = noise.view(row_count, -1).addcdiv_(work.view(row_count, -1), per_row.unsqueeze(1), value=levels)
        codes = codes.view(-1)
        codes = codes.to(torch.uint8).clamp_(0, 2 * levels)
        kept = _sent_spans(segments)
        sent_codes = codes if kept is None else torch.cat([codes[start:start + size] for start, size in kept])
        packed = pack_grouped(sent_codes, bits)
        norms = norms.float()
        (rows,) = yield Round([Gather((norms, packed))], last=True)
        workers = len(rows)

        def decoded(all_codes: Tensor, all_norms: Tensor, alpha: float) -> Tensor:
            """``(..., rows, align)`` values of codes and norms: ``norm · (alpha / s) · (code − s)``."""
            if kept is not None:  # back to the flat layout (the gaps get any code: left out of every result)
                group, index = _spread_index(segments, kept, device)
                lead = all_codes.shape[:-1]
                all_codes = all_codes.view(*lead, -1, group).index_select(-2, index).view(*lead, -1)
            values = torch.sub(all_codes, _level_offset(levels, self._work_dtype, device))  # ints in, floats out
            values = values.view(*all_codes.shape[:-1], row_count, -1)
            weight = all_norms.to(values.dtype) * (alpha / levels)
            if self.bucket_size > ROW_BUCKETS:
                weight = weight.index_select(-1, segments.row_segments(device))
            return values.mul_(weight.unsqueeze(-1))

        def write(out: Tensor) -> None:
            received = unpack_grouped(stacked(rows, 1), bits, None)  # integer codes: `decoded` converts
            received_norms = stacked(rows, 0)
            verdict = take_verdict(contexts)  # NaN for a void bucket: in every norm, so in every value
            if verdict is not None:
                received_norms = received_norms + verdict
            values = decoded(received, received_norms, 1.0 / workers)
            torch.sum(values, dim=0, out=out.view(row_count, -1))

        def subtract(residual: Tensor) -> None:
            residual.view(row_count, -1).add_(decoded(sent_codes, norms, -1.0).to(residual.dtype))

        return SegmentsOutcome(segments.numels, subtract, write, overwrites=True)  # the sum sets every row

    def _buckets(self, flat: Tensor) -> list[tuple[Tensor, slice]]:
        """``flat`` as rows of ``bucket_size`` (views), the last bucket possibly shorter, with the
        positions of their norms."""
        numel, size = flat.numel(), self.bucket_size
        full = numel // size
        parts = []
        if full:
            parts.append((flat[: full * size].view(full, size), slice(0, full)))
        if numel > full * size:
            parts.append((flat[full * size:].view(1, -1), slice(full, full + 1)))
        return parts


#: Bits of each uniform draw of :func:`offset_uniform` on CPU.
NOISE_BITS = 16


def offset_uniform(numel: int, low: float, dtype: torch.dtype, generator: torch.Generator,
                   device: torch.device) -> Tensor:
    r"""``low + u_i`` with ``u_i`` uniform in (0, 1): the thresholds of stochastic rounding, in a
    :func:`~lightning_gradcomp.compressors.scratch.scratch` tensor (tag ``"noise"``).

    On CPU, ``u_i = (r_i + 2^{15} + 1/2) / 2^{16}`` with ``r_i`` a uniform 16-bit integer, four per
    64-bit draw of the generator: about a quarter of the cost of ``torch.rand`` (Mersenne Twister, one
    32-bit draw and a conversion per element; 9-12 copies of the tensor on its own). Rounding
    :math:`\lfloor y + u_i \rfloor` is then up by one with probability :math:`y - \lfloor y \rfloor`
    to within :math:`2^{-17}`, the grid of ``u``: unbiased to a 2^-17 of a quantisation step, far below
    the step's own standard deviation. On accelerators, ``uniform_`` (Philox, about one pass).
    """
    out = scratch("noise", numel, dtype, device)
    if not host_reads_allowed(device):  # the accelerator path (also on CPU tensors under accelerator_path)
        return out.uniform_(low, low + 1, generator=generator)
    lanes_per_word = 64 // NOISE_BITS
    words = scratch("noise.words", -(-numel // lanes_per_word), torch.int64, device)
    words.random_(-(2**63), None, generator=generator)
    out.copy_(words.view(torch.int16)[:numel])  # r, uniform on [-2^15, 2^15)
    offset = torch.tensor(low + 0.5 + 2.0 ** -(NOISE_BITS + 1), dtype=dtype)
    return torch.add(offset, out, alpha=2.0**-NOISE_BITS, out=out)


def _level_offset(levels: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``s`` as a 0-d tensor of ``dtype`` on ``device``, kept: ``codes − s`` of integer codes is then one
    operation that also converts (a 0-d floating operand sets the result's dtype), exact for these small
    integers."""
    return device_constant(("qsgd level offset", levels, dtype), device,
                           lambda: torch.tensor(float(levels), dtype=dtype))


def _sent_spans(segments: Segments) -> Optional[list[tuple[int, int]]]:
    """Where the codes that cross the wire lie in the flat buffer: each tensor's first ``⌈d/8⌉·8`` elements
    (as per tensor), as ``(start, length)`` spans, joined by one ``cat`` (no index); ``None`` when that is
    every element."""
    padded = [-(-numel // 8) * 8 for numel in segments.numels]
    if all(size == segments.rows_of(index) * segments.align for index, size in enumerate(padded)):
        return None
    return list(zip(segments.starts, padded))


def _spread_index(segments: Segments, spans: list[tuple[int, int]], device: torch.device) -> tuple[int, Tensor]:
    """The inverse of joining ``spans``: ``(g, index)`` with the flat buffer in groups of ``g`` elements (the
    largest that divides every span's start and length, at least 8) and, for each group, the group of the
    joined codes it comes from (gaps: group 0, any value); int32, one entry per ``g`` elements (a constant
    of the layout)."""
    group = math.gcd(segments.align, *(size for _, size in spans))

    def build(device: torch.device) -> Tensor:
        index = torch.zeros(segments.total // group, dtype=torch.int32)
        joined = 0
        for start, size in spans:
            index[start // group:(start + size) // group] = torch.arange(joined, joined + size // group)
            joined += size // group
        return to_device(index, device)
    return group, segments.constant(("qsgd-spread", group), device, build)
