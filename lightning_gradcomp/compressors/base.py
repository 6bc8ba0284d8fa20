"""The one interface every compressor implements.

A compressor's exchange of one tensor is a short protocol of rounds (:meth:`Compressor.exchange`, see
:mod:`lightning_gradcomp.core.protocol`): it yields the requests of each round (an average over
workers, a gather of every worker's parts), receives their results, and returns what was sent and how
to write the aggregate. The engine runs the protocols of all tensors of a DDP bucket in lock-step and
merges their requests into one collective per kind and round; the real driver (the DDP hook) and the
simulation of N workers run the same engine.

Most compressors need one round, and only implement

* :meth:`Compressor.compress` (one flat tensor -> :class:`Payload`, a few 1-D tensors) and
  :meth:`Compressor.accumulate` (``out += alpha * decompress(payload)``);
* the wire format: :meth:`Compressor.part_dtypes`, :meth:`Compressor.payload_numels` and
  :meth:`Compressor.static_count` (checked against every payload: a wrong declaration is an error);
* :attr:`Compressor.all_reducible`: payloads that can be summed element-wise by ``all_reduce``
  (casts, shared-index Random-k) are averaged and decoded once; all others are ``all_gather``-ed and
  every worker's payload is decoded;
* optionally :meth:`Compressor.finalize`, a step after aggregation (a majority vote).

A multi-round method (PowerSGD) overrides :meth:`Compressor.exchange` and
:meth:`Compressor.wire_format`. See ``docs/adding-a-compressor.md``.

Compressors hold only hyper-parameters. Per-parameter state (DGC momenta, PowerSGD's warm-started
``Q``) lives in :class:`~lightning_gradcomp.exchange.memory.CompressionMemory` and reaches the compressor through
:class:`CompressContext`, so the same object serves every parameter, every worker and the simulator,
and the state is checkpointed.
"""

from __future__ import annotations

import hashlib
import math
from abc import ABC
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar, Mapping, Optional, Sequence

import torch
from torch import Tensor

# The helpers a compressor needs, importable from here by compressor authors:
from lightning_gradcomp.core.checks import check_bool, check_density, check_int, check_number  # noqa: F401
from lightning_gradcomp.core.device import host_reads_allowed
from lightning_gradcomp.core.protocol import Gather, Mean, Outcome, Protocol, Round, SegmentsProtocol
from lightning_gradcomp.core.segments import Segments, SegmentsState
from lightning_gradcomp.core.tensors import (  # noqa: F401
    Finite,
    all_finite,
    both_finite,
    itemsize,
    keep_if_finite,
    squared_norm,
)

#: name -> compressor class, filled by :meth:`Compressor.__init_subclass__`.
COMPRESSORS: dict[str, type["Compressor"]] = {}

#: The optional capabilities a compressor class declares in :attr:`Compressor.capabilities`, each with the
#: methods that provide it (a class that defines one of them must declare it, and one that declares it must
#: implement one: checked when the class is defined). ``whole_bucket``: its :meth:`~Compressor.exchange_segments`
#: gives the results of its own per-tensor methods for a whole bucket at once (the engine takes that path on
#: accelerators, where :meth:`~Compressor.segment_alignment` says how). ``dense_segments`` and ``finalize_dense``:
#: the steps for the tensors sent dense. ``reads_flat_only`` is a promise, with no method: its
#: :meth:`~Compressor.exchange_segments` only reads the bucket's flat input (a lone gradient is then handed
#: over as it is, without a copy).
CAPABILITIES: dict[str, tuple[str, ...]] = {
    "whole_bucket": ("exchange_segments",),
    "dense_segments": ("dense_segments",),
    "finalize_dense": ("finalize_dense", "finalize_dense_many"),
    "reads_flat_only": (),
}

#: The capabilities of the whole-bucket path, which a subclass does not inherit: its bucket-wise code reproduces
#: its parent's per-tensor methods, so a subclass (a user's variant of a built-in) runs its own per-tensor
#: methods unless it declares them again in its own body (``capabilities = Parent.capabilities``: a promise
#: that the parent's bucket-wise code still gives its results).
BUCKET_CAPABILITIES = frozenset({"whole_bucket", "dense_segments", "reads_flat_only"})


@dataclass
class Payload:
    """What a compressor produces for one tensor.

    Attributes:
        parts: the 1-D tensors that cross the wire, in the order of :meth:`Compressor.part_dtypes`.
        numel: number of elements of the tensor that was compressed.
        count: number of coordinates the payload represents (``k`` for a sparsifier, ``numel`` for a
            quantiser); the density of this step is ``count / numel``.
        meta: local information the decoder of an all-reducible payload needs (e.g. the shared Random-k
            indices). It never crosses the wire.
    """

    parts: tuple[Tensor, ...]
    numel: int
    count: int
    meta: Any = None


@dataclass
class CompressContext:
    """Everything a compressor may need besides the tensor itself.

    Attributes:
        name: stable name of the parameter (the key of its memory).
        step: number of optimizer steps already synchronised.
        rank: this worker's rank.
        world_size: number of workers ``N``.
        seed: base seed, identical on every rank.
        state: persistent per-parameter, per-worker state owned by the compressor (checkpointed).
        shape: the parameter's shape (the tensor handed to the compressor is flat); ``()`` if unknown.
        finite: whether this worker's gradient is finite (see :func:`all_finite`). A compressor that keeps
            state must leave it unchanged when it is not (:func:`keep_if_finite`). ``None`` while the
            compressor is to find it itself (:attr:`Compressor.checks_finite`).
        dtype: the gradient's dtype, in which values cross the wire (:meth:`wire_dtype`). The tensor handed
            to the compressor may be wider: under error feedback it is ``g + e`` in fp32 (residuals are
            kept in fp32 whatever the gradient's dtype, :func:`~lightning_gradcomp.core.device.state_dtype`).
            ``None``: the tensor's own dtype.
        verdict: after the protocol's last round, the bucket's verdict as a 0-d floating tensor: 0, or NaN
            when some worker's gradients were not finite. Added to a result it makes the result NaN exactly
            when the bucket is void, with no host read. The engine makes the results NaN itself, unless the
            protocol added the flag and set this back to ``None``.
    """

    name: str
    step: int = 0
    rank: int = 0
    world_size: int = 1
    seed: int = 0
    state: dict[str, Tensor] = field(default_factory=dict)
    shape: tuple[int, ...] = ()
    finite: "Optional[Finite]" = True
    dtype: Optional[torch.dtype] = None
    verdict: Optional[Tensor] = None

    def commit(self, key: str, new: Tensor, check_result: bool = False) -> None:
        """Keep ``new`` as this parameter's state ``key``, the one rule for compressor state: unless the
        gradient was not finite (:attr:`finite`), in which case the previous value stays (or none).

        During compression :attr:`finite` is this worker's own gradient's finiteness; after the
        protocol's last round it is the bucket's verdict on every worker, so state computed from the
        exchange's results (PowerSGD's ``Q``, an owner residual) is committed alike on every worker.
        ``check_result=True`` also refuses a ``new`` that is itself not finite (an overflow in the
        exchange's arithmetic). With a tensor flag, an element-wise select: no host read."""
        previous = self.state.get(key)
        if previous is not None and previous.shape != new.shape:
            previous = None
        finite = both_finite(self.finite, all_finite(new)) if check_result else self.finite
        kept = keep_if_finite(new, previous, finite)
        if kept is None:
            self.state.pop(key, None)
        else:
            self.state[key] = kept

    def wire_dtype(self, tensor: Tensor) -> torch.dtype:
        """The dtype of values sent for ``tensor``: the gradient's (:attr:`dtype`), else the tensor's."""
        return self.dtype if self.dtype is not None else tensor.dtype

    def generator(self, device: torch.device, *, per_rank: bool) -> torch.Generator:
        """A fresh generator seeded from ``(seed, step, name[, rank])``; the global RNG is never touched.

        Stateless seeding makes draws reproducible after a resume and, with ``per_rank=False``,
        identical on every worker (shared Random-k indices), provided ``device`` is the CPU for those
        (:func:`~lightning_gradcomp.core.device.shared_draw_generator_device`): a GPU generator's
        stream depends on the GPU model.
        """
        key = f"{self.seed}/{self.step}/{self.name}/{self.rank if per_rank else -1}"
        generator = torch.Generator(device=device)
        generator.manual_seed(int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1)
        return generator


class Compressor(ABC):
    """Base class of all compressors. Subclasses set :attr:`name` to register themselves."""

    name: ClassVar[str] = ""
    #: Biased compressors get error feedback by default (Stich et al. 2018; Karimireddy et al. 2019).
    biased: ClassVar[bool] = True
    #: The compressor keeps its own residual (DGC's velocity): the generic error feedback stays off.
    owns_residual: ClassVar[bool] = False
    #: Error feedback by default, where the method's paper decides otherwise than :attr:`biased` (signSGD
    #: with majority vote is biased and runs without it); ``None``: follow :attr:`biased`.
    default_error_feedback: ClassVar[Optional[bool]] = None
    #: :meth:`compress` finds whether its input is finite as a by-product (Top-k's block peaks: one
    #: maximum per block, NaN or infinite exactly when an element of the block is) and sets
    #: ``ctx.finite`` before it returns, so the engine skips its own pass over the tensor. ``ctx.finite``
    #: is ``None`` until then; such a compressor must not read it first.
    checks_finite: ClassVar[bool] = False
    #: What else than a NaN or Inf in the gradient makes this compressor's payload non-finite, for the
    #: non-finite warning of the DDP hook (FP16: a value beyond ±65504, which the cast turns into inf).
    nonfinite_hint: ClassVar[str] = ""
    #: The optional capabilities this class provides (:data:`CAPABILITIES`): ``"whole_bucket"`` (a whole
    #: bucket at once, :meth:`exchange_segments`), ``"dense_segments"`` (a bucket's tensors sent dense are
    #: prepared in one flat buffer, :meth:`dense_segments`), ``"finalize_dense"`` (a step after the dense
    #: average, :meth:`finalize_dense`), ``"reads_flat_only"``. A subclass inherits ``"finalize_dense"``, not
    #: the whole-bucket ones (:data:`BUCKET_CAPABILITIES`), unless its body declares them again.
    capabilities: ClassVar[frozenset[str]] = frozenset()

    @property
    def produces_signs(self) -> bool:
        """Whether the aggregate handed to the optimizer is a vector of signs (every coordinate ±1 or 0,
        whatever the gradient's size: DeMo's, signSGD's with ``scale="none"``). Its norm is about ``√d``,
        so clipping it by norm (``Trainer(gradient_clip_val=...)``, ``clip_grad_norm_``) shrinks every step
        by about that factor and training stops; the Trainer strategies refuse it
        (:func:`~lightning_gradcomp.lightning.options.check_gradient_clipping`)."""
        return False

    @property
    def averages_over_senders(self) -> bool:
        """Whether each coordinate's aggregate is the mean over the workers that sent it, not over every worker
        (SparseLoCo's ``aggregate="chosen"``, DeMo): outer gradients weighted before compression (local updates'
        ``weight_by``) are then merged only approximately, and the local-update loop warns."""
        return False

    @property
    def awaits_optimizer(self) -> bool:
        """Whether the compressor reads the optimizer that :meth:`check_optimizer` binds (DeMo's learning
        rate) and none is bound yet: :func:`~lightning_gradcomp.register`'s handle warns at the first
        exchange (``handle.bind(optimizer)`` binds it)."""
        return False

    @property
    def keeps_state(self) -> bool:
        """Whether the compressor keeps values across steps that follow the gradient's scale (DGC's
        velocity, Signum's momentum, an owner residual): fp16 mixed precision's changing loss scale would
        mix scales in them, so such a compressor is refused there like error feedback."""
        return self.owns_residual

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "capabilities" not in cls.__dict__:  # inherited: without the whole-bucket path (BUCKET_CAPABILITIES)
            cls.capabilities = cls.capabilities - BUCKET_CAPABILITIES
        _check_capabilities(cls)
        if cls.__dict__.get("name"):  # its own name: a subclass that inherits one does not replace its parent
            COMPRESSORS[cls.name] = cls

    @property
    def all_reducible(self) -> bool:
        """Whether payloads of different workers can be summed element-wise by ``all_reduce`` (their parts
        are linear in the input and share their layout, e.g. casts or shared-index Random-k): they are
        then averaged and decoded once. Otherwise they are gathered and each worker's is decoded."""
        return False

    # ------------------------------------------------------------------ the wire format
    def part_dtypes(self, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        """Dtypes of the payload parts for a gradient of ``dtype``."""
        raise NotImplementedError(f"{type(self).__name__} must implement part_dtypes (or override exchange)")

    def payload_numels(self, numel: int, count: int) -> tuple[int, ...]:
        """Element counts of the payload parts for a tensor of ``numel`` elements carrying ``count``."""
        raise NotImplementedError(f"{type(self).__name__} must implement payload_numels (or override exchange)")

    def static_count(self, numel: int) -> Optional[int]:
        """The coordinate count of every payload for a tensor of ``numel`` elements, or ``None`` when it
        depends on the data (then counts are exchanged before gathering). Checked against every payload."""
        return numel

    def wire_format(self, shape: Sequence[int], dtype: torch.dtype, count: Optional[int] = None,
                    world_size: int = 1) -> list[list[tuple[torch.dtype, int]]]:
        """Per round, ``(dtype, numel)`` of every tensor this worker hands over for one parameter of
        ``shape`` among ``world_size`` workers, when its payload carries ``count`` coordinates (default:
        the static count). An :class:`~lightning_gradcomp.core.protocol.AllToAll` request lists its
        parts destination after destination.

        The conformance suite checks it against what the drivers are handed."""
        numel = math.prod(shape)
        count = self.static_count(numel) if count is None else count
        return [list(zip(self.part_dtypes(dtype), self.payload_numels(numel, count)))]

    # ------------------------------------------------------------------ hooks around the exchange
    def dense(self, tensor: Tensor, ctx: CompressContext) -> Tensor:
        """The tensor to all-reduce for a parameter sent dense (below the strategy's size threshold).

        Identity by default; DGC applies its momentum here. Must not modify ``tensor``.
        """
        return tensor

    def check_optimizer(self, optimizer: Any, names: Optional[Mapping[int, str]] = None) -> None:
        """Raise ``ValueError`` if ``optimizer`` conflicts with this compressor (called before training, and by
        ``bind``). ``names``: the model's parameter names, ``id(parameter) -> name`` (the names the exchange's
        tensors carry), where the entry point knows them: a compressor that reads each parameter's group
        (DeMo's learning rate) finds it by them."""

    def check_gradient_dtype(self, dtype: torch.dtype) -> None:
        """Raise ``ValueError`` if gradients of ``dtype`` cannot be compressed faithfully (the engine calls it
        for each new dtype, before compressing any of its tensors); anything goes by default."""

    def finalize(self, out: Tensor, ctx: CompressContext) -> None:
        """A step after aggregation, in place on the averaged result ``out`` (a majority vote takes its
        sign); nothing by default."""

    def finalize_dense(self, out: Tensor, ctx: CompressContext) -> None:
        """A step after averaging a tensor sent dense (below the strategy's size threshold), in place on
        the mean ``out`` (DeMo takes its sign); nothing by default."""

    def finalize_dense_many(self, outs: Sequence[Tensor], contexts: Sequence[CompressContext]) -> None:
        """:meth:`finalize_dense` of several tensors (a bucket's), where a compressor can do it in a fixed
        number of operations (DeMo: one multi-tensor sign); by default one call per tensor."""
        for out, ctx in zip(outs, contexts):
            self.finalize_dense(out, ctx)

    def compression_error(self, tensor: Tensor, outcome: Outcome, ctx: CompressContext) -> tuple[Tensor, Tensor]:
        """``(‖p − C(p)‖², ‖p‖²)`` for the tensor just exchanged (telemetry of compressors without the
        generic error feedback; under error feedback the pipeline measures the residual itself)."""
        error = tensor.clone()
        outcome.subtract(error)
        return squared_norm(error), squared_norm(tensor)

    # ------------------------------------------------------------------ one-round methods
    def compress(self, tensor: Tensor, ctx: CompressContext) -> Payload:
        """Compress a flat tensor. Must not modify ``tensor``."""
        raise NotImplementedError(f"{type(self).__name__} must implement compress (or override exchange)")

    def accumulate(self, payload: Payload, out: Tensor, alpha: float = 1.0) -> None:
        """``out += alpha * decompress(payload)``, in place, without materialising a dense copy where
        the format allows (sparse formats scatter-add)."""
        raise NotImplementedError(f"{type(self).__name__} must implement accumulate (or override exchange)")

    def decompress(self, payload: Payload, dtype: torch.dtype = torch.float32,
                   device: Optional[torch.device] = None) -> Tensor:
        """The dense tensor a payload stands for."""
        device = device if device is not None else payload.parts[0].device
        out = torch.zeros(payload.numel, dtype=dtype, device=device)
        self.accumulate(payload, out)
        return out

    def check_payload(self, payload: Payload, dtype: torch.dtype, name: str = "") -> None:
        """Raise if ``payload`` is not what :meth:`static_count`, :meth:`part_dtypes` and
        :meth:`payload_numels` declare: every worker must be able to read every other's payload."""
        where = f" for parameter {name!r}" if name else ""
        static = self.static_count(payload.numel)
        if static is not None and payload.count != static:
            raise ValueError(
                f"{type(self).__name__}.compress returned {payload.count} coordinates{where} of {payload.numel}, "
                f"but static_count({payload.numel}) declares {static}; return None from static_count when the "
                "count depends on the data"
            )
        declared = list(zip(self.part_dtypes(dtype), self.payload_numels(payload.numel, payload.count)))
        actual = [(part.dtype, part.numel()) for part in payload.parts]
        if declared != actual:
            raise ValueError(
                f"{type(self).__name__}.compress returned parts {actual}{where}, but part_dtypes/payload_numels "
                f"declare {declared}"
            )

    def exchange(self, tensor: Tensor, ctx: CompressContext) -> Protocol:
        """The protocol of one tensor (a generator; see :mod:`lightning_gradcomp.core.protocol`).

        Default, one round: ``compress``; all-reducible parts are averaged and decoded once, other
        payloads are gathered and every worker's is decoded with weight ``1/N``; then :meth:`finalize`.
        ``subtract`` removes this worker's own decoded payload (error feedback ``e = p − C(p)``).
        """
        payload = self.compress(tensor, ctx)
        self.check_payload(payload, ctx.wire_dtype(tensor), ctx.name)
        if self.all_reducible:
            means = yield Round([Mean(part) for part in payload.parts], last=True)
            received = [Payload(tuple(means), payload.numel, payload.count, payload.meta)]
            weight = 1.0
        else:
            dynamic = self.static_count(payload.numel) is None
            request = Gather(payload.parts, payload.count if dynamic else None,
                             partial(self.payload_numels, payload.numel) if dynamic else None)
            (rows,) = yield Round([request], last=True)
            received = [Payload(row.parts, payload.numel, payload.count if row.count is None else row.count)
                        for row in rows]
            weight = 1.0 / len(rows)

        def write(out: Tensor) -> None:
            out.zero_()
            for item in received:
                self.accumulate(item, out, alpha=weight)
            self.finalize(out, ctx)

        return Outcome(payload.count, partial(self.accumulate, payload, alpha=-1.0), write, payload)

    # ------------------------------------------------------------------ a whole bucket at once
    def segment_alignment(self, device: torch.device) -> Optional[int]:
        """The alignment (in elements) of the tensors' segments when a compressor that declares
        ``"whole_bucket"`` compresses a whole bucket at once (:meth:`exchange_segments`) on ``device``, or
        ``None`` for one protocol per tensor there. Default: the bucket's flat buffer as it is (1) on
        accelerators, per tensor on the CPU, where kernel launches cost nothing and the per-tensor methods may
        read sizes on the host. Consulted only for a class that declares ``"whole_bucket"``."""
        return None if host_reads_allowed(device) else 1

    def segments_fit(self, numels: Sequence[int], align: int) -> bool:
        """Whether a bucket of tensors of ``numels`` elements may take the bucket-wise path (default:
        every tensor at least one row of ``align`` elements)."""
        return all(numel >= align for numel in numels)

    def dense_segments(self, flat: Tensor, segments: Segments, contexts: Sequence[CompressContext],
                       state: SegmentsState) -> Optional[Tensor]:
        """What to all-reduce for a bucket's tensors sent dense, as one flat buffer laid out by
        ``segments`` (alignment 1), where :meth:`dense` does more than return the tensor (DGC's momentum,
        the casts): the same values as :meth:`dense` of every tensor, in a fixed number of operations.
        Used on the whole-bucket path, by a class that declares ``"dense_segments"``."""
        return None

    def exchange_segments(self, flat: Tensor, segments: Segments, contexts: Sequence[CompressContext],
                          state: SegmentsState) -> SegmentsProtocol:
        """The protocol of a whole bucket: the same rounds, counts and results as :meth:`exchange` of
        every tensor, in a fixed number of tensor operations per bucket (a few kernels on a GPU, however
        many tensors the bucket holds).

        ``flat`` holds the tensors laid out by ``segments`` (gaps zero; fp32, or fp64 for fp64
        gradients); ``contexts[i]`` is tensor ``i``'s context. Unless :attr:`checks_finite`, every
        context's ``finite`` is set before the call; with it, this method sets them. Per-parameter state
        is read and committed through ``state`` (flat buffers), not ``ctx.state``. Only compressors
        that declare ``"whole_bucket"`` implement it."""
        raise NotImplementedError(f"{type(self).__name__} has no exchange of a whole bucket")

    def payload_nbytes(self, numel: int, count: int, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of the payload parts (without alignment padding)."""
        sizes = self.payload_numels(numel, count)
        dtypes = self.part_dtypes(dtype)
        return sum(n * itemsize(d) for n, d in zip(sizes, dtypes))

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.hparams().items())
        return f"{type(self).__name__}({params})"

    def hparams(self) -> dict[str, Any]:
        """The constructor arguments, for logs and ``repr``."""
        return {}


def _check_capabilities(cls: type[Compressor]) -> None:
    """A compressor class's :attr:`~Compressor.capabilities` match what it implements: unknown names, a
    capability declared without its method, and a method defined without its capability declared (the
    engine would never call it) are a ``TypeError`` when the class is defined. A whole-bucket method that a
    class inherits without declaring it again (:data:`BUCKET_CAPABILITIES`) is not called: that is allowed."""
    declared = cls.capabilities
    if not isinstance(declared, frozenset) or not declared <= set(CAPABILITIES):
        raise TypeError(f"{cls.__name__}.capabilities must be a frozenset of {sorted(CAPABILITIES)}, got {declared!r}")
    for capability, methods in CAPABILITIES.items():
        implemented = [method for method in methods if getattr(cls, method) is not getattr(Compressor, method)]
        defined = [method for method in implemented if capability not in BUCKET_CAPABILITIES or method in cls.__dict__]
        if defined and capability not in declared:
            wanted = ", ".join(repr(name) for name in sorted(declared | {capability}))
            raise TypeError(f"{cls.__name__} overrides {defined[0]} without declaring the capability "
                            f"{capability!r}, so the engine would never call it: set capabilities = "
                            f"frozenset({{{wanted}}}) in the class")
        if methods and capability in declared and not implemented:
            raise TypeError(f"{cls.__name__} declares the capability {capability!r} without implementing "
                            f"{' or '.join(methods)}")
    if "finalize_dense" in cls.__dict__ and "finalize_dense_many" not in cls.__dict__ and \
            cls.finalize_dense_many is not Compressor.finalize_dense_many:  # the inherited one would bypass it
        raise TypeError(f"{cls.__name__} overrides finalize_dense, but the finalize_dense_many it inherits (which the "
                        "engine calls for a bucket's tensors sent dense) does not call it: override "
                        "finalize_dense_many too")


def take_verdict(contexts: Sequence[CompressContext]) -> Optional[Tensor]:
    """The bucket's verdict flag (:attr:`CompressContext.verdict`: 0, or NaN for a void bucket), for a
    bucket-wise ``write`` that folds it into its results itself, cheaply (added to a small tensor every
    result is a multiple of, or to the result as it is written), taken from every context: the engine then
    makes no pass of its own over the results. ``None`` if not known yet, or already taken."""
    verdict = contexts[0].verdict if contexts else None
    for ctx in contexts:
        ctx.verdict = None
    return verdict


def sparse_count(density: float, numel: int) -> int:
    """Number of elements Top-k and Random-k keep: ``max(1, round(density * numel))``."""
    return max(1, min(numel, int(round(density * numel))))


def get_compressor(spec: "Compressor | str") -> Compressor:
    """A compressor from an instance (returned as is) or a registered short name (default arguments)."""
    if isinstance(spec, Compressor):
        return spec
    if isinstance(spec, str):
        key = spec.strip().lower()
        if key in COMPRESSORS:
            return COMPRESSORS[key]()
        raise ValueError(f"`compressor`: unknown name {spec!r}; allowed names: {', '.join(sorted(COMPRESSORS))}")
    raise ValueError(
        f"`compressor` must be a Compressor instance or one of {', '.join(sorted(COMPRESSORS))}, got {spec!r}"
    )
