"""What the hook measures while telemetry is on: compression error per parameter, and time spent.

Everything stays on the device while steps go by: at the end of a step :meth:`StepRecorder.close_step`
and :meth:`Stopwatch.close_step` fold the step's figures into device-side sums (no host
synchronisation), and only :meth:`StepRecorder.read` and :meth:`Stopwatch.read`, called when the
figures are wanted (a logging step, a summary, a checkpoint), bring them to the host, once for every
step since the last read. Totals stay exact whichever steps are read.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch import Tensor

from lightning_gradcomp.metrics.stats import LayerStats, StepStats


class Stopwatch:
    """Accumulated elapsed time: ``perf_counter`` on CPU, CUDA events on GPU (read by :meth:`read`)."""

    def __init__(self) -> None:
        self._current = _Times()
        self._last = _Times()
        self._earlier = _Times()
        self._lock = threading.Lock()

    @contextmanager
    def measure(self, device: torch.device) -> Iterator[None]:
        if device.type == "cuda":
            stream = torch.cuda.current_stream(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            yield
            end.record(stream)
            with self._lock:
                self._current.events.append((start, end))
        else:
            began = time.perf_counter()
            yield
            with self._lock:
                self._current.seconds += time.perf_counter() - began

    def close_step(self) -> None:
        """End a step: its time becomes the last step's (no host synchronisation); the earlier steps'
        events that have completed are turned into seconds, so unread steps hold few events."""
        with self._lock:
            self._earlier.seconds += self._last.seconds
            self._earlier.events.extend(self._last.events)
            self._earlier.fold_completed()
            self._last, self._current = self._current, _Times()

    def read(self) -> tuple[float, float]:
        """``(seconds of the steps closed before the last, seconds of the last closed step)`` since the
        previous read; waits for the recorded events."""
        with self._lock:
            earlier, last = self._earlier, self._last
            self._earlier, self._last = _Times(), _Times()
        return earlier.total(), last.total()

    @property
    def unread(self) -> bool:
        """Whether measured time waits for :meth:`read`."""
        return bool(self._last.seconds or self._last.events or self._earlier.seconds or self._earlier.events)


class _Times:
    """Seconds measured on the host and CUDA event pairs not read yet."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def fold_completed(self) -> None:
        """Turn the event pairs whose work has completed into seconds (``query``: no host sync)."""
        pending = []
        for start, end in self.events:
            if end.query():
                self.seconds += start.elapsed_time(end) / 1000.0
            else:
                pending.append((start, end))
        self.events = pending

    def total(self) -> float:
        seconds = self.seconds
        for start, end in self.events:
            end.synchronize()
            seconds += start.elapsed_time(end) / 1000.0
        return seconds


class StepRecorder:
    """Squared norms of the compression error and of the compressed input, per parameter, per step."""

    def __init__(self) -> None:
        self._entries: list[tuple[tuple[str, ...], Tensor, Tensor, tuple[int, ...], tuple[int, ...]]] = []
        self._streams: dict[int, "torch.cuda.Stream"] = {}  # the CUDA streams that wrote the step's entries
        self._lock = threading.Lock()  # entries come from the exchange thread, the step closes on another
        self._last: Optional[Tensor] = None  # (2,) float64: the last closed step's error and input sums
        self._earlier: Optional[Tensor] = None  # the same, summed over the steps closed before it
        self._layers: Optional[tuple[list[tuple[str, int, int]], Tensor]] = None  # the last step's, if kept

    def add(self, name: str, error_sq: Tensor, grad_sq: Tensor, count: int, numel: int, finite: object = True) -> None:
        """Record one parameter; a step whose gradient was not finite (``finite`` a 0-d tensor on
        accelerators) counts as zero, so totals stay finite."""
        self.add_many((name,), error_sq.reshape(1), grad_sq.reshape(1), (count,), (numel,),
                      finite.reshape(1) if isinstance(finite, Tensor) else finite)

    def add_many(self, names: tuple[str, ...], error_sq: Tensor, grad_sq: Tensor, counts: tuple[int, ...],
                 numels: tuple[int, ...], finite: object = True) -> None:
        """Record several parameters at once (1-D tensors of their squared norms, in ``names``' order;
        ``finite``: a bool, or a bool tensor of one flag or one per parameter)."""
        if finite is False:
            error_sq, grad_sq = torch.zeros_like(error_sq), torch.zeros_like(grad_sq)
        elif isinstance(finite, Tensor):
            error_sq, grad_sq = (torch.where(finite, value, torch.zeros_like(value)) for value in (error_sq, grad_sq))
        with self._lock:
            self._entries.append((names, error_sq.detach(), grad_sq.detach(), counts, numels))
            if error_sq.device.type == "cuda":
                stream = torch.cuda.current_stream(error_sq.device)
                self._streams[stream.stream_id] = stream

    @property
    def unread(self) -> bool:
        """Whether closed steps wait for :meth:`read`."""
        return self._last is not None or self._earlier is not None

    def close_step(self, keep_layers: bool = False) -> None:
        """Fold the step's entries into device-side sums (no host synchronisation); with ``keep_layers``
        the per-parameter figures of this step are kept for :meth:`read`."""
        with self._lock:
            entries, self._entries = self._entries, []
            streams, self._streams = list(self._streams.values()), {}
        _wait_for(streams, [tensor for entry in entries for tensor in entry[1:3]])
        if self._last is not None:
            self._earlier = self._last if self._earlier is None else self._earlier + self._last
            self._last = None
        self._layers = None
        if not entries:
            return
        per_parameter = torch.stack([torch.cat([e[1] for e in entries]), torch.cat([e[2] for e in entries])]).double()
        self._last = per_parameter.sum(dim=1)
        if keep_layers:
            self._layers = ([described for names, _, _, counts, numels in entries
                             for described in zip(names, counts, numels)], per_parameter)

    def read(self, stats: StepStats, totals: StepStats) -> None:
        """Bring the sums to the host (one read): the last closed step's into ``stats`` (and its
        per-parameter figures, if kept), every closed step's since the last read into ``totals``."""
        zero = torch.zeros(2, dtype=torch.float64)
        pieces = [zero if self._earlier is None else self._earlier, zero if self._last is None else self._last]
        layers, self._layers = self._layers, None
        if layers is not None:
            pieces.append(layers[1].reshape(-1))
        values = torch.cat([piece.to(pieces[-1].device) for piece in pieces]).tolist()
        self._earlier = self._last = None
        stats.error_sq += values[2]
        stats.grad_sq += values[3]
        totals.error_sq += values[0] + values[2]
        totals.grad_sq += values[1] + values[3]
        if layers is not None:
            described, _ = layers
            count = len(described)
            errors, inputs = values[4:4 + count], values[4 + count:]
            for (name, sent, numel), error, grad in zip(described, errors, inputs):
                stats.layers.setdefault(name, LayerStats()).add(LayerStats(error, grad, sent, numel))


def _wait_for(streams: list["torch.cuda.Stream"], tensors: list[Tensor]) -> None:
    """Make the current stream wait for ``streams`` (the exchange's, which wrote ``tensors``) and record
    ``tensors`` as used by it, so that reading them here sees their values and freeing them later does not
    hand their memory back while this stream still reads them (no host synchronisation)."""
    if not streams:
        return
    current = torch.cuda.current_stream(streams[0].device)
    others = [stream for stream in streams if stream != current]
    if not others:
        return
    for stream in others:
        current.wait_stream(stream)
    for tensor in tensors:
        tensor.record_stream(current)
