"""Compression schedules that change level during training: on a monitored metric (Tirupati et al.), or on a
gradient-norm signal (ACCORDION)."""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Optional, Sequence

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.core.checks import check_number
from lightning_gradcomp.core.checks import check_int
from lightning_gradcomp.lightning.callbacks._access import exchange_state, strategy_compressor

Level = Optional[dict[str, Any]]  # compressor parameters to set; None = uncompressed


def _check_levels(levels: Sequence[Level], parameter: str = "levels") -> list[Level]:
    if not isinstance(levels, (list, tuple)) or not levels:
        raise ValueError(f"`{parameter}` must be a non-empty list of parameter dicts or None (uncompressed)")
    for level in levels:
        if level is not None and (not isinstance(level, dict) or not all(isinstance(k, str) for k in level)):
            raise ValueError(f"each of `{parameter}` must be a dict of compressor parameters or None, got {level!r}")
    return list(levels)


def apply_level(trainer: "L.Trainer", level: Level, caller: str) -> None:
    """Set a level's parameters on the strategy's compressor, or switch compression off (None)."""
    compressor = strategy_compressor(trainer, caller=caller)
    exchange = exchange_state(trainer)
    if level is None:
        exchange.use_compressor(None)
        return
    for key, value in level.items():
        setattr(compressor, key, value)
    exchange.use_compressor(compressor)


def check_level_keys(compressor: Compressor, levels: Sequence[Level], caller: str) -> None:
    """Every key of every level must be a settable parameter of the compressor with a value it accepts
    (each level is tried on a copy before training), and an uncompressed level (None) is refused for
    compressors that carry the optimizer's momentum (DGC)."""
    settable = {name for name in dir(type(compressor))
                if isinstance(getattr(type(compressor), name), property) and getattr(type(compressor), name).fset}
    allowed = sorted(set(compressor.hparams()) | settable)
    if compressor.owns_residual and any(level is None for level in levels):
        raise ValueError(
            f"{caller}: an uncompressed level (None) would drop {type(compressor).__name__}'s momentum and leave its "
            "velocity stale; use a dense level such as {'density': 1.0} instead"
        )
    for level in levels:
        for key in level or {}:
            if key not in allowed:
                raise ValueError(
                    f"{caller}: a level sets `{key}`, which {type(compressor).__name__} does not have; "
                    f"allowed: {', '.join(allowed)}"
                )
        if level is not None:
            trial = copy.deepcopy(compressor)
            try:
                for key, value in level.items():
                    setattr(trial, key, value)
            except (ValueError, TypeError) as error:
                raise ValueError(f"{caller}: level {level!r} is not valid for {type(compressor).__name__}: {error}") \
                    from None


def _check_thresholds(thresholds: Sequence[float], count: int, mode: str) -> list[float]:
    """``count`` finite numbers, in the order the metric moves (rising for ``"max"``, falling for ``"min"``)."""
    if not isinstance(thresholds, (list, tuple)):
        raise ValueError(f"`thresholds` must be a list of len(levels) - 1 = {count} numbers, got {thresholds!r}")
    if len(thresholds) != count:
        raise ValueError(f"`thresholds` must hold len(levels) - 1 = {count} values, got {len(thresholds)}")
    if any(isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) for t in thresholds):
        raise ValueError(f"`thresholds` must be finite numbers, got {list(thresholds)!r}")
    ordered = all((b >= a) if mode == "max" else (b <= a) for a, b in zip(thresholds, thresholds[1:]))
    if not ordered:
        raise ValueError(f"`thresholds` must be {'non-decreasing' if mode == 'max' else 'non-increasing'} for "
                         f"mode={mode!r} (each level's bar is passed after the previous one), got {list(thresholds)!r}")
    return [float(t) for t in thresholds]


def check_validation_runs(trainer: "L.Trainer", pl_module: "L.LightningModule", caller: str, monitor: str) -> None:
    """A schedule that decides after validation needs validation to run."""
    if trainer.limit_val_batches == 0 or not is_overridden("validation_step", pl_module):
        raise ValueError(
            f"{caller} decides after each validation epoch (monitor {monitor!r}), but validation does not run "
            "(no validation_step, or limit_val_batches=0); enable validation, or log the metric in validation"
        )


def _log_level(pl_module: "L.LightningModule", index: int, level: Level) -> None:
    pl_module.log("gradcomp/level", float(index), on_step=True, on_epoch=False)
    pl_module.log("gradcomp/compressed", 0.0 if level is None else 1.0, on_step=True, on_epoch=False)
    for key, value in (level or {}).items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            # under level/: gradcomp/density is the measured density (CompressionMonitor, the strategy)
            pl_module.log(f"gradcomp/level/{key}", float(value), on_step=True, on_epoch=False)


@dataclass
class ScheduleState:
    """Where a step-function schedule stands."""

    level: int = 0
    epochs_on_level: int = 0
    escape_left: int = 0
    return_level: int = 0
    last_loss: Optional[float] = None
    history: list[int] = field(default_factory=list)


class AdaptiveCompression(Callback):
    r"""Step-function compression schedule driven by a monitored metric (Abdelmoniem & Canini style
    dynamic compression; Tirupati et al.).

    Training starts on ``levels[0]`` (the most aggressive) and moves to the next level each time, at
    the end of a validation epoch, the monitored metric passes the current level's threshold
    (``thresholds[i]`` is the bar to leave level ``i``), or, with ``loss_delta``, when the training loss
    changed by less than ``loss_delta`` since the previous epoch (it stalls). If training stays on one
    level for ``patience`` epochs, compression is switched off for ``escape_epochs`` epochs, then the
    schedule returns to the level it left. A level is a dict of compressor parameters (``{"bits": 8}``,
    ``{"density": 0.01}``, ``{"threshold": 1e-3}``...), or ``None`` for uncompressed.

    Every rank uses the same level: the decision is made on rank 0 and broadcast. The level index,
    whether compression is on and the live parameters are logged every step (``gradcomp/level``,
    ``gradcomp/compressed``, ``gradcomp/level/<parameter>``); changes are printed once; the state is in the
    checkpoint.

    Args:
        monitor: a logged metric (e.g. ``"val_acc"``).
        levels: the levels, most compressed first.
        thresholds: ``len(levels) - 1`` values of ``monitor`` that move to the next level.
        mode: ``"max"`` if higher is better, ``"min"`` if lower is.
        loss_delta: also move on when the epoch's training loss changes by less than this.
        loss_monitor: a logged training loss to use with ``loss_delta``; default: the mean, over the
            epoch, of the losses ``training_step`` returned (on rank 0, which decides).
        patience: epochs on one level before the escape (``None``: never).
        escape_epochs: epochs without compression during an escape.
    """

    def __init__(
        self,
        monitor: str,
        levels: Sequence[Level],
        thresholds: Sequence[float],
        mode: Literal["max", "min"] = "max",
        loss_delta: Optional[float] = None,
        loss_monitor: Optional[str] = None,
        patience: Optional[int] = None,
        escape_epochs: int = 1,
    ) -> None:
        if not isinstance(monitor, str) or not monitor:
            raise ValueError(f"`monitor` must be the name of a logged metric (e.g. 'val_acc'), got {monitor!r}")
        self.monitor = monitor
        self.levels = _check_levels(levels)
        if mode not in ("max", "min"):
            raise ValueError(f"`mode` must be 'max' or 'min', got {mode!r}")
        self.thresholds = _check_thresholds(thresholds, len(self.levels) - 1, mode)
        if loss_delta is not None and not (isinstance(loss_delta, (int, float)) and loss_delta >= 0):
            raise ValueError(f"`loss_delta` must be None or a number >= 0, got {loss_delta!r}")
        self.mode = mode
        self.loss_delta = loss_delta
        if loss_monitor is not None and (not isinstance(loss_monitor, str) or not loss_monitor):
            raise ValueError(f"`loss_monitor` must be None or the name of a logged metric, got {loss_monitor!r}")
        self.loss_monitor = loss_monitor
        self.patience = None if patience is None else check_int(patience, "patience", 1)
        self.escape_epochs = check_int(escape_epochs, "escape_epochs", 1)
        self.state = ScheduleState()
        self._loss_sum: Optional[torch.Tensor] = None
        self._loss_count = 0

    # ------------------------------------------------------------------ the schedule, without Lightning
    @property
    def current_level(self) -> Level:
        return None if self.state.escape_left > 0 else self.levels[self.state.level]

    def _passed(self, value: float, bar: float) -> bool:
        return value >= bar if self.mode == "max" else value <= bar

    def step(self, metric: Optional[float], train_loss: Optional[float] = None) -> Optional[str]:
        """Advance the schedule by one epoch; return a sentence describing a change, or None."""
        state = self.state
        stalled = False
        if self.loss_delta is not None and train_loss is not None and state.last_loss is not None:
            stalled = abs(state.last_loss - train_loss) < self.loss_delta
        if train_loss is not None:
            state.last_loss = train_loss
        message = None
        if state.escape_left > 0:
            state.escape_left -= 1
            if state.escape_left == 0:
                state.level, state.epochs_on_level = state.return_level, 0
                message = f"escape over, back to level {state.level} {self.levels[state.level]}"
        elif state.level < len(self.levels) - 1 and (
            (metric is not None and math.isfinite(metric) and self._passed(metric, self.thresholds[state.level]))
            or stalled
        ):
            reason = (f"{self.monitor}={metric:.4g} passed {self.thresholds[state.level]:g}"
                      if metric is not None and self._passed(metric, self.thresholds[state.level])
                      else f"{self.loss_monitor or 'training loss'} changed by less than {self.loss_delta:g}")
            state.level += 1
            state.epochs_on_level = 0
            message = f"{reason}: level {state.level} {self.levels[state.level]}"
        else:
            state.epochs_on_level += 1
            if (self.patience is not None and state.epochs_on_level >= self.patience
                    and self.levels[state.level] is not None):
                state.escape_left, state.return_level, state.epochs_on_level = self.escape_epochs, state.level, 0
                message = f"stuck {self.patience} epochs on level {state.level}: compression off for " \
                          f"{self.escape_epochs} epoch(s)"
        state.history.append(-1 if state.escape_left > 0 else state.level)
        return message

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, trainer: "L.Trainer", pl_module: "L.LightningModule", stage: str) -> None:
        if stage == "fit":
            check_level_keys(strategy_compressor(trainer, caller="AdaptiveCompression"), self.levels,
                             "AdaptiveCompression")
            check_validation_runs(trainer, pl_module, "AdaptiveCompression", self.monitor)

    def on_train_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        apply_level(trainer, self.current_level, "AdaptiveCompression")

    def on_train_epoch_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        self._loss_sum, self._loss_count = None, 0

    def on_train_batch_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        index = -1 if self.state.escape_left > 0 else self.state.level
        _log_level(pl_module, index, self.current_level)

    def on_train_batch_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if self.loss_delta is not None and isinstance(loss, torch.Tensor):
            loss = loss.detach().float()
            self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
            self._loss_count += 1

    def _training_loss(self, metrics: dict[str, Any]) -> Optional[float]:
        """The epoch's training loss: a logged metric, or the mean of the losses training_step returned."""
        if self.loss_monitor is not None:
            value = metrics.get(self.loss_monitor)
            return None if value is None else float(value)
        return float(self._loss_sum) / self._loss_count if self._loss_count else None

    def on_validation_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        # After the LightningModule's own on_validation_epoch_end, so metrics logged there count.
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        decision: tuple[Optional[str], Optional[str]] = (None, None)  # (error, message)
        if trainer.is_global_zero:  # rank 0 decides, every rank takes its state: all use the same level
            metrics = trainer.callback_metrics
            metric = metrics.get(self.monitor)
            loss = self._training_loss(metrics) if self.loss_delta is not None else None
            missing = [name for name, value in ((self.monitor, metric), (self.loss_monitor, loss))
                       if name is not None and value is None and (name == self.monitor or self.loss_delta is not None)]
            if missing:
                decision = (f"AdaptiveCompression: {', '.join(repr(m) for m in missing)} not logged "
                            f"(`monitor` / `loss_monitor`); logged metrics: {', '.join(sorted(metrics)) or 'none'}",
                            None)
            else:
                decision = (None, self.step(float(metric), loss))
        self.state, decision = trainer.strategy.broadcast((self.state, decision), src=0)
        error, message = decision
        if error:
            raise ValueError(error)
        if message:
            rank_zero_info(f"gradcomp AdaptiveCompression, epoch {trainer.current_epoch}: {message}")
        apply_level(trainer, self.current_level, "AdaptiveCompression")

    def state_dict(self) -> dict[str, Any]:
        return asdict(self.state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state = ScheduleState(**state_dict)


def critical_layers(previous: dict[str, float], current: dict[str, float], ratio: float) -> list[str]:
    """Layers whose accumulated gradient norm changed by at least ``ratio`` (relative to ``previous``)."""
    return sorted(name for name, now in current.items()
                  if name in previous and previous[name] > 0 and abs(previous[name] - now) / previous[name] >= ratio)


class GradientNormTrigger(Callback):
    r"""ACCORDION (Agarwal, Wang, Lee, Venkataraman & Papailiopoulos, MLSys 2021): switch between a low
    and a high compression level on a gradient-norm signal.

    Over windows of ``window`` epochs each layer's (averaged, synchronised) gradients are summed; at the
    end of a window the layer is *critical* when the norm of that sum changed by at least ``ratio``
    since the previous window: :math:`|\|G_{prev}\| - \|G_{cur}\|| / \|G_{prev}\| \ge \eta`. A learning-rate
    drop also makes the regime critical. In a critical regime the next window uses ``low`` (little
    compression), else ``high``. The compressor is shared by all layers, so the model is critical when
    any layer is (the list of critical layers is logged). Gradients are identical on every rank after
    synchronisation, and rank 0's decision is broadcast.

    Args:
        low: level for critical regimes (e.g. ``{"density": 0.1}``, or None for uncompressed).
        high: level otherwise (e.g. ``{"density": 0.01}``).
        window: epochs per window.
        ratio: ``η``, relative change that marks a layer critical (ACCORDION uses 0.5).
    """

    def __init__(self, low: Level, high: Level, window: int = 1, ratio: float = 0.5) -> None:
        self.low, self.high = _check_levels([low, high], "low/high")
        self.window = check_int(window, "window", 1)
        self.ratio = check_number(ratio, "ratio", "a number > 0", lambda value: 0 < value < math.inf)
        self.critical = True  # the first window is critical (ACCORDION starts with low compression)
        self.previous_norms: dict[str, float] = {}
        self.critical_names: list[str] = []
        self._sums: dict[str, torch.Tensor] = {}
        self._lrs: Optional[list[float]] = None

    def decide(self, norms: dict[str, float], lr_dropped: bool) -> bool:
        """End of a window: is the next window critical?"""
        self.critical_names = critical_layers(self.previous_norms, norms, self.ratio)
        first = not self.previous_norms
        self.previous_norms = dict(norms)
        self.critical = first or lr_dropped or bool(self.critical_names)
        return self.critical

    @property
    def current_level(self) -> Level:
        return self.low if self.critical else self.high

    def setup(self, trainer: "L.Trainer", pl_module: "L.LightningModule", stage: str) -> None:
        if stage == "fit":
            check_level_keys(strategy_compressor(trainer, caller="GradientNormTrigger"), [self.low, self.high],
                             "GradientNormTrigger")

    def on_train_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        apply_level(trainer, self.current_level, "GradientNormTrigger")
        self._lrs = self._learning_rates(trainer)

    def on_before_optimizer_step(self, trainer: "L.Trainer", pl_module: "L.LightningModule", optimizer: Any) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        if grads and not bool(torch.isfinite(torch.stack([torch.linalg.vector_norm(g) for g in grads])).all()):
            return  # a step AMP will skip: not part of the signal
        with torch.no_grad():
            for name, p in pl_module.named_parameters():
                if p.grad is not None:
                    total = self._sums.get(name)
                    self._sums[name] = p.grad.detach().clone() if total is None else total.add_(p.grad)

    def on_train_batch_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        _log_level(pl_module, 0 if self.critical else 1, self.current_level)

    def on_train_epoch_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        if (trainer.current_epoch + 1) % self.window:
            return
        norms = {name: float(torch.linalg.vector_norm(total)) for name, total in self._sums.items()}
        self._sums = {}
        lrs = self._learning_rates(trainer)
        lr_dropped = self._lrs is not None and any(now < before for now, before in zip(lrs, self._lrs))
        self._lrs = lrs
        was = self.critical
        self.decide(norms, lr_dropped)
        self.critical = bool(trainer.strategy.broadcast(self.critical, src=0))
        if self.critical != was:
            why = "learning rate dropped" if lr_dropped else f"critical layers: {', '.join(self.critical_names) or 'none'}"
            rank_zero_info(f"gradcomp GradientNormTrigger, epoch {trainer.current_epoch}: "
                           f"{'critical' if self.critical else 'not critical'} ({why}): {self.current_level}")
        apply_level(trainer, self.current_level, "GradientNormTrigger")

    @staticmethod
    def _learning_rates(trainer: "L.Trainer") -> list[float]:
        return [group["lr"] for optimizer in trainer.optimizers for group in optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"critical": self.critical, "previous_norms": self.previous_norms, "lrs": self._lrs}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.critical = bool(state_dict["critical"])
        self.previous_norms = dict(state_dict["previous_norms"])
        self._lrs = state_dict.get("lrs")
