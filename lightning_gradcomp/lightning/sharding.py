"""What the Trainer's and Fabric's sharded strategies share: their options and the checks of them, the
``("replicate", "shard")`` mesh, their registration and samplers (:class:`ShardsInReplicas`), sharding by an
auto-wrap policy, and the exchange attached between the replicas. It imports no Lightning (the strategies'
modules do, and Lightning's import registers them: a module they both import must be complete before that
happens)."""

from __future__ import annotations

import importlib
from typing import Any, Optional

from torch import nn
from typing_extensions import override

from lightning_gradcomp.core.fsdp2 import MESH_DIMS
from lightning_gradcomp.lightning.options import group_sampler_kwargs
from lightning_gradcomp.local.handle import FaultTolerantHandle

#: Options of the other gradcomp strategies and of ``ModelParallelStrategy`` that have no meaning here, and why.
REFUSED_OPTIONS = {
    "hierarchy": "the mesh is the hierarchy here: FSDP communicates inside a replica, the compressed exchange runs "
                 "between replicas; allowed: leave hierarchy unset and choose the replica size with shard_size=",
    "exchange_thread": "the exchange runs in FSDP2's all-reduce hook, on FSDP's own stream; allowed: leave "
                       "exchange_thread unset",
    "data_parallel_size": "the mesh is (replicas, shard_size) with dimensions ('replicate', 'shard'); allowed: "
                          "shard_size= (the processes per replica)",
    "tensor_parallel_size": "tensor parallelism is not combined with compressed HSDP; allowed: shard_size= (the "
                            "processes per replica)",
}

#: The options the strategy takes, for the message about an unknown one.
ALLOWED_OPTIONS = ("compressor", "error_feedback", "min_compress_numel", "seed", "log_stats", "print_summary",
                   "local_updates", "global_device", "fault_tolerance", "shard_size", "auto_wrap_policy", "mp_policy", "reshard_after_forward",
                   "save_distributed_checkpoint", "process_group_backend", "timeout")

# ---------------------------------------------------------------------- options
def refuse_options(kwargs: dict[str, Any], strategy: str = "GradCompFSDPStrategy",
                   allowed: tuple[str, ...] = ALLOWED_OPTIONS) -> None:
    """Refuse, naming it, an option of the other strategies that has no meaning here, or an unknown one."""
    for name, value in kwargs.items():
        if name in REFUSED_OPTIONS and value is not None:  # None: unset, as LightningCLI passes it
            raise ValueError(f"{strategy}: `{name}={value!r}`: {REFUSED_OPTIONS[name]}")
    unknown = sorted(name for name in kwargs if name not in REFUSED_OPTIONS)
    if unknown:
        raise ValueError(f"{strategy}: unknown option(s) {unknown}; allowed: {', '.join(allowed)} "
                         "(DistributedDataParallel's arguments do not apply: FSDP2 shards the model)")


def replica_mesh(strategy: str, world_size: int, num_processes: int, shard_size: Optional[int],
                 fault_tolerant: bool, device_type: str) -> Any:
    """The ``("replicate", "shard")`` mesh of a sharded strategy: ``shard_size`` processes per replica (``None``:
    the processes per node); under fault tolerance this job is one replica group, sharded over all its
    processes (torchft joins the groups)."""
    if fault_tolerant:
        if shard_size not in (None, world_size):
            raise ValueError(f"{strategy}(fault_tolerance=...): this job is one replica group, its {world_size} "
                             f"processes shard the model and torchft joins the groups; allowed: shard_size=None or "
                             f"{world_size}")
        shard_size = world_size
        by_default = False
    else:
        by_default = shard_size is None
        shard_size = shard_size or num_processes
    replicas = check_world_divides(world_size, shard_size, by_default, strategy)  # one replica: check_mesh warns
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (replicas, shard_size), mesh_dim_names=MESH_DIMS)


class ShardsInReplicas:
    """Mixin of the sharded strategies (the Trainer's and Fabric's), before Lightning's ``ModelParallelStrategy``
    in the bases: the registered name, the mesh, and every process's share of the data."""

    strategy_name: str
    fault_tolerance: Any
    shard_size: Optional[int]

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``gradcomp_fsdp``."""
        strategy_registry.register(
            cls.strategy_name, cls, override=True,
            description="FSDP2 inside each replica, compressed gradients between replicas (lightning-gradcomp HSDP)",
        )

    def _setup_mesh(self, strategy: str) -> None:
        """Start the processes' group and build the :func:`replica_mesh` (``strategy``: the name its errors give)."""
        self._setup_distributed()
        if self.fault_tolerance is not None:  # this job is one replica group, sharded over all its processes
            self.fault_tolerance = self.fault_tolerance.for_group()  # one name for every process (samplers' seed)
        self._device_mesh = replica_mesh(strategy, self.world_size, self.num_processes, self.shard_size,
                                         self.fault_tolerance is not None, self.root_device.type)
        self._data_parallel_size, self._tensor_parallel_size = self._device_mesh.shape

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every process its own share of the data (replicas and shards alike are data parallel); under fault
        tolerance each replica group shuffles with its own seed
        (:meth:`~lightning_gradcomp.FaultTolerance.data_seed`)."""
        return group_sampler_kwargs({"num_replicas": self.world_size, "rank": self.global_rank}, self.fault_tolerance)


def replicas_exchanging(handle: Any, mesh: Any) -> int:
    """The processes that exchange one shard compressed: the replicas of ``mesh`` (under fault tolerance, the
    replica groups of the last quorum)."""
    if isinstance(handle, FaultTolerantHandle):
        return handle.loop.exchange.driver.world_size
    return mesh["replicate"].size()


def check_shard_size(shard_size: Any) -> Optional[int]:
    """``None`` (the devices per node) or an integer >= 1."""
    if shard_size is not None and (isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1):
        raise ValueError(f"`shard_size` must be None (the devices per node) or an integer >= 1 (the processes per "
                         f"replica), got {shard_size!r}")
    return shard_size


def check_world_divides(world_size: int, shard_size: int, by_default: bool,
                        strategy: str = "GradCompFSDPStrategy") -> int:
    """The number of replicas, ``world_size // shard_size``; ``ValueError`` when it does not divide."""
    if world_size % shard_size:
        divisors = [size for size in range(1, world_size + 1) if world_size % size == 0]
        origin = "the devices per node (shard_size=None)" if by_default else f"shard_size={shard_size}"
        raise ValueError(f"{strategy}: the world size {world_size} is not a multiple of {origin}; allowed: "
                         f"shard_size in {divisors}")
    return world_size // shard_size


def check_auto_wrap_policy(policy: Any) -> Optional[tuple[type[nn.Module], ...]]:
    """``None``, or a non-empty set, list or tuple of ``nn.Module`` subclasses (or their import paths)."""
    if policy is None:
        return None
    allowed = ("a set, list or tuple of nn.Module subclasses or their import paths (e.g. {Block} or "
               "{'torch.nn.TransformerEncoderLayer'}), or None (configure_model shards the model)")
    if isinstance(policy, (str, type)) or not isinstance(policy, (set, frozenset, list, tuple)) or not policy:
        raise ValueError(f"`auto_wrap_policy` must be {allowed}, got {policy!r}")
    classes = tuple(_module_class(entry, allowed) for entry in policy)
    return tuple(sorted(set(classes), key=lambda cls: f"{cls.__module__}.{cls.__qualname__}"))


def _module_class(entry: Any, allowed: str) -> type[nn.Module]:
    """One entry of ``auto_wrap_policy`` as a class."""
    if isinstance(entry, str):
        module_name, _, class_name = entry.rpartition(".")
        try:
            entry = getattr(importlib.import_module(module_name), class_name) if module_name else None
        except (ImportError, AttributeError) as error:
            raise ValueError(f"`auto_wrap_policy`: cannot import {entry!r} ({error}); it must be {allowed}") from error
    if not isinstance(entry, type) or not issubclass(entry, nn.Module):
        raise ValueError(f"`auto_wrap_policy` must be {allowed}, got the entry {entry!r}")
    return entry


def check_fully_shard_options(policy: Optional[tuple[type[nn.Module], ...]], mp_policy: Any,
                              reshard_after_forward: Any) -> dict[str, Any]:
    """``fully_shard``'s options for ``auto_wrap_policy``; refused without it (``configure_model`` passes its own)."""
    if policy is None and (mp_policy is not None or reshard_after_forward is not None):
        raise ValueError("`mp_policy` and `reshard_after_forward` apply to the modules auto_wrap_policy shards; "
                         "allowed without auto_wrap_policy: mp_policy=None and reshard_after_forward=None (pass them "
                         "to fully_shard in your configure_model instead)")
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise ValueError(f"`mp_policy` must be None or a torch.distributed.fsdp.MixedPrecisionPolicy, got "
                         f"{mp_policy!r}")
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool) and (
            not isinstance(reshard_after_forward, int) or reshard_after_forward < 2):
        raise ValueError(f"`reshard_after_forward` must be None (FSDP's default), True, False or an integer >= 2 (a "
                         f"smaller shard size after forward), got {reshard_after_forward!r}")
    kwargs: dict[str, Any] = {"reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    return kwargs


# ---------------------------------------------------------------------- sharding
def is_fsdp_module(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module`` (FSDP2)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def shard_by_policy(root: nn.Module, classes: tuple[type[nn.Module], ...], mesh: Any,
                    kwargs: dict[str, Any]) -> None:
    """``fully_shard(module, mesh=mesh)`` for every instance of ``classes`` under ``root`` (the innermost
    first; those already sharded are left as they are), then for ``root`` itself."""
    from torch.distributed.fsdp import fully_shard

    matching = [module for module in root.modules()
                if module is not root and isinstance(module, classes) and not is_fsdp_module(module)]
    for module in reversed(matching):  # modules() lists a parent before its children
        fully_shard(module, mesh=mesh, **kwargs)
    if not is_fsdp_module(root):
        fully_shard(root, mesh=mesh, **kwargs)


def refuse_fsdp1(model: nn.Module) -> None:
    """FSDP1's ``FullyShardedDataParallel`` wrapper has no all-reduce hook to attach to."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(module, FullyShardedDataParallel) for module in model.modules()):
        raise ValueError("GradCompFSDPStrategy works with FSDP2 (torch.distributed.fsdp.fully_shard); found modules "
                         "wrapped in FSDP1's FullyShardedDataParallel: apply fully_shard(module, "
                         "mesh=self.device_mesh['shard']) in configure_model instead")


#: why Lightning's ModelParallelStrategy may fail to read a checkpoint with an IndexError, and what to do
UNREADABLE_CHECKPOINT = (
    "gradcomp: Lightning's ModelParallelStrategy could not read the optimizer state of {path} (IndexError while "
    "re-keying it). Lightning 2.6 fails so on an optimizer that keeps no state (SGD without momentum) in a "
    "single-file checkpoint (save_distributed_checkpoint=False), and on a checkpoint a non-sharded strategy "
    "wrote (DDP's, gradcomp's): save with save_distributed_checkpoint=True (the default), and resume a "
    "sharded run from a sharded strategy's checkpoint")

