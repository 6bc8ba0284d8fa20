"""The exchange session: the one object that owns a compressed exchange on this rank.

Every mode feeds it: DDP's hook (a bucket's gradients, :mod:`lightning_gradcomp.ddp`), FSDP2's all-reduce
hook (a replica shard, :mod:`lightning_gradcomp.fsdp`) and the local-update loops (a window's outer
gradients, :mod:`lightning_gradcomp.local`) turn what they hold into
:class:`~lightning_gradcomp.exchange.engine.Entry` lists and call :meth:`ExchangeSession.exchange`::

    session = ExchangeSession(TopK(0.01), group=group)
    session.exchange(entries, last=True)                       # blocking: every entry's ``out`` holds the average
    future = session.exchange(entries, last=True, overlap=True)  # a future; on the exchange thread if it runs

The session owns the engine and its pipeline (error feedback residuals, compressor state), the driver
(torch.distributed; torchft's reconfigurable group under fault tolerance, :meth:`use_driver`), the exchange
thread and streams, the accounting (step figures, totals, the tally of collectives) and this rank's part of
a checkpoint (:meth:`state_dict`; the gather of every rank's part is :mod:`lightning_gradcomp.exchange.checkpoint`).
"""

import atexit
import gc
import logging
import threading
import time
import warnings
import weakref
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.futures import Future

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.compressors.identity import NoCompression
from lightning_gradcomp.core.checks import check_bool
from lightning_gradcomp.exchange.agreement import check_agreement
from lightning_gradcomp.exchange.checkpoint import forget_checkpoint_group
from lightning_gradcomp.exchange.drivers import TorchDriver
from lightning_gradcomp.exchange.engine import BucketProtocol, BucketReport, Entry, ExchangeEngine
from lightning_gradcomp.exchange.memory import CompressionMemory
from lightning_gradcomp.exchange.options import ExchangeOptions
from lightning_gradcomp.exchange.pipeline import resolve_error_feedback, warn_nonfinite, WorkerPipeline
from lightning_gradcomp.exchange.state import Accounting, restore_worker_state, worker_state
from lightning_gradcomp.exchange.thread import (
    check_concurrent_communicators,
    concurrent_communicators_allowed,
    exchange_group,
    ExchangeStreams,
    ExchangeThread,
    group_timeout,
)
from lightning_gradcomp.metrics.stats import logged_bytes_sent, StepStats
from lightning_gradcomp.metrics.tally import CollectiveTally


class ExchangeSession(Accounting):
    """The compressed exchange of one model (or one group of shards) on this rank, whatever feeds it.

    Args:
        compressor: the compressor (or its registered name) applied to every parameter of at least
            ``min_compress_numel`` elements.
        error_feedback: whether residuals are kept; ``None`` means the compressor's default (on when
            biased, unless the compressor keeps its own residual like DGC).
        min_compress_numel: smaller tensors are sent dense.
        seed: base seed of the compressors' generators, identical on all ranks.
        group: process group (default: the world).
        exchange_thread: exchange buckets on a thread of their own (:mod:`lightning_gradcomp.exchange.thread`,
            its own process group, created here); ``False`` runs them in the hook; ``None`` (default): the
            thread for CUDA buckets, the hook for CPU ones (see docs/benchmarks.md) and on NCCL with
            ``CUDA_DEVICE_MAX_CONNECTIONS=1``, where ``True`` is refused.
        device: the gradients' device, where known, to decide ``exchange_thread=None`` now (default:
            CUDA when available).
        settings: what else shapes the wire, as ``name -> value`` text (the adapter's: a shard layout,
            local updates' ``H`` and fragments).
        caller: the entry point, for messages.

    Every rank of ``group`` builds its session at the same point, where the ranks' settings are compared
    (:func:`~lightning_gradcomp.exchange.agreement.check_agreement`). On CUDA every exchange runs on a stream
    of its own (:mod:`lightning_gradcomp.exchange.thread`), and nothing inside the hook waits for the device.

    A step's figures are closed when the next step's first bucket arrives, if nobody took them before
    (:meth:`take_step_stats`), so a raw hook keeps no more than one step of them.

    Attributes:
        telemetry: measure compression error and time (set by
            :class:`~lightning_gradcomp.lightning.callbacks.CompressionMonitor`); off, the hook does no extra work.
        telemetry_due: whether :meth:`take_step_stats` brings the measured figures to the host (one host
            synchronisation on accelerators); the monitor sets it on the steps it logs. Unread figures
            are kept on the device and reach :attr:`totals` at the next read.
        record_layers: also keep per-parameter figures for the current step.
        tally: every collective issued so far, counted by kind and size (for the summary's time
            estimate); part of the checkpoint.
    """

    def __init__(
        self,
        compressor: Union[Compressor, str],
        error_feedback: Optional[bool] = None,
        min_compress_numel: int = 1024,
        seed: int = 0,
        group: Optional[dist.ProcessGroup] = None,
        exchange_thread: Optional[bool] = None,
        device: Optional[torch.device] = None,
        *,
        settings: Optional[Mapping[str, str]] = None,
        caller: str = "the exchange",
    ) -> None:
        options = ExchangeOptions(compressor, error_feedback, min_compress_numel, seed)
        self.error_feedback = resolve_error_feedback(options.compressor, options.error_feedback)
        self.pipeline = WorkerPipeline(options.compressor, self.error_feedback)
        self.engine = ExchangeEngine(self.pipeline, options.min_compress_numel, options.seed)
        self.pipelines, self.engines = [self.pipeline], [self.engine]  # the one worker's (Accounting)
        self.driver = TorchDriver(group)
        if exchange_thread is not None:
            check_bool(exchange_thread, "exchange_thread")
        self.exchange_thread = _resolve_exchange_thread(exchange_thread, dist.get_backend(group))
        self.streams = ExchangeStreams()
        self.thread: Optional[ExchangeThread] = None
        self._thread_driver: Optional[TorchDriver] = None
        #: the group the ranks agree over (the exchange's group at construction; torchft's, swapped in later by
        #: :meth:`use_driver`, is not a torch.distributed group)
        self._agreement_group = group
        may_use_thread = self.exchange_thread if self.exchange_thread is not None else (
            device.type == "cuda" if device is not None else torch.cuda.is_available())
        check_agreement({"entry point": caller, "compressor": repr(options.compressor),
                         "error_feedback": str(self.error_feedback),
                         "min_compress_numel": str(options.min_compress_numel), "seed": str(options.seed),
                         "exchange_thread": str(may_use_thread), **(settings or {})},
                        group, caller=caller)
        if may_use_thread:
            self._thread_driver = TorchDriver(exchange_group(group, device))
        _LIVE_STATES.add(self)
        _register_exit_cleanup()
        self.step = 0
        self.hook_calls = 0
        self.record_layers = False
        self.telemetry_due = True
        self._totals = StepStats()
        self.tally = CollectiveTally()
        #: how the workers exchange (checkpoints record it; residuals are kept only under the same layout)
        self.layout = "flat"
        self._stats = StepStats()
        self._last = StepStats()
        self._closed_step = 0
        self._lock = threading.Lock()
        self._cpu_group: Optional[dist.ProcessGroup] = None
        #: a plain handle's own gloo group for checkpoint gathers (``timeout``), released at exit
        self.handle_gather_group: Optional[dist.ProcessGroup] = None
        #: the first error of an exchange whose future DDP waited on (a :class:`CollectiveError` when a peer
        #: died); DDP's backward raises it as a ``RuntimeError`` carrying its message (see :meth:`_for_ddp`)
        self.failure: Optional[BaseException] = None
        self._hinted: set[str] = set()  # compressors' non-finite hints already given (once each)
        logger.info("gradcomp exchange on rank %d of %d: %r, error feedback %s, min_compress_numel %d, exchange thread %s",
                    self.driver.rank, self.driver.world_size, self.compressor, "on" if self.error_feedback else "off",
                    self.min_compress_numel,
                    "on its own process group" if self._thread_driver is not None else "off (in the hook)")

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
    def checkpoint_group(self) -> Optional[dist.ProcessGroup]:
        """The processes whose states one checkpoint entry gathers (the exchange's group)."""
        return self.driver.group

    def use_compressor(self, compressor: Optional[Compressor]) -> None:
        """Switch compressor between steps (``None``: send uncompressed); memory and state are kept. The
        ranks of the exchange agree on the new one first (a switch on some ranks only would mix payload
        sizes): every rank switches at the same point, or every rank raises
        :class:`~lightning_gradcomp.exchange.agreement.SettingsMismatch` (a rank that never switches:
        :class:`~lightning_gradcomp.exchange.waits.WaitTimeout`)."""
        compressor = compressor if compressor is not None else NoCompression()
        check_agreement({"compressor": repr(compressor)}, self._agreement_group, caller="use_compressor()")
        self.pipeline.compressor = compressor

    # ------------------------------------------------------------------ accounting
    def take_step_stats(self) -> StepStats:
        """The figures of the step that ended since the last call (its last bucket was handed to the
        hook; empty if none did), added to :attr:`totals`; with :attr:`telemetry_due`, its measured
        figures read from the device. Call it after the optimizer step (outside the hook)."""
        closed = self._close_step()
        if self.telemetry_due:
            self._read_measurements()
        return self._last if closed else StepStats()

    @property
    def last_step_stats(self) -> StepStats:
        """The figures of the step closed last, with its measured figures (read outside the hook)."""
        self._close_step()
        self._read_measurements()
        return self._last

    def _close_step(self, flush: bool = False) -> bool:
        """Close the figures of a step whose buckets were all handed over, without waiting for the
        device: bytes, collectives, non-finite warnings whose flags reached the host, and the
        measurements folded into device-side sums. Whether a step was closed. ``flush``: also fold in
        what arrived since the last close without a new step (an overlapped exchange that finished
        late), into the totals and the last step's figures."""
        self._warn(self.pipeline.nonfinite.take())
        if self.step == self._closed_step and not flush:
            return False
        steps, self._closed_step = self.step - self._closed_step, self.step
        with self._lock:
            stats, self._stats = self._stats, StepStats()
        stats.collectives = self._take_collective_log()
        # bytes sent by the package's one definition; node:* collectives (hierarchical mode) are not counted
        stats.bytes_sent = logged_bytes_sent(stats.collectives, self.driver.world_size) if stats.collectives else 0
        self._close_measurements()
        stats.steps = steps  # steps whose last bucket was handed over (an overlapped one may report later)
        self._totals.add(stats)
        self.tally.add(stats)
        if steps:
            self._last = stats
        else:
            self._last.add(stats)
            self._last.collectives += stats.collectives
        return bool(steps)

    def flush(self) -> None:
        """Wait for the exchanges on the exchange thread and fold their figures into the totals (at the end
        of training, before a summary)."""
        if self.thread is not None:
            self.thread.drain()
        self._close_step(flush=True)

    def _read_measurements(self) -> None:
        """Bring the measured figures of every closed step to the host (one synchronisation): the last
        step's into its stats, all of them into the totals."""
        recorder, clocks = self.pipeline.recorder, self._clocks()
        if not recorder.unread and not any(clock.unread for clock in clocks):
            return
        recorder.read(self._last, self._totals)
        for clock, field in zip(clocks, ("compress_s", "decompress_s")):
            earlier, last = clock.read()
            setattr(self._last, field, getattr(self._last, field) + last)
            setattr(self._totals, field, getattr(self._totals, field) + earlier + last)

    def flush_nonfinite(self) -> None:
        """Wait for every non-finite flag still in flight and warn (at teardown)."""
        self._warn(self.pipeline.nonfinite.take(block=True))

    def _warn(self, found: list[tuple[int, list[str]]]) -> None:
        """The non-finite warnings of the steps in ``found``, and once the compressor's hint at another cause
        than a NaN in the gradient (:attr:`~lightning_gradcomp.compressors.base.Compressor.nonfinite_hint`:
        FP16's range)."""
        if found:
            rank = self.driver.rank if dist.is_initialized() else -1
            warn_nonfinite(found, rank)
            hint = self.compressor.nonfinite_hint
            if hint and hint not in self._hinted:
                self._hinted.add(hint)
                warnings.warn(f"gradcomp: the non-finite gradients above may be finite but large: {hint}",
                              RuntimeWarning, stacklevel=2)

    def _take_collective_log(self) -> list[tuple[str, int]]:
        log = self.driver.take_log()
        if self._thread_driver is not None and self._thread_driver is not self.driver:
            log += self._thread_driver.take_log()
        return log

    def _account(self, report: BucketReport) -> None:
        with self._lock:
            self._stats.bytes_dense += report.bytes_dense
            self._stats.elements_sent += report.elements_sent
            self._stats.elements_total += report.elements_total
            self._stats.buckets += 1

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of a checkpoint entry (:func:`~lightning_gradcomp.exchange.state.worker_state`)."""
        self._close_step()
        return worker_state(self.step, self.memory, self.totals, self.tally)

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        """Restore a :meth:`state_dict` (``device``: where the memory goes). On CUDA the tensors are
        created on the exchange stream, which later reads and frees them."""
        with self.streams.entered(torch.device(device)):
            self.restore_counters(*restore_worker_state(state, self.memory, device))

    def gather_group(self) -> Optional[dist.ProcessGroup]:
        """The group that gathers checkpoint entries: :attr:`checkpoint_group`, or a gloo group of the
        same ranks when that one is not gloo (so that nothing is gathered in GPU memory). Created at
        the first call; every rank of the group calls it at the same point (a checkpoint save)."""
        group = self.checkpoint_group
        if dist.get_backend(group) == dist.Backend.GLOO:
            return group
        if self._cpu_group is None:
            world = group is None or group is dist.group.WORLD
            ranks = None if world else dist.get_process_group_ranks(group)
            self._cpu_group = dist.new_group(ranks, backend="gloo", timeout=group_timeout(group),
                                             use_local_synchronization=not world)
        return self._cpu_group

    # ------------------------------------------------------------------ the exchange
    def exchange(self, entries: Sequence[Entry], *, last: bool, overlap: bool = False,
                 value: Any = None, keeps_inputs: bool = False) -> Optional[Future]:
        """Exchange ``entries`` among the driver's workers, each average written into its entry's ``out``.

        Every rank calls it with the same names in the same order. ``last``: these entries end a step (the
        step counter moves on, which seeds the compressors' draws). The first exchange of a step closes the
        figures of the step before, without waiting for the device.

        ``overlap=False``: in the calling thread; when it returns, the averages are written; a peer that died
        raises :class:`~lightning_gradcomp.exchange.drivers.CollectiveError` on every rank.
        ``overlap=True``: returns a future of ``value`` (default: the outputs), and the exchange overlaps what
        the caller does next: on the exchange thread where it runs (:attr:`exchange_thread`, or CUDA tensors
        by default), else issued now with the last round's decoding in the future's callback. Waiting on the
        future raises the exchange's error. On the thread, the entries' tensors are recorded on the exchange
        stream (they were allocated on the caller's), unless ``keeps_inputs``: the caller keeps them alive
        until the future completes (DDP's bucket).
        """
        protocol = self._begin(entries, last)
        if not overlap:
            self._account(self.driver.drive(protocol))
            return None
        device = entries[0].grad.device
        outs = [entry.out for entry in entries if entry.out is not None]
        result = outs if value is None else value

        def finish(report: BucketReport) -> Any:
            self._account(report)
            return result  # on CUDA, waiting on the future makes the waiter's stream wait for it

        if self._use_thread(device):
            handed = () if keeps_inputs else [entry.grad for entry in entries] + outs
            return self._exchange_thread().submit(protocol, device, finish, handed)
        with self.streams.entered(device):
            return self.driver.run(protocol, finish, device, self.streams.get(device))

    def _begin(self, entries: Sequence[Entry], last: bool) -> BucketProtocol:
        """The engine's exchange of ``entries`` among the driver's workers, not yet run: closes the step
        before if this is a new one, counts the call, and the step when ``last``."""
        self._close_step()
        protocol = self.engine.bucket(entries, self.step, self.driver.rank, self.driver.world_size)
        self.hook_calls += 1
        if last:
            self.step += 1
        return protocol

    def _exchange_thread(self) -> ExchangeThread:
        if self.thread is None:
            if self._thread_driver is None:  # exchange_thread=None, device not known at construction
                raise RuntimeError(
                    "gradcomp: the exchange thread needs its process group, created with the exchange session; "
                    "pass `device=` (or exchange_thread=True) when building it so that it is created up front")
            self.thread = ExchangeThread(self._thread_driver, self.streams)
        return self.thread

    def use_driver(self, driver: TorchDriver) -> None:
        """Run every later exchange through ``driver``, in the caller and on the exchange thread alike (a
        process group that changes between exchanges: torchft's): an overlapped exchange then runs on the
        thread whether or not the session was built with ``exchange_thread=True`` (build it without: no
        group of its own)."""
        if self.thread is not None:
            raise RuntimeError("gradcomp: the exchange thread already runs on its own group")
        self.driver = driver
        self._thread_driver = driver
        self.exchange_thread = True

    def end_step(self) -> None:
        """Count the end of a step whose exchanges were made with ``last=False`` (``register_fsdp``: when the
        backward that exchanged ends)."""
        self.step += 1

    def _use_thread(self, device: torch.device) -> bool:
        return device.type == "cuda" if self.exchange_thread is None else self.exchange_thread

    def close(self) -> None:
        """Stop the exchange thread, if any, and report non-finite gradients still in flight (the
        strategy calls it at teardown)."""
        if self.thread is not None:
            self.thread.close()
        self.flush_nonfinite()


logger = logging.getLogger(__name__)


def _resolve_exchange_thread(requested: Optional[bool], backend: str) -> Optional[bool]:
    """``exchange_thread`` under the ordering rule (:mod:`lightning_gradcomp.exchange.thread`): ``True`` is
    refused, and ``None`` becomes ``False`` (the hook), where NCCL has one hardware queue
    (``CUDA_DEVICE_MAX_CONNECTIONS=1``); otherwise as requested."""
    if requested:
        check_concurrent_communicators(backend)
    elif requested is None and not concurrent_communicators_allowed(backend):
        logger.info("gradcomp: CUDA_DEVICE_MAX_CONNECTIONS=1 on NCCL: buckets are exchanged in the hook")
        return False
    return requested


_LIVE_STATES: "weakref.WeakSet[ExchangeSession]" = weakref.WeakSet()
_exit_cleanup_registered = False
#: how long the exit clean-up leaves the GIL to the process groups' worker threads (seconds)
EXIT_DRAIN_S = 0.05


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
        # the gather groups this package made: freed now, with the interpreter whole, not in its teardown
        state.handle_gather_group = state._cpu_group = None
    forget_checkpoint_group()
    # A DDP model the script dropped often survives in a reference cycle (its hooks refer to it) until the
    # interpreter's own teardown, where its reducer and process group are destroyed in no safe order (the
    # same abort). Collected here, while the interpreter is whole.
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - nothing can be reported at exit
            pass
    # The process groups' worker threads outlive this (a DDP model keeps its group alive to the end). One
    # that is still letting go of a finished collective (its tensors, its future's Python callback) needs
    # the GIL for their Python objects; a thread that takes the GIL once the interpreter is finalizing
    # aborts the process (the same "terminate called"; about 1 run in 10 on a loaded 2-core machine, the
    # gloo worker freeing an all-gather's output while the interpreter finalizes). Sleeping releases the
    # GIL: they finish now, while the interpreter is whole.
    time.sleep(EXIT_DRAIN_S)


@contextmanager
def exchange_failures(state: Any) -> Iterator[None]:
    """Around a ``backward()`` of a DDP model with the hook: re-raise the exchange's own error (a
    :class:`~lightning_gradcomp.exchange.drivers.CollectiveError` when a peer died) where DDP reports it
    as a ``RuntimeError``, so that callers can catch it by type. ``state``: anything with a ``failure``
    attribute (the hook state, or the handle :func:`~lightning_gradcomp.register` returns; ``None``
    passes every error on)::

        with lightning_gradcomp.exchange_failures(gradcomp):
            loss.backward()
    """
    try:
        yield
    except RuntimeError as error:
        failure = getattr(state, "failure", None)
        if failure is None or failure is error:
            raise
        raise failure from error
