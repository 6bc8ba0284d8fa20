"""One wiring for every entry point: what the entry point asks for (:class:`ExchangePlan`) and how the
model is laid out select one of six rows, each built by its adapter. The Trainer's, Fabric's and the sharded
strategies and the plain functions (:func:`~lightning_gradcomp.register`,
:func:`~lightning_gradcomp.register_fsdp`, :func:`~lightning_gradcomp.local_updates`) all call
:func:`attach_exchange`.

=====================  ====================  =========================  ==================================
model                  every step            local updates              local updates under torchft
=====================  ====================  =========================  ==================================
replicated (DDP)       ``ddp.attach_ddp``    ``local.attach``           ``local.attach_fault_tolerant``
sharded (FSDP2 mesh)   ``fsdp.attach_fsdp``  ``local.attach_sharded``   ``local.attach_fault_tolerant_sharded``
=====================  ====================  =========================  ==================================

What every row shares is done here, once: one exchange per model at a time (refused while another is open),
the telemetry switch, the checkpoint gather's group and timeout, and counting the first inner optimizer's
steps. Each row returns an :class:`~lightning_gradcomp.exchange.handle.ExchangeHandle`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from lightning_gradcomp.core.checks import check_bool
from lightning_gradcomp.core.fsdp2 import sharded_modules
from lightning_gradcomp.ddp.handle import attach_ddp, check_ddp_model
from lightning_gradcomp.ddp.hook import no_communication_hook
from lightning_gradcomp.exchange.checkpoint import check_checkpoint_timeout, checkpoint_group, DEFAULT_CHECKPOINT_TIMEOUT
from lightning_gradcomp.exchange.handle import ExchangeHandle, hold, refuse_a_second_exchange
from lightning_gradcomp.exchange.options import ExchangeOptions
from lightning_gradcomp.fsdp.handle import attach_fsdp
from lightning_gradcomp.local.config import LocalUpdates
from lightning_gradcomp.local.fault_tolerance import FaultTolerance, torchft_module
from lightning_gradcomp.local.handle import (
    attach,
    attach_fault_tolerant,
    check_global_device,
    LocalUpdateHandle,
    refuse_driving_by_ddp,
    start_replicas_equal,
)
from lightning_gradcomp.local.sharded import attach_fault_tolerant_sharded, attach_sharded


@dataclass(frozen=True)
class ExchangePlan:
    """What an entry point asks of the exchange, checked when it is made (before any process starts).

    Attributes:
        options: how the gradients (or outer gradients) are compressed.
        local_updates: ``None``: an exchange every step; else the schedule of local updates.
        fault_tolerance: the local updates' synchronisations through torchft (this job is one replica group).
        global_device: where ``θ_global`` lives under local updates (``None``: the parameters' device; ``"cpu"``).
        exchange_thread: the exchange of every step on a thread of its own (``None``: the session decides).
        telemetry: also measure the compression error and time.
        timeout: how long a handle's ``state_dict()`` (a collective) waits for the other ranks.
        caller: the entry point, for messages and the ranks' agreement.
        checked_by_caller: the entry point checks the optimizers at the start, shows ``θ_global`` to evaluation
            and writes each rank's checkpoint part itself (the Trainer's DDP strategy): no optimizer watch, no
            evaluation hook, no gather group for the handle's ``state_dict()``.
    """

    options: ExchangeOptions = field(default_factory=ExchangeOptions)
    local_updates: Optional[LocalUpdates] = None
    fault_tolerance: Optional[FaultTolerance] = None
    global_device: Optional[Union[str, torch.device]] = None
    exchange_thread: Optional[bool] = None
    telemetry: bool = False
    timeout: Union[timedelta, float] = DEFAULT_CHECKPOINT_TIMEOUT
    caller: str = "register()"
    checked_by_caller: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.options, ExchangeOptions):
            raise ValueError(f"`options` must be a lightning_gradcomp.ExchangeOptions, got {self.options!r}")
        if self.local_updates is not None and not isinstance(self.local_updates, LocalUpdates):
            raise ValueError(f"`local_updates` must be None or a LocalUpdates(...), got {self.local_updates!r}")
        check_fault_tolerance(self.fault_tolerance, self.local_updates)
        object.__setattr__(self, "global_device", check_global_device_option(self.global_device, self.local_updates))
        if self.exchange_thread is not None:
            check_bool(self.exchange_thread, "exchange_thread")
        object.__setattr__(self, "telemetry", check_bool(self.telemetry, "telemetry"))
        object.__setattr__(self, "timeout", check_checkpoint_timeout(self.timeout))


def check_fault_tolerance(value: Any, local_updates: Optional[LocalUpdates]) -> Optional[FaultTolerance]:
    """``None``, or a :class:`FaultTolerance` with ``local_updates`` (torchft installed)."""
    if value is None:
        return None
    if not isinstance(value, FaultTolerance):
        raise ValueError(f"`fault_tolerance` must be None or a lightning_gradcomp.FaultTolerance(...), got {value!r}")
    if local_updates is None:
        raise ValueError("`fault_tolerance` runs the synchronisations of local updates through torchft; allowed "
                         "without local_updates: fault_tolerance=None")
    torchft_module()
    return value


def check_global_device_option(global_device: Any, local_updates: Any) -> Optional[torch.device]:
    """``global_device``: where θ_global lives under local updates (``None`` or ``"cpu"``); refused without
    ``local_updates``, where there is no θ_global."""
    if global_device is not None and local_updates is None:
        raise ValueError("`global_device` places θ_global under local updates; allowed without local_updates: "
                         "global_device=None (or set local_updates=H)")
    return check_global_device(global_device)


def attach_exchange(model: Optional[torch.nn.Module], plan: ExchangePlan, *,
                    ddp: Optional[torch.nn.parallel.DistributedDataParallel] = None, mesh: Optional[Any] = None,
                    group: Optional[dist.ProcessGroup] = None, optimizers: Sequence[Optimizer] = (),
                    node_groups: Optional[tuple[Any, Any]] = None) -> ExchangeHandle:
    """The compressed exchange of ``model`` on this rank, as ``plan`` asks (the row of the module's table).

    Args:
        model: the model the loop trains (its parameter names key the exchange); ``None``: ``ddp.module``.
        plan: what the entry point asks for.
        ddp: the ``DistributedDataParallel`` wrapper a strategy (or the user, for :func:`register`) made: its
            hook carries the exchange of every step; under local updates its replicas are already equal and
            its gradient all-reduce is switched off (kept inside a fault-tolerant group of several processes).
        mesh: a sharded model's ``("replicate", "shard")`` mesh (not under fault tolerance, where this job's
            world is one replica group).
        group: a bare replicated model's group under local updates (default: the world).
        optimizers: the inner optimizers of local updates, the first one's steps counting the window (a
            strategy that counts the steps itself passes none and sets ``handle.optimizers``).
        node_groups: the hierarchical DDP hook's (intra-node, cross-node) groups.
    """
    if model is None:
        model = check_ddp_model(ddp).module
    # a fault-tolerant group of several processes may pass its own DDP wrapper of the model
    bare = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    refuse_a_second_exchange(bare, plan.caller)
    handle, checkpoint_ranks = _row(model, plan, ddp, mesh, group, node_groups,
                                    sharded=mesh is not None or bool(sharded_modules(bare)))
    handle.hook_state.telemetry = plan.telemetry
    if not plan.checked_by_caller:
        handle.checkpoint_group = checkpoint_group(checkpoint_ranks, plan.timeout)
    if optimizers:
        assert isinstance(handle, LocalUpdateHandle)
        handle.optimizers = list(optimizers)
        handle.count_optimizer_steps(optimizers[0])
    hold(bare, handle, plan.caller)
    return handle


def _row(model: torch.nn.Module, plan: ExchangePlan, ddp: Optional[torch.nn.parallel.DistributedDataParallel],
         mesh: Optional[Any], group: Optional[dist.ProcessGroup], node_groups: Optional[tuple[Any, Any]],
         sharded: bool) -> tuple[ExchangeHandle, Optional[dist.ProcessGroup]]:
    """The row's handle, built by its adapter (a strategy's DDP wrapper is checked for the hook of every step;
    under local updates it only gets the hook that communicates nothing), and the ranks of its checkpoint gather (``None``: the world:
    sharded rows, the hierarchical hook and fault tolerance, where every rank holds a different part)."""
    config = plan.local_updates
    if config is None and sharded:
        return attach_fsdp(model, mesh, plan.options), None
    if config is None:  # the exchange of every step of a replicated model rides on its DDP wrapper
        handle = attach_ddp(check_ddp_model(ddp), model, plan.options, exchange_thread=plan.exchange_thread,
                            node_groups=node_groups, watch_optimizers=not plan.checked_by_caller, caller=plan.caller)
        return handle, None if node_groups is not None else ddp.process_group
    if plan.fault_tolerance is not None and sharded:
        return attach_fault_tolerant_sharded(model, config, plan.options, plan.fault_tolerance,
                                             global_device=plan.global_device), None
    if plan.fault_tolerance is not None:
        several = dist.get_world_size() > 1  # a replica group of several processes: DDP inside the group
        if ddp is None and not several:
            refuse_driving_by_ddp(model)
        handle = attach_fault_tolerant(model, config, plan.options, plan.fault_tolerance,
                                       global_device=plan.global_device, ddp_inside=ddp is None and several,
                                       follow_evaluation=not plan.checked_by_caller, caller=plan.caller)
        if ddp is not None and not several:
            ddp.register_comm_hook(None, no_communication_hook)
        return handle, None
    if sharded:
        return attach_sharded(model, mesh, config, plan.options, global_device=plan.global_device), None
    if ddp is None:
        start_replicas_equal(model, group, plan.caller)
    else:
        group = ddp.process_group
    handle = attach(model, config, plan.options, group=group, global_device=plan.global_device,
                    refuse_ddp=ddp is None, follow_evaluation=not plan.checked_by_caller, caller=plan.caller)
    if ddp is not None:
        ddp.register_comm_hook(None, no_communication_hook)
    return handle, group
