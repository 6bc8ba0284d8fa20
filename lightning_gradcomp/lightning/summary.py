"""The end-of-fit summary of the Trainer strategies (the table itself: :mod:`lightning_gradcomp.metrics.summary`)."""

from __future__ import annotations

from typing import Any

from lightning_gradcomp.lightning.callbacks.monitor import CompressionMonitor
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
    local = getattr(strategy, "local_loop", None) or getattr(strategy, "local", None)
    text = summarise(strategy.hook_state, strategy.compressor, strategy.compression_workers, network,
                     lambda values: strategy.reduce(values.to(device), reduce_op="mean").cpu(),
                     optimizer_steps=local.steps_taken_here if local is not None else None,
                     dense_per_step=float(local.dense_bytes_per_step()) if local is not None else None)
    if strategy.is_global_zero:
        print(text, flush=True)
