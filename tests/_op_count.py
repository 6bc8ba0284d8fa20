"""How many ATen operations one worker's exchange of one bucket issues (a proxy for GPU kernel launches).

:func:`count_bucket_ops` runs a bucket of ``P`` compressed tensors through the in-process driver with
two workers and counts, under a ``TorchDispatchMode``, the non-view ATen calls made by worker 0's
engine: compression, merging into collectives, decoding, error feedback and state updates. The
collectives themselves (the driver's) are not counted. Views, slices, reshapes and detaches
(``OpOverload.is_view``) are not counted either: they launch no kernel.

Along the accelerator path (:func:`~lightning_gradcomp.core.device.accelerator_path`, the default
here) the code is the one a GPU runs; ``accelerator=False`` counts the CPU path.
"""

from __future__ import annotations

from collections import Counter
from contextlib import ExitStack, nullcontext
from typing import Any, Callable, Generator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.core.device import accelerator_path
from lightning_gradcomp.exchange.engine import ExchangeEngine
from lightning_gradcomp.exchange.simulated import SimulatedExchange

#: Shape of every compressed tensor of the measured buckets (a 2-D weight, so PowerSGD compresses it).
SHAPE = (128, 128)


class OpCounter(TorchDispatchMode):
    """Counts non-view ATen calls by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if not func.is_view and func._schema.name not in ("aten::detach", "aten::lift_fresh"):
            self.ops[func._schema.name.removeprefix("aten::")] += 1
        return func(*args, **(kwargs or {}))


def _counted(protocol: Generator, counter: OpCounter) -> Generator:
    """``protocol`` with every step of it run under ``counter``."""
    result = None
    while True:
        with counter:
            try:
                turn = protocol.send(result)
            except StopIteration as stop:
                return stop.value
        result = yield turn


def count_bucket_ops(make: Callable[[], Compressor], tensors: int, steps: int = 3, accelerator: bool = True,
                     error_feedback: Optional[bool] = None, seed: int = 0,
                     shape: tuple[int, ...] = SHAPE, dense_tensors: int = 0, workers: int = 2) -> OpCounter:
    """Worker 0's ops for the last of ``steps`` steps of a bucket of ``tensors`` tensors of ``shape``
    and ``dense_tensors`` tensors of 512 elements, below the size threshold (biases: sent dense;
    ``workers`` workers, the compressor's default error feedback, telemetry off)."""
    exchange = SimulatedExchange(make(), workers=workers, error_feedback=error_feedback,
                                 min_compress_numel=1024, seed=seed)
    exchange.telemetry_due = False
    generator = torch.Generator().manual_seed(seed)
    names = [f"layer{index:03d}.weight" for index in range(tensors)]
    names += [f"layer{index:03d}.bias" for index in range(dense_tensors)]
    shapes = {name: shape if name.endswith(".weight") else (512,) for name in names}
    counter = OpCounter()
    bucket: Callable = ExchangeEngine.bucket
    for step in range(steps):
        grads = [[(name, torch.randn(shapes[name], generator=generator)) for name in names] for _ in range(workers)]
        last = step == steps - 1
        engine = exchange.engines[0]

        def counted_bucket(self: ExchangeEngine, *args: Any, **kwargs: Any) -> Generator:
            protocol = bucket(self, *args, **kwargs)
            return _counted(protocol, counter) if self is engine else protocol

        with ExitStack() as stack:
            stack.enter_context(accelerator_path() if accelerator else nullcontext())
            if last:
                ExchangeEngine.bucket = counted_bucket  # type: ignore[method-assign]
                stack.callback(setattr, ExchangeEngine, "bucket", bucket)
            for worker in range(workers):
                exchange.add_worker(worker, grads[worker])
            exchange.finish_step()
    return counter


def bound(tensors: int) -> int:
    """The issue's budget: 40 + 3 per compressed tensor."""
    return 40 + 3 * tensors
