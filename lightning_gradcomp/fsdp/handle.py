"""Plain PyTorch: compressed HSDP, FSDP2 inside a replica, the compressed exchange between replicas.

::

    mesh = init_device_mesh("cuda", (nodes, gpus_per_node), mesh_dim_names=("replicate", "shard"))
    for block in model.layers:
        fully_shard(block, mesh=mesh["shard"])          # 1-D: FSDP shards inside the node, nothing more
    fully_shard(model, mesh=mesh["shard"])
    gradcomp = lightning_gradcomp.register_fsdp(model, mesh, compressor="int8")
    ...
    loss.backward(); optimizer.step()                   # every FSDP group's shard crosses the nodes compressed
    entry = gradcomp.state_dict()                       # every rank calls it; every rank's state, on rank 0

FSDP2 reduce-scatters each parameter group's gradient inside the replica (the ``"shard"`` mesh
dimension) and hands this rank's shard to the group's all-reduce hook
(``FSDPModule.set_all_reduce_hook``); the hook exchanges it with the ranks of the same shard in the
other replicas (the ``"replicate"`` dimension) through the exchange engine, per parameter (each
parameter's local row block, :mod:`lightning_gradcomp.fsdp.layout`), and leaves the replicas' average in
it. FSDP then divides by the shard count as it always does: the result is native HSDP's mean over every
rank. Replicas with the same shard rank hold the same row blocks, so PowerSGD's factors and DeMo's tiles
line up. Error feedback and compressor state are per rank (each owns a different shard), fp32, keyed by
parameter name; the checkpoint entry carries every rank's.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.core.checks import check_bool
from lightning_gradcomp.ddp.checkpoint import (
    check_checkpoint_timeout,
    checkpoint_group,
    DEFAULT_CHECKPOINT_TIMEOUT,
    restore_entry,
)
from lightning_gradcomp.ddp.handle import GradCompHandle, OptimizerWatch, warn_if_unbound
from lightning_gradcomp.ddp.hook import GradCompHookState
from lightning_gradcomp.fsdp.layout import group_layout, GroupLayout

#: the mesh dimensions :func:`register_fsdp` expects, outer to inner
MESH_DIMS = ("replicate", "shard")


class FSDPHandle(GradCompHandle):
    """What :func:`register_fsdp` returns: the compressed exchange between the replicas of one sharded model
    on this rank (``step_stats``, ``totals``, ``summary()``, ``state_dict()``, ``load_state_dict()``,
    ``failure``, ``use_compressor()``, ``bind()``; see :class:`~lightning_gradcomp.ddp.handle.GradCompHandle`).

    Attributes:
        layouts: each FSDP parameter group's shard layout, in the order the modules were found.
        hook_calls_per_step: the FSDP groups whose shard is exchanged every step.
    """

    def __init__(self, hook_state: GradCompHookState, compressor: Compressor, device: torch.device,
                 layouts: list[GroupLayout]) -> None:
        super().__init__(hook_state, compressor, device)
        self.layouts = layouts
        self.hook_calls_per_step = sum(1 for layout in layouts if layout.slots)
        self._calls_this_step = 0

    def all_reduce_hook(self, layout: GroupLayout) -> Any:
        """FSDP's all-reduce hook of one parameter group: the replicas' average of ``reduce_output``, in place."""
        def hook(reduce_output: torch.Tensor) -> None:
            self._calls_this_step += 1
            last = self._calls_this_step == self.hook_calls_per_step
            if last:
                self._calls_this_step = 0
            if self.hook_state.compressor is not self._examined:
                self._examined = self.hook_state.compressor
                warn_if_unbound(self._examined)
            if reduce_output.is_cuda:
                # FSDP allocated the shard on its reduce-scatter stream and may free it (a reduce dtype other
                # than the parameters') right after the hook: keep the block from being reused before the
                # exchange issued here on the all-reduce stream (the hook's current stream) has read it
                reduce_output.record_stream(torch.cuda.current_stream(reduce_output.device))
            try:
                self.hook_state.exchange_now(layout.entries(reduce_output), last)
            except BaseException as error:
                if self.hook_state.failure is None:
                    self.hook_state.failure = error
                raise
        return hook

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's part of a :meth:`state_dict` (every rank loads the entry rank 0 saved; the
        entry holds every rank of the world, each its own shard's state). Another world size or compressor
        keeps only the step counter and the totals, with a warning."""
        if not isinstance(state, dict):
            raise ValueError(f"`state` must be the dict that state_dict() returned on rank 0, got "
                             f"{type(state).__name__}")
        rank = dist.get_rank()
        restore_entry(state, self.hook_state, dist.get_world_size(), self.compressor,
                      lambda ranks: self.hook_state.load_state_dict(ranks[rank], self.device))


def register_fsdp(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    compressor: Union[Compressor, str] = "topk",
    *,
    error_feedback: Optional[bool] = None,
    min_compress_numel: int = 1024,
    seed: int = 0,
    telemetry: bool = False,
    timeout: Union[timedelta, float] = DEFAULT_CHECKPOINT_TIMEOUT,
) -> FSDPHandle:
    """Compress what the replicas of an FSDP2-sharded model exchange (HSDP).

    Args:
        model: the root module, with ``fully_shard(..., mesh=mesh["shard"])`` applied to it and its blocks
            (a 1-D shard mesh: FSDP itself then all-reduces nothing between replicas).
        mesh: the 2-D ``DeviceMesh`` with dimensions ``("replicate", "shard")``: the compressed exchange
            runs over ``mesh["replicate"]``.
        compressor, error_feedback, min_compress_numel, seed: as for :func:`~lightning_gradcomp.register`.
        telemetry: also measure the compression error and time.
        timeout: how long :meth:`FSDPHandle.state_dict` (a collective of every rank) waits for the others.

    Every FSDP module is set to reduce-scatter unused parameters too (zero gradients), so that every
    replica sends the same parameters every step. Gradient accumulation with
    ``set_requires_gradient_sync(False)`` on the non-final micro-batches exchanges once per optimizer step.
    As with :func:`~lightning_gradcomp.register`, the first optimizer that steps the model is checked
    against the compressor and bound (or call ``handle.bind(optimizer)``), and an fp16 ``GradScaler`` with
    error feedback is warned about.
    """
    shard_group, replicate_group = _check_mesh(mesh)
    modules = _fsdp_modules(model)
    names = {id(p): name for name, p in model.named_parameters()}
    layouts = []
    for module_name, module, param_group in modules:
        _check_group(module_name, param_group, shard_group)
        layouts.append(group_layout(module_name, param_group, names))
    timeout = check_checkpoint_timeout(timeout)
    device = next(model.parameters()).device
    hook_state = GradCompHookState(compressor, names, error_feedback=error_feedback,
                                   min_compress_numel=min_compress_numel, seed=seed, group=replicate_group,
                                   exchange_thread=False, device=device)
    hook_state.telemetry = check_bool(telemetry, "telemetry")
    handle = FSDPHandle(hook_state, hook_state.compressor, device, layouts)
    handle.checkpoint_group = checkpoint_group(None, timeout)  # every rank's shard state, on rank 0
    handle._watch = OptimizerWatch(handle, list(model.parameters()))  # binds the optimizer at its first step
    for (_, module, _), layout in zip(modules, layouts):
        module.set_reduce_scatter_unused_params(True, recurse=False)
        if layout.slots:
            module.set_all_reduce_hook(handle.all_reduce_hook(layout))
    return handle


def _check_mesh(mesh: Any) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
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
    return mesh["shard"].get_group(), mesh["replicate"].get_group()


def _fsdp_modules(model: torch.nn.Module) -> list[tuple[str, Any, Any]]:
    """``(name, module, parameter group)`` of every FSDP2 module under ``model`` that holds parameters."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError as error:  # pragma: no cover - torch without FSDP2
        raise ValueError("gradcomp: register_fsdp needs FSDP2 (torch.distributed.fsdp.fully_shard, torch >= 2.6)") \
            from error
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        groups = module._get_fsdp_state()._fsdp_param_groups
        if len(groups) > 1:
            raise ValueError(f"gradcomp: the FSDP module {name or 'root'} has {len(groups)} parameter groups "
                             "(fully_shard with shard_placement_fn and several meshes); compressed HSDP needs one "
                             "per module")
        if groups:
            found.append((name, module, groups[0]))
    if not found:
        raise ValueError("gradcomp: register_fsdp found no module sharded with FSDP2; apply "
                         "fully_shard(module, mesh=mesh['shard']) to the model's blocks and to the model first")
    return found


def _check_group(name: str, param_group: Any, shard_group: dist.ProcessGroup) -> None:
    """Refuse a native HSDP module (a 2-D mesh in ``fully_shard``) and one sharded over another group."""
    mesh_info = param_group.mesh_info
    if getattr(param_group, "_is_hsdp", False) or hasattr(mesh_info, "replicate_process_group"):
        raise ValueError(
            f"gradcomp: {name or 'the root module'} was sharded with a 2-D mesh (native HSDP), whose replicas FSDP "
            "all-reduces itself, dense; shard on the 1-D shard dimension instead: fully_shard(module, "
            "mesh=mesh['shard']), and register_fsdp(model, mesh) exchanges between the replicas")
    sharded_over = getattr(mesh_info, "shard_process_group", None)
    if sharded_over is None or dist.get_process_group_ranks(sharded_over) != dist.get_process_group_ranks(shard_group):
        raise ValueError(
            f"gradcomp: {name or 'the root module'} is sharded over other ranks than mesh['shard'] of the mesh given "
            "to register_fsdp; shard every module with fully_shard(module, mesh=mesh['shard']) of that mesh")
