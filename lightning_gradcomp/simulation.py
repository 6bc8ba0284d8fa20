"""Simulate N data-parallel workers with compressed exchange on one device (a public import path).

The simulation's parts live in their layers: the in-process exchange in
:mod:`lightning_gradcomp.exchange.simulated`, the Trainer strategy and :func:`current_worker` in
:mod:`lightning_gradcomp.lightning.simulation`, the sampler in :mod:`lightning_gradcomp.lightning.sampler`.
"""

from lightning_gradcomp.exchange.simulated import SimulatedExchange
from lightning_gradcomp.lightning.sampler import DistributedOrderBatchSampler
from lightning_gradcomp.lightning.simulation import GradCompSimStrategy, current_worker

__all__ = ["DistributedOrderBatchSampler", "GradCompSimStrategy", "SimulatedExchange", "current_worker"]
