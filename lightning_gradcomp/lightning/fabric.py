"""``GradCompFabricStrategy``: compressed gradients for Lightning Fabric, registered as ``"gradcomp"``.

::

    fabric = Fabric(accelerator="cpu", devices=2, strategy="gradcomp")              # Top-k at 1%
    fabric = Fabric(devices=8, strategy=GradCompFabricStrategy(compressor=PowerSGD(rank=4)))
    model, optimizer = fabric.setup(model, optimizer)
    ...
    fabric.strategy.step_stats                    # this step's bytes, ratio, density
    fabric.save(path, {"model": model, "optimizer": optimizer})   # residuals saved under "gradcomp"
    fabric.load(path, {"model": model, "optimizer": optimizer})   # and restored

Fabric's own ``DDPStrategy`` has no way to pass a communication hook; this subclass wraps the model in
``DistributedDataParallel`` as Fabric does and registers the exchange through
:func:`~lightning_gradcomp.ddp.handle.register`, on CPU (gloo) and GPU (nccl) alike.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Literal, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.types import _PATH
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.core.checks import check_bool
from lightning_gradcomp.exchange.checkpoint import CHECKPOINT_KEY, checkpoint_group, DEFAULT_CHECKPOINT_TIMEOUT
from lightning_gradcomp.ddp.handle import GradCompHandle, register
from lightning_gradcomp.exchange.options import exchange_options
from lightning_gradcomp.exchange.pipeline import resolve_error_feedback
from lightning_gradcomp.lightning.options import (
    check_ddp_kwargs,
    check_fault_tolerance,
    check_global_device_option,
    group_sampler_kwargs,
    check_process_group_backend,
    check_start_method,
    check_timeout,
    FIND_UNUSED_VARIANT,
    local_update_ddp_kwargs,
    REGISTERED_VARIANTS,
)
from lightning_gradcomp.lightning.options import check_clipping_after_signs, check_fit_setup
from lightning_gradcomp.lightning.step_figures import ReportsFigures
from lightning_gradcomp.ddp.hook import exchange_failures, no_communication_hook
from lightning_gradcomp.local.config import check_local_updates, LocalUpdates
from lightning_gradcomp.local.fault_tolerance import FaultTolerance
from lightning_gradcomp.local.handle import attach, attach_fault_tolerant, LocalUpdateHandle
from lightning_gradcomp.metrics.netmodel import Network
from lightning_gradcomp.metrics.stats import StepStats


#: Options of :class:`~lightning_gradcomp.GradCompStrategy` that Fabric's strategy does not take.
TRAINER_ONLY_OPTIONS = ("hierarchy", "log_stats", "print_summary")


class GradCompFabricStrategy(ReportsFigures, DDPStrategy):
    """Fabric's DDP with the compressed exchange of :class:`~lightning_gradcomp.GradCompStrategy`.

    Args:
        compressor, error_feedback, min_compress_numel, seed, exchange_thread, timeout, local_updates,
            fault_tolerance: as for :class:`~lightning_gradcomp.GradCompStrategy` (with local updates, the
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
        self.options = exchange_options(compressor, error_feedback, min_compress_numel, seed)
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
        self.gradcomp: Optional[GradCompHandle] = None
        self._pending_entry: Optional[dict[str, Any]] = None

    @property
    def compressor(self) -> Compressor:
        return self.options.compressor

    @property
    def step_stats(self) -> StepStats:
        """The figures of the latest completed backward pass (empty before the model is set up)."""
        return self.gradcomp.step_stats if self.gradcomp is not None else StepStats()

    def summary(self, network: Optional[Network] = None) -> str:
        """The end-of-training table (:mod:`lightning_gradcomp.metrics.summary`), averaged over ranks; every rank
        must call it (print it on rank 0: ``fabric.print(fabric.strategy.summary())``)."""
        if self.gradcomp is None:
            raise RuntimeError("GradCompFabricStrategy.summary(): no model has been set up yet (fabric.setup)")
        return self.gradcomp.summary(network)

    # ------------------------------------------------------------------ registration
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``gradcomp`` and its ``_spawn``, ``_fork``, ``_notebook`` variants with Fabric."""
        for name, start_method in REGISTERED_VARIANTS:
            strategy_registry.register(
                name, cls, override=True, start_method=start_method,
                description=f"DDP with compressed gradients (lightning-gradcomp), start_method '{start_method}'",
            )
        strategy_registry.register(
            FIND_UNUSED_VARIANT, cls, override=True, find_unused_parameters=True,
            description="DDP with compressed gradients (lightning-gradcomp), find_unused_parameters=True",
        )

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """DDP's, with each replica group's own shuffling seed under fault tolerance (:func:`group_sampler_kwargs`)."""
        return group_sampler_kwargs(super().distributed_sampler_kwargs, self.fault_tolerance)

    @override
    def setup_environment(self) -> None:
        """Fabric's DDP setup; under fault tolerance, then one group name for every process
        (:meth:`FaultTolerance.for_group`: its samplers' seed and torchft's replica id)."""
        super().setup_environment()
        if self.fault_tolerance is not None:
            self.fault_tolerance = self.fault_tolerance.for_group()

    # ------------------------------------------------------------------ setup
    @override
    def setup_module(self, module: Module) -> DistributedDataParallel:
        if self.gradcomp is not None:
            raise ValueError("GradCompFabricStrategy compresses the gradients of one model; a second model was "
                             "set up (allowed: one fabric.setup(model, ...) per Fabric)")
        ddp = super().setup_module(module)
        options = self.options
        if self.fault_tolerance is not None:  # this Fabric is one replica group; the quorum is taken now
            self.gradcomp = attach_fault_tolerant(module, [], self.local_updates, options.compressor,
                                                  self.fault_tolerance, error_feedback=options.error_feedback,
                                                  min_compress_numel=options.min_compress_numel, seed=options.seed,
                                                  global_device=self.global_device)
            if self.world_size == 1:  # else DDP's own all-reduce keeps the group's processes equal
                ddp.register_comm_hook(None, no_communication_hook)
        elif self.local_updates is not None:
            self.gradcomp = attach(module, [], self.local_updates, options.compressor, options.error_feedback,
                                   options.min_compress_numel, options.seed, group=ddp.process_group,
                                   global_device=self.global_device)
            # fabric.save on some ranks only: CheckpointTimeout after this, not the process group's timeout
            self.gradcomp.checkpoint_group = checkpoint_group(ddp.process_group, DEFAULT_CHECKPOINT_TIMEOUT)
            ddp.register_comm_hook(None, no_communication_hook)
        else:
            self.gradcomp = register(ddp, options.compressor, error_feedback=options.error_feedback,
                                     min_compress_numel=options.min_compress_numel, seed=options.seed,
                                     exchange_thread=self.exchange_thread)
        self.gradcomp.hook_state.telemetry = self.telemetry
        if isinstance(self.gradcomp, LocalUpdateHandle):
            self.gradcomp.counted_by_strategy = "GradCompFabricStrategy(local_updates=...)"
        if self._pending_entry is not None:
            entry, self._pending_entry = self._pending_entry, None
            self.gradcomp.load_state_dict(entry)
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

    @override
    def clip_gradients_norm(self, module: Module, optimizer: Optimizer, max_norm: Union[float, int],
                            norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        """Fabric's clipping, refused after a compressor that hands the optimizer signs (DeMo)."""
        if self.local_updates is None:
            check_clipping_after_signs(self.compressor, f"fabric.clip_gradients(max_norm={max_norm!r})",
                                       "no fabric.clip_gradients")
        return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)

    @override
    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: Union[float, int]) -> None:
        """Fabric's clipping by value, refused after a compressor that hands the optimizer signs."""
        if self.local_updates is None:
            check_clipping_after_signs(self.compressor, f"fabric.clip_gradients(clip_val={clip_val!r})",
                                       "no fabric.clip_gradients")
        return super().clip_gradients_value(module, optimizer, clip_val)

    @override
    def backward(self, tensor: torch.Tensor, module: Optional[Module], *args: Any, **kwargs: Any) -> None:
        """Fabric's backward; an exchange that failed (a dead peer) raises its
        :class:`~lightning_gradcomp.CollectiveError`, not DDP's ``RuntimeError`` wrapping it."""
        with exchange_failures(self.gradcomp.hook_state if self.gradcomp is not None else None):
            super().backward(tensor, module, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The inner step; with local updates every ``H``-th one is followed by the outer synchronisation."""
        output = super().optimizer_step(optimizer, **kwargs)
        if isinstance(self.gradcomp, LocalUpdateHandle):
            self.gradcomp.step_for_the_strategy()
        return output

    @override
    def teardown(self) -> None:
        if self.gradcomp is not None:
            self.gradcomp.close()
        super().teardown()

    # ------------------------------------------------------------------ checkpointing
    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Union[Module, Optimizer, Any]],
        storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        """Fabric's checkpoint, plus every rank's compression state under ``"gradcomp"``; with local updates
        the model's ``state_dict`` is ``θ_global``'s (each rank's replica travels in the entry)."""
        if self.gradcomp is not None:
            if CHECKPOINT_KEY in state:
                raise ValueError(f"fabric.save: the key {CHECKPOINT_KEY!r} holds the compression state; "
                                 "allowed: any other name for your own entries")
            entry = self.gradcomp.state_dict()  # a collective: every rank takes part
            if entry is not None:
                state = {**state, CHECKPOINT_KEY: entry}
        if isinstance(self.gradcomp, LocalUpdateHandle):
            with self.gradcomp.global_weights():  # the model's state_dict is θ_global's; replicas in the entry
                super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)
            return
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: Optional[Union[Module, Optimizer, dict[str, Union[Module, Optimizer, Any]]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """Fabric's load; with a ``state`` dict, the compression state is restored too (now, or when the
        model is set up) and left out of the returned remainder."""
        remainder = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        if isinstance(state, dict) and state:
            entry = remainder.pop(CHECKPOINT_KEY, None)
            if entry is not None and self.gradcomp is not None:
                self.gradcomp.load_state_dict(entry)
            elif entry is not None:
                self._pending_entry = entry
        return remainder


GradCompFabricStrategy.register_strategies(STRATEGY_REGISTRY)
