"""One worker's side of an exchange: error feedback, compressor state, and what telemetry measures.

Every worker (the DDP hook's own rank, or each simulated worker) has one :class:`WorkerPipeline`.
The engine (:mod:`lightning_gradcomp.exchange.engine`) asks it for one protocol per tensor
(:meth:`WorkerPipeline.protocol`): the compressor's protocol wrapped in error feedback, telemetry and
the write of the aggregated result.
"""

from __future__ import annotations

import ctypes
import math
import threading
import warnings
from collections import deque
from typing import Generator, Optional, Sequence

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import CompressContext, Compressor, take_verdict
from lightning_gradcomp.core.device import host_reads_allowed, state_dtype
from lightning_gradcomp.core.protocol import Mean, Outcome, Round, SegmentsOutcome
from lightning_gradcomp.core.segments import Segments, SegmentsState
from lightning_gradcomp.core.tensors import all_finite, all_finite_many, flag_vector, squared_norm
from lightning_gradcomp.exchange.memory import CompressionMemory, state_fits
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
    """Compress one worker's gradients with that worker's own memory (fp32 state, see
    :mod:`~lightning_gradcomp.exchange.memory`; what crosses the wire is cast to :attr:`CompressContext.dtype`).

    Non-finite gradients (found by :func:`all_finite`, or by the compressor from its block peaks,
    :attr:`~lightning_gradcomp.compressors.base.Compressor.checks_finite`, judging ``g + e`` under error
    feedback) make the bucket's step void on every worker
    (:class:`~lightning_gradcomp.exchange.engine.BucketVerdict`: NaN results, memory unchanged, no
    compression error recorded). The worker that saw them also leaves the state its compressor updates
    while compressing (DGC's momentum and velocity) unchanged, and names the parameters in a warning at
    the end of the step (:attr:`nonfinite`, :class:`NonfiniteWatch`).

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
        if corrected is not None:  # error feedback: ``e_{t+1} = p_t − C(p_t)``, computed in the storage of ``p_t``
            input_sq = squared_norm(corrected) if self.telemetry and ctx.finite is not False else None
            residual = self.memory.update(ctx.name, corrected, outcome.subtract, ctx.finite)
            if input_sq is not None and residual is not None:
                self.recorder.add(ctx.name, squared_norm(residual), input_sq, outcome.count, corrected.numel(), ctx.finite)
        elif self.telemetry and ctx.finite is not False:
            error_sq, input_sq = self.compressor.compression_error(tensor, outcome, ctx)
            self.recorder.add(ctx.name, error_sq, input_sq, outcome.count, view.numel(), ctx.finite)
        if out is not None:
            outcome.write(out)
        return outcome.count

    def dense_bucket_protocol(self, views: Sequence[Tensor], contexts: Sequence[CompressContext],
                              outs: Sequence[Optional[Tensor]]) -> Generator[Round, list, int]:
        """Every parameter of a bucket below the size threshold, averaged uncompressed (what each sends:
        :meth:`~Compressor.dense`; DGC adds its momentum first, the 16-bit casts cast): one round of
        ``Mean`` requests (merged into one all-reduce by the engine) and one multi-tensor copy of the
        results."""
        sent = [self.compressor.dense(view, ctx) for view, ctx in zip(views, contexts)]
        if self.telemetry:
            for view, ctx, value in zip(views, contexts, sent):
                error = (squared_norm(view - value.to(view.dtype)) if value.dtype != view.dtype
                         else torch.zeros((), dtype=torch.float64, device=view.device))
                self.recorder.add(ctx.name, error, squared_norm(value), view.numel(), view.numel(), ctx.finite)
        self._write_dense(outs, (yield Round([Mean(value) for value in sent], last=True)), contexts)
        return sum(view.numel() for view in views)

    def _write_dense(self, outs: Sequence[Optional[Tensor]], results: Sequence[Tensor],
                     contexts: Sequence[CompressContext]) -> None:
        """The dense averages into ``outs`` (one multi-tensor copy), then the compressor's step after the
        dense average (DeMo's sign), where it has one."""
        written = [(out, result, ctx) for out, result, ctx in zip(outs, results, contexts) if out is not None]
        if written:
            targets, values, owners = map(list, zip(*written))
            torch._foreach_copy_(targets, values)
            if "finalize_dense" in self.compressor.capabilities:
                self.compressor.finalize_dense_many(targets, owners)

    def dense_segments_protocol(self, segments: Segments, views: Sequence[Tensor],
                                contexts: Sequence[CompressContext], outs: Sequence[Optional[Tensor]]
                                ) -> Generator[Round, list, int]:
        """:meth:`dense_bucket_protocol` for a compressor whose :meth:`~Compressor.dense` does work (DGC's
        momentum, a cast): the small tensors in one flat buffer, the compressor's
        :meth:`~Compressor.dense_segments`, one ``Mean`` and one multi-tensor copy of the results."""
        flat = segments.gather(views, state_dtype(views[0].dtype))
        state = _FlatState(self.memory, segments, contexts, flat.dtype, flat.device)
        sent = self.compressor.dense_segments(flat, segments, contexts, state)
        if self.telemetry:  # a cast has a rounding error; anything else sent dense is exact
            sent_views = segments.views(sent)
            error = (_squared_norms(torch._foreach_sub(segments.views(flat), [v.to(flat.dtype) for v in sent_views]))
                     if sent.dtype != flat.dtype else torch.zeros(len(segments), dtype=torch.float64,
                                                                  device=flat.device))
            finite = [ctx.finite for ctx in contexts]  # all bools (CPU) or all 0-d tensors (elsewhere)
            verdict = flag_vector(finite) if isinstance(finite[0], Tensor) else all(finite)
            self.recorder.add_many(segments.names, error, _squared_norms(sent_views), segments.numels,
                                   segments.numels, verdict)
        (mean,) = yield Round([Mean(sent)], last=True)
        self._write_dense(outs, segments.views(mean), contexts)
        return segments.total

    def segments_protocol(self, segments: Segments, views: Sequence[Tensor], contexts: Sequence[CompressContext],
                          outs: Sequence[Optional[Tensor]]) -> Generator[Round, list, int]:
        """:meth:`protocol` for every compressed tensor of a bucket at once, in one flat buffer
        (:meth:`~lightning_gradcomp.compressors.base.Compressor.exchange_segments`): ``p = g + e`` by one
        ``cat`` and one ``add``, the compressor's bucket protocol, error feedback on the flat buffer, and
        one multi-tensor copy of the results into ``outs`` — or none, where the one destination holds the
        whole layout (:func:`_whole_layout`: the results are written straight into it)."""
        for view, ctx in zip(views, contexts):
            if view.numel() > MAX_NUMEL:
                raise RuntimeError(f"gradcomp: parameter {ctx.name!r} has more than 2**31 - 1 elements")
        reads_flat_only = "reads_flat_only" in self.compressor.capabilities
        borrowed = None if self.error_feedback else _input_as_flat(self.compressor, segments, views)
        if self.error_feedback:
            flat = self.memory.compensate_bucket(segments, views)
        elif borrowed is not None:  # the gradient itself, read only: no copy of it
            flat = borrowed
        else:
            flat = segments.gather(views, state_dtype(views[0].dtype))
        if not self.compressor.checks_finite:
            for ctx, finite in zip(contexts, all_finite_many(segments.views(flat))):
                ctx.finite = finite
        measure = self.telemetry
        input_sq = _squared_norms(segments.views(flat)) if measure and self.error_feedback else None
        state = _FlatState(self.memory, segments, contexts, flat.dtype, flat.device)
        outcome: SegmentsOutcome = yield from self.compressor.exchange_segments(flat, segments, contexts, state)
        verdict = contexts[0].finite  # the bucket's verdict: the same in every context (BucketVerdict.tell)
        if self.error_feedback:
            residual = self.memory.update_bucket(segments, flat, outcome.subtract, verdict, outcome.gaps_stay_zero)
            if input_sq is not None and residual is not None:
                self.recorder.add_many(segments.names, _squared_norms(segments.views(residual)), input_sq,
                                       tuple(outcome.counts), segments.numels, verdict)
        elif measure and verdict is not False:
            if outcome.error is not None:
                error_sq, input_sq = outcome.error()
            else:
                error = flat.clone()
                outcome.subtract(error)
                error_sq, input_sq = _squared_norms(segments.views(error)), _squared_norms(segments.views(flat))
            self.recorder.add_many(segments.names, error_sq, input_sq, tuple(outcome.counts), segments.numels,
                                   verdict)
        written = [(out, index) for index, out in enumerate(outs) if out is not None]
        # a write that sets every element may go into the gradient it read (the flat input, dead by now)
        direct = _whole_layout(outs, segments, flat, borrowed is not None and outcome.overwrites)
        # a write that adds into its buffer gets it filled with the verdict flag: NaN results for a void bucket
        fill = take_verdict(contexts) if outcome.adds and not outcome.overwrites else None
        if direct is not None:  # the result straight into the gradient: no buffer, no copy
            if fill is not None:
                direct.copy_(fill)
            elif not outcome.overwrites:
                direct.zero_()
            outcome.write(direct)
        elif written:
            if fill is not None:
                result = fill.to(flat.dtype).expand(segments.total).clone(memory_format=torch.contiguous_format)
            elif outcome.overwrites and reads_flat_only and not self.error_feedback and borrowed is None:
                result = flat  # the gathered input, dead by now (not memory): no buffer of its own
            else:  # a write that sets every element needs no zeros first (nor a pass to write them)
                make = torch.empty if outcome.overwrites else torch.zeros
                result = make(segments.total, dtype=flat.dtype, device=flat.device)
            outcome.write(result)
            results = segments.views(result)
            torch._foreach_copy_([out for out, _ in written], [results[index] for _, index in written])
        return sum(outcome.counts)


class _FlatState(SegmentsState):
    """A worker's compressor state of one bucket, in flat buffers of its memory."""

    def __init__(self, memory: CompressionMemory, segments: Segments, contexts: Sequence[CompressContext],
                 dtype: torch.dtype, device: torch.device) -> None:
        self.memory = memory
        self.segments = segments
        self.contexts = contexts
        self.dtype = dtype
        self.device = device

    def get(self, key: str, layout: Optional[Segments] = None) -> Optional[Tensor]:
        return self.memory.bucket_state(layout or self.segments, key, self.dtype, self.device, layout is not None)

    def present(self, key: str, layout: Optional[Segments] = None) -> list[bool]:
        segments = layout or self.segments  # a state of another shape is none (as :meth:`get` reads it)
        return [state_fits(self.memory.states.get(name, {}).get(key), shape, numel, layout is not None)
                for name, shape, numel in zip(segments.names, segments.shapes, segments.numels)]

    def commit(self, key: str, new: Tensor, layout: Optional[Segments] = None, check_result: bool = False) -> None:
        segments = layout or self.segments
        flags = [ctx.finite for ctx in self.contexts]
        result_ok: Optional[Tensor] = None  # with check_result: whether all of new is finite (one check)
        if check_result:
            if host_reads_allowed(new.device):
                ok = bool(all_finite(new))
                flags = [flag if ok else False for flag in flags]
            else:
                result_ok = torch.linalg.vector_norm(new, math.inf).lt(math.inf)
        if all(flag is False for flag in flags):
            return
        vector = self._flag_vector(flags)
        if result_ok is not None:
            vector = result_ok if vector is None else vector & result_ok
        if vector is not None:  # keep each tensor's previous part where its flag is false
            previous = self.get(key, layout)
            if previous is None:
                previous = torch.zeros_like(new)
            if vector.dim():  # a flag per tensor, spread over the tensors' rows (as long as the sizes allow)
                coarse = segments.coarse_rows
                new = torch.where(coarse.expand(vector), new.view(coarse.rows, -1), previous.view(coarse.rows, -1))
            else:
                new = torch.where(vector, new, previous)
            new = new.view(-1)
        self.memory.set_bucket_state(segments, key, new, layout is not None)

    def _flag_vector(self, flags: list) -> Optional[Tensor]:
        """The tensors' flags as one bool vector (the vector they are views of, when they are), or one 0-d
        flag when they are one bucket verdict (after the last round); ``None`` when all are ``True``."""
        if all(flag is True for flag in flags):
            return None
        tensors = {id(flag): flag for flag in flags if isinstance(flag, Tensor)}
        if len(tensors) == 1 and all(flag is True or isinstance(flag, Tensor) for flag in flags):
            return next(iter(tensors.values())).reshape(())
        if len(tensors) == len(flags):
            return flag_vector(flags)
        return torch.stack([torch.as_tensor(flag, device=self.device).reshape(()) for flag in flags])


def _whole_layout(outs: Sequence[Optional[Tensor]], segments: Segments, flat: Tensor, may_alias: bool = False
                  ) -> Optional[Tensor]:
    """The one destination of a bucket's compressed tensors when it can hold the whole layout as it is (a
    lone tensor, as a large layer fills one of DDP's buckets: contiguous, of the flat buffer's dtype and
    size, no gap, not sharing memory with it unless ``may_alias``), flat; else ``None``."""
    if len(outs) != 1 or outs[0] is None:
        return None
    out = outs[0]
    if (out.dtype != flat.dtype or out.device != flat.device or out.numel() != segments.total
            or not out.is_contiguous()
            or (not may_alias and out.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr())):
        return None
    return out.view(-1)


def _input_as_flat(compressor: Compressor, segments: Segments, views: Sequence[Tensor]) -> Optional[Tensor]:
    """A lone gradient as the bucket's flat input as it is, without the copy of :meth:`Segments.gather`, for a
    compressor whose bucket-wise exchange only reads its input (capability ``reads_flat_only``: the dense formats, where
    the copy would be one of the few passes over the bucket) when it is the layout exactly (contiguous, of the
    state dtype, no gap); else ``None``."""
    if "reads_flat_only" not in compressor.capabilities or len(views) != 1 or segments.padded:
        return None
    view = views[0]
    if view.dtype != state_dtype(view.dtype) or not view.is_contiguous() or view.numel() != segments.total:
        return None
    return view.reshape(-1)


def _squared_norms(tensors: Sequence[Tensor]) -> Tensor:
    """``‖t‖²`` of every tensor, as one float64 vector (one multi-tensor norm)."""
    return torch.stack(torch._foreach_norm(list(tensors))).double().square()


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
        self._spares: dict[tuple[int, bool], list[Tensor]] = {}  # host buffers already read
        self._pending: "deque[tuple[int, list[str], Tensor, Optional[torch.cuda.Event]]]" = deque()
        self._lock = threading.Lock()  # noted on the exchange thread, taken on the training thread

    def note(self, contexts: Sequence[CompressContext], stacked: Optional[Tensor] = None) -> None:
        """Record one bucket's flags (``ctx.finite`` of each of its tensors; ``stacked``: its tensor flags
        stacked in order, if already at hand)."""
        with self._lock:
            unsure = []
            for ctx in contexts:
                if ctx.finite is False:
                    self._known.append((ctx.step, ctx.name))
                elif isinstance(ctx.finite, Tensor):
                    unsure.append(ctx)
            if not unsure:
                return
            finite = stacked if stacked is not None else torch.stack([ctx.finite.reshape(()) for ctx in unsure])
            on_cuda = finite.device.type == "cuda"
            spares = self._spares.get((finite.numel(), on_cuda))  # host buffers read before, kept for reuse
            host = spares.pop() if spares else torch.empty(finite.numel(), dtype=torch.bool, pin_memory=on_cuda)
            host.copy_(finite, non_blocking=on_cuda)
            event = None
            if on_cuda:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(finite.device))
            self._pending.append((unsure[0].step, [ctx.name for ctx in unsure], host, event))
            if len(self._pending) > self.LIMIT:
                self._collect(wait=True)

    def take(self, block: bool = False) -> list[tuple[int, list[str]]]:
        """``(step, names)`` of the non-finite gradients found since the last call, by step. Device flags
        whose copy has not arrived stay for a later call (``block=True``: wait for them)."""
        with self._lock:
            while self._pending:
                event = self._pending[0][3]
                if not block and event is not None and not event.query():
                    break
                self._collect(wait=block)
            found: dict[int, list[str]] = {}
            for step, name in self._known:
                found.setdefault(step, []).append(name)
            self._known = []
            return sorted(found.items())

    def _collect(self, wait: bool) -> None:
        """Add the names flagged in the oldest bucket's host copy to the known ones (its bytes, read straight
        from host memory: the copy has arrived, nothing is dispatched to the device), and keep its host
        buffer for a later bucket of the same size."""
        step, names, host, event = self._pending.popleft()
        if event is not None and wait:
            event.synchronize()
        flags = ctypes.string_at(host.data_ptr(), host.numel())  # 1 where finite
        self._known.extend((step, name) for name, finite in zip(names, flags) if not finite)
        spares = self._spares.setdefault((host.numel(), event is not None), [])
        if len(spares) < 64:
            spares.append(host)


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
