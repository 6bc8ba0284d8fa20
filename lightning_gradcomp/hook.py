"""The DDP communication hook: error feedback, compression, transport and decoding for one bucket.

``bucket -> per-parameter views -> error feedback -> compressor -> transport -> aggregate -> bucket``

Parameters below ``min_compress_numel`` elements (biases, norms) are all-reduced dense. The others are
compressed one tensor at a time. Summable payloads are divided by the world size and summed by one
``all_reduce`` per dtype; the rest are packed into one uint8 buffer and gathered with one
``all_gather``. The hook returns a future whose callback only decodes: it never issues a collective.
The result is the average over workers, exactly as DDP's own all-reduce computes it.
"""

import threading
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_gradcomp import wire
from lightning_gradcomp.compressors.base import CompressContext, Compressor, Payload
from lightning_gradcomp.compressors.identity import NoCompression
from lightning_gradcomp.memory import CompressionMemory
from lightning_gradcomp.pipeline import Compressed, WorkerPipeline, resolve_error_feedback
from lightning_gradcomp.stats import StepStats
from lightning_gradcomp.telemetry import Stopwatch
from lightning_gradcomp.transport import Transport


@dataclass
class _Compressed:
    """A parameter's view in the bucket and its compressed gradient."""

    view: Tensor
    item: Compressed

    @property
    def payload(self) -> Payload:
        return self.item.payload


@dataclass
class _ReduceGroup:
    """Tensors of one dtype summed by a single all_reduce."""

    tensors: list[Tensor] = field(default_factory=list)

    def add(self, tensor: Tensor) -> int:
        self.tensors.append(tensor.reshape(-1))
        return len(self.tensors) - 1


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
        self.error_feedback = resolve_error_feedback(compressor, error_feedback)
        self.pipeline = WorkerPipeline(compressor, self.error_feedback)
        self.param_names = param_names
        self.min_compress_numel = min_compress_numel
        self.seed = seed
        self.transport = Transport(group)
        self.step = 0
        self.hook_calls = 0
        self.record_layers = False
        self.totals = StepStats()
        self._stats = StepStats()
        self._compress_clock = Stopwatch()
        self._decompress_clock = Stopwatch()
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
    def telemetry(self) -> bool:
        """Measure compression error and time; off, the hook does no extra work."""
        return self.pipeline.telemetry

    @telemetry.setter
    def telemetry(self, on: bool) -> None:
        self.pipeline.telemetry = bool(on)

    def use_compressor(self, compressor: Optional[Compressor]) -> None:
        """Switch compressor between steps (``None``: send uncompressed); memory and state are kept."""
        self.pipeline.compressor = compressor if compressor is not None else NoCompression()

    # ------------------------------------------------------------------ bookkeeping
    def take_step_stats(self) -> StepStats:
        """The figures accumulated since the last call (one optimizer step), added to :attr:`totals`."""
        with self._lock:
            stats, self._stats = self._stats, StepStats()
        stats.collectives = self.transport.take_log()
        if self.telemetry:
            self.pipeline.recorder.resolve(stats, per_layer=self.record_layers)
            stats.compress_s = self._compress_clock.take()
            stats.decompress_s = self._decompress_clock.take()
        stats.steps = 1 if stats.buckets else 0
        self.totals.add(stats)
        return stats

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "memory": self.memory.state_dict(), "totals": self.totals.state_dict()}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        self.step = int(state["step"])
        self.memory.load_state_dict(state["memory"], device)
        self.totals = StepStats.from_state_dict(state.get("totals", {}))

    # ------------------------------------------------------------------ the exchange
    def exchange(self, bucket: dist.GradBucket) -> Future:
        world_size = self.transport.world_size
        bytes_before = self.transport.bytes_sent
        buffer = bucket.buffer()
        reduce_groups: dict[torch.dtype, _ReduceGroup] = {}
        dense: list[tuple[Tensor, torch.dtype, int]] = []
        summed: list[tuple[_Compressed, list[tuple[torch.dtype, int]]]] = []
        gathered: list[_Compressed] = []
        elements_sent = 0

        def reduce_slot(tensor: Tensor) -> tuple[torch.dtype, int]:
            return tensor.dtype, reduce_groups.setdefault(tensor.dtype, _ReduceGroup()).add(tensor)

        with self._compress_clock.measure(buffer.device) if self.telemetry else nullcontext():
            for param, grad in zip(bucket.parameters(), bucket.gradients()):
                view = grad.view(-1)
                ctx = self._context(param, world_size)
                if view.numel() < self.min_compress_numel:
                    dense.append((view, *reduce_slot(self.pipeline.dense(view, ctx))))
                    elements_sent += view.numel()
                    continue
                item = _Compressed(view, self.pipeline.compress(view, ctx))
                elements_sent += item.payload.count
                if self.compressor.summable:
                    summed.append((item, [reduce_slot(part) for part in item.payload.parts]))
                else:
                    gathered.append(item)

            futures: list[Future] = []
            flat_sums: dict[torch.dtype, Tensor] = {}
            for dtype, group in reduce_groups.items():
                flat = torch.cat(group.tensors).div_(world_size)
                flat_sums[dtype] = flat
                futures.append(self.transport.all_reduce_sum(flat))
            gather_future, gather_shapes = self._issue_gather(gathered, buffer.dtype, buffer.device)
            if gather_future is not None:
                futures.append(gather_future)

            for item in (*[s[0] for s in summed], *gathered):
                self.pipeline.remember(item.item)

        with self._lock:
            self._stats.bytes_sent += self.transport.bytes_sent - bytes_before
            self._stats.bytes_dense += buffer.numel() * buffer.element_size()
            self._stats.elements_sent += elements_sent
            self._stats.elements_total += buffer.numel()
            self._stats.buckets += 1
        self.hook_calls += 1
        if bucket.is_last():
            self.step += 1

        def finish(_: Future) -> Tensor:
            # collect_all's future carries no CUDA events: waiting on each child future raises its error,
            # if any, and makes the current stream wait for NCCL before the results are read.
            for future in futures:
                future.wait()
            with self._decompress_clock.measure(buffer.device) if self.telemetry else nullcontext():
                sums = {dtype: flat.split([t.numel() for t in reduce_groups[dtype].tensors])
                        for dtype, flat in flat_sums.items()}
                for view, dtype, index in dense:
                    view.copy_(sums[dtype][index])
                for item, slots in summed:
                    parts = tuple(sums[dtype][index] for dtype, index in slots)
                    item.view.zero_()
                    self.compressor.accumulate(
                        Payload(parts, item.payload.numel, item.payload.count, item.payload.meta), item.view
                    )
                if gather_future is not None:
                    self._decode_gathered(gather_future.value(), gathered, gather_shapes, buffer.dtype, world_size)
            return buffer

        if not futures:
            result: Future = Future()
            result.set_result(buffer)
            return result
        return torch.futures.collect_all(futures).then(finish)

    def _context(self, param: Tensor, world_size: int) -> CompressContext:
        name = self.param_names.get(id(param))
        if name is None:
            raise RuntimeError("gradcomp hook: a bucket holds a parameter the strategy did not name")
        return self.pipeline.context(name, self.step, self.transport.rank, world_size, self.seed)

    def _issue_gather(
        self, gathered: list[_Compressed], dtype: torch.dtype, device: torch.device
    ) -> tuple[Optional[Future], list[list[tuple[int, int]]]]:
        """Pack the non-summable payloads and start their all_gather; also return every rank's shapes."""
        if not gathered:
            return None, []
        shapes = [(item.payload.numel, item.payload.count) for item in gathered]
        slots, total = wire.layout(self.compressor, shapes, dtype)
        buffer = wire.serialize([item.payload.parts for item in gathered], slots, total, device)
        world_size = self.transport.world_size
        if all(self.compressor.static_count(numel) is not None for numel, _ in shapes):
            return self.transport.all_gather(buffer), [shapes] * world_size
        counts = torch.tensor([count for _, count in shapes], dtype=torch.int32, device=device)
        all_counts = self.transport.exchange_counts(counts).tolist()
        rank_shapes = [[(numel, count) for (numel, _), count in zip(shapes, row)] for row in all_counts]
        longest = max(wire.layout(self.compressor, s, dtype)[1] for s in rank_shapes)
        if longest == 0:  # nothing selected on any rank: the counts said it all
            empty: Future = Future()
            empty.set_result(buffer.new_zeros(world_size, 0))
            return empty, rank_shapes
        if longest > total:
            buffer = torch.cat([buffer, buffer.new_zeros(longest - total)])
        return self.transport.all_gather(buffer), rank_shapes

    def _decode_gathered(self, rows: Tensor, gathered: list[_Compressed], rank_shapes: list[list[tuple[int, int]]],
                         dtype: torch.dtype, world_size: int) -> None:
        for item in gathered:
            item.view.zero_()
        for row, shapes in zip(rows, rank_shapes):
            slots, _ = wire.layout(self.compressor, shapes, dtype)
            for item, parts, (numel, count) in zip(gathered, wire.deserialize(row, slots), shapes):
                self.compressor.accumulate(Payload(parts, numel, count), item.view, alpha=1.0 / world_size)


def gradcomp_hook(state: GradCompHookState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """DDP communication hook: ``model.register_comm_hook(GradCompHookState(...), gradcomp_hook)``.

    (This module does not use postponed annotations: DDP checks the hook's annotations as objects.)
    """
    return state.exchange(bucket)
