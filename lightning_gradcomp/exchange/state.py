"""What every exchange state offers: the DDP hook's (one rank) and the simulation's (N workers).

Strategies and callbacks reach the running exchange as ``strategy.hook_state`` and use only what
:class:`ExchangeState` declares: the compressor and how to switch it, the telemetry switches, the step
counter, the running totals and the tally of collectives, and the exchange layout recorded in
checkpoints. :func:`worker_state` and :func:`restore_worker_state` are the one format of a worker's
part of a checkpoint entry, written by both; :class:`Accounting`, the running totals and measurements both keep.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable

import torch

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.exchange.memory import CompressionMemory
from lightning_gradcomp.metrics.stats import StepStats
from lightning_gradcomp.metrics.tally import CollectiveTally
from lightning_gradcomp.metrics.telemetry import Stopwatch


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


class Accounting:
    """What the session and the simulation keep alike: running totals (``_totals``), the telemetry switch of
    their workers' ``pipelines`` and the measurements of their ``engines`` (read by ``_read_measurements``)."""

    @property
    def totals(self) -> StepStats:
        """Running totals of every closed step's figures (measured figures read from the device first);
        part of the checkpoint."""
        self._read_measurements()
        return self._totals

    @totals.setter
    def totals(self, value: StepStats) -> None:
        self._totals = value

    @property
    def telemetry(self) -> bool:
        """Measure compression error and time; off, the exchange does no extra work."""
        return self.pipelines[0].telemetry

    @telemetry.setter
    def telemetry(self, on: bool) -> None:
        for pipeline in self.pipelines:
            pipeline.telemetry = bool(on)

    def _clocks(self) -> list[Stopwatch]:
        return [clock for engine in self.engines for clock in (engine.compress_clock, engine.decompress_clock)]

    def _close_measurements(self) -> None:
        """End the step's measurements: folded into device-side sums (no host synchronisation)."""
        if self.telemetry or self.pipelines[0].recorder.unread:
            self.pipelines[0].recorder.close_step(keep_layers=self.record_layers)
            for clock in self._clocks():
                clock.close_step()

    def restore_counters(self, step: int, totals: StepStats, tally: CollectiveTally) -> None:
        """Continue from a checkpoint's step counter, running totals and tally (the step counts as
        closed: its figures are in ``totals``)."""
        self.step = self._closed_step = step
        self._totals, self.tally = totals, tally


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
