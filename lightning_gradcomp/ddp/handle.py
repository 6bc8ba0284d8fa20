"""Plain PyTorch: compressed gradients on a bare ``DistributedDataParallel`` model, in one call.

::

    ddp = DistributedDataParallel(model)
    gradcomp = lightning_gradcomp.register(ddp, compressor=TopK(0.01))
    ...
    loss.backward()          # buckets are exchanged compressed
    gradcomp.step_stats      # this step's bytes, ratio, density
    entry = gradcomp.state_dict()                        # every rank calls; the entry on rank 0, None elsewhere
    if rank == 0: torch.save({"model": ddp.module.state_dict(), "gradcomp": entry}, path)
    gradcomp.load_state_dict(torch.load(path, map_location="cpu")["gradcomp"])       # every rank, on resume

The hook, the exchange engine and the checkpoint format are those of the Lightning strategies.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp.compressors.base import Compressor, get_compressor
from lightning_gradcomp.core.checks import check_bool
from lightning_gradcomp.ddp.checkpoint import gather_entry, restore_entry
from lightning_gradcomp.ddp.hook import GradCompHookState, gradcomp_hook
from lightning_gradcomp.metrics.netmodel import Network
from lightning_gradcomp.metrics.stats import StepStats
from lightning_gradcomp.metrics.summary import summarise


class GradCompHandle:
    """What :func:`register` returns: the compressed exchange of one DDP model on this rank.

    Attributes:
        hook_state: the :class:`~lightning_gradcomp.ddp.hook.GradCompHookState` (configuration, memory,
            accounting).
        compressor: the compressor the exchange was configured with.
    """

    def __init__(self, hook_state: GradCompHookState, compressor: Compressor, device: torch.device) -> None:
        self.hook_state = hook_state
        self.compressor = compressor
        self.device = device

    def use_compressor(self, compressor: Union[Compressor, str, None]) -> None:
        """Switch the compressor between two steps (a name or an instance; ``None``: send uncompressed).
        Residuals and compressor state are kept, keyed by parameter name. This is how a schedule changes
        the compression: DDP accepts one communication hook per model, so :func:`register` cannot be called
        again on the same model."""
        self.hook_state.use_compressor(None if compressor is None else get_compressor(compressor))

    # ------------------------------------------------------------------ the hook's entry point
    def exchange(self, bucket: dist.GradBucket) -> Future:
        """Called by DDP through :func:`~lightning_gradcomp.ddp.hook.gradcomp_hook` for every bucket (the
        first bucket of a step closes the figures of the step before, without waiting for the device)."""
        return self.hook_state.exchange(bucket)

    # ------------------------------------------------------------------ figures
    @property
    def step_stats(self) -> StepStats:
        """The figures of the latest completed backward pass (bytes handed to ``torch.distributed``,
        dense bytes, ratio, density; with telemetry the measured error and time, read from the device
        now); read it after ``backward()``."""
        return self.hook_state.last_step_stats

    @property
    def totals(self) -> StepStats:
        """Running totals of every completed step (part of :meth:`state_dict`)."""
        self.hook_state.flush()  # closes the step that ended, if any
        return self.hook_state.totals

    @property
    def failure(self) -> Optional[BaseException]:
        """The first error of an exchange (a :class:`~lightning_gradcomp.CollectiveError` when a peer
        died), ``None`` while all went well. DDP's ``backward()`` raises it as a ``RuntimeError`` whose
        message carries the error's type and message; ``with exchange_failures(handle):`` around the
        backward (or ``raise handle.failure``) gives the error itself."""
        return self.hook_state.failure

    def summary(self, network: Optional[Network] = None) -> str:
        """The end-of-training table (averaged over ranks; every rank must call it), the last step
        included. With ``network``, the estimated communication time of the run next to dense DDP's."""
        self.hook_state.flush()
        group = self.hook_state.driver.group

        def mean_over_ranks(values: torch.Tensor) -> torch.Tensor:
            values = values.to(self.device)
            dist.all_reduce(values, group=group)
            return values.cpu() / dist.get_world_size(group)

        return summarise(self.hook_state, self.compressor, dist.get_world_size(group), network, mean_over_ranks,
                         optimizer_steps=self._optimizer_steps())

    def _optimizer_steps(self) -> Optional[int]:
        """The optimizer steps the exchanges covered when that is not one each (local updates), else ``None``."""
        return None

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> Optional[dict[str, Any]]:
        """Every rank's residuals, compressor state, step and totals, gathered on rank 0 in the format of
        the Lightning checkpoints' ``checkpoint["gradcomp"]``; ``None`` on the other ranks. A
        collective: every rank must call it (then save on rank 0). Gathered in host memory (over gloo),
        never on a GPU."""
        return gather_entry(self.hook_state, self.compressor)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's part of a :meth:`state_dict`: every rank loads the same entry, the one
        rank 0's :meth:`state_dict` returned and saved (load it with ``map_location="cpu"``; each rank
        moves only its own part to its device). A run with another number of workers or another
        compressor keeps only the step counter and the totals, with a warning."""
        if not isinstance(state, dict):
            raise ValueError(
                f"`state` must be the dict that state_dict() returned on rank 0, got {type(state).__name__}: "
                "state_dict() returns None on the other ranks, so save rank 0's entry and load that saved entry "
                "on every rank, e.g. gradcomp.load_state_dict(torch.load(path, map_location='cpu')['gradcomp'])"
            )
        workers = dist.get_world_size(self.hook_state.driver.group)
        rank = dist.get_rank(self.hook_state.driver.group)
        restore_entry(state, self.hook_state, workers, self.compressor,
                      lambda ranks: self.hook_state.load_state_dict(ranks[rank], self.device))

    def close(self) -> None:
        """Stop the exchange thread, if one runs."""
        self.hook_state.close()


def register(
    ddp_model: DistributedDataParallel,
    compressor: Union[Compressor, str] = "topk",
    *,
    error_feedback: Optional[bool] = None,
    min_compress_numel: int = 1024,
    seed: int = 0,
    exchange_thread: Optional[bool] = None,
    telemetry: bool = False,
) -> GradCompHandle:
    """Install the compressed exchange on a ``DistributedDataParallel`` model (any backend, CPU or GPU).

    Args:
        ddp_model: the DDP-wrapped model; its process group is the exchange's.
        compressor, error_feedback, min_compress_numel, seed, exchange_thread: as for
            :class:`~lightning_gradcomp.GradCompStrategy`.
        telemetry: also measure the compression error ``Σ‖p − C(p)‖²`` and the time spent compressing
            (``step_stats.error_sq``, ``compress_s``...); off, the hook does no extra work.

    Returns:
        a :class:`GradCompHandle` with ``step_stats``, ``totals``, ``summary()``, ``state_dict()`` and
        ``load_state_dict()``.
    """
    if _is_sharded(ddp_model):
        raise ValueError(
            f"gradcomp: register() compresses the buckets of a DistributedDataParallel model; got a sharded model "
            f"({type(ddp_model).__name__}: fully_shard / FullyShardedDataParallel), whose gradients FSDP reduce-scatters "
            "itself. Compressing FSDP's traffic between replicas (HSDP) is not supported yet; allowed: a model "
            "replicated on every rank, wrapped in torch.nn.parallel.DistributedDataParallel")
    if not isinstance(ddp_model, DistributedDataParallel):
        raise ValueError(f"`ddp_model` must be a torch.nn.parallel.DistributedDataParallel, got "
                         f"{type(ddp_model).__name__}; wrap the model first: DistributedDataParallel(model)")
    if getattr(ddp_model, "_comm_hooks", None):
        raise ValueError(
            "gradcomp: this DistributedDataParallel model already has a communication hook (an earlier register() "
            "or register_comm_hook), and DDP accepts one per model. To change the compression between steps, "
            "call use_compressor(...) on the handle the first register() returned; otherwise wrap a new "
            "DistributedDataParallel")
    check_reducer(ddp_model)
    names = {id(p): name for name, p in ddp_model.module.named_parameters()}
    device = next(ddp_model.module.parameters()).device
    hook_state = GradCompHookState(compressor, names, error_feedback=error_feedback,
                                   min_compress_numel=min_compress_numel, seed=seed,
                                   group=ddp_model.process_group, exchange_thread=exchange_thread, device=device)
    hook_state.telemetry = check_bool(telemetry, "telemetry")
    handle = GradCompHandle(hook_state, hook_state.compressor, device)
    ddp_model.register_comm_hook(handle, gradcomp_hook)
    return handle


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
