"""Simulate N data-parallel workers with compressed exchange on one device (000 §3.2, Algorithm 1)."""

from typing import Any

from lightning_gradcomp.simulation.exchange import SimulatedExchange
from lightning_gradcomp.simulation.sampler import DistributedOrderBatchSampler
from lightning_gradcomp.simulation.strategy import GradCompSimStrategy


def current_worker(module: Any) -> int:
    """The simulated worker whose share of the batch ``module`` is processing (0 outside a simulation).

    A recurrent LightningModule keeps one hidden state per worker with it::

        hidden = self.hidden.get(current_worker(self))
    """
    trainer = getattr(module, "_trainer", None)
    strategy = getattr(trainer, "strategy", None) if trainer is not None else None
    return int(getattr(strategy, "current_worker", 0))


__all__ = ["DistributedOrderBatchSampler", "GradCompSimStrategy", "SimulatedExchange", "current_worker"]
