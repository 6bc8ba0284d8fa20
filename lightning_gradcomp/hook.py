"""The DDP communication hook: a DDP bucket handed to the exchange engine, driven by torch.distributed.

``model.register_comm_hook(GradCompHookState(compressor, names), gradcomp_hook)``

The hook builds the bucket's entries (each parameter's gradient view, which also receives the
aggregate), runs :meth:`~lightning_gradcomp.exchange.engine.ExchangeEngine.bucket` with a
:class:`~lightning_gradcomp.exchange.drivers.TorchDriver`, and returns a future of the bucket: the
average over workers of the decoded exchange, as DDP's own all-reduce computes it. The state object
holds the configuration and the accounting; the protocol is the engine's, the collectives the driver's.
"""

import threading
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.futures import Future

from lightning_gradcomp.compressors.base import Compressor, check_int
from lightning_gradcomp.compressors.identity import NoCompression
from lightning_gradcomp.exchange.drivers import TorchDriver
from lightning_gradcomp.exchange.engine import BucketReport, Entry, ExchangeEngine
from lightning_gradcomp.memory import CompressionMemory
from lightning_gradcomp.pipeline import WorkerPipeline, resolve_error_feedback
from lightning_gradcomp.stats import StepStats


class GradCompHookState:
    """State of the ``gradcomp`` communication hook (one per DDP model and rank).

    Args:
        compressor: the compressor applied to every parameter of at least ``min_compress_numel`` elements.
        param_names: ``id(parameter) -> name``; names key the memory, so it survives bucket rebuilds.
        error_feedback: whether residuals are kept; ``None`` means the compressor's default (on when
            biased, unless the compressor keeps its own residual like DGC).
        min_compress_numel: smaller tensors are sent dense.
        seed: base seed of the compressors' generators, identical on all ranks.
        group: process group (default: the world).

    Attributes:
        telemetry: measure compression error and time (set by
            :class:`~lightning_gradcomp.callbacks.CompressionMonitor`); off, the hook does no extra work.
        record_layers: also keep per-parameter figures for the current step.
        totals: running totals of every step's figures; part of the checkpoint.
    """

    def __init__(
        self,
        compressor: Compressor,
        param_names: dict[int, str],
        error_feedback: Optional[bool] = None,
        min_compress_numel: int = 1024,
        seed: int = 0,
        group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        if not isinstance(compressor, Compressor):
            raise ValueError(f"`compressor` must be a Compressor instance, got {compressor!r}")
        if not isinstance(param_names, dict):
            raise ValueError(f"`param_names` must be a dict of id(parameter) -> name, got {type(param_names).__name__}")
        if error_feedback not in (None, True, False):
            raise ValueError(f"`error_feedback` must be None, True or False, got {error_feedback!r}")
        self.error_feedback = resolve_error_feedback(compressor, error_feedback)
        self.pipeline = WorkerPipeline(compressor, self.error_feedback)
        self.engine = ExchangeEngine(self.pipeline, check_int(min_compress_numel, "min_compress_numel", 0),
                                     check_int(seed, "seed", 0))
        self.param_names = param_names
        self.driver = TorchDriver(group)
        self.step = 0
        self.hook_calls = 0
        self.record_layers = False
        self.totals = StepStats()
        self._stats = StepStats()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ configuration
    @property
    def compressor(self) -> Compressor:
        """The compressor in use (a schedule may switch to :class:`NoCompression` for a while)."""
        return self.pipeline.compressor

    @property
    def memory(self) -> CompressionMemory:
        return self.pipeline.memory

    @property
    def min_compress_numel(self) -> int:
        return self.engine.min_compress_numel

    @property
    def seed(self) -> int:
        return self.engine.seed

    @property
    def telemetry(self) -> bool:
        """Measure compression error and time; off, the hook does no extra work."""
        return self.pipeline.telemetry

    @telemetry.setter
    def telemetry(self, on: bool) -> None:
        self.pipeline.telemetry = bool(on)

    def use_compressor(self, compressor: Optional[Compressor]) -> None:
        """Switch compressor between steps (``None``: send uncompressed); memory and state are kept."""
        self.pipeline.compressor = compressor if compressor is not None else NoCompression()

    # ------------------------------------------------------------------ accounting
    def take_step_stats(self) -> StepStats:
        """The figures accumulated since the last call (one optimizer step), added to :attr:`totals`."""
        with self._lock:
            stats, self._stats = self._stats, StepStats()
        stats.collectives = self.driver.take_log()
        stats.bytes_sent = sum(nbytes for _, nbytes in stats.collectives)
        if self.telemetry:
            self.pipeline.recorder.resolve(stats, per_layer=self.record_layers)
            stats.compress_s = self.engine.compress_clock.take()
            stats.decompress_s = self.engine.decompress_clock.take()
        stats.steps = 1 if stats.buckets else 0
        self.totals.add(stats)
        return stats

    def _account(self, report: BucketReport) -> None:
        with self._lock:
            self._stats.bytes_dense += report.bytes_dense
            self._stats.elements_sent += report.elements_sent
            self._stats.elements_total += report.elements_total
            self._stats.buckets += 1

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "memory": self.memory.state_dict(), "totals": self.totals.state_dict()}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        self.step = int(state["step"])
        self.memory.load_state_dict(state["memory"], device)
        self.totals = StepStats.from_state_dict(state.get("totals", {}))

    # ------------------------------------------------------------------ the exchange
    def exchange(self, bucket: dist.GradBucket) -> Future:
        """Exchange one bucket; the future's value is the bucket's buffer holding the average."""
        buffer = bucket.buffer()
        entries = [Entry(self._name(param), tuple(param.shape), grad.view(-1), grad.view(-1))
                   for param, grad in zip(bucket.parameters(), bucket.gradients())]
        protocol = self.engine.bucket(entries, self.step, self.driver.rank, self.driver.world_size)
        self.hook_calls += 1
        if bucket.is_last():
            self.step += 1
        future = self.driver.run(protocol)

        def done(finished: Future) -> torch.Tensor:
            self._account(finished.value())
            return buffer

        return future.then(done)

    def _name(self, param: torch.Tensor) -> str:
        name = self.param_names.get(id(param))
        if name is None:
            raise RuntimeError("gradcomp hook: a bucket holds a parameter the strategy did not name")
        return name


def gradcomp_hook(state: GradCompHookState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """DDP communication hook: ``model.register_comm_hook(GradCompHookState(...), gradcomp_hook)``.

    (This module does not use postponed annotations: DDP checks the hook's annotations as objects.)
    """
    return state.exchange(bucket)
