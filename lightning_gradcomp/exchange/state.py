"""What every exchange state offers: the DDP hook's (one rank) and the simulation's (N workers).

Strategies and callbacks reach the running exchange as ``strategy.hook_state`` and use only what
:class:`ExchangeState` declares: the compressor and how to switch it, the telemetry switches, the step
counter, the running totals and the tally of collectives, and the exchange layout recorded in
checkpoints. :func:`worker_state` and :func:`restore_worker_state` are the one format of a worker's
part of a checkpoint entry, written by both.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable

import torch

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.exchange.memory import CompressionMemory
from lightning_gradcomp.metrics.stats import StepStats
from lightning_gradcomp.metrics.tally import CollectiveTally


@runtime_checkable
class ExchangeState(Protocol):
    """The contract of ``strategy.hook_state``
    (:class:`~lightning_gradcomp.exchange.session.ExchangeSession`,
    :class:`~lightning_gradcomp.ddp.hierarchy.HierarchicalHookState`,
    :class:`~lightning_gradcomp.exchange.simulated.SimulatedExchange`).

    Attributes:
        error_feedback: whether residuals are kept (resolved).
        telemetry: measure compression error and time; off, the exchange does no extra work.
        telemetry_due: whether the step that ends next brings the measured figures to the host.
        record_layers: also keep per-parameter figures for the step that ends next.
        step: optimizer steps exchanged so far (what random draws are seeded with).
        layout: how the workers exchange (``"flat"`` or a hierarchical layout); checkpoints record it.
        tally: every collective issued, by kind and size.
    """

    error_feedback: bool
    telemetry: bool
    telemetry_due: bool
    record_layers: bool
    step: int
    layout: str
    tally: CollectiveTally

    @property
    def compressor(self) -> Compressor:
        """The compressor in use."""

    @property
    def totals(self) -> StepStats:
        """Running totals of every step (measured figures read from the device first)."""

    def use_compressor(self, compressor: Optional[Compressor]) -> None:
        """Switch compressor between steps (``None``: uncompressed); memory and state are kept."""

    def restore_counters(self, step: int, totals: StepStats, tally: CollectiveTally) -> None:
        """Continue from a checkpoint's step counter, running totals and tally of collectives (the
        memory stays as it is: a resume that cannot keep the residuals)."""


def worker_state(step: int, memory: CompressionMemory, totals: StepStats, tally: CollectiveTally) -> dict[str, Any]:
    """One worker's part of a checkpoint entry: step, memory (CPU copies), running totals, tally."""
    return {"step": step, "memory": memory.state_dict(), "totals": totals.state_dict(),
            "collectives": tally.state_dict()}


def restore_worker_state(state: dict[str, Any], memory: CompressionMemory,
                         device: torch.device) -> tuple[int, StepStats, CollectiveTally]:
    """Load a :func:`worker_state` into ``memory`` (on ``device``); its step, totals and tally."""
    memory.load_state_dict(state["memory"], device)
    return (int(state["step"]), StepStats.from_state_dict(state.get("totals", {})),
            CollectiveTally.from_state_dict(state.get("collectives")))
