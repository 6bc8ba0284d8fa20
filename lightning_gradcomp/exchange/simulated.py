"""N workers' compressed exchange on one device: the exchange engine driven in process."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_gradcomp.core.checks import check_int
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.compressors.identity import NoCompression
from lightning_gradcomp.exchange.drivers import InProcessDriver
from lightning_gradcomp.exchange.engine import Entry, ExchangeEngine
from lightning_gradcomp.exchange.pipeline import resolve_error_feedback, warn_nonfinite, WorkerPipeline
from lightning_gradcomp.exchange.state import Accounting, restore_worker_state, worker_state
from lightning_gradcomp.metrics.stats import LayerStats, logged_bytes_sent, StepStats
from lightning_gradcomp.metrics.tally import CollectiveTally
from lightning_gradcomp.metrics.telemetry import StepRecorder


class SimulatedExchange(Accounting):
    """Each simulated worker's exchange, run by the same engine as the DDP hook, in lock-step.

    Per step: :meth:`add_worker` once per worker (in worker order), then :meth:`finish_step`. The whole
    model is one bucket. Each worker has its own :class:`~lightning_gradcomp.exchange.pipeline.WorkerPipeline`
    (residuals, compressor state); the :class:`~lightning_gradcomp.exchange.drivers.InProcessDriver`
    combines their collectives, and worker 0 writes the aggregate, which equals what every rank of a
    real run computes.

    With ``local_size = L > 1`` the workers are the nodes of the hierarchical exchange
    (:mod:`lightning_gradcomp.ddp.hierarchy`): each is fed its node's average gradient, its collectives are
    logged as ``cross:<kind>`` next to the two dense ``node:all_reduce`` of the bucket inside the node,
    and ``bytes_sent`` is per process (the node's payloads are shared out among its ``L`` processes).

    Bytes are counted from the tensors each worker hands over to the driver, as a real rank counts them
    (:func:`~lightning_gradcomp.metrics.stats.collective_bytes_sent`). Step
    figures are averages over workers, like the real strategy's logged figures. Memory: per worker its
    residuals and compressor state, and, until the step's exchange ends, what its protocol holds (for
    uncompressed or cast exchanges, its gradient).
    """

    def __init__(self, compressor: Compressor, workers: int, error_feedback: Optional[bool] = None,
                 min_compress_numel: int = 1024, seed: int = 0, local_size: int = 1) -> None:
        feedback = resolve_error_feedback(compressor, error_feedback)
        self.compressor = compressor
        self.workers = check_int(workers, "workers", 1)
        self.local_size = local_size
        self.layout = "flat" if local_size == 1 else f"nodes={workers},local={local_size},simulated"
        self.error_feedback = feedback
        self.recorder = StepRecorder()
        self.pipelines = [WorkerPipeline(compressor, feedback, self.recorder) for _ in range(workers)]
        self.engines = [ExchangeEngine(pipeline, min_compress_numel, seed) for pipeline in self.pipelines]
        self.driver = InProcessDriver(workers)
        self.step = 0
        self.record_layers = False
        self._totals = StepStats()
        self.tally = CollectiveTally()
        self.step_stats = StepStats()
        #: whether :meth:`finish_step` reads the measured figures from the device (see
        #: :attr:`~lightning_gradcomp.exchange.session.ExchangeSession.telemetry_due`)
        self.telemetry_due = True
        self._aggregate: dict[str, Tensor] = {}

    @property
    def min_compress_numel(self) -> int:
        return self.engines[0].min_compress_numel

    @property
    def seed(self) -> int:
        return self.engines[0].seed

    def use_compressor(self, compressor: Optional[Compressor]) -> None:
        """Switch compressor between steps (``None``: uncompressed); memory and state are kept."""
        self.compressor = compressor if compressor is not None else NoCompression()
        for pipeline in self.pipelines:
            pipeline.compressor = self.compressor

    # ------------------------------------------------------------------ one step
    def add_worker(self, worker: int, named_grads: list[tuple[str, Tensor]],
                   shapes: Optional[dict[str, tuple[int, ...]]] = None) -> None:
        """Start worker ``worker``'s exchange of its gradients (``shapes``: each parameter's shape,
        default the gradient's)."""
        entries = []
        for name, grad in named_grads:
            out = None
            if worker == 0:
                out = self._aggregate[name] = torch.zeros(grad.numel(), dtype=grad.dtype, device=grad.device)
            shape = tuple(shapes[name]) if shapes is not None and name in shapes else tuple(grad.shape)
            entries.append(Entry(name, shape, grad.reshape(-1), out))
        self.driver.start(worker, self.engines[worker].bucket(entries, self.step, worker, self.workers))

    def finish_step(self) -> dict[str, Tensor]:
        """The averaged gradients of this step, by parameter name; the step's figures go to
        :attr:`step_stats` and :attr:`totals`."""
        reports = self.driver.finish()
        for worker, pipeline in enumerate(self.pipelines):
            warn_nonfinite(pipeline.nonfinite.take(), worker)
        logs = [counter.take_log() for counter in self.driver.counters]
        workers = self.workers
        stats = StepStats(
            steps=1, buckets=1,
            bytes_sent=sum(logged_bytes_sent(log, workers) for log in logs) / workers / self.local_size,
            bytes_dense=reports[0].bytes_dense,
            elements_sent=sum(report.elements_sent for report in reports) / workers,
            elements_total=reports[0].elements_total,
            collectives=logs[0],
        )
        if self.local_size > 1:
            stats.collectives = ([("node:all_reduce", reports[0].bytes_dense)] * 2
                                 + [(f"cross:{kind}", nbytes) for kind, nbytes in logs[0]])
        self._totals.add(stats)
        self.tally.add(stats)
        self.step_stats = stats
        self._close_measurements()
        if self.telemetry_due:
            self.read_measurements()
        aggregate, self._aggregate = self._aggregate, {}
        self.step += 1
        return aggregate

    def read_measurements(self) -> None:
        """Bring the measured figures to the host (one synchronisation): the last step's into
        :attr:`step_stats`, averaged over workers, and every step's since the last read into :attr:`totals`."""
        if not self.recorder.unread and not any(clock.unread for clock in self._clocks()):
            return
        workers = self.workers
        step, totals = StepStats(), StepStats()
        self.recorder.read(step, totals)
        for field in ("error_sq", "grad_sq"):
            setattr(self.step_stats, field, getattr(self.step_stats, field) + getattr(step, field) / workers)
            setattr(self._totals, field, getattr(self._totals, field) + getattr(totals, field) / workers)
        for name, layer in step.layers.items():
            self.step_stats.layers.setdefault(name, LayerStats()).add(layer, workers)
        for engine in self.engines:
            for clock, field in ((engine.compress_clock, "compress_s"), (engine.decompress_clock, "decompress_s")):
                earlier, last = clock.read()
                setattr(self.step_stats, field, getattr(self.step_stats, field) + last / workers)
                setattr(self._totals, field, getattr(self._totals, field) + (earlier + last) / workers)

    _read_measurements = read_measurements  # what Accounting.totals calls

    def close(self) -> None:
        """Wait for every non-finite flag still in flight and warn (at teardown)."""
        for worker, pipeline in enumerate(self.pipelines):
            warn_nonfinite(pipeline.nonfinite.take(block=True), worker)

    # ------------------------------------------------------------------ checkpoint
    def state_dicts(self) -> list[dict[str, Any]]:
        """One state per worker, in the format of the DDP hook's per-rank state
        (:func:`~lightning_gradcomp.exchange.state.worker_state`)."""
        return [worker_state(self.step, pipeline.memory, self.totals, self.tally) for pipeline in self.pipelines]

    def load_state_dicts(self, states: list[dict[str, Any]], device: torch.device) -> None:
        for pipeline, state in zip(self.pipelines, states):
            self.restore_counters(*restore_worker_state(state, pipeline.memory, device))
