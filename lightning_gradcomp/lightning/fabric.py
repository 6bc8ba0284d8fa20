"""``GradCompFabricStrategy``: compressed gradients for Lightning Fabric, registered as ``"gradcomp"``: Fabric's
DDP with the exchange registered through :func:`~lightning_gradcomp.register`; see docs/guides/fabric.md."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import DDPStrategy, STRATEGY_REGISTRY
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.core.checks import check_bool
from lightning_gradcomp.exchange.options import ExchangeOptions
from lightning_gradcomp.exchange.pipeline import resolve_error_feedback
from lightning_gradcomp.lightning.options import (
    check_ddp_kwargs,
    check_fit_setup,
    check_process_group_backend,
    check_start_method,
    check_timeout,
    ExtendsDDP,
    local_update_ddp_kwargs,
)
from lightning_gradcomp.lightning.fabric_exchange import FabricExchange
from lightning_gradcomp.local.config import check_local_updates, LocalUpdates
from lightning_gradcomp.local.fault_tolerance import FaultTolerance
from lightning_gradcomp.local.handle import LocalUpdateHandle
from lightning_gradcomp.wiring.plan import check_fault_tolerance, check_global_device_option


#: Options of :class:`~lightning_gradcomp.GradCompStrategy` that Fabric's strategy does not take.
TRAINER_ONLY_OPTIONS = ("hierarchy", "log_stats", "print_summary")


class GradCompFabricStrategy(FabricExchange, ExtendsDDP, DDPStrategy):
    """Fabric's DDP with the compressed exchange of :class:`~lightning_gradcomp.GradCompStrategy`.

    Args:
        compressor, error_feedback, min_compress_numel, seed, exchange_thread, timeout, local_updates, fault_tolerance:
            as for :class:`~lightning_gradcomp.GradCompStrategy` (with local updates, the
            synchronisation runs inside ``optimizer.step()`` every ``H`` steps, and ``fabric.save`` holds every
            rank's parameters and optimizer state, so a resume inside a window continues bit for bit; with
            ``fault_tolerance`` this Fabric is one replica group (several devices: DDP inside it): loop while
            ``fabric.strategy.gradcomp.optimizer_steps`` is below the run's length, since a group that joins a
            running job continues from the others' step).
        global_device: with ``local_updates``, where ``θ_global`` and the outer state live: ``None`` (the
            parameters' device) or ``"cpu"`` (pinned host memory), as for the Trainer's strategy.
        telemetry: also measure the compression error ``Σ‖p − C(p)‖²`` and the time spent compressing (one
            host read per step), in :meth:`metrics` and the summary.
        **kwargs: passed to ``DistributedDataParallel`` (``bucket_cap_mb``, ``static_graph``...).

    One model per strategy is compressed (the first ``fabric.setup``/``setup_module``); its compression
    state goes into ``fabric.save`` under ``"gradcomp"`` (every rank's residuals, gathered on rank 0) and
    comes back with ``fabric.load(path, state)``, whether ``load`` is called before or after ``setup``.
    """

    strategy_name = "gradcomp"

    def __init__(
        self,
        compressor: Union[Compressor, str] = "topk",
        error_feedback: Optional[bool] = None,
        min_compress_numel: int = 1024,
        seed: int = 0,
        exchange_thread: Optional[bool] = None,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[Union[timedelta, float]] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        local_updates: Optional[Union[LocalUpdates, int]] = None,
        fault_tolerance: Optional[FaultTolerance] = None,
        global_device: Optional[Union[str, torch.device]] = None,
        telemetry: bool = False,
        **kwargs: Any,
    ) -> None:
        self.telemetry = check_bool(telemetry, "telemetry")
        self.options = ExchangeOptions(compressor, error_feedback, min_compress_numel, seed)
        self.exchange_thread = None if exchange_thread is None else check_bool(exchange_thread, "exchange_thread")
        trainer_only = sorted(set(kwargs) & set(TRAINER_ONLY_OPTIONS))
        if trainer_only:
            raise ValueError(
                f"GradCompFabricStrategy: {trainer_only} are options of the Trainer's GradCompStrategy only (the "
                "hierarchical exchange, logging and the end-of-fit summary); with Fabric, print "
                "fabric.strategy.summary() yourself. Allowed here: compressor, error_feedback, min_compress_numel, "
                "seed, exchange_thread, timeout, local_updates, fault_tolerance, global_device, telemetry and "
                "DistributedDataParallel's arguments")
        kwargs = check_ddp_kwargs(kwargs, "GradCompFabricStrategy")
        self.local_updates = check_local_updates(local_updates)
        if self.local_updates is not None:
            kwargs = local_update_ddp_kwargs(kwargs, "none", exchange_thread)
        self.fault_tolerance = check_fault_tolerance(fault_tolerance, self.local_updates)
        self.global_device = check_global_device_option(global_device, self.local_updates)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=check_process_group_backend(process_group_backend),
            timeout=check_timeout(timeout),
            start_method=check_start_method(start_method),
            **kwargs,
        )

    # ------------------------------------------------------------------ setup
    @override
    def setup_module(self, module: Module) -> DistributedDataParallel:
        if self.gradcomp is not None:
            raise ValueError("GradCompFabricStrategy compresses the gradients of one model; a second model was "
                             "set up (allowed: one fabric.setup(model, ...) per Fabric)")
        ddp = super().setup_module(module)
        self._attach_exchange(module, "GradCompFabricStrategy", self.exchange_thread, ddp=ddp)
        return ddp

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if self.local_updates is None:
            error_feedback = resolve_error_feedback(self.compressor, self.options.error_feedback)
            # the model's names where it was set up first (else the handle binds at the optimizer's first step)
            check_fit_setup(self.compressor, error_feedback, [optimizer], self.precision,
                            names=getattr(self.gradcomp, "param_names", None))
        elif isinstance(self.gradcomp, LocalUpdateHandle):
            self.gradcomp.optimizers.append(optimizer)  # its per-rank state goes into fabric.save
        else:
            raise ValueError("GradCompFabricStrategy(local_updates=...): set the model up before (or with) its "
                             "optimizer: fabric.setup(model, optimizer)")
        return super().setup_optimizer(optimizer)


GradCompFabricStrategy.register_strategies(STRATEGY_REGISTRY)
