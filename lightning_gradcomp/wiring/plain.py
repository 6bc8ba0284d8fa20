"""The plain PyTorch entry points: :func:`register` (DDP), :func:`register_fsdp` (compressed HSDP) and
:func:`local_updates` (DiLoCo and its family, whole or sharded, fault-tolerant or not). Each takes the
keywords of :class:`~lightning_gradcomp.ExchangeOptions` and its own, checks what only it can, and calls
the one wiring, :func:`~lightning_gradcomp.wiring.plan.attach_exchange`."""

from __future__ import annotations

from datetime import timedelta
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.core.fsdp2 import check_mesh, sharded_modules
from lightning_gradcomp.ddp.handle import check_ddp_model, GradCompHandle
from lightning_gradcomp.exchange.checkpoint import DEFAULT_CHECKPOINT_TIMEOUT
from lightning_gradcomp.exchange.options import ExchangeOptions
from lightning_gradcomp.fsdp.handle import FSDPHandle
from lightning_gradcomp.local.config import Fragments, LocalUpdates, OuterOptimizerFactory
from lightning_gradcomp.local.fault_tolerance import FaultTolerance
from lightning_gradcomp.local.handle import check_optimizers, check_steps_the_model, LocalUpdateHandle
from lightning_gradcomp.wiring.plan import attach_exchange, ExchangePlan


def register(
    ddp_model: DistributedDataParallel,
    compressor: Union[Compressor, str] = "topk",
    *,
    error_feedback: Optional[bool] = None,
    min_compress_numel: int = 1024,
    seed: int = 0,
    exchange_thread: Optional[bool] = None,
    telemetry: bool = False,
    timeout: Union[timedelta, float] = DEFAULT_CHECKPOINT_TIMEOUT,
) -> GradCompHandle:
    """Install the compressed exchange on a ``DistributedDataParallel`` model (any backend, CPU or GPU).

    Args:
        ddp_model: the DDP-wrapped model; its process group is the exchange's.
        compressor, error_feedback, min_compress_numel, seed, exchange_thread: as for
            :class:`~lightning_gradcomp.GradCompStrategy`.
        telemetry: also measure the compression error ``Σ‖p − C(p)‖²`` and the time spent compressing
            (``step_stats.error_sq``, ``compress_s``...); off, the hook does no extra work.
        timeout: how long :meth:`GradCompHandle.state_dict` (a collective) waits for the other ranks
            before it raises (a ``timedelta`` or seconds; default 5 minutes): a script that calls it on rank 0
            only fails with advice instead of hanging. A dead peer fails the exchange after the process
            group's own timeout.

    Returns:
        a :class:`GradCompHandle` with ``bind(optimizer)``, ``step_stats``, ``totals``, ``summary()``,
        ``state_dict()`` and ``load_state_dict()``.
    """
    plan = ExchangePlan(ExchangeOptions(compressor, error_feedback, min_compress_numel, seed),
                        exchange_thread=exchange_thread, telemetry=telemetry, timeout=timeout, caller="register()")
    handle = attach_exchange(check_ddp_model(ddp_model).module, plan, ddp=ddp_model)
    assert isinstance(handle, GradCompHandle)
    return handle


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
    plan = ExchangePlan(ExchangeOptions(compressor, error_feedback, min_compress_numel, seed), telemetry=telemetry,
                        timeout=timeout, caller="register_fsdp()")
    check_mesh(mesh)  # the mesh names the row: refused here, before the model's layout is read
    handle = attach_exchange(model, plan, mesh=mesh)
    assert isinstance(handle, FSDPHandle)
    return handle


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
        timeout: as for :func:`~lightning_gradcomp.register`, for :meth:`LocalUpdateHandle.state_dict`.
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
    bare = model.module if isinstance(model, DistributedDataParallel) else model
    optimizers = check_optimizers(optimizers)
    check_steps_the_model(optimizers[0], bare)
    plan = ExchangePlan(ExchangeOptions(compressor, error_feedback, min_compress_numel, seed),
                        LocalUpdates(sync_every, outer_optimizer, fragments, delay, alpha, overlap, window_seconds,
                                     weight_by),
                        fault_tolerance, global_device, telemetry=telemetry, timeout=timeout,
                        caller="local_updates()" if fault_tolerance is None else "local_updates(fault_tolerance=...)")
    sharded = mesh is not None or bool(sharded_modules(bare))
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("gradcomp.local_updates: torch.distributed is not initialised; call "
                           "dist.init_process_group(...) first (or use SimulatedLocalUpdates on one device)")
    if sharded and fault_tolerance is not None and (mesh is not None or group is not None):
        raise ValueError("gradcomp.local_updates: with fault_tolerance a sharded model is one replica group sharded "
                         "over this job's world (fully_shard(module, mesh=init_device_mesh(device, (world_size,)))), "
                         "and torchft joins the groups; allowed: mesh=None, group=None")
    if sharded and fault_tolerance is None and mesh is None:
        raise ValueError("gradcomp.local_updates: `model` is sharded with FSDP2 (fully_shard); pass the 2-D mesh its "
                         "replicas form, mesh=init_device_mesh(..., mesh_dim_names=('replicate', 'shard')), with "
                         "fully_shard(..., mesh=mesh['shard'])")
    if sharded and group is not None:
        raise ValueError("gradcomp.local_updates: `group` is for a whole model; a sharded model's replicas exchange "
                         "over mesh['replicate'] (leave group=None)")
    if fault_tolerance is not None and group is not None:
        raise ValueError("gradcomp: fault_tolerance exchanges over torchft's group of the replica groups; allowed: "
                         "group=None")
    handle = attach_exchange(model, plan, mesh=mesh, group=group, optimizers=optimizers)
    assert isinstance(handle, LocalUpdateHandle)
    return handle
