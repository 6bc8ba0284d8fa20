"""The per-batch figures of the Trainer strategies that exchange every step (``step_stats``) and their
``gradcomp/*`` scalars, written once for ``GradCompStrategy`` and ``GradCompFSDPStrategy``; and what every
strategy that holds its exchange in ``gradcomp`` does with it (:class:`HoldsExchange`). It imports no Lightning
(see :mod:`~lightning_gradcomp.lightning.fabric_exchange`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from typing_extensions import override

from lightning_gradcomp.exchange.session import exchange_failures
from lightning_gradcomp.metrics.stats import StepStats


class HoldsExchange:
    """Mixin of the Trainer's and Fabric's DDP and sharded strategies, before Lightning's strategy class in the
    bases: the host holds the exchange's handle in ``gradcomp`` (``None`` until it is built)."""

    gradcomp: Any = None

    @override
    def backward(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's (or Fabric's) backward; an exchange that failed (a dead peer) raises its
        :class:`~lightning_gradcomp.CollectiveError`, not DDP's ``RuntimeError`` wrapping it."""
        with exchange_failures(self.gradcomp):
            return super().backward(*args, **kwargs)  # type: ignore[misc]

    @override
    def teardown(self) -> None:
        if self.gradcomp is not None:  # under fault tolerance: leave the quorum, the other groups go on
            self.gradcomp.close()
        super().teardown()  # type: ignore[misc]


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
    """At a synchronisation: ``gradcomp/outer_grad_norm`` (‖Δ̄‖ of the last one) and, under fault tolerance (a
    loop whose membership keeps figures: torchft's), the figures of its quorums: ``gradcomp/ft_participants``
    (of the last), ``ft_commits``, ``ft_rollbacks``, ``ft_quorum_seconds``."""
    metrics = {"gradcomp/outer_grad_norm": loop.outer.last_norm}
    figures = getattr(getattr(loop, "membership", None), "figures", None)
    if figures is not None:
        metrics.update({"gradcomp/ft_participants": float(figures.participants[-1] if figures.participants else 0),
                        "gradcomp/ft_commits": float(figures.commits),
                        "gradcomp/ft_rollbacks": float(figures.rollbacks),
                        "gradcomp/ft_quorum_seconds": figures.quorum_seconds})
    return metrics
