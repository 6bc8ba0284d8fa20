"""The figures of one synchronisation step, and their running totals; what "bytes sent" means
(:func:`collective_bytes_sent`, the one definition behind every ``bytes_sent`` of the package)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Iterable

from lightning_gradcomp.core.checks import check_int

#: The collectives the exchange issues (a driver's log may scope them ``node:`` or ``cross:``).
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "all_to_all")
#: The scope of the collectives inside a node (the hierarchical exchange): they cross no network.
NODE_SCOPE = "node"
#: The scopes a logged collective may carry ("": every rank of the exchange).
SCOPES = ("", NODE_SCOPE, "cross")

#: Numeric fields of :class:`StepStats`, in the order of :meth:`StepStats.as_list`.
NUMERIC_FIELDS = (
    "steps", "buckets", "bytes_sent", "bytes_dense", "elements_sent", "elements_total",
    "error_sq", "grad_sq", "compress_s", "decompress_s",
)


@dataclass
class LayerStats:
    """One parameter's figures for one step: ``‖p − C(p)‖²``, ``‖p‖²``, coordinates sent, elements."""

    error_sq: float = 0.0
    grad_sq: float = 0.0
    count: float = 0.0
    numel: float = 0.0

    def add(self, other: "LayerStats", divisor: float = 1) -> None:
        """Add ``other``'s figures, each divided by ``divisor``."""
        for figure in ("error_sq", "grad_sq", "count", "numel"):
            setattr(self, figure, getattr(self, figure) + getattr(other, figure) / divisor)


@dataclass
class StepStats:
    """What one optimizer step's gradient exchange did on this rank (or the running total of many).

    Attributes:
        steps: synchronisation steps counted (1 for one step's figures).
        buckets: DDP buckets exchanged.
        bytes_sent: bytes this rank sent (:func:`collective_bytes_sent`, summed over its collectives:
            payloads, padding, count headers, dense tensors; an all-to-all's own row not counted).
        bytes_dense: bytes plain DDP's fp32 all-reduce would have sent for the same gradients (the
            same definition: an all-reduce sends its input).
        elements_sent: coordinates represented by the payloads (``k`` for a sparsifier), plus the
            elements of tensors sent dense.
        elements_total: elements of all gradients.
        error_sq: ``Σ ‖p_t − C(p_t)‖²`` over parameters, which under error feedback is ``‖e_{t+1}‖²``
            (recorded while telemetry is on).
        grad_sq: ``Σ ‖p_t‖²`` over parameters (recorded while telemetry is on).
        compress_s / decompress_s: time spent compressing (with error feedback) and decoding.
        collectives: ``(kind, bytes)`` of every collective this rank issued (``all_reduce``,
            ``all_gather`` or ``all_to_all``, bytes of its input), for a network model; the bytes
            sent follow from it (:func:`logged_bytes_sent`).
        layers: per-parameter figures, on steps where they were asked for.
    """

    steps: float = 0
    buckets: float = 0
    bytes_sent: float = 0
    bytes_dense: float = 0
    elements_sent: float = 0
    elements_total: float = 0
    error_sq: float = 0.0
    grad_sq: float = 0.0
    compress_s: float = 0.0
    decompress_s: float = 0.0
    collectives: list[tuple[str, int]] = field(default_factory=list)
    layers: dict[str, LayerStats] = field(default_factory=dict)

    @property
    def compression_ratio(self) -> float:
        """``bytes_dense / bytes_sent``."""
        return self.bytes_dense / self.bytes_sent if self.bytes_sent else float("nan")

    @property
    def density(self) -> float:
        """``elements_sent / elements_total``: the paper's ρ when taken over totals."""
        return self.elements_sent / self.elements_total if self.elements_total else float("nan")

    @property
    def relative_error(self) -> float:
        """``Σ‖p − C(p)‖² / Σ‖p‖²``."""
        return self.error_sq / self.grad_sq if self.grad_sq else float("nan")

    def metrics(self, prefix: str = "gradcomp/") -> dict[str, float]:
        """The strategy's own per-step figures."""
        return {
            f"{prefix}bytes_sent": float(self.bytes_sent),
            f"{prefix}bytes_dense": float(self.bytes_dense),
            f"{prefix}compression_ratio": self.compression_ratio,
            f"{prefix}density": self.density,
        }

    def as_list(self) -> list[float]:
        return [float(getattr(self, name)) for name in NUMERIC_FIELDS]

    @classmethod
    def from_list(cls, values: list[float]) -> "StepStats":
        return cls(**dict(zip(NUMERIC_FIELDS, values)))

    def add(self, other: "StepStats") -> None:
        """Add another step's numeric figures (for running totals)."""
        for name in NUMERIC_FIELDS:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def combined(self, other: "StepStats") -> "StepStats":
        """A new :class:`StepStats` holding both: numeric figures and per-parameter figures summed,
        collectives one after the other (the exchanges of two optimizer steps of one batch)."""
        result = StepStats(**{name: getattr(self, name) + getattr(other, name) for name in NUMERIC_FIELDS},
                           collectives=self.collectives + other.collectives)
        for stats in (self, other):
            for name, layer in stats.layers.items():
                result.layers.setdefault(name, LayerStats()).add(layer)
        return result

    def state_dict(self) -> dict[str, Any]:
        return {name: float(getattr(self, name)) for name in NUMERIC_FIELDS}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "StepStats":
        return cls(**{name: float(state.get(name, 0.0)) for name in NUMERIC_FIELDS})


assert set(NUMERIC_FIELDS) <= {f.name for f in fields(StepStats)}


def collective_bytes_sent(kind: str, input_bytes: int, world_size: int) -> int:
    """The bytes one rank sends in one collective of ``kind`` on ``input_bytes`` bytes among ``world_size``
    ranks: the bytes of its own data that the collective delivers to other ranks, each counted once.

    * ``all_reduce``: ``input_bytes`` (every rank's result depends on the whole input). DDP's fp32
      all-reduce of the gradients, ``bytes_dense``, counts the same way.
    * ``all_gather``: ``input_bytes`` (this rank's row of the result, which every other rank receives).
    * ``all_to_all``: ``(N - 1)/N`` of ``input_bytes``: the input is ``N`` equal rows, row ``c`` for rank
      ``c``, and the rank's own row never leaves the process.

    The first two are counted whatever ``N``, one rank included (the payload a rank contributes, so that
    a method's ratio against ``bytes_dense`` does not depend on ``N``); a lone rank's all-to-all sends 0.
    The bytes a link carries depend on the algorithm as well (a ring all-reduce moves about twice its
    input per rank, a ring all-gather relays every row ``N - 1`` times); the network model
    (:mod:`lightning_gradcomp.metrics.netmodel`) prices the time of each collective from its input.

    Raises:
        ValueError: an unknown ``kind``, a negative ``input_bytes``, ``world_size < 1``, or an all-to-all
            input that is not ``world_size`` equal rows.
    """
    check_int(world_size, "world_size", 1)
    check_int(input_bytes, "input_bytes", 0)
    if kind in ("all_reduce", "all_gather"):
        return input_bytes
    if kind == "all_to_all":
        if input_bytes % world_size:
            raise ValueError(f"an all_to_all's input is {world_size} equal rows; got {input_bytes} bytes")
        return input_bytes - input_bytes // world_size
    raise ValueError(f"`kind` must be one of {', '.join(COLLECTIVE_KINDS)}, got {kind!r}")


def logged_bytes_sent(collectives: Iterable[tuple[str, int]], world_size: int) -> int:
    """The bytes sent (:func:`collective_bytes_sent`) of a log of ``(kind, input bytes)``: a driver's, or
    :attr:`StepStats.collectives`. ``world_size``: the ranks of the log's collectives (for the
    hierarchical exchange's ``cross:`` ones, the processes of one local rank, one per node). Collectives
    scoped ``node:`` run inside a node, cross no network and are not counted."""
    total = 0
    for kind, nbytes in collectives:
        scope, _, base = kind.rpartition(":")
        if scope not in SCOPES:
            raise ValueError(f"a logged collective's scope must be one of {SCOPES}, got {kind!r}")
        if scope != NODE_SCOPE:
            total += collective_bytes_sent(base, int(nbytes), world_size)
    return total
