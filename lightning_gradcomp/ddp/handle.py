"""The DDP adapter's handle: compressed gradients on a ``DistributedDataParallel`` model (its row of the
wiring, :func:`attach_ddp`; the public entry point is :func:`lightning_gradcomp.register`). The hook, the
exchange engine and the checkpoint format are those of the Lightning strategies; what the strategies check
before the first step, the handle checks as the loop runs (the optimizer, an fp16 ``GradScaler``: see
:class:`~lightning_gradcomp.exchange.handle.OptimizerWatch`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist
from torch import nn
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp.ddp.hierarchy import HierarchicalHookState
from lightning_gradcomp.ddp.hook import GradCompHookState, gradcomp_hook
from lightning_gradcomp.exchange.handle import GradientHandle, OptimizerWatch
from lightning_gradcomp.exchange.options import ExchangeOptions


class GradCompHandle(GradientHandle):
    """What :func:`register` returns: the compressed exchange of one DDP model on this rank (see
    :class:`~lightning_gradcomp.exchange.handle.ExchangeHandle` for the figures, summary and checkpoint).

    Attributes:
        hook_state: the :class:`~lightning_gradcomp.ddp.hook.GradCompHookState` (configuration, memory,
            accounting).
        compressor: the compressor the exchange was configured with.
    """

    def exchange_bucket(self, bucket: dist.GradBucket) -> Future:
        """Called by DDP through :func:`~lightning_gradcomp.ddp.hook.gradcomp_hook` for every bucket (the
        first bucket of a step closes the figures of the step before, without waiting for the device).
        The first bucket a compressor exchanges warns when it reads an optimizer and none is bound."""
        self._check_bound()
        return self.hook_state.exchange_bucket(bucket)


def attach_ddp(ddp_model: DistributedDataParallel, model: nn.Module, options: ExchangeOptions, *,
               exchange_thread: Optional[bool] = None, node_groups: Optional[tuple[Any, Any]] = None,
               watch_optimizers: bool = True, caller: str = "register()") -> GradCompHandle:
    """The compressed exchange of every step on a ``DistributedDataParallel`` model (the row of
    :func:`~lightning_gradcomp.wiring.attach_exchange` that :func:`~lightning_gradcomp.register` and the DDP
    strategies take): its communication hook is the returned handle.

    ``model``: the module whose parameter names key the exchange (``ddp_model.module``, or the Trainer's
    LightningModule, which Lightning wraps once more); ``node_groups``: the (intra-node, cross-node) groups of
    the hierarchical hook (:mod:`~lightning_gradcomp.ddp.hierarchy`), ``None`` for the flat one;
    ``watch_optimizers``: check and bind the optimizer that first steps the model
    (:class:`~lightning_gradcomp.exchange.handle.OptimizerWatch`; not where the caller checks them itself)."""
    names = {id(p): name for name, p in model.named_parameters()}
    device = next(model.parameters()).device
    hook_state: GradCompHookState
    if node_groups is not None:
        hook_state = HierarchicalHookState(param_names=names, intra_group=node_groups[0], cross_group=node_groups[1],
                                           exchange_thread=exchange_thread, caller=caller, **options.keywords())
    else:
        hook_state = GradCompHookState(param_names=names, group=ddp_model.process_group, exchange_thread=exchange_thread,
                                       device=device, caller=caller, **options.keywords())
    handle = GradCompHandle(hook_state, hook_state.compressor, device)
    handle.param_names = names  # the exchange's names: bind() finds each parameter's group by them
    if watch_optimizers:
        handle._watch = OptimizerWatch(handle, model)
    ddp_model.register_comm_hook(handle, gradcomp_hook)
    return handle


def check_ddp_model(ddp_model: Any) -> DistributedDataParallel:
    """``ddp_model`` as a ``DistributedDataParallel`` that can take the compressed hook: not a sharded model,
    no hook of its own yet, not compiled autograd's Python reducer."""
    if _is_sharded(ddp_model):
        raise ValueError(
            f"gradcomp: register() compresses the buckets of a DistributedDataParallel model; got a sharded model "
            f"({type(ddp_model).__name__}: fully_shard / FullyShardedDataParallel), whose gradients FSDP reduce-scatters "
            "itself. To compress what FSDP2 replicas exchange (HSDP), shard with fully_shard(module, mesh=mesh['shard']) "
            "of a ('replicate', 'shard') mesh and call lightning_gradcomp.register_fsdp(model, mesh, compressor); "
            "register() takes a model replicated on every rank, wrapped in torch.nn.parallel.DistributedDataParallel")
    if not isinstance(ddp_model, DistributedDataParallel):
        raise ValueError(f"`ddp_model` must be a torch.nn.parallel.DistributedDataParallel, got "
                         f"{type(ddp_model).__name__}; wrap the model first: DistributedDataParallel(model)")
    if getattr(ddp_model, "_comm_hooks", None):
        raise ValueError(
            "gradcomp: this DistributedDataParallel model already has a communication hook (an earlier register() "
            "or register_comm_hook), and DDP accepts one per model and keeps it for the wrapper's life (close() "
            "does not remove it). To change the compression between steps, call use_compressor(...) on the open "
            "handle the first register() returned; for a new exchange, wrap the module again: "
            "register(DistributedDataParallel(ddp_model.module), ...)")
    check_reducer(ddp_model)
    return ddp_model


def _is_sharded(model: Any) -> bool:
    """Whether ``model`` is sharded by FSDP (FSDP2's ``fully_shard`` or FSDP1's wrapper)."""
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without FSDP2's public names
        return type(model).__name__.startswith("FSDP") or "FullyShardedDataParallel" in type(model).__name__
    return isinstance(model, (FSDPModule, FullyShardedDataParallel))


def check_reducer(ddp_model: DistributedDataParallel) -> None:
    """Refuse compiled autograd's Python reducer (``torch._dynamo.config.optimize_ddp="python_reducer"``):
    it calls communication hooks with one ``(gradient, parameter)`` pair at a time and ignores their
    result, so no compressed bucket exchange can run."""
    if getattr(ddp_model, "_use_python_reducer", False):
        raise ValueError(
            "gradcomp: torch._dynamo.config.optimize_ddp='python_reducer' (compiled autograd's Python reducer) calls "
            "communication hooks per parameter and ignores their result; allowed: optimize_ddp='ddp_optimizer' (the "
            "default) or True/False, set before the model is wrapped in DistributedDataParallel"
        )
