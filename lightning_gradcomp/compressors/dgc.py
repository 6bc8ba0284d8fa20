"""Deep Gradient Compression (Lin, Han, Mao, Wang & Dally, ICLR 2018)."""

from __future__ import annotations

import math
from typing import Any, Literal, Mapping, Optional, Sequence

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_gradcomp.compressors.base import (
    CompressContext,
    Payload,
    check_bool,
    check_density,
    sparse_count,
    squared_norm,
)
from lightning_gradcomp.compressors.selection import CONTIGUOUS_BLOCK, check_selection, segmented_topk, topk_indices
from lightning_gradcomp.compressors.sparse import HasDensity, _ValuesAndIndices, sparse_segments_protocol
from lightning_gradcomp.core.checks import check_number
from lightning_gradcomp.core.device import host_reads_allowed, to_device
from lightning_gradcomp.core.protocol import Outcome, SegmentsProtocol
from lightning_gradcomp.core.segments import Segments, SegmentsState

MOMENTUM = "momentum"
VELOCITY = "velocity"


class DGC(HasDensity, _ValuesAndIndices):
    r"""Deep Gradient Compression: sparse exchange with momentum correction, momentum-factor masking,
    local gradient clipping and sampled threshold selection (Lin et al. 2018; Harris 2020, §3.1.2).

    Per worker and parameter, with momentum ``m`` (Nesterov variant in brackets)::

        g  <- g * min(1, c / ||g||),  c = clip_norm * N^(-1/2)        (local gradient clipping)
        u  <- m * u + g                                               (momentum correction)
        v  <- v + u                  [v <- v + g + m * u]             (accumulation)
        send sparse(v): the k = density * d largest |v_i|
        u_i, v_i <- 0 where v_i was sent                              (momentum-factor masking)

    The optimizer then applies the averaged update with *no momentum of its own* (plain SGD, momentum
    0): the strategy refuses an optimizer with momentum when ``momentum > 0``. Weight decay stays in the
    optimizer and acts on the averaged update.

    ``v`` is DGC's own error feedback, so the hook's generic residual memory is off. At density 1
    nothing is delayed, so nothing is masked: DGC then equals momentum SGD (as in the reference code),
    and tensors the strategy sends dense (``min_compress_numel``) also receive the momentum.

    Selection (:mod:`~lightning_gradcomp.compressors.selection`): as Top-k's, ``"sampled"`` being the paper's
    threshold estimated from ~1% of the elements, refined to exactly ``k``. Every payload holds exactly ``k``
    entries, so no size exchange is needed.

    Args:
        density: fraction of elements sent, in (0, 1]; :class:`~lightning_gradcomp.lightning.callbacks.DGCWarmup`
            moves it during warm-up.
        momentum: ``m`` in [0, 1).
        clip_norm: local gradient clipping threshold (per tensor), or None for no clipping.
        scale_clip_by_workers: scale ``clip_norm`` by ``N^(-1/2)`` as in the paper.
        nesterov: Nesterov momentum.
        selection: ``"blocks"``, ``"sampled"`` or ``"exact"``.
        sample_fraction: share of elements sampled to estimate the threshold (``"sampled"`` only).
    """

    name = "dgc"
    #: the optional capabilities it provides (:data:`~lightning_gradcomp.compressors.base.CAPABILITIES`)
    capabilities = frozenset({"whole_bucket", "dense_segments"})
    owns_residual = True  # the velocity v

    def __init__(
        self,
        density: float = 0.001,
        momentum: float = 0.9,
        clip_norm: Optional[float] = None,
        scale_clip_by_workers: bool = True,
        nesterov: bool = False,
        selection: Literal["blocks", "sampled", "exact"] = "blocks",
        sample_fraction: float = 0.01,
    ) -> None:
        self.density = density
        self.momentum = check_number(momentum, "momentum", "a number in [0, 1)", lambda value: 0.0 <= value < 1.0)
        self.clip_norm = None if clip_norm is None else check_number(
            clip_norm, "clip_norm", "None or a finite number > 0", lambda value: 0 < value < math.inf)
        self.scale_clip_by_workers = check_bool(scale_clip_by_workers, "scale_clip_by_workers")
        self.nesterov = check_bool(nesterov, "nesterov")
        self.selection = check_selection(selection)
        self.sample_fraction = check_density(sample_fraction, "sample_fraction")

    def hparams(self) -> dict[str, Any]:
        return {"density": self.density, "momentum": self.momentum, "clip_norm": self.clip_norm,
                "scale_clip_by_workers": self.scale_clip_by_workers, "nesterov": self.nesterov,
                "selection": self.selection, "sample_fraction": self.sample_fraction}

    def payload_numels(self, numel: int, count: int) -> tuple[int, ...]:
        return (count, 0) if count == numel else (count, count)

    def check_optimizer(self, optimizer: Optimizer, names: Optional[Mapping[int, str]] = None) -> None:
        """Refuse an optimizer that applies momentum on top of DGC's."""
        if self.momentum == 0:
            return
        for index, group in enumerate(optimizer.param_groups):
            betas = group.get("betas")
            if betas and betas[0] > 0:
                raise ValueError(
                    f"DGC(momentum={self.momentum}) holds the momentum, but {type(optimizer).__name__} keeps a first "
                    f"moment too (betas[0]={betas[0]}, param group {index}). Use plain SGD (momentum 0) with DGC, or "
                    "DGC(momentum=0) to keep the optimizer's."
                )
            if group.get("momentum", 0):
                raise ValueError(
                    f"DGC(momentum={self.momentum}) holds the momentum, but {type(optimizer).__name__} applies "
                    f"momentum={group['momentum']} too (param group {index}). Set the optimizer's momentum to 0 "
                    f"(plain SGD), or DGC(momentum=0) to keep the optimizer's."
                )

    # ------------------------------------------------------------------ the algorithm
    def _momentum_update(self, grad: Tensor, ctx: CompressContext) -> tuple[Tensor, Tensor, bool]:
        """Clip, then ``u <- m u + g`` (one fused pass). Returns the increment of ``v``, the new ``u`` (not
        yet committed, see :meth:`CompressContext.commit`) and whether the state may be updated in place
        (a finite gradient on CPU: nothing can turn the state non-finite, and in-place updates spare
        allocations of the tensor's size, which cost page faults on CPU)."""
        grad = grad.float() if grad.dtype != torch.float32 and grad.dtype != torch.float64 else grad
        if self.clip_norm is not None:
            limit = self.clip_norm * (ctx.world_size ** -0.5 if self.scale_clip_by_workers else 1.0)
            norm = torch.linalg.vector_norm(grad)
            grad = grad * torch.clamp(limit / (norm + 1e-12), max=1.0)
        in_place = grad.device.type == "cpu" and ctx.finite is True
        previous = ctx.state.get(MOMENTUM)
        if previous is None or previous.shape != grad.shape:
            momentum = grad.clone()
        else:
            momentum = torch.add(grad, previous, alpha=self.momentum, out=previous if in_place else None)
        increment = torch.add(grad, momentum, alpha=self.momentum) if self.nesterov else momentum
        return increment, momentum, in_place

    def dense(self, tensor: Tensor, ctx: CompressContext) -> Tensor:
        """Tensors sent dense still receive momentum: momentum SGD, nothing delayed."""
        increment, momentum, _ = self._momentum_update(tensor, ctx)
        ctx.commit(MOMENTUM, momentum)
        return increment.to(tensor.dtype, copy=True)

    def compress(self, tensor: Tensor, ctx: CompressContext) -> Payload:
        numel = tensor.numel()
        k = sparse_count(self.density, numel)
        previous_velocity = ctx.state.get(VELOCITY)
        increment, momentum, in_place = self._momentum_update(tensor, ctx)
        if k == numel:  # density 1: momentum SGD, nothing delayed, no masking; a velocity left over is sent too
            sent = increment if previous_velocity is None else increment + previous_velocity
            ctx.commit(MOMENTUM, momentum)
            if ctx.finite is True:  # the velocity was flushed
                ctx.state.pop(VELOCITY, None)
            elif previous_velocity is not None:
                ctx.commit(VELOCITY, torch.zeros_like(previous_velocity))
            return Payload((sent.to(ctx.wire_dtype(tensor), copy=True), increment.new_empty(0, dtype=torch.int32)),
                           numel, numel)
        if previous_velocity is None or previous_velocity.shape != increment.shape:
            velocity = increment.clone()
        elif in_place:
            velocity = previous_velocity.add_(increment)
        else:
            velocity = previous_velocity + increment
        generator = ctx.generator(tensor.device, per_rank=True) if self.selection == "sampled" else None
        indices = topk_indices(velocity, k, self.selection, generator, self.sample_fraction)
        selected = indices
        values = velocity[indices]
        if indices.numel() < k:  # rare: pad with zero values at a sent index, harmless on every rank
            missing = k - indices.numel()
            pad_index = indices[:1] if indices.numel() else indices.new_zeros(1)
            indices = torch.cat([indices, pad_index.expand(missing)])
            values = torch.cat([values, values.new_zeros(missing)])
        payload = Payload((values.to(ctx.wire_dtype(tensor)), indices.to(torch.int32)), numel, k)
        velocity.index_fill_(0, selected, 0.0)  # momentum-factor masking, on this step's own tensors
        momentum.index_fill_(0, selected, 0.0)
        ctx.commit(VELOCITY, velocity)
        ctx.commit(MOMENTUM, momentum)
        return payload

    # ------------------------------------------------------------------ a whole bucket at once
    def segment_alignment(self, device: torch.device) -> Optional[int]:
        """Rows of 64 on accelerators (see :meth:`TopK.segment_alignment`), below density 1/4 (above it
        no row is pruned, and density 1's dense format is per tensor)."""
        pruned = self.selection != "exact" and not host_reads_allowed(device) and self.density < 0.25
        return CONTIGUOUS_BLOCK if pruned else None

    def exchange_segments(self, flat: Tensor, segments: Segments, contexts: Sequence[CompressContext],
                          state: SegmentsState) -> SegmentsProtocol:
        """The same steps as :meth:`compress` on every tensor of the bucket at once: clipping by one
        multi-tensor norm, the momentum and velocity updates on flat state, the segmented top-``k``
        (:func:`~lightning_gradcomp.compressors.selection.segmented_topk`), masking by two fills."""
        increment, momentum = self._momentum_segments(flat, segments, contexts, state)
        previous_velocity = state.get(VELOCITY)
        velocity = increment.clone() if previous_velocity is None else previous_velocity + increment
        counts = [sparse_count(self.density, numel) for numel in segments.numels]
        positions, _ = segmented_topk(velocity, segments, counts, report_finite=False)
        values = velocity[positions]
        velocity.index_fill_(0, positions, 0.0)  # momentum-factor masking
        momentum.index_fill_(0, positions, 0.0)
        state.commit(VELOCITY, velocity)
        state.commit(MOMENTUM, momentum)
        sent = values.to(contexts[0].wire_dtype(flat))
        outcome = yield from sparse_segments_protocol(flat, positions, segments, counts, sent.dtype, values=sent)

        def error() -> tuple[Tensor, Tensor]:  # (‖v_{t+1}‖², ‖v_t‖²) per tensor, as compression_error
            kept = state.get(VELOCITY)
            carried = torch.stack(torch._foreach_norm(segments.views(kept))).double().square()
            lengths = segments.constant(("dgc-counts", tuple(counts)), sent.device,
                                        lambda device: to_device(torch.tensor(counts), device))
            sent_sq = torch.segment_reduce(sent.double().square(), "sum", lengths=lengths, unsafe=True)
            return carried, carried + sent_sq

        outcome.error = error
        return outcome

    def _momentum_segments(self, flat: Tensor, segments: Segments, contexts: Sequence[CompressContext],
                           state: SegmentsState) -> tuple[Tensor, Tensor]:
        """:meth:`_momentum_update` of every tensor of ``flat``: clipping by one multi-tensor norm, then
        ``u <- m u + g`` on the flat state. Returns the increment of ``v`` and the new ``u`` (not committed)."""
        grad = flat
        if self.clip_norm is not None:
            limit = self.clip_norm * (contexts[0].world_size ** -0.5 if self.scale_clip_by_workers else 1.0)
            norms = torch.stack(torch._foreach_norm(segments.views(flat)))
            factor = torch.clamp(limit / (norms + 1e-12), max=1.0)
            grad = (flat.view(segments.rows, -1) * segments.expand(factor)).view(-1)
        previous = state.get(MOMENTUM)
        momentum = grad.clone() if previous is None else torch.add(grad, previous, alpha=self.momentum)
        increment = torch.add(grad, momentum, alpha=self.momentum) if self.nesterov else momentum
        return increment, momentum

    def dense_segments(self, flat: Tensor, segments: Segments, contexts: Sequence[CompressContext],
                       state: SegmentsState) -> Optional[Tensor]:
        """:meth:`dense` of every tensor sent dense, at once: momentum SGD on the flat state."""
        increment, momentum = self._momentum_segments(flat, segments, contexts, state)
        state.commit(MOMENTUM, momentum)
        return increment.to(contexts[0].dtype or flat.dtype, copy=True)

    def compression_error(self, tensor: Tensor, outcome: Outcome, ctx: CompressContext) -> tuple[Tensor, Tensor]:
        """``(‖v_{t+1}‖², ‖v_t‖²)``: the velocity carried forward is DGC's compression error, and the
        velocity before masking is what was compressed (``‖v_t‖² = ‖v_{t+1}‖² + ‖sent‖²``)."""
        payload: Payload = outcome.payload
        sent = squared_norm(payload.parts[0])
        velocity = ctx.state.get(VELOCITY)
        if velocity is None or payload.parts[1].numel() == 0:  # density 1: nothing delayed
            return torch.zeros((), dtype=torch.float64, device=sent.device), sent
        error = squared_norm(velocity)
        return error, error + sent

    def accumulate(self, payload: Payload, out: Tensor, alpha: float = 1.0) -> None:
        values, indices = payload.parts
        if indices.numel() == 0 and values.numel() == payload.numel:
            out.add_(values.to(out.dtype), alpha=alpha)
        else:
            out.index_add_(0, indices, values.to(out.dtype), alpha=alpha)
