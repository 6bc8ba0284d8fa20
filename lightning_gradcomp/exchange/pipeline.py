"""One worker's side of an exchange: error feedback, compressor state, and what telemetry measures.

Every worker (the DDP hook's own rank, or each simulated worker) has one :class:`WorkerPipeline`.
The engine (:mod:`lightning_gradcomp.exchange.engine`) asks it for one protocol per tensor
(:meth:`WorkerPipeline.protocol`): the compressor's protocol wrapped in error feedback, telemetry and
the write of the aggregated result.
"""

from __future__ import annotations

import ctypes
import warnings
from collections import deque
from typing import Any, Generator, Optional

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import CompressContext, Compressor
from lightning_gradcomp.core.protocol import Mean, Outcome, Round
from lightning_gradcomp.core.tensors import Finite, squared_norm
from lightning_gradcomp.exchange.memory import CompressionMemory
from lightning_gradcomp.metrics.telemetry import StepRecorder

MAX_NUMEL = 2**31 - 1


def resolve_error_feedback(compressor: Compressor, error_feedback: Optional[bool]) -> bool:
    """``None`` follows the compressor: its :attr:`~Compressor.default_error_feedback`, else on when
    biased, unless it keeps its own residual."""
    if error_feedback and compressor.owns_residual:
        raise ValueError(
            f"`error_feedback` must be None or False with {type(compressor).__name__}, which keeps its own "
            "residual (allowed: None, False)"
        )
    if error_feedback is None:
        if compressor.default_error_feedback is not None:
            return compressor.default_error_feedback
        return compressor.biased and not compressor.owns_residual
    return bool(error_feedback)


class WorkerPipeline:
    """Compress one worker's gradients with that worker's own memory.

    Non-finite gradients (NaN or Inf; found by one reduction per gradient, :func:`all_finite`, or by the
    compressor from its block peaks, :attr:`~lightning_gradcomp.compressors.base.Compressor.checks_finite`,
    which then judges ``g + e`` under error feedback): the engine makes the result of the bucket NaN on
    every worker, like DDP's all-reduce would (so AMP's GradScaler skips the step on every rank, and
    without AMP the loss shows it), and the step is void for the bucket's memory on every worker:
    residuals and the state a compressor keeps after the exchange (PowerSGD's ``Q``) stay as they were,
    and no compression error is recorded. The worker that saw the values also leaves the state a
    compressor updates while compressing (DGC's momentum and velocity) of that parameter unchanged (on
    the other workers it advances), and names the parameters in a warning at the end of the step
    (:attr:`nonfinite`; on accelerators once the flags have reached the host, see
    :class:`NonfiniteWatch`).

    Residuals and compressor state are fp32 whatever the gradient's dtype (fp64 for fp64); what crosses
    the wire is cast to the gradient's dtype (:attr:`CompressContext.dtype`).

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
        self.nonfinite = NonfiniteWatch()

    def context(self, name: str, shape: tuple[int, ...], step: int, rank: int, world_size: int, seed: int,
                finite: Optional[Finite] = True, dtype: Optional[torch.dtype] = None) -> CompressContext:
        return CompressContext(name, step, rank, world_size, seed, self.memory.state(name), tuple(shape), finite,
                               dtype)

    def dense_protocol(self, view: Tensor, ctx: CompressContext,
                       out: Optional[Tensor]) -> Generator[Round, list, int]:
        """A parameter below the size threshold: averaged uncompressed (DGC adds its momentum first, the
        16-bit casts cast it)."""
        sent = self.compressor.dense(view, ctx)
        if self.telemetry:  # a cast (fp16, bf16) has a rounding error; anything else sent dense is exact
            error = (squared_norm(view - sent.to(view.dtype)) if sent.dtype != view.dtype
                     else torch.zeros((), dtype=torch.float64, device=view.device))
            self.recorder.add(ctx.name, error, squared_norm(sent), view.numel(), view.numel(), ctx.finite)
        (mean,) = yield Round([Mean(sent)], last=True)
        if out is not None:
            out.copy_(mean)
        return view.numel()

    def protocol(self, view: Tensor, ctx: CompressContext, out: Optional[Tensor]) -> Generator[Round, list, int]:
        """``C(g + e)`` exchanged by the compressor's protocol, then error feedback
        ``e_{t+1} = p_t − C(p_t)``, telemetry, and the aggregate written to ``out`` (``None``: not
        wanted, e.g. by simulated workers other than the first). Returns the coordinates sent.

        ``out`` may be ``view`` itself (the DDP bucket): it is written last, once nothing needs ``p``.
        """
        if view.numel() > MAX_NUMEL:
            raise RuntimeError(f"gradcomp: parameter {ctx.name!r} has more than 2**31 - 1 elements")
        corrected = self.memory.compensate(ctx.name, view) if self.error_feedback else None
        tensor = view if corrected is None else corrected
        outcome: Outcome = yield from self.compressor.exchange(tensor, ctx)
        if corrected is not None:
            self._remember(ctx, corrected, outcome)
        elif self.telemetry and ctx.finite is not False:
            error_sq, input_sq = self.compressor.compression_error(tensor, outcome, ctx)
            self.recorder.add(ctx.name, error_sq, input_sq, outcome.count, view.numel(), ctx.finite)
        if out is not None:
            outcome.write(out)
        return outcome.count

    def note_nonfinite(self, contexts: list[CompressContext]) -> None:
        """Remember the parameters whose gradient this worker found not finite (or may have, on
        accelerators), for :attr:`nonfinite`; the engine calls it once per bucket."""
        self.nonfinite.note(contexts)

    def _remember(self, ctx: CompressContext, corrected: Tensor, outcome: Outcome) -> None:
        """Error feedback: ``e_{t+1} = p_t − C(p_t)``, computed in the storage of ``p_t``."""
        input_sq = squared_norm(corrected) if self.telemetry and ctx.finite is not False else None
        residual = self.memory.update(ctx.name, corrected, outcome.subtract, ctx.finite)
        if input_sq is not None and residual is not None:
            self.recorder.add(ctx.name, squared_norm(residual), input_sq, outcome.count, corrected.numel(), ctx.finite)


class NonfiniteWatch:
    """The parameters whose gradient this worker found not finite, reported without waiting for the device.

    Flags are Python bools where the host may read them (CPU) and 0-d device tensors elsewhere. Per
    bucket the tensor flags are stacked into one tensor and copied to pinned host memory without
    blocking (one small copy and an event, no host synchronisation); :meth:`take` reads the copies that
    have arrived and leaves the others for a later call, so a warning may come a step late on a GPU but
    the hook never waits for one. Entries are bounded: past :attr:`LIMIT` buckets in flight the oldest
    is waited for.
    """

    #: Buckets whose flags may be in flight at once before :meth:`note` waits for the oldest.
    LIMIT = 1024

    def __init__(self) -> None:
        self._known: list[tuple[int, str]] = []
        self._pending: "deque[tuple[int, list[str], Tensor, Optional[torch.cuda.Event]]]" = deque()

    def note(self, contexts: list[CompressContext]) -> None:
        """Record one bucket's flags (``ctx.finite`` of each of its tensors)."""
        unsure = []
        for ctx in contexts:
            if ctx.finite is False:
                self._known.append((ctx.step, ctx.name))
            elif isinstance(ctx.finite, Tensor):
                unsure.append(ctx)
        if not unsure:
            return
        not_finite = torch.stack([ctx.finite.reshape(()) for ctx in unsure]).logical_not_()
        on_cuda = not_finite.device.type == "cuda"
        host = torch.empty(not_finite.shape, dtype=torch.bool, pin_memory=on_cuda)
        host.copy_(not_finite, non_blocking=on_cuda)
        event = None
        if on_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(not_finite.device))
        self._pending.append((unsure[0].step, [ctx.name for ctx in unsure], host, event))
        if len(self._pending) > self.LIMIT:
            found = self._read(self._pending.popleft(), wait=True)
            if found[1]:
                self._known.extend((found[0], name) for name in found[1])

    def take(self, block: bool = False) -> list[tuple[int, list[str]]]:
        """``(step, names)`` of the non-finite gradients found since the last call, by step. Device flags
        whose copy has not arrived stay for a later call (``block=True``: wait for them)."""
        found: dict[int, list[str]] = {}
        for step, name in self._known:
            found.setdefault(step, []).append(name)
        self._known = []
        while self._pending:
            event = self._pending[0][3]
            if not block and event is not None and not event.query():
                break
            step, names = self._read(self._pending.popleft(), wait=block)
            if names:
                found.setdefault(step, []).extend(names)
        return sorted(found.items())

    @staticmethod
    def _read(entry: tuple[int, list[str], Tensor, Any], wait: bool) -> tuple[int, list[str]]:
        """The names flagged in one bucket's host copy (its bytes, read straight from host memory: the
        copy has arrived, nothing is dispatched to the device)."""
        step, names, host, event = entry
        if event is not None and wait:
            event.synchronize()
        flags = ctypes.string_at(host.data_ptr(), host.numel())
        return step, [name for name, bad in zip(names, flags) if bad]


def warn_nonfinite(found: list[tuple[int, list[str]]], rank: int) -> None:
    """The warnings of a worker that saw non-finite gradients, one per step (``(step, names)`` from
    :meth:`NonfiniteWatch.take`; steps counted from 1)."""
    for step, names in found:
        warnings.warn(
            f"gradcomp: non-finite gradient (NaN or Inf) on rank {rank} at step {step + 1} in {', '.join(names)}: the "
            "exchanged gradients of their buckets are NaN on every rank (AMP's GradScaler skips such a step on every "
            "rank), and this rank's compression memory for them is unchanged",
            RuntimeWarning,
            stacklevel=2,
        )
