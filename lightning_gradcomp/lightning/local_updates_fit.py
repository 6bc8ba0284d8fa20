"""Local updates under the Trainer: ``θ_global`` is the model everywhere but in the training batches
(validation, checkpoints' model ``state_dict``, the end of ``fit``); see docs/local-updates.md."""

from __future__ import annotations

import math

from contextlib import ExitStack
from typing import Any, Optional

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lightning_gradcomp.local.loop import ScheduledSyncs


class _GlobalModelFirst(Callback):
    """Placed first among the callbacks while a ``fit`` trains with local updates, so that the other
    callbacks see ``θ_global``: at ``on_validation_start`` it is put into the module (the strategy's
    ``on_validation_end``, which Lightning calls after the callbacks', puts the replica back), and at
    ``on_train_end`` the final synchronisation runs."""

    def __init__(self, strategy: "ShowsGlobalModel") -> None:
        self.strategy = strategy

    @override
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self.strategy._show_global()

    @override
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.strategy.finish_local_updates()


class ShowsGlobalModel:
    """Mixin for the Trainer strategies: under local updates, ``θ_global`` is what evaluation, checkpoints
    and the end of ``fit`` see (see docs/local-updates.md). The host class provides ``outer_loop`` (``None``:
    gradients exchanged every step) and calls :meth:`_start_showing_global_model` from ``setup`` when fitting."""

    _fitting_locally = False
    #: whether the strategy writes every rank's checkpoint under rank 0's file name under time-boxed windows
    names_checkpoints_alike = False
    _evaluation_view: Optional[ExitStack] = None
    _end_callback: Optional[_GlobalModelFirst] = None
    _callbacks: Optional[list[Any]] = None  # the Trainer's callback list the end callback is in
    outer_loop: Optional[ScheduledSyncs]

    def _start_showing_global_model(self, trainer: Any) -> None:
        """From ``setup``: when this ``fit`` trains with local updates, place :class:`_GlobalModelFirst` first
        among the callbacks and show ``θ_global`` to evaluation and checkpoints until ``fit`` ends."""
        self._fitting_locally = trainer.state.fn == TrainerFn.FITTING and self.outer_loop is not None
        if self._fitting_locally and self._end_callback is None:
            self._end_callback = _GlobalModelFirst(self)
            self._callbacks = trainer.callbacks
            self._callbacks.insert(0, self._end_callback)
        if self._fitting_locally:
            keep_the_batches_free_of_collectives(trainer)
            if self.outer_loop.outer.time_boxed:
                refuse_collectives_at_each_ranks_own_step(trainer, self.names_checkpoints_alike)
                validate_at_synchronisations(trainer, self.outer_loop)

    def finish_local_updates(self) -> None:
        """The end of ``fit``: the final synchronisation (a collective, on every rank; once). If it fails,
        :meth:`on_exception` still leaves ``θ_global`` in the module."""
        if self._fitting_locally and self.outer_loop is not None:
            self.outer_loop.sync()
            self._fitting_locally = False

    # ------------------------------------------------------------------ evaluation inside fit
    def _show_global(self) -> None:
        if self._fitting_locally and self._evaluation_view is None and self.outer_loop is not None:
            self._evaluation_view = ExitStack()
            self._evaluation_view.enter_context(self.outer_loop.global_weights())

    def _show_replica(self) -> None:
        view, self._evaluation_view = self._evaluation_view, None
        if view is not None:
            view.close()

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()  # type: ignore[misc]
        self._show_global()

    @override
    def on_validation_end(self) -> None:
        self._show_replica()
        super().on_validation_end()  # type: ignore[misc]


    # ------------------------------------------------------------------ checkpoints, the end
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's ``state_dict`` with ``θ_global`` in it while a ``fit`` trains with local updates."""
        if not self._fitting_locally or self.outer_loop is None:
            return super().lightning_module_state_dict()  # type: ignore[misc]
        with self.outer_loop.global_weights():
            state = super().lightning_module_state_dict()  # type: ignore[misc]
            # shown by copy (FSDP2 shards): the state dict's tensors may be the module's own storage, into which
            # the replica returns when the view closes; the checkpoint keeps θ_global's values
            return _copied(state) if self.outer_loop.shown_by_copy else state

    @override
    def on_train_end(self) -> None:
        self.finish_local_updates()  # when the callback was removed from trainer.callbacks
        super().on_train_end()  # type: ignore[misc]

    @override
    def on_exception(self, exception: BaseException) -> None:
        """A failed ``fit`` leaves ``θ_global`` as of the last synchronisation in the module (no
        communication: a peer may be dead)."""
        self._show_replica()
        if self._fitting_locally and self.outer_loop is not None:
            self._fitting_locally = False
            self.outer_loop.adopt_global()
        super().on_exception(exception)  # type: ignore[misc]

    @override
    def teardown(self) -> None:
        self._show_replica()
        self._fitting_locally = False
        callback, self._end_callback = self._end_callback, None
        if callback is not None and self._callbacks is not None and callback in self._callbacks:
            self._callbacks.remove(callback)
        self._callbacks = None
        super().teardown()  # type: ignore[misc]


def _copied(value: Any) -> Any:
    """``value`` with every tensor cloned (a DTensor stays one)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return type(value)((key, _copied(item)) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(item) for item in value)
    return value


def keep_the_batches_free_of_collectives(trainer: Any) -> None:
    """Under local updates nothing should cross the network between two synchronisations, but Lightning (2.5
    and later) broadcasts rank 0's SIGTERM flag to every rank before each training batch: a collective per
    step, a round trip on a slow link, and a barrier that ties every group to the slowest one's pace (time-boxed
    windows could not let the groups take different numbers of steps). The Trainer's epoch loop checks this
    rank's own flag instead: a rank that receives SIGTERM stops, and the others learn it at the next
    synchronisation (its collective fails on every rank). (Lightning's method is replaced on this Trainer's
    loop only; a Lightning without it is left alone.)"""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    if loop is None or not hasattr(loop, "_broadcast_sigterm_tensor"):
        return

    def check_this_ranks_sigterm() -> None:
        if getattr(trainer, "received_sigterm", False):
            raise SIGTERMException()

    loop._broadcast_sigterm_tensor = check_this_ranks_sigterm


def refuse_collectives_at_each_ranks_own_step(trainer: Any, names_checkpoints_alike: bool) -> None:
    """Under time-boxed windows the groups take different numbers of steps, so what the Trainer does at a step or
    epoch count happens on each rank at another time, and its collectives would meet another rank's
    synchronisation. A ``ModelCheckpoint`` that saves at each training epoch's end, every N training steps or every
    time interval is refused before training, on every rank alike (the Trainer's settings are the same
    everywhere); one that saves after validation (``save_on_train_epoch_end=False``) is allowed where the strategy
    writes every rank's checkpoint under rank 0's name (``names_checkpoints_alike``: each rank's own name is made
    of its own epoch and step), validation being moved to synchronisations (:func:`validate_at_synchronisations`)."""
    refused = [callback for callback in trainer.checkpoint_callbacks
               if not names_checkpoints_alike or getattr(callback, "_every_n_train_steps", 0)
               or getattr(callback, "_train_time_interval", None)
               or getattr(callback, "_save_on_train_epoch_end", None) is not False]
    if refused:
        allowed = ("ModelCheckpoint(save_on_train_epoch_end=False) without every_n_train_steps or "
                   "train_time_interval (it saves after validation, which runs right after a synchronisation, the "
                   "same one on every rank), or " if names_checkpoints_alike else "")
        raise ValueError(
            f"gradcomp: LocalUpdates(window_seconds=...) under the Trainer: {type(refused[0]).__name__} would save at "
            "each rank's own epoch or step count, but the groups take different numbers of steps, so its "
            f"collectives would meet different synchronisations. Allowed: {allowed}Trainer(enable_checkpointing="
            "False) with trainer.save_checkpoint(path) after fit (fit ends on θ_global on every rank) or from a "
            "callback's on_validation_end, with the same path on every rank")


def validate_at_synchronisations(trainer: Any, loop: Any) -> None:
    """Under time-boxed windows, validation inside ``fit`` runs right after the synchronisation that ends a window,
    the same one on every rank: every ``max(1, round(val_check_batch / sync_every))`` windows (the Trainer's
    ``val_check_interval`` in windows of ``H`` steps; ``check_val_every_n_epoch`` is not followed, the ranks'
    epochs end at different times) and at the run's planned end. Lightning's decision on this Trainer's epoch loop
    is replaced; validation's collectives (``sync_dist`` logging, ``EarlyStopping``, a ``ModelCheckpoint`` that
    saves after validation) then meet their own on every rank."""
    epoch_loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    if epoch_loop is None or not hasattr(epoch_loop, "_should_check_val_fx"):
        return
    outer = loop.outer

    def after_a_window(_data_fetcher: Any) -> bool:
        if trainer.limit_val_batches == 0 or not outer.window_ended:
            return False
        every = trainer.val_check_batch if isinstance(getattr(trainer, "val_check_batch", None), int) else None
        windows_between = max(1, round(every / outer.sync_every)) if every else 1
        return loop.finished or (outer.windows + 1) % windows_between == 0

    epoch_loop._should_check_val_fx = after_a_window


def stop_at_the_runs_end(trainer: Any, loop: Any) -> None:
    """After each inner step: stop the Trainer where the run ends for this group. A replica group that joined a
    running fault-tolerant job continues from the others' step count: it stops with them, when the outer loop's
    count reaches ``max_steps``. Under time-boxed windows (``window_seconds``) the groups take different numbers
    of steps: the loop is told this Trainer's length (``trainer.estimated_stepping_batches``) at the first step,
    and every group stops at the end they planned together (:attr:`~lightning_gradcomp.local.outer.OuterModel.finished`)."""
    if trainer is None:
        return
    if loop.outer.time_boxed and loop.clock.total_steps is None:
        total = trainer.estimated_stepping_batches
        if math.isfinite(total):
            loop.clock.run_for(int(total))
    if (trainer.max_steps > 0 and loop.outer.optimizer_steps >= trainer.max_steps) or loop.finished:
        trainer.should_stop = True
