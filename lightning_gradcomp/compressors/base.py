"""The one interface every compressor implements.

A compressor turns one flat gradient tensor into a :class:`Payload`: a few 1-D tensors that cross the
wire (values, indices, packed codes, norms...). It declares

* how payloads are aggregated (:attr:`Compressor.summable`): a *summable* payload is linear in its input,
  so the payloads of all workers are summed by ``all_reduce`` and decoded once; any other payload is
  ``all_gather``-ed and every rank decodes every worker's payload;
* whether it is biased (:attr:`Compressor.biased`), which switches error feedback on by default;
* the size of its payload (:meth:`Compressor.payload_numels`), as a function of the number of
  coordinates it represents, and whether that number is known in advance (:meth:`Compressor.static_count`).

Compressors hold only hyper-parameters. Per-parameter state (DGC momenta) lives in
:class:`~lightning_gradcomp.memory.CompressionMemory` and reaches the compressor through
:class:`CompressContext`, so the same object serves every parameter, every worker and the simulator.
"""

from __future__ import annotations

import functools
import hashlib
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch
from torch import Tensor

#: name -> compressor class, filled by :meth:`Compressor.__init_subclass__`.
COMPRESSORS: dict[str, type["Compressor"]] = {}


@dataclass
class Payload:
    """What a compressor produces for one tensor.

    Attributes:
        parts: the 1-D tensors that cross the wire, in the order of :meth:`Compressor.part_dtypes`.
        numel: number of elements of the tensor that was compressed.
        count: number of coordinates the payload represents (``k`` for a sparsifier, ``numel`` for a
            quantiser); the density of this step is ``count / numel``.
        meta: local information the decoder of a *summable* payload needs (e.g. the shared Random-k
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
    """

    name: str
    step: int = 0
    rank: int = 0
    world_size: int = 1
    seed: int = 0
    state: dict[str, Tensor] = field(default_factory=dict)

    def generator(self, device: torch.device, *, per_rank: bool) -> torch.Generator:
        """A fresh generator seeded from ``(seed, step, name[, rank])``; the global RNG is never touched.

        Stateless seeding makes draws reproducible after a resume and, with ``per_rank=False``,
        identical on every worker (shared Random-k indices).
        """
        key = f"{self.seed}/{self.step}/{self.name}/{self.rank if per_rank else -1}"
        generator = torch.Generator(device=device)
        generator.manual_seed(int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1)
        return generator


class Compressor(ABC):
    """Base class of all compressors. Subclasses set :attr:`name` to register themselves."""

    name: ClassVar[str] = ""
    #: Biased compressors get error feedback by default (DESIGN §2).
    biased: ClassVar[bool] = True
    #: The compressor keeps its own residual (DGC's velocity): the generic error feedback stays off.
    owns_residual: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name:
            COMPRESSORS[cls.name] = cls

    @property
    def summable(self) -> bool:
        """Whether payloads are linear in the input, so that ``all_reduce`` may sum them."""
        return False

    @abstractmethod
    def part_dtypes(self, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        """Dtypes of the payload parts for a gradient of ``dtype``."""

    @abstractmethod
    def payload_numels(self, numel: int, count: int) -> tuple[int, ...]:
        """Element counts of the payload parts for a tensor of ``numel`` elements carrying ``count``."""

    def static_count(self, numel: int) -> Optional[int]:
        """The coordinate count of every payload for a tensor of ``numel`` elements, or ``None`` when it
        depends on the data (then the transport exchanges counts before gathering)."""
        return numel

    def dense(self, tensor: Tensor, ctx: CompressContext) -> Tensor:
        """The tensor to all-reduce for a parameter sent dense (below the strategy's size threshold).

        Identity by default; DGC applies its momentum here. Must not modify ``tensor``.
        """
        return tensor

    def check_optimizer(self, optimizer: Any) -> None:
        """Raise ``ValueError`` if ``optimizer`` conflicts with this compressor (called before training)."""

    def compression_error(self, tensor: Tensor, payload: Payload, ctx: CompressContext) -> tuple[Tensor, Tensor]:
        """``(‖p − C(p)‖², ‖p‖²)`` for the tensor just compressed (telemetry of compressors without the
        generic error feedback; under error feedback the hook measures the residual itself)."""
        error = tensor.clone()
        self.accumulate(payload, error, alpha=-1.0)
        return squared_norm(error), squared_norm(tensor)

    @abstractmethod
    def compress(self, tensor: Tensor, ctx: CompressContext) -> Payload:
        """Compress a flat tensor. Must not modify ``tensor``."""

    @abstractmethod
    def accumulate(self, payload: Payload, out: Tensor, alpha: float = 1.0) -> None:
        """``out += alpha * decompress(payload)``, in place, without materialising a dense copy where
        the format allows (sparse formats scatter-add)."""

    def decompress(self, payload: Payload, dtype: torch.dtype = torch.float32,
                   device: Optional[torch.device] = None) -> Tensor:
        """The dense tensor a payload stands for."""
        device = device if device is not None else payload.parts[0].device
        out = torch.zeros(payload.numel, dtype=dtype, device=device)
        self.accumulate(payload, out)
        return out

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


def squared_norm(tensor: Tensor) -> Tensor:
    """``‖tensor‖²`` as a 0-d float64 tensor on the tensor's device (one pass, no copy)."""
    return torch.linalg.vector_norm(tensor).double() ** 2


@functools.lru_cache(maxsize=None)
def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


def sparse_count(density: float, numel: int) -> int:
    """Number of elements Top-k and Random-k keep: ``max(1, round(density * numel))``."""
    return max(1, min(numel, int(round(density * numel))))


def keep_finite(new: Tensor, previous: Optional[Tensor]) -> Tensor:
    """``new`` where finite, else ``previous`` (or 0): state never turns NaN/Inf because of one bad step.

    On CPU a single check skips the element-wise selection in the usual all-finite case; on GPUs the
    selection is always made, to avoid a host synchronisation.
    """
    if new.device.type == "cpu" and bool(torch.isfinite(new).all()):
        return new
    fallback = previous if previous is not None and previous.shape == new.shape else 0.0
    return torch.where(torch.isfinite(new), new, fallback)


def check_density(density: float, parameter: str = "density") -> float:
    """Validate a density in (0, 1]."""
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not (0.0 < float(density) <= 1.0) \
            or math.isnan(float(density)):
        raise ValueError(f"`{parameter}` must be a number in (0, 1], got {density!r}")
    return float(density)


def check_int(value: int, parameter: str, low: int, high: Optional[int] = None) -> int:
    """Validate an integer in ``[low, high]``."""
    allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        raise ValueError(f"`{parameter}` must be {allowed}, got {value!r}")
    return value


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
