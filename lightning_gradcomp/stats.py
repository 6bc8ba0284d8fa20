"""The figures of one synchronisation step."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class StepStats:
    """What one optimizer step's gradient exchange did on this rank.

    Attributes:
        bytes_sent: bytes of the tensors this rank handed to ``torch.distributed`` (payloads, padding,
            count headers, dense tensors).
        bytes_dense: bytes plain DDP would have all-reduced for the same gradients.
        elements_sent: coordinates represented by the payloads (``k`` for a sparsifier), plus the
            elements of tensors sent dense.
        elements_total: elements of all gradients.
        buckets: DDP buckets exchanged.
    """

    bytes_sent: float = 0
    bytes_dense: float = 0
    elements_sent: float = 0
    elements_total: float = 0
    buckets: float = 0

    @property
    def compression_ratio(self) -> float:
        """``bytes_dense / bytes_sent``."""
        return self.bytes_dense / self.bytes_sent if self.bytes_sent else float("nan")

    @property
    def density(self) -> float:
        """``elements_sent / elements_total``."""
        return self.elements_sent / self.elements_total if self.elements_total else float("nan")

    def metrics(self, prefix: str = "gradcomp/") -> dict[str, float]:
        return {
            f"{prefix}bytes_sent": float(self.bytes_sent),
            f"{prefix}bytes_dense": float(self.bytes_dense),
            f"{prefix}compression_ratio": self.compression_ratio,
            f"{prefix}density": self.density,
        }

    def as_list(self) -> list[float]:
        return [float(getattr(self, f.name)) for f in fields(self)]

    @classmethod
    def from_list(cls, values: list[float]) -> "StepStats":
        return cls(*values)
