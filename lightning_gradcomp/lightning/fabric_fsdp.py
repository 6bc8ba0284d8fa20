"""``GradCompFabricFSDPStrategy``: compressed HSDP for Fabric, registered as ``"gradcomp_fsdp"``, the Fabric
twin of the Trainer's :class:`~lightning_gradcomp.lightning.fsdp_strategy.GradCompFSDPStrategy`; see
docs/sharded.md."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Iterable, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ModelParallelStrategy, ParallelStrategy, STRATEGY_REGISTRY
from lightning.fabric.utilities.init import _materialize_distributed_module
from torch import nn
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.core.checks import check_bool
from lightning_gradcomp.exchange.options import ExchangeOptions
from lightning_gradcomp.lightning.sharding import (
    ALLOWED_OPTIONS,
    check_auto_wrap_policy,
    check_fully_shard_options,
    check_shard_size,
    refuse_fsdp1,
    refuse_options,
    replicas_exchanging,
    shard_by_policy,
    ShardsInReplicas,
    UNREADABLE_CHECKPOINT,
)
from lightning_gradcomp.wiring.plan import check_fault_tolerance, check_global_device_option
from lightning_gradcomp.lightning.options import check_fit_setup, check_process_group_backend, check_timeout
from lightning_gradcomp.lightning.fabric_exchange import FabricExchange
from lightning_gradcomp.local.config import check_local_updates, LocalUpdates
from lightning_gradcomp.local.fault_tolerance import FaultTolerance
from lightning_gradcomp.local.handle import LocalUpdateHandle

#: The Fabric strategy's own options beyond the Trainer's sharded strategy's.
FABRIC_OPTIONS = ("parallelize_fn", "telemetry")


class GradCompFabricFSDPStrategy(FabricExchange, ShardsInReplicas, ModelParallelStrategy):
    """Fabric's FSDP2 inside each replica, the compressed exchange between replicas.

    Args:
        compressor, error_feedback, min_compress_numel, seed, local_updates, global_device, fault_tolerance: as
            for the Trainer's :class:`~lightning_gradcomp.lightning.fsdp_strategy.GradCompFSDPStrategy`.
        shard_size, auto_wrap_policy, mp_policy, reshard_after_forward, save_distributed_checkpoint, timeout:
            as for the Trainer's :class:`~lightning_gradcomp.lightning.fsdp_strategy.GradCompFSDPStrategy`.
        process_group_backend: as for the Trainer's
            :class:`~lightning_gradcomp.lightning.fsdp_strategy.GradCompFSDPStrategy`.
        parallelize_fn: ``fn(model, mesh) -> model`` that shards the model itself (``fully_shard(block,
            mesh=mesh["shard"])`` for its blocks, then the model), in place of ``auto_wrap_policy``. With
            neither, the model is sharded as one module (``fully_shard(model)``).
        telemetry: also measure the compression error and the time spent compressing, in :meth:`metrics`
            and the summary.

    One model at a time (``fabric.setup_module``; another after ``fabric.strategy.gradcomp.close()``); build
    its optimizers after it, on its sharded parameters. With ``local_updates`` the synchronisation runs inside ``optimizer.step()`` of the
    first optimizer set up, every ``H`` steps; evaluate ``θ_global`` inside
    ``with fabric.strategy.gradcomp.global_weights():``.
    """

    strategy_name = "gradcomp_fsdp"

    def __init__(
        self,
        compressor: Union[Compressor, str] = "topk",
        error_feedback: Optional[bool] = None,
        min_compress_numel: int = 1024,
        seed: int = 0,
        local_updates: Optional[Union[LocalUpdates, int]] = None,
        global_device: Optional[Union[str, torch.device]] = None,
        fault_tolerance: Optional[FaultTolerance] = None,
        shard_size: Optional[int] = None,
        auto_wrap_policy: Optional[Iterable[Union[type[nn.Module], str]]] = None,
        parallelize_fn: Optional[Callable[[nn.Module, Any], nn.Module]] = None,
        mp_policy: Optional[Any] = None,
        reshard_after_forward: Optional[Union[bool, int]] = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[Union[timedelta, float]] = default_pg_timeout,
        telemetry: bool = False,
        **kwargs: Any,
    ) -> None:
        refuse_options(kwargs, "GradCompFabricFSDPStrategy", ALLOWED_OPTIONS + FABRIC_OPTIONS)
        self.telemetry = check_bool(telemetry, "telemetry")
        self.options = ExchangeOptions(compressor, error_feedback, min_compress_numel, seed)
        self.local_updates = check_local_updates(local_updates)
        self.global_device = check_global_device_option(global_device, self.local_updates)
        self.fault_tolerance = check_fault_tolerance(fault_tolerance, self.local_updates)
        self.shard_size = check_shard_size(shard_size)
        self.auto_wrap_policy = check_auto_wrap_policy(auto_wrap_policy)
        if parallelize_fn is not None and (self.auto_wrap_policy is not None or not callable(parallelize_fn)):
            raise ValueError("`parallelize_fn` must be a callable fn(model, mesh) -> model that shards the model "
                             "over mesh['shard'], and is given instead of auto_wrap_policy; allowed: one of the two")
        # fully_shard's options apply to the modules the strategy shards (the policy's, or the model alone)
        sharded_here = self.auto_wrap_policy if parallelize_fn is not None else (self.auto_wrap_policy or ())
        self.fully_shard_kwargs = check_fully_shard_options(sharded_here, mp_policy, reshard_after_forward)
        super().__init__(
            parallelize_fn=parallelize_fn or self._shard_by_policy,
            save_distributed_checkpoint=check_bool(save_distributed_checkpoint, "save_distributed_checkpoint"),
            process_group_backend=check_process_group_backend(process_group_backend),
            timeout=check_timeout(timeout),
        )

    @property
    def compression_workers(self) -> int:
        """The processes that exchange one shard compressed: the replicas (under fault tolerance: the replica
        groups of the last quorum)."""
        return replicas_exchanging(self.gradcomp, self.device_mesh)

    @override
    def setup_environment(self) -> None:
        """Start the processes' group and build the ``("replicate", "shard")`` mesh."""
        ParallelStrategy.setup_environment(self)
        self._setup_mesh("GradCompFabricFSDPStrategy")

    # ------------------------------------------------------------------ setup
    def _shard_by_policy(self, module: nn.Module, mesh: Any) -> nn.Module:
        """Every instance of ``auto_wrap_policy``'s classes, then the model (without a policy: the model alone,
        one parameter group, as Lightning's FSDP strategies do; a policy overlaps communication better)."""
        shard_by_policy(module, self.auto_wrap_policy or (), mesh["shard"], self.fully_shard_kwargs)
        return module

    @override
    def setup_module(self, module: Module) -> Module:
        """Shard ``module`` (``auto_wrap_policy`` or ``parallelize_fn``) and attach the exchange between the
        replicas."""
        if self.gradcomp is not None and not self.gradcomp.closed:
            raise ValueError("GradCompFabricFSDPStrategy compresses the gradients of one model at a time; a second "
                             "model was set up while the first one's exchange is open (allowed: "
                             "fabric.strategy.gradcomp.close() first)")
        refuse_fsdp1(module)
        module = self._parallelize_fn(module, self.device_mesh)
        if not isinstance(module, Module):
            raise TypeError(f"`parallelize_fn` must return the nn.Module it sharded, got {type(module).__name__}")
        _materialize_distributed_module(module, self.root_device)
        self._attach_exchange(module, "GradCompFabricFSDPStrategy", mesh=self.device_mesh)
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Check the optimizer against the compressor and bind it (every step), or count its steps (local
        updates: the first one set up counts the window)."""
        if self.gradcomp is None:
            raise ValueError("GradCompFabricFSDPStrategy: set the model up first, then build its optimizer on the "
                             "sharded parameters: model = fabric.setup_module(model); optimizer = "
                             "fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))")
        if isinstance(self.gradcomp, LocalUpdateHandle):
            self.gradcomp.optimizers.append(optimizer)  # its per-rank state goes into fabric.save
        else:
            check_fit_setup(self.compressor, self.gradcomp.hook_state.error_feedback, [optimizer], self.precision,
                            names=self.gradcomp.param_names)
            self.gradcomp.bind(optimizer)
        return super().setup_optimizer(optimizer)

    def _load_from_fabric(self, path: Any, state: Optional[Any], strict: bool,
                          weights_only: Optional[bool]) -> dict[str, Any]:
        try:
            return super()._load_from_fabric(path, state, strict, weights_only)
        except IndexError as error:
            raise RuntimeError(UNREADABLE_CHECKPOINT.format(path=path)) from error


GradCompFabricFSDPStrategy.register_strategies(STRATEGY_REGISTRY)
