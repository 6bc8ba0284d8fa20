"""Plain PyTorch: local-update training of a bare model and its optimizer, in one call.

::

    dist.init_process_group("gloo")                     # or torchrun's environment, nccl
    model = Net().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=4e-4)
    diloco = lightning_gradcomp.local_updates(model, optimizer, sync_every=100, compressor="int8")
    for batch in loader:                                # each rank its own shard
        loss_fn(model(batch)).backward(); optimizer.step(); optimizer.zero_grad()
        diloco.step()                                   # optional: optimizer.step() already counted the step
    entry = diloco.state_dict()                         # every rank calls; the entry on rank 0, None elsewhere

The model is not wrapped in ``DistributedDataParallel``: nothing is communicated between two
synchronisations. The exchange state, engine and checkpoint format are those of the DDP hook.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.core.checks import check_bool
from lightning_gradcomp.ddp.checkpoint import gather_entry, restore_entry
from lightning_gradcomp.ddp.handle import GradCompHandle
from lightning_gradcomp.ddp.hook import GradCompHookState
from lightning_gradcomp.local.config import LocalUpdates, OuterOptimizerFactory
from lightning_gradcomp.local.loop import LocalUpdateLoop


class LocalUpdateHandle(GradCompHandle):
    """What :func:`local_updates` returns: this rank's outer loop, its figures and checkpoint.

    Attributes:
        loop: the :class:`~lightning_gradcomp.local.loop.LocalUpdateLoop`.
        optimizers: the inner optimizers (their per-rank states go into :meth:`state_dict`).
    """

    def __init__(self, loop: LocalUpdateLoop, optimizers: Sequence[Optimizer], device: torch.device) -> None:
        super().__init__(loop.exchange, loop.exchange.compressor, device)
        self.loop = loop
        self.optimizers = list(optimizers)
        self._counted_by_hook = False  # the last optimizer step was counted by the hook, not yet by step()
        self._last_synced = False
        self._hook: Optional[Any] = None

    def count_optimizer_steps(self, optimizer: Optimizer) -> None:
        """Count an iteration whenever ``optimizer`` steps (``Optimizer.register_step_post_hook``), so that a
        loop cannot forget :meth:`step` (:func:`local_updates` hooks the first inner optimizer). The first
        call of :meth:`step` takes the counting back (see there)."""
        def counted(*_: Any) -> None:
            self._last_synced = self.loop.step()
            self._counted_by_hook = True

        self._hook = optimizer.register_step_post_hook(counted)

    def step(self) -> bool:
        """Count one inner iteration, on every rank; every ``sync_every`` iterations the outer synchronisation
        runs (a collective). Whether it did.

        Optional: until the first call, the first inner optimizer's ``step()`` counts each iteration. The
        first call ends that (the hook is removed; an iteration the hook counted just before is not counted
        twice), and from then on every call counts one iteration, also one whose optimizer step a
        ``GradScaler`` skipped, so that the schedule stays the same on every rank: with a GradScaler, call
        it every iteration."""
        if self._stop_counting_optimizer_steps() and self._counted_by_hook:
            self._counted_by_hook = False
            return self._last_synced
        return self.loop.step()

    def _stop_counting_optimizer_steps(self) -> bool:
        """Remove the optimizer's step hook; whether there was one."""
        if self._hook is None:
            return False
        self._hook.remove()
        self._hook = None
        return True

    def close(self) -> None:
        """Stop counting the optimizer's steps and stop the exchange thread, if one runs."""
        self._stop_counting_optimizer_steps()
        super().close()

    def _optimizer_steps(self) -> Optional[int]:
        """The summary's bytes are per optimizer step too (the exchanges in flight counted first)."""
        self.loop.close()
        return self.loop.outer.optimizer_steps

    def exchange(self, bucket: dist.GradBucket) -> Any:  # pragma: no cover - no DDP hook here
        raise RuntimeError("gradcomp: local updates exchange outer gradients, not DDP buckets")

    def state_dict(self) -> Optional[dict[str, Any]]:
        """Every rank's residuals, parameters, inner-optimizer states and the outer state, gathered on rank 0
        (``None`` elsewhere); a collective. With it (and nothing else) a resume continues bit for bit, also
        in the middle of a window."""
        return gather_entry(self.hook_state, self.compressor, self.loop.state_dict(self.optimizers))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's part of a :meth:`state_dict` (every rank loads the entry rank 0 saved)."""
        if not isinstance(state, dict):
            raise ValueError(f"`state` must be the dict that state_dict() returned on rank 0, got "
                             f"{type(state).__name__}")
        group = self.hook_state.driver.group
        rank = dist.get_rank(group)

        def load(ranks: list[dict[str, Any]]) -> None:
            self.hook_state.load_state_dict(ranks[rank], self.device)
            if ranks[rank].get("local") is not None:
                self.loop.load_state_dict(ranks[rank]["local"], self.optimizers)

        restore_entry(state, self.hook_state, dist.get_world_size(group), self.compressor, load)


def local_updates(
    model: torch.nn.Module,
    optimizers: Union[Optimizer, Sequence[Optimizer]],
    sync_every: int = 100,
    compressor: Union[Compressor, str] = "none",
    *,
    outer_optimizer: Optional[OuterOptimizerFactory] = None,
    fragments: int = 1,
    delay: int = 0,
    alpha: float = 0.0,
    error_feedback: Optional[bool] = None,
    min_compress_numel: int = 1024,
    seed: int = 0,
    group: Optional[dist.ProcessGroup] = None,
    telemetry: bool = False,
) -> LocalUpdateHandle:
    """Train ``model`` with local updates on this rank of ``group`` (default: the world).

    Args:
        model: the bare model (not wrapped in ``DistributedDataParallel``); rank 0's values are broadcast
            now, so every rank starts from the same parameters.
        optimizers: the inner optimizer(s), each rank's own. The first one's ``step()`` counts each iteration
            (a step post-hook), so the loop needs no :meth:`LocalUpdateHandle.step` call; a loop that calls it
            after every iteration, as before (needed with a ``GradScaler``, which may skip a rank's step),
            takes the counting over at its first call.
        sync_every, outer_optimizer, fragments, delay, alpha: see
            :class:`~lightning_gradcomp.local.config.LocalUpdates` (``fragments``, ``delay``, ``alpha``:
            Streaming DiLoCo).
        compressor, error_feedback, min_compress_numel, seed: the outer gradients' compression, as for
            :class:`~lightning_gradcomp.GradCompStrategy` (default: uncompressed, DiLoCo).
        telemetry: also measure the compression error and time.
    """
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise ValueError("`model` must be the bare model: local updates do not all-reduce gradients, so "
                         "DistributedDataParallel is not wanted (pass ddp.module)")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("gradcomp.local_updates: torch.distributed is not initialised; call "
                           "dist.init_process_group(...) first (or use SimulatedLocalUpdates on one device)")
    optimizers = [optimizers] if isinstance(optimizers, Optimizer) else list(optimizers)
    config = LocalUpdates(sync_every, outer_optimizer, fragments, delay, alpha)
    broadcast_from_first_rank(model, group)
    handle = attach(model, optimizers, config, compressor, error_feedback=error_feedback,
                    min_compress_numel=min_compress_numel, seed=seed, group=group)
    handle.hook_state.telemetry = check_bool(telemetry, "telemetry")
    if optimizers:
        handle.count_optimizer_steps(optimizers[0])
    return handle


def attach(module: torch.nn.Module, optimizers: Sequence[Optimizer], config: LocalUpdates,
           compressor: Union[Compressor, str], error_feedback: Optional[bool] = None, min_compress_numel: int = 1024,
           seed: int = 0, group: Optional[dist.ProcessGroup] = None) -> LocalUpdateHandle:
    """The outer loop of ``module`` on this rank of ``group``, whose ranks hold the same values now."""
    device = next(module.parameters()).device
    names = {id(p): name for name, p in module.named_parameters()}
    hook_state = GradCompHookState(compressor, names, error_feedback=error_feedback,
                                   min_compress_numel=min_compress_numel, seed=seed, group=group,
                                   exchange_thread=config.delay > 0, device=device)
    return LocalUpdateHandle(LocalUpdateLoop(module, config, hook_state), optimizers, device)


@torch.no_grad()
def broadcast_from_first_rank(model: torch.nn.Module, group: Optional[dist.ProcessGroup] = None) -> None:
    """Every parameter and buffer of ``model`` set to the group's first rank's (as DDP does at wrapping)."""
    source = dist.get_global_rank(group, 0) if group is not None else 0
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.data, source, group=group)
