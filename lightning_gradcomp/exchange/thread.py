"""An exchange thread: buckets are exchanged off the autograd thread, in the order DDP hands them over.

With the thread, the DDP hook only queues the bucket and returns a future; compression, every round of
collectives and decoding run on one thread per process, so they overlap the rest of backward, and a
multi-round protocol (PowerSGD) never stalls backward while it waits for its first round. One thread
takes the buckets in the order DDP calls the hook, which is the same on every rank, so collectives are
issued in the same order everywhere.

On CUDA the thread runs on its own stream: it waits for an event recorded on the autograd stream when
the bucket was handed over (the gradients are ready), and the future is created for the device, so
DDP's wait makes its stream wait for the exchange's work.
"""

from __future__ import annotations

import atexit
import queue
import threading
from typing import Any, Callable, Optional

import torch
from torch.futures import Future

from lightning_gradcomp.exchange.drivers import TorchDriver
from lightning_gradcomp.exchange.engine import BucketProtocol, BucketReport

_STOP = object()


class ExchangeThread:
    """Runs bucket exchanges with ``driver`` on a daemon thread, first in, first out."""

    def __init__(self, driver: TorchDriver) -> None:
        self.driver = driver
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._streams: dict[torch.device, "torch.cuda.Stream"] = {}
        self._lock = threading.Lock()

    def submit(self, protocol: BucketProtocol, device: torch.device, finish: Callable[[BucketReport], Any]) -> Future:
        """Queue one bucket's exchange; the future's value is ``finish(report)``, set on the exchange
        thread (on CUDA while its stream is current, so that waiting on the future makes the waiting
        stream wait for the exchange: ``finish`` should return the bucket's tensor)."""
        self._ensure_started()
        if device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
            future: Future = Future(devices=[device])
        else:
            ready, future = None, Future()
        self._queue.put((protocol, device, ready, future, finish))
        return future

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

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            protocol, device, ready, future, finish = item
            try:
                if device.type == "cuda":
                    stream = self._streams.setdefault(device, torch.cuda.Stream(device))
                    with torch.cuda.stream(stream):
                        stream.wait_event(ready)
                        future.set_result(finish(self.driver.drive(protocol)))
                else:
                    future.set_result(finish(self.driver.drive(protocol)))
            except BaseException as error:  # noqa: BLE001 - every error must reach DDP's wait
                future.set_exception(error)
