"""N workers' compressed exchange on one device: the simulation's counterpart of the DDP hook."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_gradcomp import wire
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.compressors.identity import NoCompression
from lightning_gradcomp.pipeline import WorkerPipeline, resolve_error_feedback
from lightning_gradcomp.stats import StepStats
from lightning_gradcomp.telemetry import Stopwatch, StepRecorder


class SimulatedExchange:
    """Compress each simulated worker's gradients with its own memory and average the decoded results.

    Per step: :meth:`add_worker` once per worker (in worker order), then :meth:`finish_step`. The
    aggregate equals what the DDP hook computes across real processes: small tensors and summable
    payloads are averaged, gathered payloads are decoded worker by worker with weight ``1/N``.

    Bytes are those each worker would hand to ``torch.distributed`` in one bucket holding the whole
    model: one all-reduce per dtype for dense tensors and summable payloads, one all-gather of the
    packed payloads (padded to the largest worker, after a count exchange when sizes depend on the
    data). Step figures are averages over workers, like the real strategy's logged figures.
    Memory: per worker only residuals and compressor state, never a copy of the model.
    """

    def __init__(self, compressor: Compressor, workers: int, error_feedback: Optional[bool] = None,
                 min_compress_numel: int = 1024, seed: int = 0) -> None:
        feedback = resolve_error_feedback(compressor, error_feedback)
        self.compressor = compressor
        self.workers = workers
        self.error_feedback = feedback
        self.min_compress_numel = min_compress_numel
        self.seed = seed
        self.recorder = StepRecorder()
        self.pipelines = [WorkerPipeline(compressor, feedback, self.recorder) for _ in range(workers)]
        self.step = 0
        self.record_layers = False
        self.totals = StepStats()
        self.step_stats = StepStats()
        self._telemetry = False
        self._aggregate: dict[str, Tensor] = {}
        self._worker_bytes: list[int] = []
        self._gather_shapes: list[list[tuple[int, int]]] = []
        self._reduce_bytes: dict[torch.dtype, int] = {}
        self._elements_sent = 0
        self._elements_total = 0
        self._bytes_dense = 0
        self._dtype = torch.float32
        self._compress_clock = Stopwatch()
        self._decompress_clock = Stopwatch()

    @property
    def telemetry(self) -> bool:
        return self._telemetry

    @telemetry.setter
    def telemetry(self, on: bool) -> None:
        self._telemetry = bool(on)
        for pipeline in self.pipelines:
            pipeline.telemetry = self._telemetry

    def use_compressor(self, compressor: Optional[Compressor]) -> None:
        """Switch compressor between steps (``None``: uncompressed); memory and state are kept."""
        self.compressor = compressor if compressor is not None else NoCompression()
        for pipeline in self.pipelines:
            pipeline.compressor = self.compressor

    # ------------------------------------------------------------------ one step
    def add_worker(self, worker: int, named_grads: list[tuple[str, Tensor]]) -> None:
        """Compress worker ``worker``'s gradients and add their decoded average share."""
        pipeline = self.pipelines[worker]
        reduce_bytes: dict[torch.dtype, int] = {}
        shapes: list[tuple[int, int]] = []
        scale = 1.0 / self.workers
        device = named_grads[0][1].device if named_grads else torch.device("cpu")
        for name, grad in named_grads:
            view = grad.reshape(-1)
            self._dtype = view.dtype
            out = self._aggregate.get(name)
            if out is None:
                out = self._aggregate[name] = torch.zeros_like(view)
                self._bytes_dense += view.numel() * view.element_size()
                self._elements_total += view.numel()
            ctx = pipeline.context(name, self.step, worker, self.workers, self.seed)
            if view.numel() < self.min_compress_numel:
                with self._compress_clock.measure(device) if self._telemetry else nullcontext():
                    sent = pipeline.dense(view, ctx)
                reduce_bytes[sent.dtype] = reduce_bytes.get(sent.dtype, 0) + sent.numel() * sent.element_size()
                out.add_(sent, alpha=scale)
                self._elements_sent += view.numel()
                continue
            with self._compress_clock.measure(device) if self._telemetry else nullcontext():
                item = pipeline.compress(view, ctx)
            payload = item.payload
            self._elements_sent += payload.count
            if self.compressor.summable:
                for part in payload.parts:
                    reduce_bytes[part.dtype] = reduce_bytes.get(part.dtype, 0) + part.numel() * part.element_size()
            else:
                shapes.append((payload.numel, payload.count))
            with self._decompress_clock.measure(device) if self._telemetry else nullcontext():
                self.compressor.accumulate(payload, out, alpha=scale)
            with self._compress_clock.measure(device) if self._telemetry else nullcontext():
                pipeline.remember(item)
        self._gather_shapes.append(shapes)
        self._worker_bytes.append(sum(reduce_bytes.values()))
        self._reduce_bytes = reduce_bytes

    def finish_step(self) -> dict[str, Tensor]:
        """The averaged gradients of this step, by parameter name; the step's figures go to
        :attr:`step_stats` and :attr:`totals`."""
        collectives = [("all_reduce", nbytes) for nbytes in self._reduce_bytes.values()]
        gathered_bytes = 0
        if any(self._gather_shapes):
            sizes = [wire.layout(self.compressor, shapes, self._dtype)[1] for shapes in self._gather_shapes]
            dynamic = any(self.compressor.static_count(n) is None for n, _ in self._gather_shapes[0])
            if dynamic:
                header = 4 * len(self._gather_shapes[0])
                collectives.append(("all_gather", header))
                gathered_bytes += header
            if max(sizes) > 0:
                collectives.append(("all_gather", max(sizes)))
                gathered_bytes += max(sizes)
        stats = StepStats(
            steps=1, buckets=1,
            bytes_sent=sum(self._worker_bytes) / self.workers + gathered_bytes,
            bytes_dense=self._bytes_dense,
            elements_sent=self._elements_sent / self.workers,
            elements_total=self._elements_total,
            collectives=collectives,
        )
        if self._telemetry:
            self.recorder.resolve(stats, per_layer=self.record_layers)
            stats.error_sq /= self.workers
            stats.grad_sq /= self.workers
            for layer in stats.layers.values():
                for name in ("error_sq", "grad_sq", "count", "numel"):
                    setattr(layer, name, getattr(layer, name) / self.workers)
            stats.compress_s = self._compress_clock.take() / self.workers
            stats.decompress_s = self._decompress_clock.take() / self.workers
        aggregate = self._aggregate
        self._aggregate, self._worker_bytes, self._gather_shapes, self._reduce_bytes = {}, [], [], {}
        self._elements_sent = self._elements_total = self._bytes_dense = 0
        self.step += 1
        self.step_stats = stats
        self.totals.add(stats)
        return aggregate

    # ------------------------------------------------------------------ checkpoint
    def state_dicts(self) -> list[dict[str, Any]]:
        """One state per worker, in the format of the DDP hook's per-rank state."""
        return [{"step": self.step, "memory": p.memory.state_dict(), "totals": self.totals.state_dict()}
                for p in self.pipelines]

    def load_state_dicts(self, states: list[dict[str, Any]], device: torch.device) -> None:
        for pipeline, state in zip(self.pipelines, states):
            pipeline.memory.load_state_dict(state["memory"], device)
        self.step = int(states[0]["step"])
        self.totals = StepStats.from_state_dict(states[0].get("totals", {}))
