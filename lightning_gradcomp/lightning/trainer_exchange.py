"""What the two Trainer strategies that hold their exchange in ``gradcomp`` (``GradCompStrategy``,
``GradCompFSDPStrategy``) do after each optimizer step, at the end of ``fit`` and when a checkpoint is removed
(:class:`TrainerExchange`), and the end-of-fit summary of the Trainer strategies (the table itself:
:mod:`lightning_gradcomp.metrics.summary`)."""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch.optim import Optimizer
from typing_extensions import override

from lightning_gradcomp.exchange.checkpoint import remove_part
from lightning_gradcomp.lightning.callbacks.monitor import CompressionMonitor
from lightning_gradcomp.lightning.local_updates_fit import stop_at_the_runs_end
from lightning_gradcomp.lightning.step_figures import (
    HoldsExchange,
    KeepsBatchFigures,
    log_at_synchronisations,
    log_mean_over_ranks,
)
from lightning_gradcomp.metrics.summary import summarise


def print_fit_summary(strategy: Any) -> None:
    """At the end of ``fit`` (a Trainer strategy's ``on_train_end``; every rank calls it): rank 0 prints
    :func:`summarise`, unless ``strategy.print_summary`` is off. The network model is that of the
    Trainer's :class:`~lightning_gradcomp.lightning.callbacks.CompressionMonitor`, if it has one."""
    if not strategy.print_summary or strategy.hook_state is None:
        return
    callbacks = strategy.lightning_module.trainer.callbacks
    network = next((callback.network for callback in callbacks if isinstance(callback, CompressionMonitor)), None)
    device = strategy.root_device
    local = getattr(strategy, "outer_loop", None)
    text = summarise(strategy.hook_state, strategy.compressor, strategy.compression_workers, network,
                     lambda values: strategy.reduce(values.to(device), reduce_op="mean").cpu(),
                     optimizer_steps=local.steps_taken_here if local is not None else None,
                     dense_per_step=float(local.dense_bytes_per_step()) if local is not None else None)
    if strategy.is_global_zero:
        print(text, flush=True)


class TrainerExchange(HoldsExchange, KeepsBatchFigures):
    """Mixin, first in the bases: the host provides ``hook_state`` (the exchange's session, ``None`` before ``fit``
    builds it), ``outer_loop`` (``None``: an exchange every step), ``_fault_tolerant``, ``log_stats`` and
    ``print_summary``."""

    def _checkpoint_name(self, filepath: Any) -> Any:
        """The name of a checkpoint and of each rank's part of it: ``filepath`` (a host may agree on another)."""
        return filepath

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Optional[Any] = None,
                       **kwargs: Any) -> Any:
        """Lightning's step; then, under local updates, the outer loop's count (and the run's end), and this
        batch's figures (logged with ``log_stats``)."""
        output = super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        loop = self.outer_loop
        if loop is not None:
            loop.step()
            stop_at_the_runs_end(self.lightning_module.trainer, loop)
        if self.hook_state is not None:
            self._record_step(self.hook_state)
            if self.log_stats:
                trainer = self.lightning_module.trainer if self.lightning_module is not None else None
                if loop is None:
                    log_mean_over_ranks(trainer, self.step_stats, self.root_device)
                else:
                    log_at_synchronisations(trainer, self.step_stats, loop)
        return output

    @override
    def on_train_end(self) -> None:
        super().on_train_end()  # type: ignore[misc]  # under local updates: the final synchronisation, if due
        loop = self.outer_loop
        if loop is not None:
            loop.close()  # count the overlapped exchanges still in flight
        print_fit_summary(self)
        if self._fault_tolerant and self.is_global_zero and self.print_summary:
            print(loop.membership.figures.describe(), flush=True)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Lightning's removal (rank 0), and each rank its own part of the exchange state."""
        filepath = self._checkpoint_name(filepath)
        super().remove_checkpoint(filepath)  # type: ignore[misc]
        remove_part(filepath, self.global_rank)
