"""DGC warm-up: exponentially rising sparsity, with an optional linear learning-rate warm-up."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import lightning as L
from lightning.pytorch.callbacks import Callback

from lightning_gradcomp.core.checks import check_bool, check_density, check_int
from lightning_gradcomp.lightning.callbacks._access import strategy_compressor


def paper_densities(stages: int) -> list[float]:
    """``0.25 * 4**-i``: sparsity 75%, 93.75%, 98.4375%, 99.609375% (the paper's "99.6%"), ..."""
    return [0.25 * 4.0 ** -i for i in range(stages)]


class DGCWarmup(Callback):
    r"""Warm-up of Deep Gradient Compression (Lin et al., ICLR 2018, §3.3).

    During the first ``epochs`` epochs (or ``steps`` optimizer steps) the compressor's density follows
    ``densities``, one stage after another, then stays at ``target``. The default stages are the paper's
    exponential sparsity ramp, one per epoch: density 0.25, 0.0625, 0.015625, 0.00390625, ... never
    below the target. Works with any compressor that has a ``density`` (Top-k, Random-k, DGC).

    With ``lr_warmup=True`` the learning rate of every parameter group rises linearly from
    ``lr_start_factor`` times its base value to the base value over the same period (the base is the
    optimizer's rate when training starts), then is left alone.

    The density is derived from the trainer's epoch or step, and the target and base rates are in the
    checkpoint, so a resumed run continues at the right density. ``gradcomp/warmup_density`` and
    ``gradcomp/warmup_lr_factor`` are logged every step; add Lightning's ``LearningRateMonitor`` to log
    the rates themselves.

    Args:
        epochs: warm-up length in epochs (exclusive with ``steps``).
        steps: warm-up length in optimizer steps.
        densities: the stages' densities, spread evenly over the warm-up; default
            :func:`paper_densities` with one stage per epoch (4 stages when given ``steps``).
        target: density after warm-up; default the compressor's density when training starts.
        lr_warmup: also warm up the learning rate.
        lr_start_factor: learning-rate factor at the first step, in (0, 1].
    """

    def __init__(
        self,
        epochs: Optional[int] = None,
        steps: Optional[int] = None,
        densities: Optional[Sequence[float]] = None,
        target: Optional[float] = None,
        lr_warmup: bool = False,
        lr_start_factor: float = 0.1,
    ) -> None:
        if (epochs is None) == (steps is None):
            raise ValueError("DGCWarmup: give exactly one of `epochs` or `steps` (an integer >= 1)")
        self.epochs = None if epochs is None else check_int(epochs, "epochs", 1)
        self.steps = None if steps is None else check_int(steps, "steps", 1)
        stages = self.epochs if self.epochs is not None else 4
        if densities is not None and (not isinstance(densities, (list, tuple)) or not densities):
            raise ValueError(f"`densities` must be None (the paper's ramp) or a non-empty list of densities in "
                             f"(0, 1], got {densities!r}")
        self.densities = [check_density(d, "densities") for d in (densities or paper_densities(stages))]
        self.target = None if target is None else check_density(target, "target")
        self.lr_warmup = check_bool(lr_warmup, "lr_warmup")
        self.lr_start_factor = check_density(lr_start_factor, "lr_start_factor")
        self.base_lrs: Optional[list[list[float]]] = None
        self._lr_done = False

    # ------------------------------------------------------------------ schedule
    def progress(self, epoch: int, step: int, batch_fraction: float = 0.0) -> float:
        """Fraction of the warm-up completed, in [0, 1]."""
        if self.epochs is not None:
            return min(1.0, (epoch + batch_fraction) / self.epochs)
        return min(1.0, step / self.steps)

    def density_at(self, epoch: int, step: int) -> float:
        """The density of a given epoch (epoch mode) or optimizer step (step mode)."""
        assert self.target is not None
        progress = self.progress(epoch, step)
        if progress >= 1.0:
            return self.target
        stage = min(int(progress * len(self.densities)), len(self.densities) - 1)
        return max(self.densities[stage], self.target)

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: "L.Trainer", pl_module: "L.LightningModule", stage: str) -> None:
        if stage == "fit":
            strategy_compressor(trainer, "density", "DGCWarmup")

    def on_train_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        compressor = strategy_compressor(trainer, "density", "DGCWarmup")
        if self.target is None:
            self.target = compressor.density
        if self.lr_warmup and self.base_lrs is None:
            self.base_lrs = [[group["lr"] for group in opt.param_groups] for opt in trainer.optimizers]

    def on_train_batch_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        compressor = strategy_compressor(trainer, "density", "DGCWarmup")
        density = self.density_at(trainer.current_epoch, trainer.global_step)
        compressor.density = density
        pl_module.log("gradcomp/warmup_density", density, on_step=True, on_epoch=False)
        if self.lr_warmup and not self._lr_done:
            batches = trainer.num_training_batches
            fraction = batch_idx / batches if isinstance(batches, int) and batches > 0 else 0.0
            progress = self.progress(trainer.current_epoch, trainer.global_step, fraction)
            factor = self.lr_start_factor + (1.0 - self.lr_start_factor) * progress
            for optimizer, base in zip(trainer.optimizers, self.base_lrs or []):
                for group, lr in zip(optimizer.param_groups, base):
                    group["lr"] = lr * factor
            self._lr_done = progress >= 1.0
            pl_module.log("gradcomp/warmup_lr_factor", factor, on_step=True, on_epoch=False)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {"target": self.target, "base_lrs": self.base_lrs, "lr_done": self._lr_done}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.target = state_dict.get("target", self.target)
        self.base_lrs = state_dict.get("base_lrs", self.base_lrs)
        self._lr_done = bool(state_dict.get("lr_done", False))
