"""How many ATen operations one worker's exchange of one bucket issues (a proxy for GPU kernel launches).

:func:`count_bucket_ops` runs a bucket of ``P`` compressed tensors through the in-process driver with
two workers and counts, under a ``TorchDispatchMode``, the non-view ATen calls made by worker 0's
engine: compression, merging into collectives, decoding, error feedback and state updates. The
collectives themselves (the driver's) are not counted. Views, slices, reshapes and detaches
(``OpOverload.is_view``, and :data:`NOT_COUNTED`) are not counted either: they launch no kernel.

Along the accelerator path (:func:`~lightning_gradcomp.core.device.accelerator_path`, the default
here) the code is the one a GPU runs; ``accelerator=False`` counts the CPU path.
"""

from __future__ import annotations

import math
from collections import Counter
from contextlib import ExitStack, nullcontext
from typing import Any, Callable, Generator, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.core.device import accelerator_path
from lightning_gradcomp.exchange.engine import ExchangeEngine
from lightning_gradcomp.exchange.simulated import SimulatedExchange

#: Shape of every compressed tensor of the measured buckets (a 2-D weight, so PowerSGD compresses it).
SHAPE = (128, 128)


#: Non-view ops that launch no kernel: detaching, lifting a constant, and ``_unsafe_view`` (the reshape of
#: a fresh tensor, as matmul's folding of batch dimensions issues it: a view ATen does not mark as one).
NOT_COUNTED = ("aten::detach", "aten::lift_fresh", "aten::_unsafe_view")


#: Ops that write into a few rows of their first argument: they move their values and index, not all of it.
SCATTERS = {"index_add_", "index_copy_", "index_put_", "index_fill_", "scatter_", "scatter_add_", "scatter_reduce_"}
#: Ops that read a few rows of their first argument: as many bytes as they write, plus the index.
GATHERS = {"index_select", "gather", "index", "take", "embedding"}
#: Ops that only write their output (or nothing: ``empty``).
WRITE_ONLY = {"zero_", "fill_", "zeros", "zeros_like", "full", "full_like", "ones", "ones_like", "new_zeros",
              "new_full", "new_ones", "arange"}
NO_TRAFFIC = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


class OpCounter(TorchDispatchMode):
    """Counts non-view ATen calls by name, and estimates the memory traffic of each (:attr:`traffic`)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        #: Estimated bytes read and written by each op (by name): every tensor argument read once and every
        #: output written once, except for gathers and scatters (their rows only), fills (written only) and
        #: copies; a proxy for a GPU's memory traffic, where element-wise kernels are bandwidth-bound.
        self.traffic: Counter = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not func.is_view and func._schema.name not in NOT_COUNTED:
            name = func._schema.name.removeprefix("aten::")
            self.ops[name] += 1
            self.traffic[name] += _traffic(name, args, kwargs, out)
        return out


def _tensors(value: Any) -> list[torch.Tensor]:
    return [item for item in tree_flatten(value)[0] if isinstance(item, torch.Tensor)]


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct elements (a broadcast dimension, of stride 0, is read once)."""
    return sum(math.prod(size for size, stride in zip(tensor.shape, tensor.stride()) if stride) *
               tensor.element_size() for tensor in tensors)


def _traffic(name: str, args: tuple, kwargs: dict, out: Any) -> int:
    """Estimated bytes one op reads and writes (:attr:`OpCounter.traffic`)."""
    written = _tensors(out)
    inputs = [tensor for tensor in _tensors((args, {key: value for key, value in kwargs.items() if key != "out"}))]
    if name in NO_TRAFFIC:
        return 0
    if name in WRITE_ONLY:
        return _nbytes(written)
    if name in SCATTERS:  # the index and the values read, the values' rows read and written
        moved = _nbytes(inputs[1:])
        return moved + 2 * _nbytes([tensor for tensor in inputs[1:] if tensor.is_floating_point()])
    if name in GATHERS:  # the rows read and written, and the index (the arguments after the source)
        return 2 * _nbytes(written) + _nbytes(inputs[1:])
    if name.startswith("_foreach_") and name.endswith("_"):  # in place: the first list read and written
        return _nbytes(inputs) + _nbytes(_tensors(args[0]))
    if name == "copy_":  # the destination written, the source read (unless broadcast: a value)
        source = inputs[1:2] if inputs[1:2] and inputs[1].numel() == inputs[0].numel() else []
        return _nbytes(inputs[:1]) + _nbytes(source)
    return _nbytes(inputs) + _nbytes(written)


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
                     shape: tuple[int, ...] = SHAPE, dense_tensors: int = 0, workers: int = 2,
                     exchange_type: type = SimulatedExchange) -> OpCounter:
    """Worker 0's ops for the last of ``steps`` steps of a bucket of ``tensors`` tensors of ``shape``
    and ``dense_tensors`` tensors of 512 elements, below the size threshold (biases: sent dense;
    ``workers`` workers, the compressor's default error feedback, telemetry off; ``exchange_type``: a
    :class:`SimulatedExchange` or a subclass, e.g. one that writes the results into the gradients as DDP)."""
    names = [f"layer{index:03d}.weight" for index in range(tensors)]
    names += [f"layer{index:03d}.bias" for index in range(dense_tensors)]
    bucket = {name: shape if name.endswith(".weight") else (512,) for name in names}
    return count_step_ops(make, [bucket], steps, accelerator, error_feedback, seed, workers,
                          exchange_type=exchange_type)


def count_step_ops(make: Callable[[], Compressor], buckets: Sequence[dict[str, tuple[int, ...]]], steps: int = 3,
                   accelerator: bool = True, error_feedback: Optional[bool] = None, seed: int = 0,
                   workers: int = 2, min_compress_numel: int = 1024,
                   exchange_type: type = SimulatedExchange) -> OpCounter:
    """Worker 0's ops for the last of ``steps`` steps whose gradients come in ``buckets`` (each a
    ``{name: shape}`` in the bucket's order; tensors below ``min_compress_numel`` elements are sent dense)."""
    exchange = exchange_type(make(), workers=workers, error_feedback=error_feedback,
                             min_compress_numel=min_compress_numel, seed=seed)
    exchange.telemetry_due = False
    generator = torch.Generator().manual_seed(seed)
    counter = OpCounter()
    bucket_protocol: Callable = ExchangeEngine.bucket
    engine = exchange.engines[0]

    def counted_bucket(self: ExchangeEngine, *args: Any, **kwargs: Any) -> Generator:
        protocol = bucket_protocol(self, *args, **kwargs)
        return _counted(protocol, counter) if self is engine else protocol

    for step in range(steps):
        with ExitStack() as stack:
            stack.enter_context(accelerator_path() if accelerator else nullcontext())
            if step == steps - 1:
                ExchangeEngine.bucket = counted_bucket  # type: ignore[method-assign]
                stack.callback(setattr, ExchangeEngine, "bucket", bucket_protocol)
            for shapes in buckets:  # the in-process driver takes one bucket per worker at a time
                for worker in range(workers):
                    exchange.add_worker(worker, [(name, torch.randn(shape, generator=generator))
                                                 for name, shape in shapes.items()])
                exchange.finish_step()
    return counter


def layout_constant_bytes(make: Callable[[], Compressor], tensors: int, shape: tuple[int, ...] = SHAPE,
                          workers: int = 2, dense_tensors: int = 0) -> int:
    """Bytes of the tensors worker 0's engine keeps per bucket layout (``Segments.constant``: indices, masks,
    plans), after two steps of a bucket as :func:`count_bucket_ops` builds it: on a GPU they stay in its
    memory for as long as the buckets do."""
    captured: list[SimulatedExchange] = []
    original = SimulatedExchange.__init__

    def capture(self: SimulatedExchange, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        captured.append(self)

    SimulatedExchange.__init__ = capture  # type: ignore[method-assign]
    try:
        count_bucket_ops(make, tensors, steps=2, shape=shape, dense_tensors=dense_tensors, workers=workers)
    finally:
        SimulatedExchange.__init__ = original  # type: ignore[method-assign]
    engine = captured[0].engines[0]
    if not engine._layouts:
        raise AssertionError("no bucket took the whole-bucket path: nothing measured")
    return sum(_tensor_bytes(value, set()) for layout in engine._layouts.values()
               for value in layout._constants.values())


def _tensor_bytes(value: Any, seen: set) -> int:
    """Bytes of the tensors in ``value`` (a tensor, or containers and objects holding tensors), each once."""
    if id(value) in seen:
        return 0
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_tensor_bytes(item, seen) for item in value)
    if isinstance(value, dict):
        return sum(_tensor_bytes(item, seen) for item in value.values())
    if hasattr(value, "__dict__"):
        return sum(_tensor_bytes(item, seen) for item in vars(value).values())
    return 0


def ddp_buckets(model: torch.nn.Module, bucket_cap_mb: float = 25.0, first_bucket_mb: float = 1.0,
                itemsize: int = 4) -> list[dict[str, tuple[int, ...]]]:
    """``model``'s parameters in DDP's buckets: in reverse order of registration (about the order
    backward produces them), a bucket closed once it holds ``first_bucket_mb`` (the first) or
    ``bucket_cap_mb`` (the others)."""
    buckets: list[dict[str, tuple[int, ...]]] = [{}]
    size, cap = 0, first_bucket_mb * 2**20
    for name, param in reversed(list(model.named_parameters())):
        buckets[-1][name] = tuple(param.shape)
        size += param.numel() * itemsize
        if size >= cap:
            buckets.append({})
            size, cap = 0, bucket_cap_mb * 2**20
    return [bucket for bucket in buckets if bucket]


def bound(tensors: int) -> int:
    """The issue's budget: 40 + 3 per compressed tensor."""
    return 40 + 3 * tensors
