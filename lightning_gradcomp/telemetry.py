"""What the hook measures while telemetry is on: compression error per parameter, and time spent.

Everything stays on the device until the step ends (no synchronisation inside the hook); then
:meth:`StepRecorder.resolve` turns it into numbers once.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import Tensor

from lightning_gradcomp.stats import LayerStats, StepStats


class Stopwatch:
    """Accumulated elapsed time: ``perf_counter`` on CPU, CUDA events on GPU (read when resolved)."""

    def __init__(self) -> None:
        self._seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
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
                self._events.append((start, end))
        else:
            began = time.perf_counter()
            yield
            with self._lock:
                self._seconds += time.perf_counter() - began

    def take(self) -> float:
        """Seconds accumulated since the last call."""
        with self._lock:
            events, self._events = self._events, []
            seconds, self._seconds = self._seconds, 0.0
        for start, end in events:
            end.synchronize()
            seconds += start.elapsed_time(end) / 1000.0
        return seconds


class StepRecorder:
    """Squared norms of the compression error and of the compressed input, per parameter, for a step."""

    def __init__(self) -> None:
        self._entries: list[tuple[str, Tensor, Tensor, int, int]] = []

    def add(self, name: str, error_sq: Tensor, grad_sq: Tensor, count: int, numel: int, finite: Any = True) -> None:
        """Record one parameter; a step whose gradient was not finite (``finite`` a 0-d tensor on
        accelerators) counts as zero, so totals stay finite."""
        if isinstance(finite, Tensor):
            error_sq, grad_sq = (torch.where(finite, value, torch.zeros_like(value)) for value in (error_sq, grad_sq))
        self._entries.append((name, error_sq.detach(), grad_sq.detach(), count, numel))

    def resolve(self, stats: StepStats, per_layer: bool) -> None:
        """Add the recorded sums (and, if asked, the per-parameter figures) to ``stats``; reset."""
        entries, self._entries = self._entries, []
        if not entries:
            return
        errors = torch.stack([e[1].double() for e in entries]).cpu()
        inputs = torch.stack([e[2].double() for e in entries]).cpu()
        stats.error_sq += float(errors.sum())
        stats.grad_sq += float(inputs.sum())
        if per_layer:
            for (name, _, _, count, numel), error, grad in zip(entries, errors.tolist(), inputs.tolist()):
                layer = stats.layers.setdefault(name, LayerStats())
                layer.error_sq += error
                layer.grad_sq += grad
                layer.count += count
                layer.numel += numel


