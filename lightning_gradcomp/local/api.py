"""The one plain-PyTorch entry point of local updates: :func:`local_updates`, for a whole model, a sharded
one and a fault-tolerant replica group of either (see :mod:`lightning_gradcomp.local.handle` and
:mod:`lightning_gradcomp.local.sharded` for the two layouts)."""

from __future__ import annotations

from datetime import timedelta
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.core.fsdp2 import sharded_modules
from lightning_gradcomp.exchange.checkpoint import DEFAULT_CHECKPOINT_TIMEOUT
from lightning_gradcomp.exchange.handle import (
    hold,
    refuse_a_second_exchange,
    refuse_parameters_replaced_by_sharding,
    steps_the_model,
)
from lightning_gradcomp.local.config import Fragments, LocalUpdates, OuterOptimizerFactory
from lightning_gradcomp.local.fault_tolerance import FaultTolerance
from lightning_gradcomp.local.handle import LocalUpdateHandle, replicated_local_updates
from lightning_gradcomp.local.sharded import attach_fault_tolerant_sharded, attach_sharded


def local_updates(
    model: torch.nn.Module,
    optimizers: Union[Optimizer, Sequence[Optimizer]],
    sync_every: int = 100,
    compressor: Union[Compressor, str] = "none",
    *,
    mesh: Optional[DeviceMesh] = None,
    outer_optimizer: Optional[OuterOptimizerFactory] = None,
    fragments: Fragments = 1,
    delay: int = 0,
    alpha: float = 0.0,
    overlap: str = "after",
    window_seconds: Union[None, float, str] = None,
    weight_by: Optional[str] = "samples",
    error_feedback: Optional[bool] = None,
    min_compress_numel: int = 1024,
    seed: int = 0,
    group: Optional[dist.ProcessGroup] = None,
    telemetry: bool = False,
    timeout: Union[timedelta, float] = DEFAULT_CHECKPOINT_TIMEOUT,
    global_device: Optional[Union[str, torch.device]] = None,
    fault_tolerance: Optional[FaultTolerance] = None,
) -> LocalUpdateHandle:
    """Train ``model`` with local updates (DiLoCo and its family): each rank takes ``sync_every`` inner steps
    alone, then the outer gradients ``Δ = θ_global − θ`` are exchanged, compressed, and an outer optimizer steps
    ``θ_global`` (Douillard et al. 2023, arXiv 2311.08105, Algorithm 1). One function for every layout: a whole
    model on every rank of ``group`` (``mesh=None``), an FSDP2-sharded one whose replicas are the ``"shard"``
    groups of ``mesh`` (each rank exchanges its local shard), or one fault-tolerant replica group of either
    kind (``fault_tolerance``).

    Args:
        model: the bare model, called as it is in the loop. A whole model: rank 0's values are broadcast
            now, so every rank starts from the same parameters. A ``DistributedDataParallel`` wrapper of it that the loop
            still calls raises at its first gradient all-reduce, naming the fix (a wrapper made before
            ``local_updates()``, or before the first optimizer step: found then; not one made later).
        optimizers: the inner optimizer(s), each rank's own. The first one's ``step()`` counts each iteration
            (a step post-hook), so the loop needs no :meth:`LocalUpdateHandle.step` call; a loop that calls it
            after every iteration, as before (needed with a ``GradScaler``, which may skip a rank's step),
            takes the counting over at its first call.
        sync_every, outer_optimizer, fragments, delay, alpha, overlap, window_seconds, weight_by: see
            :class:`~lightning_gradcomp.local.config.LocalUpdates` (``fragments``, ``delay``, ``alpha``,
            ``overlap``: Streaming DiLoCo; ``window_seconds``: time-boxed windows, with
            :meth:`~lightning_gradcomp.local.handle.LocalUpdateHandle.run_for` and ``finished``; ``weight_by``:
            each rank's outer gradient weighted by its samples, :meth:`~lightning_gradcomp.local.handle.LocalUpdateHandle.count`).
        compressor, error_feedback, min_compress_numel, seed: the outer gradients' compression, as for
            :class:`~lightning_gradcomp.GradCompStrategy` (default: uncompressed, DiLoCo).
        telemetry: also measure the compression error and time.
        timeout: how long :meth:`LocalUpdateHandle.state_dict` (a collective) waits for the other ranks
            before it raises (a ``timedelta`` or seconds; default 5 minutes): a script that calls it on rank 0
            only fails with advice instead of hanging. The exchange itself fails a dead peer after the
            process group's own timeout.
        global_device: where ``θ_global`` and the outer optimizer's state live: ``None`` (the parameters'
            device) or ``"cpu"`` (host memory, pinned: 2-3x the model's bytes kept off the accelerator, at
            the price of a copy each way per synchronisation).
        fault_tolerance: a :class:`~lightning_gradcomp.local.fault_tolerance.FaultTolerance`: this job is one
            replica group of a job that survives lost groups (its ``torch.distributed`` world is the group's
            alone): the synchronisations go through torchft's lighthouse and process group (needs the ``ft``
            extra), one quorum and commit per fragment's synchronisation (Streaming DiLoCo's ``fragments``
            and ``delay`` too: the exchange overlaps ``delay`` inner steps, then the vote). A group of several
            processes trains the model under
            ``DistributedDataParallel`` inside the group (pass the wrapper, or the bare model and call its
            wrapper; a gradient all-reduce inside the group every step, DDP's own), and its ranks split the
            outer exchange between them: each sends a part of the model to the same rank of the other groups.
        mesh: for a sharded model (``fully_shard(..., mesh=mesh["shard"])`` applied to its blocks and to it, a
            1-D shard mesh, so that FSDP itself all-reduces nothing between replicas), the 2-D ``DeviceMesh``
            with dimensions ``("replicate", "shard")``; the outer gradients cross ``mesh["replicate"]``, and
            rank 0's shard values are broadcast to the other replicas now. With ``fault_tolerance`` a sharded
            model is one replica group sharded over this job's world (``mesh=None``), each rank exchanging its
            shard with the same rank of the other groups over torchft's process group; ``group`` is for a whole
            model only, and the checkpoint entry of a sharded model holds every rank of the world.
    """
    bare = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    optimizers = check_optimizers(optimizers)
    check_steps_the_model(optimizers[0], bare)
    refuse_a_second_exchange(bare, "local_updates()")
    config = LocalUpdates(sync_every, outer_optimizer, fragments, delay, alpha, overlap, window_seconds, weight_by)
    exchange = {"error_feedback": error_feedback, "min_compress_numel": min_compress_numel, "seed": seed,
                "telemetry": telemetry, "timeout": timeout, "global_device": global_device}
    handle: LocalUpdateHandle
    if mesh is None and not sharded_modules(model):
        handle = replicated_local_updates(model, optimizers, config, compressor, group=group,
                                          fault_tolerance=fault_tolerance, **exchange)
    elif fault_tolerance is not None:
        if mesh is not None or group is not None:
            raise ValueError("gradcomp.local_updates: with fault_tolerance a sharded model is one replica group sharded "
                             "over this job's world (fully_shard(module, mesh=init_device_mesh(device, (world_size,)))), "
                             "and torchft joins the groups; allowed: mesh=None, group=None")
        handle = attach_fault_tolerant_sharded(model, optimizers, config, compressor, fault_tolerance, **exchange)
    elif mesh is None:
        raise ValueError("gradcomp.local_updates: `model` is sharded with FSDP2 (fully_shard); pass the 2-D mesh its "
                         "replicas form, mesh=init_device_mesh(..., mesh_dim_names=('replicate', 'shard')), with "
                         "fully_shard(..., mesh=mesh['shard'])")
    elif group is not None:
        raise ValueError("gradcomp.local_updates: `group` is for a whole model; a sharded model's replicas exchange "
                         "over mesh['replicate'] (leave group=None)")
    else:
        handle = attach_sharded(model, mesh, config, compressor, **exchange)
        handle.optimizers = optimizers
        handle.count_optimizer_steps(optimizers[0])
    hold(bare, handle, "local_updates()")
    return handle


def check_steps_the_model(optimizer: Optimizer, model: torch.nn.Module) -> None:
    """Refuse an inner optimizer (the first: its steps count the window) that steps none of ``model``'s
    parameters: built before ``fully_shard`` replaced them, or for another model, nothing would train while
    the windows are counted and synchronised."""
    refuse_parameters_replaced_by_sharding(optimizer, model, "local_updates()")
    if not steps_the_model(optimizer, model):
        raise ValueError(
            f"gradcomp.local_updates: the first optimizer ({type(optimizer).__name__}, whose steps count the window) "
            "steps none of the model's parameters: nothing would train. Pass the optimizer built on this model's "
            "parameters (after fully_shard or any wrapper that replaces them): `optimizer = "
            "torch.optim.AdamW(model.parameters(), ...)`")


def check_optimizers(optimizers: object) -> list[Optimizer]:
    """``optimizers`` as a non-empty list of ``torch.optim.Optimizer``: the first one's steps count the window,
    so with none no synchronisation would ever happen."""
    if isinstance(optimizers, Optimizer):
        return [optimizers]
    listed = list(optimizers) if isinstance(optimizers, (list, tuple)) else None
    if not listed or not all(isinstance(optimizer, Optimizer) for optimizer in listed):
        raise ValueError(
            "`optimizers` must be the inner torch.optim.Optimizer that steps the model, or a non-empty list of them "
            f"(the first one's steps count the window: with none, no synchronisation would ever happen); got "
            f"{optimizers!r:.80}")
    return listed
