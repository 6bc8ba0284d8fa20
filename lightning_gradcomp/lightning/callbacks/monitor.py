"""CompressionMonitor: total compression error, bytes, density, time and estimated communication time."""

from __future__ import annotations

import math
import time
from typing import Any, Literal, Optional

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_gradcomp.core.checks import check_int
from lightning_gradcomp.lightning.callbacks._access import exchange_state, local_update_loop, strategy_compressor
from lightning_gradcomp.lightning.step_figures import outer_loop_metrics
from lightning_gradcomp.metrics.netmodel import Network
from lightning_gradcomp.metrics.stats import NUMERIC_FIELDS, StepStats

PREFIX = "gradcomp/"


class CompressionMonitor(Callback):
    r"""Logs what compression does to a run, averaged over workers, through the Trainer's loggers.

    Every ``log_every_n_steps`` optimizer steps (default: the Trainer's):

    * ``gradcomp/total_error``: :math:`\sum_t \|e_{t+1}\|^2` since the start of training, where
      :math:`e_{t+1} = p_t - C(p_t)` is the error carried forward under error feedback (for DGC, its
      velocity). For compressors without error feedback the same quantity is computed from each step's
      compression error, so all compressors compare. It never decreases and survives checkpoint and
      resume (the running totals are saved with the strategy's state). Sahu et al. (NeurIPS 2021) show
      this total governs convergence under error feedback.
    * ``gradcomp/step_error`` (:math:`\|e_{t+1}\|^2`) and ``gradcomp/relative_error``
      (:math:`\|p_t - C(p_t)\|^2 / \|p_t\|^2`);
    * ``gradcomp/average_density``: :math:`\rho = \sum_t k_t / (T d)` since the start, and
      ``gradcomp/density`` of this step;
    * the bytes (``bytes_sent``, ``bytes_dense``, their ``_total``), ``compression_ratio``, the measured
      ``compress_ms`` (with error feedback) and ``decompress_ms``, and ``comm_ms_est``: this step's
      collectives on ``network`` (how to read them: docs/telemetry.md).

    At the end of every epoch: ``gradcomp/epoch_compute_s`` (measured; divided by the number of
    workers in a simulation, where they run one after another, as Harris 2020 does), ``gradcomp/epoch_comm_s_est``
    and their sum ``gradcomp/epoch_total_s_est``: compute plus communication per epoch.

    Every ``layer_every_n_steps`` steps (0: never) it also logs each parameter's relative error and
    density, as scalars ``gradcomp/layer/<name>/relative_error`` and ``.../density``, or as two
    TensorBoard histograms over the layers (``layer_mode="histogram"``).

    The figures of all workers are averaged with one small all-reduce per logging step. Under local
    updates nothing crosses the network between synchronisations, the monitor included: it logs this
    rank's figures at every synchronisation (the step whose exchange they describe), without an
    all-reduce, and ignores ``log_every_n_steps`` and ``layer_every_n_steps`` but for turning it off. The measured
    figures stay on the device between logging steps (no host synchronisation per step; the running
    totals still count every step). With ``log_every_n_steps=0`` the monitor is off and the hook does no
    extra work.

    Args:
        network: network model for ``comm_ms_est`` (default: 10 Gbit/s, 50 µs, ring).
        log_every_n_steps: logging interval in optimizer steps; ``None`` follows the Trainer.
        layer_every_n_steps: per-layer interval; 0 disables per-layer figures.
        layer_mode: ``"scalars"`` or ``"histogram"``.
    """

    def __init__(
        self,
        network: Optional[Network] = None,
        log_every_n_steps: Optional[int] = None,
        layer_every_n_steps: int = 0,
        layer_mode: Literal["scalars", "histogram"] = "scalars",
    ) -> None:
        if network is not None and not isinstance(network, Network):
            raise ValueError(f"`network` must be a lightning_gradcomp.metrics.netmodel.Network, got {network!r}")
        self.network = network or Network()
        self.log_every_n_steps = None if log_every_n_steps is None else check_int(log_every_n_steps, "log_every_n_steps", 0)
        self.layer_every_n_steps = check_int(layer_every_n_steps, "layer_every_n_steps", 0)
        if layer_mode not in ("scalars", "histogram"):
            raise ValueError(f"`layer_mode` must be 'scalars' or 'histogram', got {layer_mode!r}")
        self.layer_mode = layer_mode
        self._last_step = -1
        self._epoch_comm_s = 0.0
        self._epoch_began = 0.0

    def _interval(self, trainer: "L.Trainer") -> int:
        return trainer.log_every_n_steps if self.log_every_n_steps is None else self.log_every_n_steps

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: "L.Trainer", pl_module: "L.LightningModule", stage: str) -> None:
        if stage == "fit":
            strategy_compressor(trainer, caller="CompressionMonitor")
            trainer.strategy.log_stats = False  # the monitor logs a superset

    def on_train_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        exchange_state(trainer).telemetry = self._interval(trainer) > 0 or self.layer_every_n_steps > 0
        self._last_step = trainer.global_step

    def on_train_epoch_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        self._epoch_comm_s = 0.0
        self._epoch_began = time.perf_counter()

    def on_train_epoch_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        """Per epoch: measured compute time (per worker in a simulation, as Harris 2020 counts it) and the
        estimated communication time, so compressors compare on compute + communication."""
        if self._interval(trainer) <= 0:
            return
        workers = getattr(trainer.strategy, "compression_workers", trainer.world_size)
        simulated = workers != trainer.world_size
        compute = (time.perf_counter() - self._epoch_began) / (workers if simulated else 1)
        metrics = {f"{PREFIX}epoch_compute_s": compute, f"{PREFIX}epoch_comm_s_est": self._epoch_comm_s,
                   f"{PREFIX}epoch_total_s_est": compute + self._epoch_comm_s}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=_logging_step(trainer))

    def on_train_batch_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        every, interval = self.layer_every_n_steps, self._interval(trainer)
        coming = trainer.global_step + 1  # the step this batch's optimizer step completes
        hook_state = exchange_state(trainer)
        if local_update_loop(trainer) is not None:  # measured at every synchronisation, the only exchanges
            hook_state.record_layers = every > 0
            hook_state.telemetry_due = interval > 0 or every > 0
            return
        hook_state.record_layers = every > 0 and coming % every == 0
        hook_state.telemetry_due = hook_state.record_layers or (interval > 0 and coming % interval == 0)

    def on_train_batch_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_step:  # gradient accumulation: no optimizer step yet
            return
        self._last_step = step
        stats: StepStats = trainer.strategy.step_stats
        workers = getattr(trainer.strategy, "compression_workers", trainer.world_size)
        comm_s = self.network.step_time(stats.collectives, workers)  # the same collectives on every rank
        self._epoch_comm_s += comm_s
        interval = self._interval(trainer)
        loop = local_update_loop(trainer)
        if loop is not None:  # this rank's figures at each synchronisation, no collective between them
            log_now = interval > 0 and loop.synced
            if not loop.synced:
                return
        else:
            log_now = interval > 0 and step % interval == 0
        layer_names = sorted(stats.layers) if stats.layers else []
        if loop is None and exchange_state(trainer).record_layers:  # the same decision on every rank
            layer_names = _layer_names_of_every_rank(layer_names)  # an FSDP shard may be empty on some ranks
        if not log_now and not layer_names:
            return
        values = stats.as_list() + exchange_state(trainer).totals.as_list() + [comm_s]
        for name in layer_names:
            layer = stats.layers.get(name)  # a layer this rank holds no part of counts zero
            values += [layer.error_sq, layer.grad_sq, layer.count, layer.numel] if layer is not None else [0.0] * 4
        averaged = values if loop is not None else trainer.strategy.reduce(
            torch.tensor(values, dtype=torch.float64, device=trainer.strategy.root_device), reduce_op="mean"
        ).tolist()
        width = len(NUMERIC_FIELDS)
        step_avg, total_avg = StepStats.from_list(averaged[:width]), StepStats.from_list(averaged[width:2 * width])
        comm_s = averaged[2 * width]
        layer_values = averaged[2 * width + 1:]
        metrics: dict[str, float] = {}
        if log_now:
            metrics.update(self._metrics(step_avg, total_avg, comm_s))
            if loop is not None:  # ‖Δ̄‖; participants, commits, rollbacks under torchft (the strategy's own
                metrics.update(outer_loop_metrics(loop))  # logging is off meanwhile)
        logged_at = _logging_step(trainer)
        if layer_names:
            layers = {name: layer_values[4 * i:4 * i + 4] for i, name in enumerate(layer_names)}
            metrics.update(self._log_layers(trainer, layers, logged_at))
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=logged_at)

    # ------------------------------------------------------------------ figures
    @staticmethod
    def _metrics(step: StepStats, total: StepStats, comm_s: float) -> dict[str, float]:
        return {
            f"{PREFIX}total_error": total.error_sq,
            f"{PREFIX}step_error": step.error_sq,
            f"{PREFIX}relative_error": step.relative_error,
            f"{PREFIX}average_density": total.density,
            f"{PREFIX}density": step.density,
            f"{PREFIX}bytes_sent": step.bytes_sent,
            f"{PREFIX}bytes_dense": step.bytes_dense,
            f"{PREFIX}bytes_sent_total": total.bytes_sent,
            f"{PREFIX}bytes_dense_total": total.bytes_dense,
            f"{PREFIX}compression_ratio": step.compression_ratio,
            f"{PREFIX}compress_ms": step.compress_s * 1e3,
            f"{PREFIX}decompress_ms": step.decompress_s * 1e3,
            f"{PREFIX}comm_ms_est": comm_s * 1e3,
        }

    def _log_layers(self, trainer: "L.Trainer", layers: dict[str, list[float]], step: int) -> dict[str, float]:
        relative = {n: (e / g if g else math.nan) for n, (e, g, _, _) in layers.items()}
        density = {n: (c / d if d else math.nan) for n, (_, _, c, d) in layers.items()}
        if self.layer_mode == "scalars":
            metrics = {f"{PREFIX}layer/{n}/relative_error": v for n, v in relative.items()}
            metrics.update({f"{PREFIX}layer/{n}/density": v for n, v in density.items()})
            return metrics
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    finite = [v for v in relative.values() if math.isfinite(v)]
                    logger.experiment.add_histogram(f"{PREFIX}layer_relative_error", torch.tensor(finite), step)
                    logger.experiment.add_histogram(f"{PREFIX}layer_density", torch.tensor(list(density.values())), step)
        return {}


def _logging_step(trainer: "L.Trainer") -> int:
    """The step at which Lightning logs the module's metrics of the current batch (``self.log``): its count of
    batches that stepped the optimizer before this one, not ``global_step`` (which the optimizer step has
    already advanced, and which counts every optimizer of a batch)."""
    return int(getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step - 1))


def _layer_names_of_every_rank(names: list[str]) -> list[str]:
    """The union of the ranks' measured layers, sorted (one small gather of names, on the steps that log
    layers): under FSDP a rank whose shard of a parameter is empty measures nothing for it, and the
    all-reduce of the figures needs the same layers on every rank."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return names
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, names)
    return sorted({name for rank_names in gathered for name in rank_names})
