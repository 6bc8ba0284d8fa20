"""Dense formats: no compression, and casts to 16-bit floats.

``FP16`` and ``BF16`` halve the bytes of an fp32 gradient. Their payloads are all-reducible, and the engine
divides by the world size before the 16-bit all-reduce, so the sum stays within range whenever each worker's
value does; a gradient element beyond fp16's ±65504 still overflows in the cast, which ``FP16`` treats as a
non-finite gradient (prefer ``BF16``, with fp32's range, for such models).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import all_finite, CompressContext, Compressor, Payload, take_verdict
from lightning_gradcomp.core.protocol import Mean, Round, SegmentsOutcome, SegmentsProtocol
from lightning_gradcomp.core.segments import Segments, SegmentsState
from lightning_gradcomp.core.tensors import all_finite_many


class _DenseSegments(Compressor):
    """A whole bucket's tensors cast to the wire dtype and averaged by one all-reduce of the flat buffer
    (segments without gaps): the same values as each tensor's own all-reducible payload.

    :meth:`exchange_segments` only reads its input (the capability ``reads_flat_only``), and its ``write`` reads only the
    mean: a lone gradient of the state dtype is then handed over as it is, and its result written back into
    it (:func:`~lightning_gradcomp.exchange.pipeline.WorkerPipeline.segments_protocol`): for ``none`` on fp32
    gradients one copy (the engine's merge into the all-reduce), one division and one write of the bucket."""

    #: whole buckets on accelerators (one cast, one all-reduce, one write; the base's :meth:`segment_alignment`)
    capabilities = frozenset({"whole_bucket", "reads_flat_only"})

    @property
    def all_reducible(self) -> bool:
        return True

    def payload_numels(self, numel: int, count: int) -> tuple[int, ...]:
        return (numel,)

    def compress(self, tensor: Tensor, ctx: CompressContext) -> Payload:
        return Payload((tensor.to(self._wire(ctx, tensor)),), tensor.numel(), tensor.numel())

    def _wire(self, ctx: CompressContext, tensor: Tensor) -> torch.dtype:
        """The dtype a tensor (or the bucket) is sent in."""
        raise NotImplementedError

    def _check_sent(self, sent: Tensor, segments: Segments, contexts: Sequence[CompressContext]) -> None:
        """Set each context's ``finite`` from what is sent, where the compressor :attr:`checks_finite`
        (FP16: a value beyond the wire format's range becomes inf in the cast); nothing by default."""

    def exchange_segments(self, flat: Tensor, segments: Segments, contexts: Sequence[CompressContext],
                          state: SegmentsState) -> SegmentsProtocol:
        sent = flat.to(self._wire(contexts[0], flat))
        self._check_sent(sent, segments, contexts)
        (mean,) = yield Round([Mean(sent)], last=True)

        def write(out: Tensor) -> None:
            verdict = take_verdict(contexts)  # NaN for a void bucket: added as the mean is written
            if verdict is None:
                out.copy_(mean)
            else:
                torch.add(mean, verdict, out=out)

        def subtract(residual: Tensor) -> None:
            residual.sub_(sent.to(residual.dtype))

        return SegmentsOutcome(segments.numels, subtract, write, overwrites=True)


class NoCompression(_DenseSegments):
    """Sends the gradient as it is: the same all-reduce as plain DDP, through the same hook."""

    name = "none"
    biased = False
    capabilities = _DenseSegments.capabilities

    def part_dtypes(self, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        return (dtype,)

    def accumulate(self, payload: Payload, out: Tensor, alpha: float = 1.0) -> None:
        out.add_(payload.parts[0], alpha=alpha)

    def _wire(self, ctx: CompressContext, tensor: Tensor) -> torch.dtype:
        return ctx.wire_dtype(tensor)


class _Cast(_DenseSegments):
    """Round to a 16-bit float format; the all-reduce sums in that format."""

    biased = False
    #: the optional capabilities it provides (:data:`~lightning_gradcomp.compressors.base.CAPABILITIES`)
    capabilities = _DenseSegments.capabilities | {"dense_segments"}
    wire_dtype: torch.dtype = torch.float16

    def part_dtypes(self, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        return (self.wire_dtype,)

    def _wire(self, ctx: CompressContext, tensor: Tensor) -> torch.dtype:
        return self.wire_dtype

    def accumulate(self, payload: Payload, out: Tensor, alpha: float = 1.0) -> None:
        out.add_(payload.parts[0].to(out.dtype), alpha=alpha)

    def dense_segments(self, flat: Tensor, segments: Segments, contexts: Sequence[CompressContext],
                       state: SegmentsState) -> Optional[Tensor]:
        """:meth:`dense` of every small tensor at once: one cast of the flat buffer."""
        return flat.to(self.wire_dtype)

    def dense(self, tensor: Tensor, ctx: CompressContext) -> Tensor:
        """Tensors below the strategy's size threshold are cast too, so that a bucket is one 16-bit
        all-reduce (as PyTorch's ``fp16_compress_hook`` casts the whole bucket) instead of one per dtype:
        a second collective per bucket costs more latency than the small tensors' bytes."""
        return tensor.to(self.wire_dtype)


class FP16(_Cast):
    """IEEE half precision (5-bit exponent): 2x fewer bytes than fp32, range ±65504.

    The finiteness of a gradient is judged on its cast (one reduction of the 2-byte values, in place of
    the engine's pass over the gradient): a value beyond ±65504 becomes inf there, and the bucket is
    treated as non-finite (NaN results on every worker, memory unchanged, a warning) instead of sending
    inf silently."""

    name = "fp16"
    capabilities = _Cast.capabilities
    wire_dtype = torch.float16
    checks_finite = True
    nonfinite_hint = ("compressor 'fp16' casts the gradients to fp16, whose range is ±65504: a value beyond it "
                      "becomes inf in the cast and counts as non-finite. If the gradients are fp32 and that large, "
                      "use compressor 'bf16' (fp32's range in as many bytes), or scale the loss down")

    def compress(self, tensor: Tensor, ctx: CompressContext) -> Payload:
        """The cast, and the finiteness of the cast (inf where the gradient exceeds ±65504)."""
        payload = super().compress(tensor, ctx)
        ctx.finite = all_finite(payload.parts[0])
        return payload

    def dense(self, tensor: Tensor, ctx: CompressContext) -> Tensor:
        """The cast of a tensor sent dense; its finiteness is the cast's (the gradient's is implied)."""
        sent = super().dense(tensor, ctx)
        ctx.finite = all_finite(sent)
        return sent

    def dense_segments(self, flat: Tensor, segments: Segments, contexts: Sequence[CompressContext],
                       state: SegmentsState) -> Optional[Tensor]:
        """One cast of the small tensors' flat buffer; their finiteness is the cast's (one multi-tensor
        max-norm of the 2-byte values: a few kernels per bucket, no host read)."""
        sent = super().dense_segments(flat, segments, contexts, state)
        self._check_sent(sent, segments, contexts)
        return sent

    def _check_sent(self, sent: Tensor, segments: Segments, contexts: Sequence[CompressContext]) -> None:
        for ctx, finite in zip(contexts, all_finite_many(segments.views(sent))):
            ctx.finite = finite

    def check_gradient_dtype(self, dtype: torch.dtype) -> None:
        """Refuse bfloat16 gradients: as many bytes in fp16, and values beyond ±65504 would become infinite."""
        if dtype == torch.bfloat16:
            raise ValueError("compressor 'fp16' on bfloat16 gradients sends as many bytes and turns values beyond "
                             "fp16's ±65504 into inf; allowed for bfloat16 gradients: 'bf16' (or 'none', the same "
                             "bytes), or any other compressor")


class BF16(_Cast):
    """bfloat16 (8-bit exponent, 7-bit mantissa): 2x fewer bytes than fp32, fp32's range."""

    name = "bf16"
    capabilities = _Cast.capabilities
    wire_dtype = torch.bfloat16
