"""What both Fabric strategies (``GradCompFabricStrategy``, ``GradCompFabricFSDPStrategy``) do with the exchange
they hold in ``gradcomp``, written once: its figures and summary, its making, the inner steps counted for local
updates, clipping refused after signs, and the exchange state carried by ``fabric.save``/``fabric.load`` (each
rank its own part); the backward and the close at teardown are :class:`HoldsExchange`'s.

It imports no Lightning (the strategy modules do, and Lightning's import registers them: a module they both
import must be complete before that happens).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.exchange.checkpoint import (
    agree_on_the_save,
    CHECKPOINT_KEY,
    has_parts,
    is_parts_stub,
    parts_stub,
    resolve_entry,
    resolve_entry_on_every_rank,
    save_part,
)
from lightning_gradcomp.lightning.options import check_clipping_after_signs
from lightning_gradcomp.lightning.step_figures import HoldsExchange, outer_loop_metrics
from lightning_gradcomp.local.handle import LocalUpdateHandle
from lightning_gradcomp.metrics.netmodel import Network
from lightning_gradcomp.metrics.stats import StepStats
from lightning_gradcomp.wiring.plan import attach_exchange, ExchangePlan


class FabricExchange(HoldsExchange):
    """Mixin of the Fabric strategies, before Fabric's strategy class in the bases. The host sets
    ``options`` (the exchange options), ``local_updates``, ``fault_tolerance``, ``global_device`` and
    ``telemetry``; ``gradcomp`` is the handle (``None`` until the model is set up)."""

    options: Any
    local_updates: Any
    #: an entry ``fabric.load`` read before the model was set up
    _pending_entry: Optional[dict[str, Any]] = None

    @property
    def compressor(self) -> Compressor:
        return self.options.compressor

    @property
    def step_stats(self) -> StepStats:
        """The figures of the latest completed backward pass (empty before the model is set up)."""
        return self.gradcomp.step_stats if self.gradcomp is not None else StepStats()

    def summary(self, network: Optional[Network] = None) -> str:
        """The end-of-training table (:mod:`lightning_gradcomp.metrics.summary`), averaged over ranks; every rank
        calls it (print it on rank 0: ``fabric.print(fabric.strategy.summary())``)."""
        if self.gradcomp is None:
            raise RuntimeError(f"{type(self).__name__}.summary(): no model has been set up yet (fabric.setup)")
        return self.gradcomp.summary(network)

    def metrics(self) -> dict[str, float]:
        """This rank's ``gradcomp/*`` figures of the latest step (bytes sent, dense bytes, ratio, density;
        with ``telemetry=True`` the compression error and time), and under local updates, after a step that
        merged a synchronisation, ``gradcomp/outer_grad_norm`` (and the quorums' figures under fault
        tolerance): ``fabric.log_dict(fabric.strategy.metrics(), step=step)``. No communication: log them
        from any rank."""
        if self.gradcomp is None:
            return {}
        stats = self.gradcomp.step_stats
        figures = stats.metrics()
        if stats.grad_sq > 0:  # measured (telemetry): the names CompressionMonitor logs under the Trainer
            figures.update({"gradcomp/step_error": stats.error_sq, "gradcomp/relative_error": stats.relative_error,
                            "gradcomp/compress_ms": 1e3 * stats.compress_s})
        loop = getattr(self.gradcomp, "loop", None)
        if loop is not None and loop.synced:
            figures.update(outer_loop_metrics(loop))
        return figures

    def _attach_exchange(self, module: Any, caller: str, exchange_thread: Optional[bool] = None,
                         **layout: Any) -> None:
        """The exchange of ``module`` (``layout``: its DDP wrapper or mesh, see
        :func:`~lightning_gradcomp.wiring.attach_exchange`), into which the entry ``fabric.load`` read before
        goes; under fault tolerance this Fabric is one replica group and the quorum is taken now."""
        plan = ExchangePlan(self.options, self.local_updates, self.fault_tolerance, self.global_device,
                            exchange_thread=exchange_thread, telemetry=self.telemetry, caller=caller)
        self.gradcomp = attach_exchange(module, plan, **layout)
        if isinstance(self.gradcomp, LocalUpdateHandle):
            self.gradcomp.counted_by_strategy = f"{caller}(local_updates=...)"
        if self._pending_entry is not None:
            entry, self._pending_entry = self._pending_entry, None
            self.gradcomp.load_state_dict(entry)

    # ------------------------------------------------------------------ steps
    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The inner step; with local updates every ``H``-th step of the first optimizer set up is followed
        by the outer synchronisation (the strategy counts: ``gradcomp.step()`` is refused)."""
        output = super().optimizer_step(optimizer, **kwargs)  # type: ignore[misc]
        handle = self.gradcomp
        if isinstance(handle, LocalUpdateHandle) and handle.optimizers and \
                optimizer in (handle.optimizers[0], getattr(handle.optimizers[0], "optimizer", None)):
            handle.step_for_the_strategy()
        return output

    @override
    def clip_gradients_norm(self, module: Any, optimizer: Any, max_norm: Union[float, int],
                            norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        """Fabric's clipping, refused after a compressor that hands the optimizer signs (DeMo)."""
        if self.local_updates is None:
            check_clipping_after_signs(self.compressor, f"fabric.clip_gradients(max_norm={max_norm!r})",
                                       "no fabric.clip_gradients")
        return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)  # type: ignore[misc]

    @override
    def clip_gradients_value(self, module: Any, optimizer: Any, clip_val: Union[float, int]) -> None:
        """Fabric's clipping by value, refused after a compressor that hands the optimizer signs."""
        if self.local_updates is None:
            check_clipping_after_signs(self.compressor, f"fabric.clip_gradients(clip_val={clip_val!r})",
                                       "no fabric.clip_gradients")
        return super().clip_gradients_value(module, optimizer, clip_val)  # type: ignore[misc]

    # ------------------------------------------------------------------ checkpointing
    @override
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:
        """Fabric's checkpoint, and each rank's part of the exchange state (residuals; under local updates its
        replica, inner-optimizer and outer state) written by that rank beside it (``<path>.gradcomp/``) or
        inside a sharded checkpoint's directory (``<path>/gradcomp/``): nothing is gathered on one rank, so
        the checkpoint's cost per rank does not grow with the number of ranks. Under local updates the model
        saved is ``θ_global``. Every rank calls ``fabric.save``, as Fabric requires (checked, bounded: a save on
        some ranks only raises ``WaitTimeout`` after ``GRADCOMP_WAIT_TIMEOUT``, naming the absent ranks)."""
        part = None
        if self.gradcomp is not None:
            if CHECKPOINT_KEY in state:
                raise ValueError(f"fabric.save: the key {CHECKPOINT_KEY!r} holds the compression state; "
                                 "allowed: any other name for your own entries")
            agree_on_the_save(path, self.gradcomp.hook_state._agreement_group, "fabric.save")
            part = self.gradcomp.rank_state_dict()  # before global_weights(): the replica is this rank's
            state = {**state, CHECKPOINT_KEY: parts_stub(part)}
        if isinstance(self.gradcomp, LocalUpdateHandle):
            with self.gradcomp.global_weights():
                super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)  # type: ignore[misc]
        else:
            super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)  # type: ignore[misc]
        if part is not None:
            save_part(path, self.global_rank, part)  # type: ignore[attr-defined]

    @override
    def load_checkpoint(self, path: Any, state: Optional[Any] = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Fabric's load; with a ``state`` dict this rank's part of the exchange state is restored too (now, or
        when the model is set up). Its parts missing, a load that resumes training (``state`` holds an optimizer)
        is refused on every rank, with the reason; a load of the model alone (evaluation, fine-tuning) goes on
        without them. A checkpoint written before the parts existed holds every rank's state in its
        ``"gradcomp"`` entry, read as before. The entry is left out of the returned remainder."""
        remainder = self._load_from_fabric(path, state, strict, weights_only)
        if isinstance(state, dict) and state:
            entry = remainder.pop(CHECKPOINT_KEY, None)
            resuming = any(isinstance(getattr(value, "optimizer", value), Optimizer) for value in state.values())
            if is_parts_stub(entry) and not resuming and not has_parts(path):
                return remainder  # the model alone (evaluation, fine-tuning) of a checkpoint copied without its parts
            if self.gradcomp is not None:
                entry = resolve_entry_on_every_rank(entry, path, self.global_rank, self.world_size,  # type: ignore[attr-defined]
                                                    self.gradcomp.hook_state._agreement_group, "fabric.load")
                if entry is not None:
                    self.gradcomp.load_state_dict(entry)
            else:
                self._pending_entry = resolve_entry(entry, path, self.global_rank, self.world_size)  # type: ignore[attr-defined]
        return remainder

    def _load_from_fabric(self, path: Any, state: Optional[Any], strict: bool,
                          weights_only: Optional[bool]) -> dict[str, Any]:
        """Fabric's own load (a strategy translates its errors here)."""
        return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)  # type: ignore[misc]
