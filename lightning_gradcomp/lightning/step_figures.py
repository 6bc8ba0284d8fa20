"""The per-batch figures of the Trainer strategies that exchange every step (``step_stats``) and their
``gradcomp/*`` scalars, written once for ``GradCompStrategy`` and ``GradCompFSDPStrategy``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from typing_extensions import override

from lightning_gradcomp.metrics.stats import StepStats


class KeepsBatchFigures:
    """Mixin: :attr:`step_stats` holds the current batch's figures, all its optimizer steps together
    (manual optimization with several optimizers: not the last step's alone). The host calls
    :meth:`_record_step` after each optimizer step with its exchange state."""

    step_stats: StepStats
    _batch_stats_fresh: bool = True  # the next optimizer step is the batch's first

    def _record_step(self, hook_state: Any) -> None:
        taken = hook_state.take_step_stats()
        # empty when one backward fed several optimizers' steps
        self.step_stats = taken if self._batch_stats_fresh else self.step_stats.combined(taken)
        self._batch_stats_fresh = False

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]
        self._batch_stats_fresh = True


def log_mean_over_ranks(trainer: Any, stats: StepStats, device: torch.device) -> None:
    """``stats``' ``gradcomp/*`` scalars averaged over every rank (one all-reduce), through the Trainer's
    loggers every ``log_every_n_steps``; every rank calls it after each optimizer step."""
    if trainer is None or not trainer.loggers or trainer.log_every_n_steps <= 0:
        return
    step = trainer.global_step
    if step % trainer.log_every_n_steps != 0:
        return
    figures = torch.tensor(stats.as_list(), dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(figures)
        figures /= dist.get_world_size()
    metrics = StepStats.from_list(figures.tolist()).metrics()
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)


def log_at_synchronisations(trainer: Any, stats: StepStats, loop: Any) -> None:
    """Under local updates nothing crosses the network between synchronisations, so no all-reduce of the
    figures either: this rank's ``stats`` and ``gradcomp/outer_grad_norm`` are logged after each optimizer
    step that merged a synchronisation (the same on every rank for fixed-size compressors); under fault
    tolerance also ``gradcomp/ft_participants``, ``ft_commits``, ``ft_rollbacks`` and ``ft_quorum_seconds``."""
    if trainer is None or not trainer.loggers or trainer.log_every_n_steps <= 0 or not loop.synced:
        return
    metrics = stats.metrics()
    metrics.update(outer_loop_metrics(loop))
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)


def outer_loop_metrics(loop: Any) -> dict[str, float]:
    """At a synchronisation: ``gradcomp/outer_grad_norm`` (‖Δ̄‖ of the last one) and, under fault tolerance,
    :func:`fault_tolerance_metrics`."""
    return {"gradcomp/outer_grad_norm": loop.outer.last_norm, **fault_tolerance_metrics(loop)}


def fault_tolerance_metrics(loop: Any) -> dict[str, float]:
    """Under fault tolerance (a loop whose membership keeps figures: torchft's), the figures of its quorums:
    ``gradcomp/ft_participants`` (of the last), ``ft_commits``, ``ft_rollbacks``, ``ft_quorum_seconds``; else none."""
    figures = getattr(getattr(loop, "membership", None), "figures", None)
    if figures is None:
        return {}
    return {"gradcomp/ft_participants": float(figures.participants[-1] if figures.participants else 0),
            "gradcomp/ft_commits": float(figures.commits), "gradcomp/ft_rollbacks": float(figures.rollbacks),
            "gradcomp/ft_quorum_seconds": figures.quorum_seconds}


class ReportsFigures:
    """Mixin of the Fabric strategies (Fabric has no callbacks that log): :meth:`metrics` for
    ``fabric.log_dict``. The host holds the exchange's handle in ``gradcomp``."""

    gradcomp: Any

    def metrics(self) -> dict[str, float]:
        """This rank's ``gradcomp/*`` figures of the latest step (bytes sent, dense bytes, ratio, density;
        with ``telemetry=True`` the compression error and time), and under local updates, after a step that
        merged a synchronisation, ``gradcomp/outer_grad_norm`` (and the quorums' figures under fault
        tolerance): ``fabric.log_dict(fabric.strategy.metrics(), step=step)``. No communication: log them
        from any rank."""
        if self.gradcomp is None:
            return {}
        stats = self.gradcomp.step_stats
        figures = stats.metrics()
        if stats.grad_sq > 0:  # measured (telemetry): the names CompressionMonitor logs under the Trainer
            figures.update({"gradcomp/step_error": stats.error_sq, "gradcomp/relative_error": stats.relative_error,
                            "gradcomp/compress_ms": 1e3 * stats.compress_s})
        loop = getattr(self.gradcomp, "loop", None)
        if loop is not None and loop.synced:
            figures.update(outer_loop_metrics(loop))
        return figures

