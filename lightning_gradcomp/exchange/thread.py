"""An exchange thread: buckets are exchanged off the autograd thread, in the order DDP hands them over.

With the thread, the DDP hook only queues the bucket and returns a future; compression, every round of
collectives and decoding run on one thread per process, so they overlap the rest of backward, and a
multi-round protocol (PowerSGD) never stalls backward while it waits for its first round. One thread
takes the buckets in the order DDP calls the hook, which is the same on every rank, so its collectives
are issued in the same order everywhere.

The thread's collectives go to a process group of their own (the same ranks, see
:func:`exchange_group`): collectives that other code issues on the training's group while the thread
still sends buckets (DDP's map of unused parameters with ``find_unused_parameters=True``,
SyncBatchNorm's backward all-reduce, an autograd function that communicates) would otherwise be
interleaved with the thread's in a different order on different ranks: gloo aborts, NCCL hangs or
mixes gradients.

On CUDA the exchange runs on a stream of its own (:class:`ExchangeStreams`): it waits for an event
recorded on the autograd stream when the bucket was handed over (the gradients are ready), and the
future is created for the device, so DDP's wait makes its stream wait for the exchange's work.

Three rules keep that safe on GPUs:

* **Tensors from another stream are recorded on the exchange stream.** A tensor the caller allocated
  on its own stream and hands to the exchange (local updates' outer gradients and the buffers their
  averages go to) is ``record_stream``-ed on the exchange stream before the exchange uses it
  (:func:`hand_over`), so that the caching allocator does not give its memory to the caller's next
  allocation while the exchange's kernels still read or write it. What the exchange allocates itself
  belongs to its stream.
* **The thread sets its device before it touches a stream** (:func:`on_stream`). A new thread's current
  device is 0; entering and leaving ``torch.cuda.stream`` there would make device 0 current and create a
  CUDA context on it, about 0.5 GB of another rank's GPU per process.
* **The ordering rule.** Each process group's collectives are issued by one thread, in an order that
  is the same on every rank: the training's group by the training (and autograd) thread, the exchange
  group only by the exchange thread, bucket after bucket. The interleaving *between* the two groups may
  differ from rank to rank. NCCL allows that only while kernels of both communicators can run at the same
  time and nothing waits for the whole device; so (1) the exchange group's communicator is created
  eagerly, on the thread that builds the hook state, never lazily from the exchange thread
  (:func:`exchange_group`); (2) the exchange never synchronises the host with the device for fixed-size
  compressors (``tests/test_host_sync.py``); (3) with ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (one hardware
  queue: a kernel of one communicator waiting for its peers blocks the other's) the thread is not used on
  NCCL: ``exchange_thread=None`` runs the exchange in the hook, and ``exchange_thread=True`` (or local
  updates with ``delay > 0``) is refused (:func:`check_concurrent_communicators`). What remains is the
  user's: a ``torch.cuda.synchronize()``, ``empty_cache()`` or an out-of-memory retry of the allocator
  while both groups have kernels in flight waits for the whole device; if a job with the thread hangs
  there, ``exchange_thread=False`` issues every collective from the autograd thread.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
from contextlib import nullcontext
from datetime import timedelta
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_gradcomp.core.device import on_stream
from lightning_gradcomp.exchange.drivers import TorchDriver
from lightning_gradcomp.exchange.engine import BucketProtocol, BucketReport

logger = logging.getLogger(__name__)

_STOP = object()
#: the tag of an entry ``(_DRAIN, done)``: completes ``done`` once the entries before it have run (``drain``)
_DRAIN = object()


class ExchangeStreams:
    """One CUDA stream per device on which every exchange of a hook state runs (in the hook or on the
    exchange thread), so that every tensor the exchange allocates, reads and frees belongs to that
    stream (the caching allocator may hand a freed block to another stream's next allocation at once)."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, "torch.cuda.Stream"] = {}
        self._lock = threading.Lock()

    def get(self, device: torch.device) -> "Optional[torch.cuda.Stream]":
        """The stream for ``device`` (``None`` on devices other than CUDA)."""
        if device.type != "cuda":
            return None
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            return stream

    def entered(self, device: torch.device) -> ContextManager[Any]:
        """Make the exchange stream of ``device`` current, after the current stream's queued work (the
        gradients are ready); nothing on other devices."""
        stream = self.get(device)
        if stream is None:
            return nullcontext()
        stream.wait_stream(torch.cuda.current_stream(device))
        return on_stream(stream)


def hand_over(tensors: Sequence[Optional[Tensor]], stream: "Optional[torch.cuda.Stream]") -> None:
    """Mark ``tensors``, allocated on another stream, as used by ``stream`` (the exchange's): the caching
    allocator then keeps their memory until ``stream``'s work queued before they are freed has run
    (``Tensor.record_stream``). Tensors not on CUDA, and ``stream=None``, need nothing."""
    if stream is None:
        return
    for tensor in tensors:
        if tensor is not None and tensor.device.type == "cuda":
            _record_stream(tensor, stream)


def _record_stream(tensor: Tensor, stream: "torch.cuda.Stream") -> None:
    tensor.record_stream(stream)


#: Where NCCL may run kernels of two communicators at once: not with one hardware queue per device.
MAX_CONNECTIONS_VARIABLE = "CUDA_DEVICE_MAX_CONNECTIONS"


def concurrent_communicators_allowed(backend: str, environ: Optional[dict[str, str]] = None) -> bool:
    """Whether the exchange group's collectives may run beside the training group's (the ordering rule
    above): always on gloo; on NCCL unless ``CUDA_DEVICE_MAX_CONNECTIONS=1``."""
    environ = os.environ if environ is None else environ
    return str(backend).lower() != "nccl" or environ.get(MAX_CONNECTIONS_VARIABLE, "").strip() != "1"


def check_concurrent_communicators(backend: str, environ: Optional[dict[str, str]] = None) -> None:
    """Refuse the exchange thread where its collectives could deadlock against the training's (NCCL with
    ``CUDA_DEVICE_MAX_CONNECTIONS=1``), naming what to do instead."""
    if not concurrent_communicators_allowed(backend, environ):
        raise ValueError(
            f"gradcomp: the exchange thread (exchange_thread=True, or local updates with delay > 0) runs NCCL "
            f"collectives beside the training's, which {MAX_CONNECTIONS_VARIABLE}=1 can deadlock (one hardware "
            f"queue: a collective waiting for its peers blocks the other communicator's). Allowed: unset "
            f"{MAX_CONNECTIONS_VARIABLE} (or set it above 1), or exchange_thread=None/False (delay=0 for local "
            "updates)")


def exchange_group(group: Optional[dist.ProcessGroup], device: Optional[torch.device] = None) -> dist.ProcessGroup:
    """A process group with the ranks, backend and timeout of ``group`` (``None``: the world), for the
    exchange thread's collectives. Every rank of ``group`` must call it at the same point (the world's
    ranks all, when ``group`` is the world).

    On NCCL the communicator is created now, on the calling thread, by a one-element all-reduce on
    ``device`` (default: the current CUDA device): NCCL creates communicators lazily at their first
    collective, and creating one from the exchange thread while the training's communicator has kernels
    in flight can deadlock (see the ordering rule above)."""
    world = group is None or group is dist.group.WORLD
    ranks = None if world else dist.get_process_group_ranks(group)
    backend = dist.get_backend(group)
    created = dist.new_group(ranks, timeout=group_timeout(group), backend=backend,
                             use_local_synchronization=not world)
    if str(backend).lower() == "nccl":
        eager_init(created, device)
    return created


def eager_init(group: dist.ProcessGroup, device: Optional[torch.device] = None) -> None:
    """Create ``group``'s NCCL communicator now: a one-element all-reduce on ``device``, waited for."""
    device = device if device is not None and device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    dist.all_reduce(torch.zeros(1, device=device), group=group)
    torch.cuda.synchronize(device)


def group_timeout(group: Optional[dist.ProcessGroup]) -> Optional[timedelta]:
    """The timeout ``group`` was created with, where the backend tells it (gloo, NCCL); else ``None``."""
    group = group if group is not None else dist.group.WORLD
    for device in ("cuda", "cpu"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except Exception:  # noqa: BLE001 - the backend has no such device or no options: try the next
            continue
    return None


class ExchangeThread:
    """Runs bucket exchanges with ``driver`` on a daemon thread, first in, first out, on ``streams``."""

    def __init__(self, driver: TorchDriver, streams: ExchangeStreams) -> None:
        self.driver = driver
        self.streams = streams
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def submit(self, protocol: BucketProtocol, device: torch.device, finish: Callable[[BucketReport], Any],
               handed: Sequence[Optional[Tensor]] = ()) -> Future:
        """Queue one bucket's exchange; the future's value is ``finish(report)``, set on the exchange
        thread (on CUDA while its stream is current, so that waiting on the future makes the waiting
        stream wait for the exchange: ``finish`` should return the tensors the waiter reads, the bucket's
        buffer or the outputs). ``handed``: tensors the caller allocated on its own stream that the
        exchange reads or writes; they are recorded on the exchange stream (:func:`hand_over`) before it
        runs. (A DDP bucket's buffer needs nothing: DDP keeps it for the whole training.)"""
        self._ensure_started()
        if device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
            future: Future = Future(devices=[device])
        else:
            ready, future = None, Future()
        self._queue.put((protocol, device, ready, future, finish, tuple(handed)))
        return future

    def drain(self) -> None:
        """Wait until every exchange queued so far has finished (its future completed or failed)."""
        if self._thread is None:
            return
        done = Future()
        self._queue.put((_DRAIN, done))
        done.wait()

    def close(self, timeout: Optional[float] = None) -> None:
        """Finish the queued exchanges and stop the thread (idempotent; also run at interpreter exit)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(_STOP)
            thread.join(timeout)
            atexit.unregister(self._close_at_exit)

    def _close_at_exit(self) -> None:
        self.close(timeout=10.0)  # a thread stuck on a dead peer must not hang the exit

    def _ensure_started(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="gradcomp-exchange", daemon=True)
                self._thread.start()
                atexit.register(self._close_at_exit)
                logger.debug("gradcomp: exchange thread started")

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if item[0] is _DRAIN:
                item[1].set_result(None)
                continue
            protocol, device, ready, future, finish, handed = item
            try:
                stream = self.streams.get(device)
                with on_stream(stream):
                    if stream is not None:
                        stream.wait_event(ready)
                        hand_over(handed, stream)
                    future.set_result(finish(self.driver.drive(protocol)))
            except BaseException as error:  # noqa: BLE001 - every error must reach DDP's wait
                future.set_exception(error)
            finally:
                # dropped before waiting for the next bucket (their memory, recorded on the exchange stream,
                # is reused only once the stream's work on them has run)
                del protocol, handed, item
