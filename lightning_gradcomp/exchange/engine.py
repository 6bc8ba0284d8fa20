"""The exchange of one bucket, written once: routing, rounds, merging into collectives, decoding.

``bucket -> protocols (error feedback, compressor) -> rounds of collectives -> aggregate``

:meth:`ExchangeEngine.bucket` is a generator that a driver runs: it yields a :class:`CollectiveRound`
(the collectives to issue, and whether it is the bucket's final round) and receives their results. How a
bucket is routed and its requests merged: docs/architecture.md, steps 4-5 (tensors taken in the order of
their names, so that a simulation with the same buckets hands over the same bytes); finiteness:
:class:`BucketVerdict`. The sequence of collectives depends only on the bucket's parameters, the
compressor and the counts exchanged in the headers, so it is the same on every worker: drivers may issue
it as it comes.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from enum import Enum
from typing import Generator, Iterator, Literal, Optional, Sequence

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import CompressContext
from lightning_gradcomp.core.device import host_reads_allowed, to_device
from lightning_gradcomp.core.protocol import AllToAll, Gather, Mean, Received, Round, stack_views
from lightning_gradcomp.core.segments import Segments
from lightning_gradcomp.core.tensors import all_finite_many, Finite, flag_vector
from lightning_gradcomp.exchange import wire
from lightning_gradcomp.exchange.pipeline import WorkerPipeline
from lightning_gradcomp.metrics.stats import collective_bytes_sent
from lightning_gradcomp.metrics.telemetry import Stopwatch


@dataclass
class Entry:
    """One parameter of a bucket: its gradient (flat) and where its aggregate goes (``None``: nowhere)."""

    name: str
    shape: tuple[int, ...]
    grad: Tensor
    out: Optional[Tensor]


@dataclass
class Collective:
    """A collective for the driver, on a 1-D tensor of the same size on every worker: ``all_reduce`` (sum,
    in place), ``all_gather`` (result: ``(N, numel)``, row ``w`` from worker ``w``) or ``all_to_all``
    (the tensor is ``N`` equal rows, row ``c`` for worker ``c``; result: ``(N, numel / N)``, row ``w``
    from worker ``w``)."""

    kind: Literal["all_reduce", "all_gather", "all_to_all"]
    tensor: Tensor

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


@dataclass
class CollectiveRound:
    """The collectives of one round; after the ``final`` one the bucket's exchange only decodes."""

    collectives: list[Collective]
    final: bool


@dataclass
class BucketReport:
    """What one worker's exchange of one bucket did (the driver counts the bytes sent; ``bytes_dense``: what
    DDP's all-reduce of the bucket's gradients would send, by the same definition)."""

    elements_sent: int
    elements_total: int
    bytes_dense: int


BucketProtocol = Generator[CollectiveRound, list, BucketReport]


class ExchangeEngine:
    """One worker's exchange of DDP buckets (or of the whole model, in the simulation).

    Args:
        pipeline: the worker's compressor, error feedback and memory.
        min_compress_numel: smaller tensors are averaged uncompressed.
        seed: base seed of the compressors' generators, identical on all workers.
        segmented: let compressors that can compress a whole bucket at once do so (the default; ``False``
            runs one protocol per tensor everywhere, the reference the bucket-wise paths are tested against).
    """

    def __init__(self, pipeline: WorkerPipeline, min_compress_numel: int = 1024, seed: int = 0,
                 segmented: bool = True) -> None:
        self.pipeline = pipeline
        self.min_compress_numel = min_compress_numel
        self.seed = seed
        self.segmented = segmented
        #: time compression and decoding with :attr:`compress_clock` / :attr:`decompress_clock` even
        #: without telemetry (``gradcomp estimate``)
        self.timed = False
        self._layouts: dict[tuple, Segments] = {}
        self._checked_dtypes: set[tuple[type, torch.dtype]] = set()  # (compressor class, gradient dtype)
        self.compress_clock = Stopwatch()
        self.decompress_clock = Stopwatch()

    def bucket(self, entries: Sequence[Entry], step: int, rank: int, world_size: int) -> BucketProtocol:
        """The exchange of one bucket (a generator run by a driver): :meth:`_bucket`, each stretch between two
        rounds run with autocast off (:func:`without_autocast`)."""
        device = entries[0].grad.device if entries else torch.device("cpu")
        return without_autocast(self._bucket(entries, step, rank, world_size), device.type)

    def _bucket(self, entries: Sequence[Entry], step: int, rank: int, world_size: int) -> BucketProtocol:
        """The exchange of one bucket.

        1. Every tensor's protocol runs to its first round (compression); this worker's finiteness of
           the bucket is then known (:class:`BucketVerdict`).
        2. Round by round, the pending tensors' requests are merged into collectives and their results
           handed back. A protocol whose last round comes before the bucket's final one is *parked* with
           its results: every tensor finishes once the bucket's verdict is known.
        3. The final round carries the verdict flag; every context learns the bucket's verdict, every
           protocol decodes and commits its memory, and a non-finite bucket's results become NaN.
        """
        entries = sorted(entries, key=lambda entry: entry.name)
        compressor = type(self.pipeline.compressor)
        for key in {(compressor, entry.grad.dtype) for entry in entries} - self._checked_dtypes:
            self.pipeline.compressor.check_gradient_dtype(key[1])
            self._checked_dtypes.add(key)
        device = entries[0].grad.device if entries else torch.device("cpu")
        contexts = [CompressContext(entry.name, step, rank, world_size, self.seed, self.pipeline.memory.state(entry.name),
                                    tuple(entry.shape), None, entry.grad.dtype) for entry in entries]
        units = self._units(entries, contexts, device)
        protocols = [protocol for protocol, _ in units]
        names = [entries[members[0]].name for _, members in units]
        sent = [0] * len(protocols)
        with self._clock(self.compress_clock, device):
            pending = _advance(protocols, {index: None for index in range(len(protocols))}, sent)
        verdict = self._verdict(contexts, device)
        parked: dict[int, tuple[Round, list]] = {}
        while pending:
            final = all(turn.last for turn in pending.values())
            merged = _MergedRound(pending, rank, world_size, device, verdict.flag() if final else None)
            if merged.dynamic:
                (counts,) = yield CollectiveRound([Collective("all_gather", merged.header())], final=False)
                merged.read_header(counts)
            results = yield CollectiveRound(merged.collectives(), final)
            per_tensor = merged.split(results)
            if final:
                for index, (turn, result) in parked.items():
                    pending[index], per_tensor[index] = turn, result
                verdict.tell(contexts, merged.summed_flag)
            else:
                for index in [index for index, turn in pending.items() if turn.last]:
                    parked[index] = (pending.pop(index), per_tensor.pop(index))
            with self._clock(self.decompress_clock if final else self.compress_clock, device):
                pending = _advance(protocols, per_tensor, sent, previous=pending)
            if final:
                if pending:
                    raise RuntimeError(f"gradcomp: the protocol of {names[next(iter(pending))]!r} went on "
                                       "after a round it marked last")
                # the results of every tensor whose protocol did not add the flag itself (CompressContext.verdict)
                verdict.poison([entry.out for entry, ctx in zip(entries, contexts)
                                if entry.out is not None and ctx.verdict is not None], merged.summed_flag)
        return BucketReport(
            elements_sent=sum(sent),
            elements_total=sum(entry.grad.numel() for entry in entries),
            bytes_dense=sum(collective_bytes_sent("all_reduce", entry.grad.numel() * entry.grad.element_size(),
                                                  world_size) for entry in entries),
        )

    def _compressed(self, entry: Entry) -> bool:
        return entry.grad.numel() >= self.min_compress_numel

    def _units(self, entries: Sequence[Entry], contexts: Sequence[CompressContext], device: torch.device
               ) -> list[tuple[Generator[Round, list, int], list[int]]]:
        """The bucket's protocols and the entries each covers: one for the tensors sent dense, then one
        for all compressed tensors where the compressor compresses whole buckets (it declares ``"whole_bucket"``
        and :meth:`~lightning_gradcomp.compressors.base.Compressor.segment_alignment` gives an alignment on this
        device), else one per compressed tensor. Sets the finiteness of every tensor the compressor does not
        check itself (one multi-tensor reduction)."""
        compressor = self.pipeline.compressor
        dense = [index for index, entry in enumerate(entries) if not self._compressed(entry)]
        compressed = [index for index, entry in enumerate(entries) if self._compressed(entry)]
        bucket_wise = self.segmented and "whole_bucket" in compressor.capabilities
        bucket_alignment = compressor.segment_alignment(device) if bucket_wise else None
        align = bucket_alignment if compressed else None
        if align is not None and not compressor.segments_fit([entries[index].grad.numel() for index in compressed],
                                                             align):
            align = None  # e.g. a tensor smaller than a row: the per-tensor formats decide (DGC's dense payload)
        checked = dense if align is not None or compressor.checks_finite else dense + compressed
        for index, finite in zip(checked, all_finite_many([entries[index].grad for index in checked])):
            contexts[index].finite = finite

        def pick(indices: list[int]) -> tuple[list[Tensor], list[CompressContext], list[Optional[Tensor]]]:
            """The gradients, contexts and outputs of these entries."""
            return [entries[i].grad for i in indices], [contexts[i] for i in indices], [entries[i].out for i in indices]

        units: list[tuple[Generator[Round, list, int], list[int]]] = []
        if dense and bucket_alignment is not None and "dense_segments" in compressor.capabilities:
            segments = self._segments([entries[index] for index in dense], 1)
            units.append((self.pipeline.dense_segments_protocol(segments, *pick(dense)), dense))
        elif dense:
            units.append((self.pipeline.dense_bucket_protocol(*pick(dense)), dense))
        if align is not None:
            segments = self._segments([entries[index] for index in compressed], align)
            units.append((self.pipeline.segments_protocol(segments, *pick(compressed)), compressed))
        else:
            units += [(self.pipeline.protocol(entries[index].grad, contexts[index], entries[index].out), [index])
                      for index in compressed]
        return units

    def _segments(self, entries: Sequence[Entry], align: int) -> Segments:
        """The layout of these tensors (kept, with its constants, while the buckets stay the same)."""
        key = (tuple(entry.name for entry in entries), tuple(entry.shape for entry in entries), align)
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) >= 4096:  # buckets rebuilt again and again: start over
                self._layouts.clear()
            layout = self._layouts[key] = Segments(key[0], tuple(tuple(entry.grad.shape) if not entry.shape
                                                                 else entry.shape for entry in entries), align)
        return layout

    def _verdict(self, contexts: Sequence[CompressContext], device: torch.device) -> "BucketVerdict":
        """This worker's verdict on the bucket once the protocols have compressed (before any round's
        results): every tensor's finiteness, noted for the warnings."""
        for ctx in contexts:
            if ctx.finite is None:
                raise RuntimeError(
                    f"gradcomp: {type(self.pipeline.compressor).__name__} declares checks_finite but its compress did "
                    f"not set ctx.finite for {ctx.name!r}"
                )
        verdict = BucketVerdict([ctx.finite for ctx in contexts], device)
        self.pipeline.nonfinite.note(contexts, verdict.stacked)
        return verdict

    def _clock(self, clock: Stopwatch, device: torch.device):
        return clock.measure(device) if self.pipeline.telemetry or self.timed else nullcontext()


def without_autocast(protocol: BucketProtocol, device_type: str) -> BucketProtocol:
    """``protocol``, each of its steps run with ``torch.autocast`` off for ``device_type``.

    A user's ``torch.autocast`` around ``backward()`` reaches the DDP hook on the autograd thread (autocast
    state is thread-local and autograd carries it there), and would run the exchange's matrix products and
    reductions in bf16 or fp16: PowerSGD's and DeMo's state and error feedback are fp32 by design, and the
    exchange thread, which carries no autocast state, would compute otherwise than the hook. Each step is
    wrapped separately: a ``with`` block held across a ``yield`` would leak its state into the driver."""
    available = getattr(torch.amp, "is_autocast_available", lambda kind: kind in ("cuda", "cpu"))
    autocast = available(device_type)
    results = None
    while True:
        with torch.autocast(device_type, enabled=False) if autocast else nullcontext():
            try:
                turn = protocol.send(results)
            except StopIteration as stop:
                return stop.value
        results = yield turn


def _advance(protocols: list[Generator[Round, list, int]], results: dict[int, Optional[list]], sent: list[int],
             previous: Optional[dict[int, Round]] = None) -> dict[int, Round]:
    """Send every pending protocol its results; return the rounds of those that go on."""
    pending: dict[int, Round] = {}
    for index, result in results.items():
        try:
            turn = protocols[index].send(result)
        except StopIteration as stop:
            sent[index] = int(stop.value or 0)
            continue
        if previous is not None and previous[index].last:
            raise RuntimeError("gradcomp: a compressor's protocol yielded another round after its last one")
        if not isinstance(turn, Round):
            raise TypeError(f"gradcomp: a compressor's protocol must yield Round objects, got {type(turn).__name__}")
        pending[index] = turn
    return pending


class BucketVerdict:
    """Whether a bucket's gradients are finite: this worker's flag, and the verdict of every worker.

    One rule: the bucket's final round carries one float32 element per worker, 0 when every gradient of
    the bucket is finite on that worker and NaN otherwise, summed over the workers (NaN when any
    worker's was not finite). Before the protocols finish, every tensor's context learns that verdict
    (:meth:`tell`): memory is committed only for a bucket finite on every worker, on every worker alike,
    as AMP's GradScaler voids a step everywhere. A non-finite bucket's results are NaN on every worker
    (:meth:`poison`), as DDP's all-reduce would carry it.

    Flags are Python bools where the host may read them and 0-d device tensors elsewhere
    (:func:`~lightning_gradcomp.core.device.host_reads_allowed`): on accelerators nothing here waits for
    the device.
    """

    def __init__(self, finite: Sequence[Finite], device: torch.device) -> None:
        self.finite = list(finite)
        self.device = device
        tensors = [flag for flag in self.finite if isinstance(flag, Tensor)]
        #: this worker's flags that are device tensors, stacked once (also read by the non-finite watch)
        self.stacked: Optional[Tensor] = flag_vector(tensors) if tensors else None

    def flag(self) -> Tensor:
        """This worker's element of the final round: 0, or NaN when a gradient was not finite."""
        if any(flag is False for flag in self.finite):
            return torch.full((1,), math.nan, device=self.device)
        if self.stacked is None:
            return torch.zeros(1, device=self.device)
        zero, nan = _flag_values(self.device)
        finite = self.stacked if self.stacked.numel() == 1 else self.stacked.all()  # one flag: no reduction
        return torch.where(finite, zero, nan)

    def tell(self, contexts: Sequence[CompressContext], summed: Tensor) -> None:
        """Set every context's ``finite`` to the bucket's verdict on every worker. (A worker's own flag
        needs no second look: a tensor not finite here made the summed flag NaN.) Every context also gets the
        summed flag itself (:attr:`CompressContext.verdict`)."""
        for ctx in contexts:
            ctx.verdict = summed
        if host_reads_allowed(summed.device):
            if not math.isfinite(float(summed)):
                for ctx in contexts:
                    ctx.finite = False
            return
        clean = torch.eq(summed, 0)  # the summed flag is 0 or NaN
        for ctx in contexts:
            if ctx.finite is not False:
                ctx.finite = clean

    def poison(self, outs: Sequence[Tensor], summed: Tensor) -> None:
        """Make the results NaN when the bucket was not finite on some worker (on accelerators by adding
        the summed flag, 0 or NaN: no host sync)."""
        if host_reads_allowed(summed.device):
            if not math.isfinite(float(summed)):
                for out in outs:
                    out.fill_(math.nan)
            return
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for out in outs:
            by_dtype.setdefault(out.dtype, []).append(out)
        for dtype, group in by_dtype.items():
            # ``alpha=`` selects the multi-tensor add's Tensor overload, which takes the 0-d device flag
            # without reading it; without it, Python's argument parser picks the Scalar overload first and
            # reads the flag on the host (``aten._local_scalar_dense``: one host synchronisation per bucket)
            torch._foreach_add_(group, summed.to(dtype), alpha=1)


_FLAG_VALUES: dict[str, tuple[Tensor, Tensor]] = {}


def _flag_values(device: torch.device) -> tuple[Tensor, Tensor]:
    """Kept ``(0, NaN)`` one-element float32 tensors on ``device``, the two values of a verdict flag."""
    key = str(device)
    if key not in _FLAG_VALUES:
        _FLAG_VALUES[key] = (torch.zeros(1, device=device), torch.full((1,), math.nan, device=device))
    return _FLAG_VALUES[key]


class _FlagSlot(Enum):
    """Where the final round's verdict flag rides: appended to the round's first all-reduce, in the
    gathered buffer, or in an all-reduce of its own (a round of all-to-alls only)."""

    MEANS = "means"
    GATHER = "gather"
    ALONE = "alone"


class _MergedRound:
    """The requests of one round of every pending tensor, merged into one collective per kind and dtype."""

    def __init__(self, pending: dict[int, Round], rank: int, world_size: int, device: torch.device,
                 flag: Optional[Tensor] = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.flag = flag  # this worker's verdict flag, in the final round (see BucketVerdict)
        self.flag_slot: Optional[_FlagSlot] = None
        self._summed_flag: Optional[Tensor] = None  # the flag summed over workers, once split
        self.means: dict[torch.dtype, list[tuple[int, int, Mean]]] = {}
        self.gathers: list[tuple[int, int, Gather]] = []
        self.exchanges: list[tuple[int, int, AllToAll]] = []
        self.shapes: dict[int, int] = {}
        for index, turn in pending.items():
            self.shapes[index] = len(turn.requests)
            for position, request in enumerate(turn.requests):
                if isinstance(request, Mean):
                    self.means.setdefault(request.tensor.dtype, []).append((index, position, request))
                elif isinstance(request, Gather):
                    self.gathers.append((index, position, request))
                elif isinstance(request, AllToAll):
                    if len(request.parts) != world_size:
                        raise ValueError(f"gradcomp: an AllToAll request holds {len(request.parts)} destinations for "
                                         f"{world_size} workers")
                    self.exchanges.append((index, position, request))
                else:
                    raise TypeError(f"gradcomp: unknown request {type(request).__name__} "
                                    "(allowed: Mean, Gather, AllToAll)")
        self.dynamic = [request for _, _, request in self.gathers if request.count is not None]
        self.rank_specs: Optional[list[list[list[wire.PartSpec]]]] = None
        self.rank_counts: Optional[list[list[Optional[int]]]] = None
        self.gather_layouts: list[tuple[list[list[wire.Slot]], int]] = []
        self.exchange_slots: list[list[wire.Slot]] = []  # the layout of the rows this worker receives

    # ------------------------------------------------------------------ sizes
    def header(self) -> Tensor:
        """This worker's data-dependent counts (int32, one per dynamic request)."""
        counts = torch.tensor([request.count for request in self.dynamic], dtype=torch.int32)
        return to_device(counts, self.device)  # through pinned memory: a pageable copy would wait for the stream

    def read_header(self, counts: Tensor) -> None:
        """Every worker's part sizes, from the gathered counts (``(N, len(dynamic))``)."""
        self.rank_counts = []
        for row in counts.view(self.world_size, -1).tolist():
            worker_counts = iter(row)
            self.rank_counts.append([None if request.count is None else int(next(worker_counts))
                                     for _, _, request in self.gathers])
        self.rank_specs = [[_specs(request, count) for (_, _, request), count in zip(self.gathers, counts_of_rank)]
                           for counts_of_rank in self.rank_counts]

    def _all_specs(self) -> list[list[list[wire.PartSpec]]]:
        if self.rank_specs is None:  # static sizes: the same on every worker
            local = [_specs(request, None) for _, _, request in self.gathers]
            self.rank_specs = [local] * self.world_size
        return self.rank_specs

    # ------------------------------------------------------------------ collectives
    def collectives(self) -> list[Collective]:
        """The round's collectives; the final round's flag rides in the first all-reduce, else in the
        gathered buffer, else alone."""
        ops = []
        self.flag_slot = None if self.flag is None else (_FlagSlot.MEANS if self.means else
                                                         _FlagSlot.GATHER if self.gathers else _FlagSlot.ALONE)
        for position, requests in enumerate(self.means.values()):
            tensors = [request.tensor.reshape(-1) for _, _, request in requests]
            if self.flag_slot is _FlagSlot.MEANS and position == 0:
                tensors.append(self.flag.to(tensors[0].dtype))
            flat = torch.cat(tensors)
            if self.world_size > 1:
                flat.div_(self.world_size)
            ops.append(Collective("all_reduce", flat))
        if self.gathers:
            extra: list[list[wire.PartSpec]] = [[(torch.float32, 1)]] if self.flag_slot is _FlagSlot.GATHER else []
            self.gather_layouts = [wire.layout(specs + extra) for specs in self._all_specs()]
            longest = max(total for _, total in self.gather_layouts)
            if longest > 0:  # else nothing was selected anywhere: the counts said it all
                own = [_specs(request, request.count) for _, _, request in self.gathers] + extra
                parts = [request.parts for _, _, request in self.gathers] + ([(self.flag,)] if extra else [])
                ops.append(Collective("all_gather", wire.serialize(parts, wire.layout(own)[0], longest, self.device)))
        if self.exchanges:
            ops.append(Collective("all_to_all", self._all_to_all_input()))
        if self.flag_slot is _FlagSlot.ALONE:
            ops.append(Collective("all_reduce", self.flag.clone()))
        return ops

    def _all_to_all_input(self) -> Tensor:
        """``N`` rows of equal length, row ``c`` holding every request's parts for worker ``c`` (padded to
        the longest row; each destination's layout is the same on every worker)."""
        layouts = [wire.layout([[(part.dtype, part.numel()) for part in request.parts[destination]]
                                for _, _, request in self.exchanges])
                   for destination in range(self.world_size)]
        self.exchange_slots = layouts[self.rank][0]
        longest = max(total for _, total in layouts)
        return wire.serialize_rows([[request.parts[destination] for _, _, request in self.exchanges]
                                    for destination in range(self.world_size)],
                                   [slots for slots, _ in layouts], longest, self.device)

    @property
    def summed_flag(self) -> Tensor:
        """The final round's flag summed over workers (0, or NaN when some worker's bucket was not finite)."""
        return self._summed_flag if self._summed_flag is not None else torch.zeros((), device=self.device)

    def split(self, results: list[Tensor]) -> dict[int, list]:
        """Each tensor's results, in the order of its requests (and the flag's sum in :attr:`summed_flag`)."""
        per_tensor: dict[int, list] = {index: [None] * size for index, size in self.shapes.items()}
        results_iter: Iterator[Tensor] = iter(results)
        for position, requests in enumerate(self.means.values()):
            summed = next(results_iter)
            if self.flag_slot is _FlagSlot.MEANS and position == 0:
                self._summed_flag, summed = summed[-1], summed[:-1]
            pieces = summed.split([request.tensor.numel() for _, _, request in requests])
            for (index, position_in_tensor, request), piece in zip(requests, pieces):
                per_tensor[index][position_in_tensor] = piece.view(request.tensor.shape)
        if self.gathers:
            rows = next(results_iter, None)
            received: list[list[Received]] = [[] for _ in self.gathers]
            flags = []
            for rank, (slots, _) in enumerate(self.gather_layouts):
                row = rows[rank] if rows is not None else torch.empty(0, dtype=torch.uint8, device=self.device)
                counts = self.rank_counts[rank] if self.rank_counts is not None else [None] * len(self.gathers)
                payloads = wire.deserialize(row, slots)
                if self.flag_slot is _FlagSlot.GATHER:
                    flags.append(payloads.pop()[0])
                for request_index, parts in enumerate(payloads):
                    received[request_index].append(Received(parts, counts[request_index]))
            if flags:  # one sum over the workers' flags (a strided view of the gathered rows)
                self._summed_flag = flags[0][0] if len(flags) == 1 else stack_views(flags).sum()
            for (index, position, _), rows_of_request in zip(self.gathers, received):
                per_tensor[index][position] = rows_of_request
        if self.exchanges:
            rows = next(results_iter)
            received = [[] for _ in self.exchanges]
            for row in rows:
                for request_index, parts in enumerate(wire.deserialize(row, self.exchange_slots)):
                    received[request_index].append(Received(parts, None))
            for (index, position, _), rows_of_request in zip(self.exchanges, received):
                per_tensor[index][position] = rows_of_request
        if self.flag_slot is _FlagSlot.ALONE:
            self._summed_flag = next(results_iter)[0]
        return per_tensor


def _specs(request: Gather, count: Optional[int]) -> list[wire.PartSpec]:
    """``(dtype, numel)`` of a gathered request's parts, for a worker whose count is ``count``."""
    if count is None or request.part_numels is None:
        return [(part.dtype, part.numel()) for part in request.parts]
    return [(part.dtype, int(numel)) for part, numel in zip(request.parts, request.part_numels(count))]
