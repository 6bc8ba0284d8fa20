"""The DDP communication hook: a DDP bucket handed to the exchange engine, driven by torch.distributed.

``model.register_comm_hook(GradCompHookState(compressor, names), gradcomp_hook)``

The hook builds the bucket's entries (each parameter's gradient view, which also receives the
aggregate), runs :meth:`~lightning_gradcomp.exchange.engine.ExchangeEngine.bucket` with a
:class:`~lightning_gradcomp.exchange.drivers.TorchDriver`, and returns a future of the bucket: the
average over workers of the decoded exchange, as DDP's own all-reduce computes it. The state object
holds the configuration and the accounting; the protocol is the engine's, the collectives the driver's.
"""

import atexit
import threading
import weakref
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch.futures import Future

from lightning_gradcomp.compressors.base import Compressor, check_bool
from lightning_gradcomp.compressors.identity import NoCompression
from lightning_gradcomp.exchange.drivers import TorchDriver
from lightning_gradcomp.exchange.engine import BucketProtocol, BucketReport, Entry, ExchangeEngine
from lightning_gradcomp.exchange.thread import ExchangeThread
from lightning_gradcomp.memory import CompressionMemory
from lightning_gradcomp.options import exchange_options
from lightning_gradcomp.pipeline import WorkerPipeline, resolve_error_feedback, warn_nonfinite
from lightning_gradcomp.stats import StepStats
from lightning_gradcomp.summary import CollectiveTally


class GradCompHookState:
    """State of the ``gradcomp`` communication hook (one per DDP model and rank).

    Args:
        compressor: the compressor (or its registered name) applied to every parameter of at least
            ``min_compress_numel`` elements.
        param_names: ``id(parameter) -> name``; names key the memory, so it survives bucket rebuilds.
        error_feedback: whether residuals are kept; ``None`` means the compressor's default (on when
            biased, unless the compressor keeps its own residual like DGC).
        min_compress_numel: smaller tensors are sent dense.
        seed: base seed of the compressors' generators, identical on all ranks.
        group: process group (default: the world).
        exchange_thread: exchange buckets on a thread of their own (in the order DDP hands them over), so
            compression and every round of communication overlap the rest of backward; ``False`` runs
            them in the hook (the last round's decoding in a future's callback); ``None`` (default): the
            thread for CUDA buckets, the hook for CPU ones (on a CPU the thread competes with backward
            for the same cores; see docs/benchmarks.md).

    Attributes:
        telemetry: measure compression error and time (set by
            :class:`~lightning_gradcomp.callbacks.CompressionMonitor`); off, the hook does no extra work.
        record_layers: also keep per-parameter figures for the current step.
        totals: running totals of every step's figures; part of the checkpoint.
        tally: every collective issued so far, counted by kind and size (for the summary's time
            estimate); part of the checkpoint.
    """

    def __init__(
        self,
        compressor: Union[Compressor, str],
        param_names: dict[int, str],
        error_feedback: Optional[bool] = None,
        min_compress_numel: int = 1024,
        seed: int = 0,
        group: Optional[dist.ProcessGroup] = None,
        exchange_thread: Optional[bool] = None,
    ) -> None:
        options = exchange_options(compressor, error_feedback, min_compress_numel, seed)
        if not isinstance(param_names, dict) or not all(isinstance(n, str) for n in param_names.values()):
            raise ValueError("`param_names` must be a dict of id(parameter) -> parameter name (str), e.g. "
                             "{id(p): n for n, p in model.named_parameters()}")
        self.error_feedback = resolve_error_feedback(options.compressor, options.error_feedback)
        self.pipeline = WorkerPipeline(options.compressor, self.error_feedback)
        self.engine = ExchangeEngine(self.pipeline, options.min_compress_numel, options.seed)
        self.param_names = param_names
        self.driver = TorchDriver(group)
        if exchange_thread is not None:
            check_bool(exchange_thread, "exchange_thread")
        self.exchange_thread = exchange_thread
        self.thread: Optional[ExchangeThread] = None
        _LIVE_STATES.add(self)
        _register_exit_cleanup()
        self.step = 0
        self.hook_calls = 0
        self.record_layers = False
        self.totals = StepStats()
        self.tally = CollectiveTally()
        #: how the workers exchange (checkpoints record it; residuals are kept only under the same layout)
        self.layout = "flat"
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

    @property
    def checkpoint_group(self) -> Optional[dist.ProcessGroup]:
        """The processes whose states one checkpoint entry gathers (the exchange's group)."""
        return self.driver.group

    def use_compressor(self, compressor: Optional[Compressor]) -> None:
        """Switch compressor between steps (``None``: send uncompressed); memory and state are kept."""
        self.pipeline.compressor = compressor if compressor is not None else NoCompression()

    # ------------------------------------------------------------------ accounting
    def take_step_stats(self) -> StepStats:
        """The figures accumulated since the last call (one optimizer step), added to :attr:`totals`."""
        with self._lock:
            stats, self._stats = self._stats, StepStats()
        warn_nonfinite(self.pipeline.take_nonfinite(), self.driver.rank, self.step)
        stats.collectives = self._take_collective_log()
        # collectives inside a node (hierarchical mode, logged as node:*) do not cross the network: not counted
        stats.bytes_sent = sum(nbytes for kind, nbytes in stats.collectives if not kind.startswith("node:"))
        if self.telemetry:
            self.pipeline.recorder.resolve(stats, per_layer=self.record_layers)
            stats.compress_s = self.engine.compress_clock.take()
            stats.decompress_s = self.engine.decompress_clock.take()
        stats.steps = 1 if stats.buckets else 0
        self.totals.add(stats)
        self.tally.add(stats)
        return stats

    def _take_collective_log(self) -> list[tuple[str, int]]:
        return self.driver.take_log()

    def _account(self, report: BucketReport) -> None:
        with self._lock:
            self._stats.bytes_dense += report.bytes_dense
            self._stats.elements_sent += report.elements_sent
            self._stats.elements_total += report.elements_total
            self._stats.buckets += 1

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "memory": self.memory.state_dict(), "totals": self.totals.state_dict(),
                "collectives": self.tally.state_dict()}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        self.step = int(state["step"])
        self.memory.load_state_dict(state["memory"], device)
        self.totals = StepStats.from_state_dict(state.get("totals", {}))
        self.tally = CollectiveTally.from_state_dict(state.get("collectives"))

    # ------------------------------------------------------------------ the exchange
    def exchange(self, bucket: dist.GradBucket) -> Future:
        """Exchange one bucket; the future's value is the bucket's buffer holding the average."""
        buffer = bucket.buffer()
        protocol = self._start(bucket, self.entries(bucket))

        def finish(report: BucketReport) -> torch.Tensor:
            self._account(report)
            return buffer

        if self._use_thread(buffer.device):
            if self.thread is None:
                self.thread = ExchangeThread(self.driver)
            return self.thread.submit(protocol, buffer.device, finish)
        return self.driver.run(protocol).then(lambda done: finish(done.value()))

    def entries(self, bucket: dist.GradBucket) -> list[Entry]:
        """The bucket's parameters: each gradient's view, which also receives its aggregate."""
        return [Entry(self._name(param), tuple(param.shape), grad.view(-1), grad.view(-1))
                for param, grad in zip(bucket.parameters(), bucket.gradients())]

    def _start(self, bucket: dist.GradBucket, entries: list[Entry]) -> BucketProtocol:
        """The engine's exchange of ``entries`` among the driver's workers; counts the hook call, and the
        step when ``bucket`` is the step's last."""
        protocol = self.engine.bucket(entries, self.step, self.driver.rank, self.driver.world_size)
        self.hook_calls += 1
        if bucket.is_last():
            self.step += 1
        return protocol

    def _use_thread(self, device: torch.device) -> bool:
        return device.type == "cuda" if self.exchange_thread is None else self.exchange_thread

    def close(self) -> None:
        """Stop the exchange thread, if any (the strategy calls it at teardown)."""
        if self.thread is not None:
            self.thread.close()

    def _name(self, param: torch.Tensor) -> str:
        name = self.param_names.get(id(param))
        if name is None:
            raise RuntimeError("gradcomp hook: a bucket holds a parameter the strategy did not name")
        return name


_LIVE_STATES: "weakref.WeakSet[GradCompHookState]" = weakref.WeakSet()
_exit_cleanup_registered = False


def _register_exit_cleanup() -> None:
    global _exit_cleanup_registered
    if not _exit_cleanup_registered:
        _exit_cleanup_registered = True
        atexit.register(_cleanup_at_exit)


def _cleanup_at_exit() -> None:
    """Stop every exchange thread, then destroy the default process group if the script left it alive.

    A gloo process group still alive when the interpreter exits can end the process with SIGABRT
    ("terminate called without an active exception"; about 1 run in 15 here, with PyTorch's own
    ``allreduce_hook`` too), and a launcher such as ``torchrun`` then reports the job as failed. By the
    time this runs (after the script's own code), no collective is wanted any more.
    """
    for state in list(_LIVE_STATES):
        state.close()
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - nothing can be reported at exit
            pass


def gradcomp_hook(state: GradCompHookState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """DDP communication hook: ``model.register_comm_hook(GradCompHookState(...), gradcomp_hook)``.

    (This module does not use postponed annotations: DDP checks the hook's annotations as objects.)
    """
    return state.exchange(bucket)
