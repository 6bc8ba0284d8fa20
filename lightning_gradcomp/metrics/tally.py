"""The collectives a run issued, counted by kind and size, so that any network model can price them."""

from __future__ import annotations

from collections import Counter
from typing import Any, Optional

from lightning_gradcomp.metrics.netmodel import Network
from lightning_gradcomp.metrics.stats import StepStats


class CollectiveTally:
    """How many times each collective ``(kind, bytes)`` was issued; training steps repeat the same few,
    so this stays small, and any network model can price it afterwards."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, int]] = Counter()

    def add(self, stats: StepStats) -> None:
        """Count one step's collectives (``stats.collectives``)."""
        self.counts.update((kind, int(nbytes)) for kind, nbytes in stats.collectives)

    def state_dict(self) -> list[list[Any]]:
        return [[kind, nbytes, count] for (kind, nbytes), count in sorted(self.counts.items())]

    @classmethod
    def from_state_dict(cls, state: Optional[list[list[Any]]]) -> "CollectiveTally":
        tally = cls()
        for kind, nbytes, count in state or []:
            tally.counts[(str(kind), int(nbytes))] = int(count)
        return tally

    def time(self, network: Network, workers: int) -> float:
        """Seconds the counted collectives take on ``network`` when issued one after another."""
        return sum(count * network.time(kind, nbytes, workers) for (kind, nbytes), count in self.counts.items())
