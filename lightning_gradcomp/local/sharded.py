"""Local updates (DiLoCo, SparseLoCo's schedule, Streaming DiLoCo) on an FSDP2-sharded model: its loop, handle and
builders (the sharded rows of :func:`~lightning_gradcomp.wiring.attach_exchange`).

A replica is one ``"shard"`` group of the mesh: FSDP2's reduce-scatters and all-gathers run inside it every
step, and nothing crosses between replicas until a synchronisation. There each rank's outer gradient of
its *local shard*, ``Δ = θ_global − θ`` (DiLoCo, Douillard et al. 2023, Algorithm 1, applied shard by
shard: every operation of the outer step is elementwise or per tensor, and the ranks of one shard in the
replicas hold the same row block of each parameter), goes through the exchange engine over
``mesh["replicate"]`` with any compressor (shape-aware ones on the local row blocks, as for
:func:`~lightning_gradcomp.register_fsdp`), and the outer optimizer steps this rank's shard of
``θ_global``. ``θ_global``, the outer optimizer's state, the residuals and the compressor state are per
shard: no rank holds a whole copy of the model, on the accelerator or (``global_device="cpu"``) in host
memory. Torchft's ``DiLoCo`` has the same shape (outer gradients of the local tensor of each DTensor,
exchanged across the replica group).

The schedule, the fragments (any grouping of parameters: each rank exchanges its shards of the fragment's
parameters; FSDP modules, or groups of them, are natural ones), ``delay``, ``alpha``, ``overlap``, the
checkpoint and ``sync()``/``global_weights()`` are those of the replicated loop
(:mod:`lightning_gradcomp.local`): this module supplies the local shards and FSDP2's checks.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from lightning_gradcomp.core.fsdp2 import (check_every_parameter_sharded, check_group, check_mesh, fsdp_modules, local_shard,
                                           shard_layout, sharded_modules)
from lightning_gradcomp.exchange.options import ExchangeOptions
from lightning_gradcomp.exchange.session import ExchangeSession
from lightning_gradcomp.exchange.drivers import CollectiveError, world_collective_device
from lightning_gradcomp.local.config import LocalUpdates
from lightning_gradcomp.local.fault_tolerance import FaultTolerance
from lightning_gradcomp.local.global_model import CopiedIn
from lightning_gradcomp.local.handle import (attach_fault_tolerant, broadcast_from_first_rank, FaultTolerantHandle,
                                             LocalUpdateHandle)
from lightning_gradcomp.local.loop import LocalUpdateLoop, WholeModel
from lightning_gradcomp.local.outer import cpu_copy, LOCAL_SHARD_KEY


class ShownOnShards(CopiedIn):
    """:class:`~lightning_gradcomp.local.global_model.CopiedIn` on FSDP2's shards, the FSDP modules resharded
    after the values are copied in and after they are restored: a module keeps its all-gathered (unsharded)
    parameters between forward passes where it does not reshard after forward (the root, by default, and any
    forward pass without a backward), and the next pass would use those instead of what the shards hold."""

    def __init__(self, tensors: Sequence[Tensor], values: Sequence[Optional[Tensor]], modules: Sequence[Any]) -> None:
        self.modules = list(modules)
        super().__init__(tensors, values)
        self._reshard()

    def restore(self) -> None:
        super().restore()
        self._reshard()

    def _reshard(self) -> None:
        for module in self.modules:
            module.reshard()


class ShardsOfModel(WholeModel):
    """The layout of an FSDP2 model each rank of a replica holds a shard of (see :class:`WholeModel`).

    The parameters are FSDP2's sharded parameters (DTensors); the loop works on their local tensors, read
    afresh each time (FSDP2 may re-point them at new storage at its lazy initialisation), so ``θ_global``,
    ``Δ`` and the merges have the local shard's shape. ``θ_global`` is shown in the module by copying
    (:class:`ShownOnShards`): FSDP2's all-gathers read its own storage. The outer step's verdict and norm are
    summed over the replica's shards, and the inner optimizers' states travel as their local shards.

    Args:
        module: the sharded model.
        shard_group: the replica's processes (default: the world, a fault-tolerant replica group's job).
    """

    def __init__(self, module: torch.nn.Module, shard_group: Optional[dist.ProcessGroup] = None) -> None:
        self.module = module
        self.shard_group = shard_group

    def tensors(self, parameters: list[Tensor]) -> list[Tensor]:
        return [local_shard(p) for p in parameters]

    def show(self, tensors: list[Tensor], values: list[Optional[Tensor]]) -> CopiedIn:
        return ShownOnShards(tensors, values, sharded_modules(self.module))

    def ranks_per_replica(self) -> int:
        return dist.get_world_size(self.shard_group)

    def sum_within_replica(self, tensor: Tensor) -> None:
        self.sum_over_shards(tensor)

    def sum_over_shards(self, tensor: Tensor) -> None:  # type: ignore[override]
        """Sum ``tensor`` over the replica's shards; a peer that died raises
        :class:`~lightning_gradcomp.exchange.drivers.CollectiveError`."""
        try:
            dist.all_reduce(tensor, group=self.shard_group)
        except Exception as error:
            raise CollectiveError(
                f"gradcomp: all_reduce of the outer step's verdict over the replica's shards failed on rank "
                f"{dist.get_rank(self.shard_group)} of {dist.get_world_size(self.shard_group)}: {error}") from error

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """``optimizer.state_dict()`` with every tensor copied to the CPU, a DTensor as its local shard
        (``{"local_shard": tensor}``): this rank's part, loadable with plain ``torch.load``."""
        return cpu_copy(optimizer.state_dict(), local_shards=True)

    def load_optimizer_state(self, optimizer: Optimizer, state: dict[str, Any]) -> None:
        load_sharded_optimizer_state(optimizer, state)


class ShardedLocalUpdateLoop(LocalUpdateLoop):
    """:class:`~lightning_gradcomp.local.loop.LocalUpdateLoop` over this rank's local shards of an FSDP2 model
    (the loop with the :class:`ShardsOfModel` layout)."""

    def __init__(self, module: torch.nn.Module, config: LocalUpdates, exchange: ExchangeSession,
                 shard_group: Optional[dist.ProcessGroup] = None,
                 global_device: Optional[Union[str, torch.device]] = None) -> None:
        super().__init__(module, config, exchange, global_device=global_device,
                         layout=ShardsOfModel(module, shard_group))


class ShardedLocalUpdateHandle(LocalUpdateHandle):
    """What :func:`local_updates` returns for an FSDP2 model (see
    :class:`~lightning_gradcomp.local.handle.LocalUpdateHandle`): its checkpoint entry holds every rank of the
    world, each its own shard's state, and its summary averages over every rank."""

    _entry_covers_world = True

    def _collective_device(self) -> torch.device:
        return world_collective_device()


def attach_sharded(model: torch.nn.Module, mesh: DeviceMesh, config: LocalUpdates, options: ExchangeOptions, *,
                   global_device: Optional[torch.device] = None) -> ShardedLocalUpdateHandle:
    """The outer loop of an FSDP2 model sharded over ``mesh["shard"]`` on this rank, its replicas made equal
    now (the first replica's shards broadcast); the outer gradients cross ``mesh["replicate"]``."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("gradcomp.local_updates: torch.distributed is not initialised")
    shard_group, replicate_group = check_mesh(mesh)
    _check_sharding(model, shard_group)
    device = next(model.parameters()).device
    broadcast_from_first_rank(model, replicate_group, local_shard)  # every replica from the first replica's shards
    session = ExchangeSession(**options.keywords(), group=replicate_group, exchange_thread=config.delay > 0,
                              device=device, caller="local_updates(mesh=...)",
                              settings={**config.settings(), "shard layout": shard_layout(model)})
    # θ_global, the residuals and the outer state fit this mesh's shards only: another split drops them
    session.layout = f"local-hsdp:replicate={mesh['replicate'].size()},shard={mesh['shard'].size()}"
    loop = ShardedLocalUpdateLoop(model, config, session, shard_group, global_device=global_device)
    return ShardedLocalUpdateHandle(loop, [], device)


def attach_fault_tolerant_sharded(model: torch.nn.Module, config: LocalUpdates, options: ExchangeOptions,
                                  fault_tolerance: FaultTolerance, *, global_device: Optional[torch.device] = None
                                  ) -> FaultTolerantHandle:
    """Local updates of an FSDP2 model sharded over this job's world, one replica group under torchft."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("gradcomp.local_updates: torch.distributed is not initialised")
    _check_sharding(model, dist.group.WORLD)
    return attach_fault_tolerant(model, config, options, fault_tolerance, global_device=global_device,
                                 model_layout=ShardsOfModel(model),
                                 checkpoint_layout=f"local-hsdp-ft:shard={dist.get_world_size()}")


def _check_sharding(model: torch.nn.Module, shard_group: dist.ProcessGroup) -> None:
    """Every FSDP module sharded over ``mesh["shard"]`` alone (not native HSDP), and every trainable
    parameter sharded by one: a parameter outside FSDP would be averaged by nobody inside the replica."""
    names = {id(p): name for name, p in model.named_parameters()}
    sharded = set()
    for module_name, _, param_group in fsdp_modules(model, "local_updates"):
        check_group(module_name, param_group, shard_group, "local_updates")
        sharded |= {names.get(id(fsdp_param.sharded_param)) for fsdp_param in param_group.fsdp_params}
    check_every_parameter_sharded(model, sharded, "gradcomp.local_updates: the trainable parameters {} are not "
                                  "sharded by any fully_shard, so the ranks of a replica would train them apart")


def load_sharded_optimizer_state(optimizer: Optimizer, state: dict[str, Any]) -> None:
    """Restore an optimizer state saved by :meth:`ShardsOfModel.optimizer_state`: each local shard becomes a
    DTensor again, laid out as the parameter it belongs to."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    per_param: dict[Any, Any] = {}
    for index, values in state.get("state", {}).items():
        parameter = params[int(index)]
        per_param[index] = {
            key: (DTensor.from_local(value[LOCAL_SHARD_KEY].to(local_shard(parameter).device), parameter.device_mesh,
                                     parameter.placements, run_check=False, shape=parameter.shape,
                                     stride=parameter.stride())
                  if isinstance(value, dict) and set(value) == {LOCAL_SHARD_KEY} else value)
            for key, value in values.items()}
    optimizer.load_state_dict({**state, "state": per_param})
