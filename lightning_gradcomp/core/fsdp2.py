"""What the package reads of FSDP2 (``torch.distributed.fsdp.fully_shard``), in one place.

Compressed HSDP (:mod:`lightning_gradcomp.fsdp`) and local updates on shards
(:mod:`lightning_gradcomp.local.sharded`) both take a model sharded with ``fully_shard(module,
mesh=mesh["shard"])`` of a 2-D ``("replicate", "shard")`` mesh. Finding its FSDP modules and checking how
they were sharded reads FSDP2's private state (``_get_fsdp_state()._fsdp_param_groups``, a parameter
group's ``mesh_info`` and ``fsdp_params``): pinned here, so that a torch release that moves it breaks one
module, and the tests of both callers.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

#: the dimensions of the mesh a sharded model's replicas form
MESH_DIMS = ("replicate", "shard")

#: the FSDPModule methods the compressed all-reduce hook needs (HSDP; local updates need neither)
HOOK_METHODS = ("set_all_reduce_hook", "set_reduce_scatter_unused_params")


def sharded_modules(model: torch.nn.Module) -> list[Any]:
    """Every module of ``model`` that ``fully_shard`` wrapped (none without FSDP2)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def fsdp_modules(model: torch.nn.Module, caller: str, hooks: bool = False) -> list[tuple[str, Any, Any]]:
    """``(name, module, parameter group)`` of every FSDP2 module under ``model`` that holds parameters
    (``caller``: the function the errors name; ``hooks``: refuse a torch whose FSDP2 lacks the all-reduce
    hook's methods, :data:`HOOK_METHODS`)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError as error:  # pragma: no cover - torch without FSDP2
        raise ValueError(f"gradcomp: {caller} needs FSDP2 (torch.distributed.fsdp.fully_shard)") from error
    for needed in HOOK_METHODS if hooks else ():
        if not hasattr(FSDPModule, needed):  # pragma: no cover - older torch
            raise ValueError(f"gradcomp: {caller} needs FSDPModule.{needed}, which this torch "
                             f"({torch.__version__}) lacks; upgrade torch")
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        groups = param_groups(module)
        if len(groups) > 1:
            raise ValueError(f"gradcomp: the FSDP module {name or 'root'} has {len(groups)} parameter groups "
                             f"(fully_shard with shard_placement_fn and several meshes); {caller} needs one per "
                             "module")
        if groups:
            found.append((name, module, groups[0]))
    if not found:
        raise ValueError(f"gradcomp: {caller} found no module sharded with FSDP2; apply "
                         "fully_shard(module, mesh=mesh['shard']) to the model's blocks and to the model first")
    return found


def param_groups(module: Any) -> list[Any]:
    """The FSDP2 parameter groups of one ``fully_shard`` module: a list in newer torch
    (``FSDPState._fsdp_param_groups``), one group or ``None`` in torch 2.11 and earlier (``FSDPState._fsdp_param_group``)."""
    state = module._get_fsdp_state()
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def check_mesh(mesh: Any) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """The shard and replicate groups of a ``("replicate", "shard")`` mesh, or a ``ValueError`` that says
    what to pass."""
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"`mesh` must be a torch.distributed.device_mesh.DeviceMesh with dimensions {MESH_DIMS}, "
                         f"got {type(mesh).__name__}")
    if mesh.ndim != 2 or tuple(mesh.mesh_dim_names or ()) != MESH_DIMS:
        raise ValueError(
            f"`mesh` must be 2-D with mesh_dim_names={MESH_DIMS} (replicas x shards, e.g. init_device_mesh('cuda', "
            f"(nodes, gpus_per_node), mesh_dim_names={MESH_DIMS})), got {mesh.ndim}-D with names "
            f"{mesh.mesh_dim_names}; a 1-D mesh has no replicas to compress between (use FSDP alone, or "
            "register() with DDP)")
    if mesh["replicate"].size() == 1 and (not dist.is_initialized() or dist.get_rank() == 0):
        warnings.warn("gradcomp: the mesh has one replica (mesh['replicate'] of size 1): nothing crosses between "
                      "replicas, so compression only adds error; give it several replicas (the sharded strategies: "
                      "shard_size= a divisor of the world size below it)", UserWarning, stacklevel=3)
    return mesh["shard"].get_group(), mesh["replicate"].get_group()


def check_group(name: str, param_group: Any, shard_group: dist.ProcessGroup, caller: str) -> None:
    """Refuse a native HSDP module (a 2-D mesh in ``fully_shard``) and one sharded over another group."""
    mesh_info = param_group.mesh_info
    if getattr(param_group, "_is_hsdp", False) or hasattr(mesh_info, "replicate_process_group"):
        raise ValueError(
            f"gradcomp: {name or 'the root module'} was sharded with a 2-D mesh (native HSDP), whose replicas FSDP "
            "all-reduces itself, dense; shard on the 1-D shard dimension instead: fully_shard(module, "
            f"mesh=mesh['shard']), and {caller}(model, ..., mesh) exchanges between the replicas")
    sharded_over = getattr(mesh_info, "shard_process_group", None)
    if sharded_over is None or dist.get_process_group_ranks(sharded_over) != dist.get_process_group_ranks(shard_group):
        raise ValueError(
            f"gradcomp: {name or 'the root module'} is sharded over other ranks than mesh['shard'] of the mesh given "
            f"to {caller}; shard every module with fully_shard(module, mesh=mesh['shard']) of that mesh")


def check_every_parameter_sharded(model: torch.nn.Module, sharded: set[Optional[str]], refusal: str) -> None:
    """Refuse the trainable parameters of ``model`` whose names are not in ``sharded`` (their modules never
    sharded, or ``ignored_params``), with ``refusal`` (``{}``: their names), what would go wrong, and the fix."""
    missing = [name for name, parameter in model.named_parameters() if parameter.requires_grad and name not in sharded]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(refusal.format(shown) + "; apply fully_shard(module, mesh=mesh['shard']) to the modules "
                         "holding them, and finally to the root module")


def local_shard(tensor: Tensor) -> Tensor:
    """This rank's part of ``tensor``: a DTensor's local tensor (a view of FSDP2's sharded storage, so
    writing into it changes the parameter), else ``tensor`` itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def shard_layout(model: torch.nn.Module) -> str:
    """Every parameter's local shard shape on this rank, as text: the same on the ranks of one shard index
    in every replica, which exchange these shards (they must agree on it)."""
    return ";".join(f"{name}:{tuple(local_shard(parameter).shape)}" for name, parameter in model.named_parameters())
