"""One worker's side of compression: error feedback, compressor state, and what telemetry measures.

The DDP hook runs one :class:`WorkerPipeline` (its own rank); the single-device simulation runs one per
simulated worker. Both then hand the payloads to a transport (real collectives) or aggregate them
directly (simulation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import CompressContext, Compressor, Payload, squared_norm
from lightning_gradcomp.memory import CompressionMemory
from lightning_gradcomp.telemetry import StepRecorder

MAX_NUMEL = 2**31 - 1


@dataclass
class Compressed:
    """A compressed gradient on its way: the payload, and ``p = g + e`` until the memory is updated."""

    name: str
    payload: Payload
    corrected: Optional[Tensor]


def resolve_error_feedback(compressor: Compressor, error_feedback: Optional[bool]) -> bool:
    """``None`` follows the compressor (on when biased, unless it keeps its own residual)."""
    if error_feedback and compressor.owns_residual:
        raise ValueError(
            f"`error_feedback` must be None or False with {type(compressor).__name__}, which keeps its own "
            "residual (allowed: None, False)"
        )
    if error_feedback is None:
        return compressor.biased and not compressor.owns_residual
    return bool(error_feedback)


def check_fit_setup(compressor: Compressor, error_feedback: bool, optimizers: list, precision_plugin: Any) -> None:
    """Refuse, before the first step, settings that would silently train something else.

    * an optimizer that conflicts with the compressor (DGC's momentum on top of the optimizer's);
    * fp16 mixed precision with memory (error feedback or DGC's state): the hook sees gradients times a
      loss scale that GradScaler changes and whose overflow steps it skips, so the memory would be kept
      at stale scales and advanced on skipped steps.
    """
    for optimizer in optimizers:
        compressor.check_optimizer(optimizer)
    if getattr(precision_plugin, "scaler", None) is not None and (error_feedback or compressor.owns_residual):
        raise ValueError(
            f"precision='16-mixed' scales gradients by a changing loss scale, which the memory of "
            f"{type(compressor).__name__} (error feedback or DGC state) would keep at stale scales; "
            "allowed: precision='bf16-mixed', '32-true' or '64-true', or a compressor without memory"
        )


class WorkerPipeline:
    """Compress one worker's gradients with that worker's own memory.

    Args:
        compressor: shared by all workers (it holds hyper-parameters only).
        error_feedback: resolved flag (see :func:`resolve_error_feedback`).
        recorder: where compression errors go while ``telemetry`` is on (may be shared by workers).
    """

    def __init__(self, compressor: Compressor, error_feedback: bool, recorder: Optional[StepRecorder] = None) -> None:
        self.compressor = compressor
        self.error_feedback = error_feedback
        self.memory = CompressionMemory()
        self.recorder = recorder if recorder is not None else StepRecorder()
        self.telemetry = False

    def context(self, name: str, step: int, rank: int, world_size: int, seed: int) -> CompressContext:
        return CompressContext(name, step, rank, world_size, seed, self.memory.state(name))

    def dense(self, view: Tensor, ctx: CompressContext) -> Tensor:
        """The tensor to send for a parameter below the size threshold (DGC adds its momentum)."""
        sent = self.compressor.dense(view, ctx)
        if self.telemetry:
            zero = torch.zeros((), dtype=torch.float64, device=view.device)
            self.recorder.add(ctx.name, zero, squared_norm(sent), view.numel(), view.numel())
        return sent

    def compress(self, view: Tensor, ctx: CompressContext) -> Compressed:
        """``C(g + e)``; the memory is updated later, by :meth:`remember`, once the payload is sent."""
        if view.numel() > MAX_NUMEL:
            raise RuntimeError(f"gradcomp: parameter {ctx.name!r} has more than 2**31 - 1 elements")
        corrected = self.memory.compensate(ctx.name, view) if self.error_feedback else None
        tensor = view if corrected is None else corrected
        payload = self.compressor.compress(tensor, ctx)
        if self.telemetry and corrected is None:
            error_sq, input_sq = self.compressor.compression_error(tensor, payload, ctx)
            self.recorder.add(ctx.name, error_sq, input_sq, payload.count, payload.numel)
        return Compressed(ctx.name, payload, corrected)

    def remember(self, item: Compressed) -> None:
        """Error feedback: ``e_{t+1} = p_t − C(p_t)`` (consumes ``item.corrected``)."""
        if item.corrected is None:
            return
        input_sq = squared_norm(item.corrected) if self.telemetry else None
        residual = self.memory.update(item.name, item.corrected, item.payload, self.compressor)
        if input_sq is not None:
            self.recorder.add(item.name, squared_norm(residual), input_sq, item.payload.count, item.payload.numel)
        item.corrected = None
