"""The figures of one synchronisation step, and their running totals."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

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


@dataclass
class StepStats:
    """What one optimizer step's gradient exchange did on this rank (or the running total of many).

    Attributes:
        steps: synchronisation steps counted (1 for one step's figures).
        buckets: DDP buckets exchanged.
        bytes_sent: bytes of the tensors this rank handed to ``torch.distributed`` (payloads, padding,
            count headers, dense tensors).
        bytes_dense: bytes plain DDP would have all-reduced for the same gradients.
        elements_sent: coordinates represented by the payloads (``k`` for a sparsifier), plus the
            elements of tensors sent dense.
        elements_total: elements of all gradients.
        error_sq: ``Σ ‖p_t − C(p_t)‖²`` over parameters, which under error feedback is ``‖e_{t+1}‖²``
            (recorded while telemetry is on).
        grad_sq: ``Σ ‖p_t‖²`` over parameters (recorded while telemetry is on).
        compress_s / decompress_s: time spent compressing (with error feedback) and decoding.
        collectives: ``(kind, bytes)`` of every collective this rank issued (``all_reduce`` or
            ``all_gather``, bytes of its input), for a network model.
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
                mine = result.layers.setdefault(name, LayerStats())
                for figure in ("error_sq", "grad_sq", "count", "numel"):
                    setattr(mine, figure, getattr(mine, figure) + getattr(layer, figure))
        return result

    def state_dict(self) -> dict[str, Any]:
        return {name: float(getattr(self, name)) for name in NUMERIC_FIELDS}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "StepStats":
        return cls(**{name: float(state.get(name, 0.0)) for name in NUMERIC_FIELDS})


assert set(NUMERIC_FIELDS) <= {f.name for f in fields(StepStats)}
