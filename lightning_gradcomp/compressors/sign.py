"""The sign family: one bit per element and one scale per tensor.

Wire format of both: the signs bit-packed (bit 1 = negative; ``ceil(d/8)`` bytes, a zero is sent as
``+``: one bit cannot carry it) and one fp32 scale, so an fp32 gradient costs ``d/8 + 4`` bytes
instead of ``4d``, a 32x ratio for large tensors. Both payloads are gathered: packed sign bits cannot be
summed by an all-reduce.
"""

from __future__ import annotations

from typing import Any, Literal, Mapping, Optional, Sequence

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_gradcomp.compressors.base import CompressContext, Compressor, Payload, take_verdict
from lightning_gradcomp.compressors.bitpack import pack, pack_signs, packed_nbytes, unpack, unpack_signs
from lightning_gradcomp.core.checks import check_number
from lightning_gradcomp.core.device import host_reads_allowed, to_device
from lightning_gradcomp.core.protocol import (
    Gather,
    Outcome,
    Protocol,
    Round,
    SegmentsOutcome,
    SegmentsProtocol,
    stacked,
)
from lightning_gradcomp.core.segments import Segments, SegmentsState

#: Signum's momentum in the compressor's per-parameter state.
MOMENTUM = "momentum"


class _ScaledSigns(Compressor):
    """``C(p) = scale · sign(p)`` on the wire as sign bits and one fp32 scale."""

    def part_dtypes(self, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        return (torch.uint8, torch.float32)

    def payload_numels(self, numel: int, count: int) -> tuple[int, ...]:
        return (packed_nbytes(numel, 1), 1)

    @staticmethod
    def _signs(tensor: Tensor, scale: Tensor) -> Payload:
        """The payload of ``scale · sign(tensor)`` (``scale``: a 0-d or 1-element tensor, no host sync)."""
        return Payload((pack(torch.lt(tensor, 0), 1), scale.reshape(1).float()), tensor.numel(), tensor.numel())

    @staticmethod
    def _mean_magnitude(tensor: Tensor) -> Tensor:
        """``||p||_1 / d`` as a 0-d fp32 tensor (no host sync; summed in fp64 for fp64 gradients, which the
        norm's ``dtype`` may not narrow)."""
        if tensor.dtype == torch.float64:
            return (torch.linalg.vector_norm(tensor, ord=1) / tensor.numel()).float()
        return torch.linalg.vector_norm(tensor, ord=1, dtype=torch.float32) / tensor.numel()

    # ------------------------------------------------------------------ a whole bucket at once
    #: Rows of the flat buffer: whole bytes of sign bits for every tensor (``d_t/8`` rounded up, as per tensor).
    SIGN_ROW = 8

    #: the subclasses' bucket-wise exchange (:meth:`exchange_segments`)
    capabilities = frozenset({"whole_bucket"})

    def segment_alignment(self, device: torch.device) -> Optional[int]:
        """Rows of 8 elements (one byte of signs) on accelerators; per tensor on the CPU."""
        return None if host_reads_allowed(device) else self.SIGN_ROW

    def _voted_segments(self, flat: Tensor, state: SegmentsState) -> Tensor:
        """What the bucket's tensors send the signs of (Signum's momentum overrides)."""
        return flat

    def _scales_segments(self, voted: Tensor, segments: Segments) -> Tensor:
        """One fp32 scale per tensor: ``‖p_t‖₁ / d_t`` (one multi-tensor norm)."""
        norms = torch.stack(torch._foreach_norm(segments.views(voted), 1))
        return norms.float().div_(segments.constant("numels", voted.device, lambda device: to_device(torch.tensor(
            segments.numels, dtype=torch.float32), device)))

    def exchange_segments(self, flat: Tensor, segments: Segments, contexts: Sequence[CompressContext],
                          state: SegmentsState) -> SegmentsProtocol:
        """Every tensor's sign bits in one bit stream (bit ``j`` of byte ``i`` is element ``8i + j`` of the
        flat buffer: each tensor's ``⌈d_t/8⌉`` bytes, as per tensor) and one scale each, in one gather."""
        voted = self._voted_segments(flat, state)
        scales = self._scales_segments(voted, segments)
        negative = torch.lt(voted, 0)
        bits = pack_signs(negative)
        (rows,) = yield Round([Gather((bits, scales))], last=True)
        workers = len(rows)
        row_count = segments.rows

        def subtract(residual: Tensor) -> None:  # accumulate(payload, residual, alpha=-1), per row of 8
            scale_rows = segments.expand(scales).to(residual.dtype)
            residual.view(row_count, -1).sub_(scale_rows).addcmul_(negative.view(row_count, -1), scale_rows,
                                                                   value=2.0)  # the bools promote: no copy

        def write(out: Tensor) -> None:
            signs = unpack_signs(stacked(rows, 0))  # (N, total) 0/1
            received = stacked(rows, 1)  # (N, P)
            verdict = take_verdict(contexts)  # NaN for a void bucket: in every scale, so in every value
            if verdict is not None:
                received = received + verdict
            self._decode_segments(out.view(row_count, -1), signs.view(workers, row_count, -1), received, segments)

        return SegmentsOutcome(segments.numels, subtract, write, overwrites=True)  # every row decoded

    def _decode_segments(self, out: Tensor, signs: Tensor, scales: Tensor, segments: Segments) -> None:
        """``out = (1/N) Σ_w scale_w · (1 − 2·bit_w)`` on ``(rows, 8)``: each worker's ``s − 2·s·bit`` in one
        operation (the uint8 bits promote; exact: ``s`` or ``−s``), then the mean."""
        per_row = segments.spread_rows(scales, 1).unsqueeze(-1).to(out.dtype)  # (N, rows, 1)
        torch.mean(torch.addcmul(per_row, signs, per_row, value=-2.0), dim=0, out=out)

    def accumulate(self, payload: Payload, out: Tensor, alpha: float = 1.0) -> None:
        """``out += alpha · scale · (1 − 2·bit)``: two passes, no dense ±1 tensor."""
        bits, scale = payload.parts
        negative = unpack(bits, 1, payload.numel, dtype=out.dtype)
        scale = scale.to(out.dtype)
        out.add_(scale * alpha).addcmul_(negative, scale, value=-2.0 * alpha)


class EFSignSGD(_ScaledSigns):
    r"""EF-signSGD (Karimireddy, Rebjock, Stich & Jaggi, ICML 2019, "Error feedback fixes SignSGD").

    .. math:: C(p) = \frac{\|p\|_1}{d}\,\operatorname{sign}(p)

    applied to the error-corrected ``p = g + e`` (error feedback on by default, as the method requires);
    the workers' ``C(p)`` are averaged. The scale makes the update the size of an SGD step, so SGD's
    usual learning rates apply. 1 bit per element plus one fp32 scale per tensor.
    """

    name = "efsignsgd"
    capabilities = _ScaledSigns.capabilities

    def compress(self, tensor: Tensor, ctx: CompressContext) -> Payload:
        return self._signs(tensor, self._mean_magnitude(tensor))


class SignSGD(_ScaledSigns):
    r"""signSGD with majority vote (Bernstein, Zhao, Azizzadenesheli & Anandkumar, ICLR 2019).

    Each worker sends the signs of its gradient; the aggregate is the vote

    .. math:: \tilde g = \gamma \cdot \operatorname{sign}\Big(\sum_{w=1}^{N} \operatorname{sign}(g_w)\Big)

    (0 where the vote ties). The scale of the update: with ``scale="none"`` :math:`\gamma = 1`, the
    paper's update of ``±lr`` per coordinate (its experiments use learning rates around 1e-4 to 1e-3
    with SGD); with ``scale="mean"`` (default) :math:`\gamma` is the workers' mean of
    :math:`\|g_w\|_1/d`, the size of an average coordinate, so SGD's usual learning rates apply. Either
    way the direction is the majority vote.

    With ``momentum=β > 0`` it is **Signum** (the same paper's experiments): each worker keeps
    :math:`m_t = β m_{t-1} + (1-β) g_t` and votes with :math:`\operatorname{sign}(m_t)`; the
    averaging in the momentum makes the workers' signs agree more often, which matters most with few
    voters (with two, every disagreement is a tie). The momentum is compressor state (per worker,
    checkpointed), so the optimizer must not add its own.

    Error feedback is off by default, as in the paper. A coordinate whose gradient is zero on every
    worker is sent as ``+`` (one bit has no zero) and moves by :math:`\gamma`: prefer
    :class:`EFSignSGD` or TernGrad for models with many exactly-zero gradients (unused embeddings).
    1 bit per element plus one fp32 scale per tensor.

    Args:
        scale: ``"mean"`` or ``"none"``.
        momentum: Signum's β in [0, 1); 0 (default) is plain signSGD.
    """

    name = "signsgd"
    capabilities = _ScaledSigns.capabilities
    default_error_feedback = False

    def __init__(self, scale: Literal["mean", "none"] = "mean", momentum: float = 0.0) -> None:
        if scale not in ("mean", "none"):
            raise ValueError(f"`scale` must be 'mean' or 'none', got {scale!r}")
        self.scale = scale
        self.momentum = check_number(momentum, "momentum", "a number in [0, 1)", lambda value: 0.0 <= value < 1.0)

    def hparams(self) -> dict[str, Any]:
        return {"scale": self.scale, "momentum": self.momentum}

    @property
    def keeps_state(self) -> bool:
        """Signum keeps its momentum across steps."""
        return self.momentum > 0

    @property
    def produces_signs(self) -> bool:
        """With ``scale="none"`` the aggregate is the bare vote (±1 or 0 per coordinate): gradient clipping
        by norm would shrink every step by about ``√d``. With ``scale="mean"`` its size is the gradients'
        (at most their norm), and clipping works as on a gradient."""
        return self.scale == "none"

    def check_optimizer(self, optimizer: Optimizer, names: Optional[Mapping[int, str]] = None) -> None:
        """Signum holds the momentum: refuse an optimizer that applies its own on top."""
        if not self.momentum:
            return
        for index, group in enumerate(optimizer.param_groups):
            if group.get("momentum", 0) or (group.get("betas") or (0,))[0] > 0:
                raise ValueError(
                    f"SignSGD(momentum={self.momentum}) is Signum and holds the momentum, but "
                    f"{type(optimizer).__name__} applies momentum too (param group {index}); use plain SGD "
                    "(momentum 0), or SignSGD(momentum=0)"
                )

    def _voted_segments(self, flat: Tensor, state: SegmentsState) -> Tensor:
        """:meth:`_voted` on the flat buffer: Signum's momentum as flat state."""
        if not self.momentum:
            return flat
        previous = state.get(MOMENTUM)
        momentum = flat * (1.0 - self.momentum) if previous is None else torch.add(
            previous * self.momentum, flat, alpha=1.0 - self.momentum)
        state.commit(MOMENTUM, momentum)
        return momentum

    def _scales_segments(self, voted: Tensor, segments: Segments) -> Tensor:
        if self.scale == "none":
            return segments.constant("ones", voted.device, lambda device: torch.ones(len(segments), device=device))
        return super()._scales_segments(voted, segments)

    def _decode_segments(self, out: Tensor, signs: Tensor, scales: Tensor, segments: Segments) -> None:
        """The scaled majority vote: ``sign(N − 2 Σ_w bit_w) · mean_w scale_w`` on ``(rows, 8)``."""
        workers = signs.shape[0]
        votes = torch.rsub(signs.sum(dim=0, dtype=out.dtype), workers, alpha=2.0).sign_()  # sign(N − 2·Σ bits)
        torch.mul(votes, segments.expand(scales.mean(dim=0)), out=out)

    def _voted(self, tensor: Tensor, ctx: CompressContext) -> Tensor:
        """What a worker votes with: the gradient, or Signum's ``m = β m + (1 − β) g`` (stored unless the
        gradient was not finite)."""
        if not self.momentum:
            return tensor
        grad = tensor.float()
        previous = ctx.state.get(MOMENTUM)
        if previous is None or previous.shape != grad.shape:
            momentum = grad * (1.0 - self.momentum)
        else:
            momentum = torch.add(previous * self.momentum, grad, alpha=1.0 - self.momentum)
        ctx.commit(MOMENTUM, momentum)
        return momentum

    def compress(self, tensor: Tensor, ctx: CompressContext) -> Payload:
        voted = self._voted(tensor, ctx)
        scale = torch.ones((), device=tensor.device) if self.scale == "none" else self._mean_magnitude(voted)
        return self._signs(voted, scale)

    def exchange(self, tensor: Tensor, ctx: CompressContext) -> Protocol:
        """One gather of every worker's signs and scale; the aggregate is the scaled majority vote."""
        payload = self.compress(tensor, ctx)
        self.check_payload(payload, ctx.wire_dtype(tensor), ctx.name)
        (rows,) = yield Round([Gather(payload.parts)], last=True)

        def write(out: Tensor) -> None:
            votes = torch.zeros(payload.numel, dtype=torch.float32, device=out.device)
            for row in rows:  # votes = sum over workers of (1 - 2·bit) = N - 2·(negative votes)
                votes.add_(unpack(row.parts[0], 1, payload.numel, dtype=torch.float32))
            votes.mul_(-2.0).add_(len(rows)).sign_()
            scale = torch.stack([row.parts[1].reshape(()) for row in rows]).mean()
            out.copy_(votes.mul_(scale))

        return Outcome(payload.count, lambda residual: self.accumulate(payload, residual, alpha=-1.0), write, payload)
