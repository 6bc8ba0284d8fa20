"""The drivers of the exchange engine: the collectives, and the count of the bytes they send.

:class:`TorchDriver` issues them through ``torch.distributed``, every collective from the calling thread
and never from a future's callback (so in the same order on every rank; only the decoding after the final
round runs in a callback); :class:`InProcessDriver` runs N simulated workers in lock-step and combines
their collectives in process. Both count ``bytes_sent`` from the tensors they are handed
(:func:`~lightning_gradcomp.metrics.stats.collective_bytes_sent`) and log each collective's ``(kind,
input bytes)``, so a real run and a simulation with the same buckets report the same bytes.

Failures: on gloo a collective that fails (a peer died, closed its connection or timed out) fails its
future, and :class:`TorchDriver` raises :class:`CollectiveError` on every rank that waits for it. On
NCCL a collective's future completes when the collective is *queued* (the device waits, not the host),
so a dead peer is not seen there: PyTorch's NCCL watchdog finds the collective still running after the
process group's ``timeout``, aborts the communicator and ends every surviving process with an error
naming the collective (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, on by default). Making the host wait for each
collective (``TORCH_NCCL_BLOCKING_WAIT=1``) would turn that into a Python error, at the price of a host
synchronisation per collective, which this package does not do.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_gradcomp.core.device import on_stream
from lightning_gradcomp.exchange.engine import BucketProtocol, BucketReport, Collective, CollectiveRound
from lightning_gradcomp.exchange.waits import Arrival, WaitTimeout
from lightning_gradcomp.metrics.stats import collective_bytes_sent


def world_collective_device() -> torch.device:
    """Where a collective of the default group takes its tensors: the current GPU on NCCL (the parameters
    may be offloaded to the CPU), else the CPU."""
    return collective_device(None)


def collective_device(group: Optional[dist.ProcessGroup]) -> torch.device:
    """Where a collective of ``group`` (``None``: the default group) takes its tensors: the current GPU on
    NCCL, else the CPU. A group that torch.distributed does not know (torchft's) is gloo's: the CPU."""
    try:
        nccl = dist.get_backend(group) == dist.Backend.NCCL
    except (ValueError, RuntimeError):  # not registered with torch.distributed
        nccl = False
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


class CollectiveError(RuntimeError):
    """A collective of the compressed exchange failed (a peer died, closed its connection or timed out)."""


class _ByteCounter:
    """``bytes_sent`` (:func:`~lightning_gradcomp.metrics.stats.collective_bytes_sent`) and the
    ``(kind, input bytes)`` log of every collective handed over; with a ``scope`` (``"node"``, ``"cross"``:
    which processes take part, see :mod:`lightning_gradcomp.metrics.netmodel`) the kinds are logged as
    ``"<scope>:<kind>"``."""

    def __init__(self, scope: str = "") -> None:
        self.bytes_sent = 0
        self.scope = scope
        self._log: list[tuple[str, int]] = []
        self._lock = threading.Lock()  # the exchange thread counts while the training thread takes the log

    def count(self, collective: Collective, world_size: int) -> None:
        """Count ``collective``, issued among ``world_size`` ranks."""
        sent = collective_bytes_sent(collective.kind, collective.nbytes, world_size)
        with self._lock:
            self.bytes_sent += sent
            self._log.append((f"{self.scope}:{collective.kind}" if self.scope else collective.kind, collective.nbytes))

    def take_log(self) -> list[tuple[str, int]]:
        """``(kind, input bytes)`` of every collective handed over since the last call."""
        with self._lock:
            log, self._log = self._log, []
        return log


class TorchDriver(_ByteCounter):
    """Runs a bucket's exchange through ``torch.distributed`` on one process group."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None, scope: str = "") -> None:
        super().__init__(scope)
        self.group = group
        #: whether ``Work.wait()`` is called after the future (NCCL and other device backends; not gloo)
        self._releases_on_wait = _backend(group) not in ("gloo", "")

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def run(self, protocol: BucketProtocol, finish: Callable[[BucketReport], Any] = lambda report: report,
            device: Optional[torch.device] = None, stream: "Optional[torch.cuda.Stream]" = None) -> Future:
        """Drive ``protocol`` (from :meth:`ExchangeEngine.bucket`): its intermediate rounds now, its final
        round's decoding once the collectives complete. The future's value is ``finish(report)``.

        On CUDA (``device``), the caller runs this with ``stream`` current and the decoding runs on
        ``stream`` too (a callback's own stream is whatever the completing thread had); the future is
        made for the device, so that waiting on it makes the waiting stream wait for the decoding
        (``finish`` should then return the tensor the waiter reads)."""
        result: Future = Future(devices=[device]) if device is not None and device.type == "cuda" else Future()
        turn = self._to_final_round(protocol)
        if not isinstance(turn, CollectiveRound):
            # no round (nothing to send): completed here, on the caller's stream (``stream``), as a device
            # future, so that the waiter's stream waits for the decoding all the same
            result.set_result(finish(turn))
            return result
        issued = [self._issue(collective) for collective in turn.collectives]

        def decode(_: Any) -> None:
            # Waiting on each collective raises its error (a dead peer on gloo) instead of decoding
            # garbage, and, on CUDA, makes the current stream wait for the collective (collect_all
            # carries no stream events).
            try:
                with on_stream(stream):
                    result.set_result(finish(_decode(protocol, [self._wait(*item) for item in issued])))
            except BaseException as error:  # noqa: BLE001 - every error must reach the waiter
                result.set_exception(error)

        if not issued:
            decode(None)
        else:
            torch.futures.collect_all([future for future, _, _, _ in issued]).then(decode)
        return result

    def drive(self, protocol: BucketProtocol) -> BucketReport:
        """Drive ``protocol`` to its end, waiting on every round (for an exchange thread)."""
        turn = self._to_final_round(protocol)
        if not isinstance(turn, CollectiveRound):
            return turn
        issued = [self._issue(collective) for collective in turn.collectives]
        return _decode(protocol, [self._wait(*item) for item in issued])

    def _to_final_round(self, protocol: BucketProtocol) -> "CollectiveRound | BucketReport":
        """Run ``protocol`` through its intermediate rounds, waiting for each in the calling thread; its
        final round (not yet issued), or its report if it ended without one."""
        try:
            turn = next(protocol)
            while not turn.final:
                issued = [self._issue(collective) for collective in turn.collectives]
                turn = protocol.send([self._wait(*item) for item in issued])
        except StopIteration as stop:
            return stop.value
        return turn

    def all_reduce(self, tensor: Tensor) -> None:
        """A dense, blocking all-reduce (sum, in place) on the group, counted like any other collective."""
        collective = Collective("all_reduce", tensor)
        self._wait(*self._issue(collective))

    def all_gather(self, tensor: Tensor, arrival: Optional[Arrival] = None) -> Tensor:
        """Every rank's ``tensor`` (the same size on each), one row per rank: blocking, counted like any other
        collective. With ``arrival`` (made just before, on every rank) the host waits at most
        ``GRADCOMP_WAIT_TIMEOUT`` seconds (:class:`~lightning_gradcomp.exchange.waits.WaitTimeout`)."""
        issued = self._issue(Collective("all_gather", tensor))
        if arrival is not None:
            try:
                arrival.wait(issued[3])
            except WaitTimeout:
                raise
            except Exception as error:  # a peer died: as any other collective's failure
                raise self._failure(issued[2], error) from error
        return self._wait(*issued)

    def _issue(self, collective: Collective) -> tuple[Future, Tensor, Collective, Optional[dist.Work]]:
        """Issue ``collective``: its future, where its result lands, the collective, and its work handle
        (waited for by :meth:`_wait` on NCCL only, see there)."""
        self.count(collective, self.world_size)
        tensor = collective.tensor
        if collective.kind == "all_reduce":
            work = dist.all_reduce(tensor, group=self.group, async_op=True)
            result = tensor
        elif collective.kind == "all_to_all":
            output = torch.empty_like(tensor)
            work = dist.all_to_all_single(output, tensor, group=self.group, async_op=True)
            result = output.view(self.world_size, -1)
        else:
            output = tensor.new_empty(self.world_size * tensor.numel())
            work = _all_gather_single()(output, tensor, group=self.group, async_op=True)
            result = output.view(self.world_size, -1)
        return work.get_future(), result, collective, work

    def _wait(self, future: Future, result: Tensor, collective: Collective, work: Optional[dist.Work]) -> Tensor:
        """The collective's result, once it is done: on gloo the host waits (and a failure raises); on CUDA
        the current stream waits for the collective's. On NCCL ``work.wait()`` also lets the process group
        drop the tensors it keeps for the collective (else held until its watchdog finds the work completed).
        On gloo only the future is waited for: ``work.wait()`` inside the future's callback, on the thread that
        completes the work, would wait for itself."""
        try:
            future.wait()
            if work is not None and self._releases_on_wait:
                work.wait()
        except Exception as error:
            raise self._failure(collective, error) from error
        return result

    def _failure(self, collective: Collective, error: BaseException) -> CollectiveError:
        """The error that ``collective`` failed with ``error`` (a peer died, or its connection broke)."""
        return CollectiveError(f"gradcomp: {collective.kind} of {collective.nbytes} bytes failed on rank {self.rank} of "
                               f"{self.world_size}: {error}")


class ReconfigurableDriver(TorchDriver):
    """:class:`TorchDriver` on a process group that is not registered with ``torch.distributed`` and changes
    between exchanges (torchft's quorum's group, reconfigured when replica groups leave or join): the group is
    set with :meth:`use` before each exchange; its rank and size are the group's own. Gloo only (the host
    waits on each collective's future)."""

    def __init__(self, scope: str = "") -> None:
        _ByteCounter.__init__(self, scope)
        self.group = None
        self._releases_on_wait = False

    def use(self, group: dist.ProcessGroup) -> None:
        """Issue the next exchanges on ``group``."""
        self.group = group

    @property
    def world_size(self) -> int:
        return self.group.size() if self.group is not None else 1

    @property
    def rank(self) -> int:
        return self.group.rank() if self.group is not None else 0


class InProcessDriver:
    """Runs N simulated workers' exchanges in lock-step and combines their collectives in process.

    Per step: :meth:`start` once per worker, in worker order (each worker's protocol runs to its first
    round at once, so the simulation can go on to the next worker's backward), then :meth:`finish`.
    ``all_reduce`` is a sum in worker order; ``all_gather`` stacks the workers' tensors; ``all_to_all``
    hands worker ``w`` row ``w`` of every worker's tensor. Every worker receives the same tensors for
    the first two (protocols treat results as read-only). Bytes are counted per worker, exactly as
    :class:`TorchDriver` counts them on each rank (among ``workers`` ranks).
    """

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.counters = [_ByteCounter() for _ in range(workers)]
        self._protocols: list[BucketProtocol] = []
        self._turns: list[Optional[CollectiveRound]] = []
        self._reports: list[Optional[BucketReport]] = []

    def start(self, worker: int, protocol: BucketProtocol) -> None:
        """Run worker ``worker``'s protocol to its first round."""
        if worker != len(self._protocols):
            raise RuntimeError(f"InProcessDriver: workers start in order; expected {len(self._protocols)}, got {worker}")
        self._protocols.append(protocol)
        self._turns.append(None)
        self._reports.append(None)
        self._send(worker, None)

    def _send(self, worker: int, results: Optional[list[Tensor]]) -> None:
        """Hand worker ``worker``'s protocol its results (``None``: start it): its next round, or its report."""
        try:
            self._turns[worker] = self._protocols[worker].send(results)
        except StopIteration as stop:
            self._turns[worker], self._reports[worker] = None, stop.value

    def all_reduce(self, tensors: list[Tensor]) -> Tensor:
        """A dense all-reduce (sum) of every worker's tensor, in worker order, in place in worker 0's,
        counted on every worker as :meth:`TorchDriver.all_reduce` counts it on each rank."""
        if len(tensors) != self.workers:
            raise RuntimeError(f"InProcessDriver.all_reduce: {len(tensors)} tensors for {self.workers} workers")
        return self._counted("all_reduce", tensors)

    def all_gather(self, tensors: list[Tensor]) -> Tensor:
        """Every worker's tensor (the same size on each), one row per worker, counted on every worker as
        :meth:`TorchDriver.all_gather` counts it on each rank."""
        if len(tensors) != self.workers:
            raise RuntimeError(f"InProcessDriver.all_gather: {len(tensors)} tensors for {self.workers} workers")
        return self._counted("all_gather", [tensor.reshape(-1) for tensor in tensors])

    def _counted(self, kind: str, tensors: list[Tensor]) -> Tensor:
        """A collective of every worker's tensor, counted on every worker."""
        for counter, tensor in zip(self.counters, tensors):
            counter.count(Collective(kind, tensor), self.workers)
        return _combined(kind, tensors)

    def finish(self) -> list[BucketReport]:
        """Run the remaining rounds of every worker in lock-step; each worker's report."""
        if len(self._protocols) != self.workers:
            raise RuntimeError(f"InProcessDriver: {len(self._protocols)} of {self.workers} workers started")
        try:
            while any(turn is not None for turn in self._turns):
                for worker, results in enumerate(self._combine()):
                    self._send(worker, results)
            return [report for report in self._reports if report is not None]
        finally:
            self._protocols, self._turns, self._reports = [], [], []

    def _combine(self) -> list[list[Tensor]]:
        """Each worker's results of the current round's collectives."""
        turns = self._turns
        if any(turn is None for turn in turns):
            raise RuntimeError("gradcomp simulation: the workers' exchanges have different numbers of rounds")
        first = turns[0].collectives
        for worker, turn in enumerate(turns):
            if _shape(turn.collectives) != _shape(first):
                raise RuntimeError(f"gradcomp simulation: worker {worker} hands over {_shape(turn.collectives)}, "
                                   f"worker 0 {_shape(first)}")
            for collective in turn.collectives:
                self.counters[worker].count(collective, self.workers)
        results: list[list[Tensor]] = [[] for _ in turns]
        for position, collective in enumerate(first):
            tensors = [turn.collectives[position].tensor for turn in turns]
            if collective.kind == "all_to_all":  # (source, destination, row) -> worker w gets [:, w]
                rows = torch.stack([tensor.view(self.workers, -1) for tensor in tensors])
                for worker, worker_results in enumerate(results):
                    worker_results.append(rows[:, worker])
                continue
            combined = _combined(collective.kind, tensors)
            for worker_results in results:
                worker_results.append(combined)
        return results


def _shape(collectives: list[Collective]) -> list[tuple[str, torch.dtype, int]]:
    """What a round's collectives must agree on between workers: kind, dtype and size of each."""
    return [(c.kind, c.tensor.dtype, c.tensor.numel()) for c in collectives]


def _combined(kind: str, tensors: list[Tensor]) -> Tensor:
    """Every worker's tensor combined: an ``all_reduce``'s sum in worker order, in place in worker 0's tensor
    (as all_reduce does on a rank), else a stack."""
    if kind != "all_reduce":
        return torch.stack(tensors)
    for tensor in tensors[1:]:
        tensors[0].add_(tensor)
    return tensors[0]


def _decode(protocol: BucketProtocol, results: list[Tensor]) -> BucketReport:
    """Hand the final round's results to ``protocol``, which decodes them and ends with its report."""
    try:
        protocol.send(results)
    except StopIteration as stop:
        return stop.value
    raise RuntimeError("gradcomp: the exchange went on after its final round")


def _backend(group: Optional[dist.ProcessGroup]) -> str:
    """``group``'s backend in lower case; ``""`` where none is known (no process group, not a member)."""
    try:
        return str(dist.get_backend(group)).lower() if dist.is_initialized() else ""
    except (ValueError, RuntimeError):
        return ""


def _all_gather_single():
    # torch >= 2.14 renamed all_gather_into_tensor; looked up at call time.
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
