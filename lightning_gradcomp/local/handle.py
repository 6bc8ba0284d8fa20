"""The local-update adapter's handle and its builders (the rows of :func:`~lightning_gradcomp.wiring.attach_exchange`
for a whole model); the public entry point is :func:`lightning_gradcomp.local_updates`.
"""

from __future__ import annotations

import gc
import warnings
from typing import Any, Callable, ContextManager, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from lightning_gradcomp.exchange.agreement import check_agreement, model_layout
from lightning_gradcomp.exchange.handle import (
    ExchangeHandle,
    refuse_parameters_replaced_by_sharding,
    steps_the_model,
)
from lightning_gradcomp.exchange.options import ExchangeOptions
from lightning_gradcomp.exchange.session import ExchangeSession
from lightning_gradcomp.local.config import LocalUpdates
from lightning_gradcomp.local.fault_tolerance import (
    fault_tolerant_loop,
    FaultTolerance,
    MembershipFigures,
    TorchftMembership,
    torchft_module,
)
from lightning_gradcomp.local.loop import LocalUpdateLoop, WholeModel


#: the warning of a resume that keeps the counters only (another number of workers, compressor or layout)
LOCAL_STATE_DROPPED = (
    "gradcomp: the checkpoint's local-update state belongs to another number of workers, compressor or shard "
    "layout, so it is dropped too: every worker's replica and inner-optimizer state, the outer optimizer's state "
    "and the window position. Training goes on from the model as loaded (the checkpoint's model, θ_global) as if "
    "a synchronisation had just happened")


class LocalUpdateHandle(ExchangeHandle):
    """What :func:`local_updates` returns: this rank's outer loop, its figures and checkpoint.

    Attributes:
        loop: the :class:`~lightning_gradcomp.local.loop.LocalUpdateLoop`.
        optimizers: the inner optimizers (their per-rank states go into :meth:`state_dict`).
    """

    def __init__(self, loop: LocalUpdateLoop, optimizers: Sequence[Optimizer], device: torch.device,
                 refuse_ddp: bool = False, follow_evaluation: bool = True) -> None:
        super().__init__(loop.exchange, loop.exchange.compressor, device)
        self.loop = loop
        self.optimizers = list(optimizers)
        self._counted_by_hook = False  # the last optimizer step was counted by the hook, not yet by step()
        self._last_synced = False
        self._hook: Optional[Any] = None
        #: the check of the model's DistributedDataParallel wrappers still due at the first step (one made after
        #: :func:`local_updates`): refused (the model must not be driven through DDP), or, for a fault-tolerant
        #: group of several processes, required (:attr:`wrapper_check`)
        self.wrapper_check: Optional[Callable[[torch.nn.Module], None]] = refuse_gradient_all_reduce if refuse_ddp else None
        #: the strategy (Fabric's) that calls :meth:`step` after each optimizer step itself, if one does
        self.counted_by_strategy: Optional[str] = None
        self._strategy_counting = False
        #: evaluation sees θ_global: before each forward pass of the model, :meth:`LocalUpdateLoop.follow_forward`
        # (prepended: before FSDP2's own pre-hook gathers the root's parameters); not where the caller shows
        # θ_global to evaluation itself (the Trainer's DDP strategy)
        self._evaluation_hook = (loop.module.register_forward_pre_hook(self._before_forward, prepend=True)
                                 if follow_evaluation else None)

    @torch.compiler.disable
    def _before_forward(self, module: torch.nn.Module, _args: Any) -> None:
        """A forward pass of the model (not of a copy, which carries the hook too): in eval mode without
        gradients it evaluates, and sees θ_global; otherwise the replica. Never compiled: a ``torch.compile``'d
        model (LitGPT's default) leaves the graph here and runs it at every call (traced into the graph, it ran
        once, when compiled, and evaluation saw the replica); the compiled code reads the parameters it is
        then given. (``fullgraph=True`` refuses that break: evaluate inside ``global_weights()`` there.)"""
        if module is self.loop.module:
            self.loop.follow_forward(not module.training and not torch.is_grad_enabled())

    @property
    def optimizer_steps(self) -> int:
        """Inner iterations counted so far: the position in the schedule (a group that joined a running
        fault-tolerant job starts from its peers')."""
        return self.loop.outer.optimizer_steps

    def count(self, samples: int) -> None:
        """Report the samples (or, with ``weight_by="tokens"``, the tokens) of the coming inner step, before its
        optimizer step: each rank's outer gradient is weighted by what it processed in the window
        (:mod:`~lightning_gradcomp.local.windows`). Optional; without it each inner step counts as one (equal
        batch sizes); call it on every rank or on none."""
        self._refuse_after_close("count()")
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
            raise ValueError(f"count(): `samples` must be an int >= 0 (the samples or tokens of this inner step), "
                             f"got {samples!r}")
        self.loop.count(samples)

    def run_for(self, steps: int) -> None:
        """Say how many inner steps this rank's loop takes in all (from the start, not from now). Needed under
        time-boxed windows (``window_seconds``), where the groups take different numbers of steps: when the
        first group's steps are about to run out, every group plans the last window together and
        :attr:`finished` turns True on every rank at its end; stop the loop then. The Trainer strategies say it
        themselves."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"run_for(): `steps` must be an int >= 1 (the inner steps this loop takes in all), got "
                             f"{steps!r}")
        self.loop.clock.run_for(steps)

    @property
    def finished(self) -> bool:
        """Whether a time-boxed run (``window_seconds``) reached the end every group planned (see
        :meth:`run_for`); always False in lock-step, where each loop ends at its own step count."""
        return self.loop.finished

    def count_optimizer_steps(self, optimizer: Optimizer) -> None:
        """Count an iteration whenever ``optimizer`` steps (``Optimizer.register_step_post_hook``), so that a
        loop cannot forget :meth:`step` (:func:`local_updates` hooks the first inner optimizer). The first
        call of :meth:`step` takes the counting back (see there)."""
        def counted(*_: Any) -> None:
            self._last_synced = self._step()
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
        self._refuse_after_close("step()")
        if self.counted_by_strategy and not self._strategy_counting:
            raise RuntimeError(f"gradcomp: step(): {self.counted_by_strategy} counts the inner steps itself (in "
                               "optimizer.step()); calling step() as well would count each iteration twice (a "
                               "synchronisation every H/2 iterations): leave it out")
        if self._stop_counting_optimizer_steps() and self._counted_by_hook:
            self._counted_by_hook = False
            return self._last_synced
        return self._step()

    def _step(self) -> bool:
        if self.wrapper_check is not None:  # a DistributedDataParallel made after local_updates()
            check, self.wrapper_check = self.wrapper_check, None
            check(self.loop.module)
        return self.loop.step()

    def _stop_counting_optimizer_steps(self) -> bool:
        """Remove the optimizer's step hook; whether there was one."""
        if self._hook is None:
            return False
        self._hook.remove()
        self._hook = None
        return True

    def sync(self) -> bool:
        """Synchronise now, on every rank (a collective: every rank calls it at the same point): merge the
        exchanges in flight, exchange the fragments whose parameters moved since their last
        synchronisation, and set the model (parameters and floating-point buffers) to ``θ_global`` on every
        rank. Call it when training ends, so that a partial window's steps are not lost and every rank
        holds the same weights. Whether anything was exchanged.

        The schedule goes on from the step counter (the next window is shorter); a resume from a
        checkpoint written before the :meth:`sync` continues as if it never happened."""
        self._refuse_after_close("sync()")
        return self.loop.sync()

    def _refuse_after_close(self, what: str) -> None:
        if self.closed:
            raise RuntimeError(f"gradcomp: {what} after close(): the handle no longer counts the optimizer's steps "
                               "nor runs the exchange; call sync() before close(), and close() when training ends")

    def step_for_the_strategy(self) -> bool:
        """:meth:`step`, called by a strategy that counts the inner steps itself (:attr:`counted_by_strategy`)."""
        self._strategy_counting = True
        try:
            return self.step()
        finally:
            self._strategy_counting = False

    def global_weights(self) -> ContextManager[None]:
        """``with handle.global_weights(): ...``: inside, the model holds ``θ_global`` and the buffers of the
        last synchronisation (by reference, no communication: rank 0 alone may enter it), for evaluation
        and for ``model.state_dict()`` in a checkpoint; afterwards the rank's replica again. Do not train
        inside."""
        return self.loop.global_weights()

    def close(self) -> None:
        """Stop counting the optimizer's steps and stop the exchange thread, if one runs."""
        self._stop_counting_optimizer_steps()
        self.loop.forget_first_use()
        if self._evaluation_hook is not None:
            self._evaluation_hook.remove()
        self.loop._leave_evaluation()
        super().close()

    def _optimizer_steps(self) -> Optional[int]:
        """The summary's bytes are per optimizer step too (the exchanges in flight counted first)."""
        self.loop.close()
        return self.loop.steps_taken_here

    def _dense_per_step(self) -> Optional[float]:
        return float(self.loop.dense_bytes_per_step())

    def bind(self, optimizer: Optimizer) -> None:
        """Refused: the compressor of local updates compresses outer gradients, and the inner optimizers are
        the training loop's own (they are not checked against it); the outer optimizer is ``outer_optimizer``
        of :func:`local_updates`."""
        raise ValueError("gradcomp: bind() checks the optimizer that a compressed gradient feeds; under local "
                         "updates the compressor sends outer gradients to the outer optimizer (local_updates(..., "
                         "outer_optimizer=...)), and the inner optimizers need no binding")

    def state_dict(self) -> Optional[dict[str, Any]]:
        """Every rank's residuals, parameters, inner-optimizer states and the outer state, gathered on rank 0
        (``None`` elsewhere). With it (and nothing else) a resume continues bit for bit, also in the middle
        of a window.

        A collective: every rank calls it at the same point; called on some ranks only, it raises
        :class:`~lightning_gradcomp.exchange.checkpoint.CheckpointTimeout` after the ``timeout`` of
        :func:`local_updates`, naming the fix. The model's own ``state_dict()`` for the same checkpoint is
        taken inside :meth:`global_weights` (``θ_global``; rank 0 alone may do that)."""
        return self._gather_entry(self.loop.state_dict(self.optimizers))

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's part of :meth:`state_dict` (its residuals, replica, inner-optimizer state and outer state),
        with no collective: each rank saves its own and loads it back with :meth:`load_state_dict`."""
        return self._own_entry(self.loop.state_dict(self.optimizers))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's part of a :meth:`state_dict` (every rank loads the entry rank 0 saved)."""
        rank, restored = self._restore(state, self._warn_if_no_local_state, advice="")
        if not restored and rank == 0:
            warnings.warn(LOCAL_STATE_DROPPED, UserWarning, stacklevel=2)

    def _warn_if_no_local_state(self, state: dict[str, Any]) -> None:
        ranks = state.get("ranks")
        saved = [entry for entry in ranks if entry is not None] if isinstance(ranks, list) else []
        if self._entry_position()[0] == 0 and saved and all(isinstance(entry, dict) and entry.get("local") is None
                                                            for entry in saved):
            warnings.warn("gradcomp: this checkpoint entry holds no local-update state (it was written by an exchange "
                          "every step: register(), register_fsdp() or a strategy without local_updates=): the window "
                          "starts afresh from the model as loaded, with its residuals and counters", UserWarning,
                          stacklevel=4)

    def _load_own(self, saved: dict[str, Any]) -> None:
        super()._load_own(saved)
        if saved.get("local") is not None:
            self.loop.load_state_dict(saved["local"], self.optimizers)

    def _restored_position(self) -> str:
        return f", inner step {self.loop.outer.optimizer_steps}"


class FaultTolerantHandle(LocalUpdateHandle):
    """:class:`LocalUpdateHandle` of a replica group under torchft (``local_updates(..., fault_tolerance=...)``):
    its checkpoint and summary are this group's own; :attr:`fault_tolerance` holds the quorums' figures."""

    @property
    def membership(self) -> TorchftMembership:
        """The loop's membership: torchft's quorums, votes and heals."""
        return self.loop.membership  # type: ignore[return-value]

    @property
    def fault_tolerance(self) -> MembershipFigures:
        """Participants per synchronisation, commits, rollbacks, heals, seconds waiting for quorums."""
        return self.membership.figures

    def summary(self, network: Optional[Any] = None) -> str:
        return f"{super().summary(network)}\n{self.fault_tolerance.describe()}"

    #: this job alone (its world): the groups' processes do not all-reduce outside a synchronisation
    _entry_covers_world = True

    def close(self) -> None:
        """Stop counting steps and leave the quorum (the other groups go on)."""
        super().close()
        self.loop.shutdown()


def attach(module: torch.nn.Module, config: LocalUpdates, options: ExchangeOptions, *,
           group: Optional[dist.ProcessGroup] = None, global_device: Optional[torch.device] = None,
           refuse_ddp: bool = False, follow_evaluation: bool = True, caller: str = "local_updates()"
           ) -> LocalUpdateHandle:
    """The outer loop of a whole ``module`` on this rank of ``group``, whose ranks hold the same values now
    (``refuse_ddp``: a ``DistributedDataParallel`` wrapper of ``module`` made later is refused at the first
    step, see :func:`refuse_gradient_all_reduce`). The overlapped exchanges (``delay > 0``) run on the
    session's thread."""
    device = next(module.parameters()).device
    session = ExchangeSession(**options.keywords(), group=group, exchange_thread=config.delay > 0, device=device,
                              settings=config.settings(), caller=caller)
    loop = LocalUpdateLoop(module, config, session, global_device=global_device)
    return LocalUpdateHandle(loop, [], device, refuse_ddp, follow_evaluation)


def attach_fault_tolerant(model: torch.nn.Module, config: LocalUpdates, options: ExchangeOptions,
                          fault_tolerance: FaultTolerance, *, global_device: Optional[torch.device] = None,
                          model_layout: Optional[WholeModel] = None, checkpoint_layout: Optional[str] = None,
                          ddp_inside: bool = False, follow_evaluation: bool = True,
                          caller: str = "local_updates(fault_tolerance=...)") -> FaultTolerantHandle:
    """The outer loop of one replica group under torchft (see :mod:`~lightning_gradcomp.local.fault_tolerance`);
    the quorum is taken now. ``model_layout``: how each rank holds the model (an FSDP2 model's shards:
    :class:`~lightning_gradcomp.local.sharded.ShardsOfModel`; default whole); ``checkpoint_layout``: the
    exchange layout its checkpoints record; ``ddp_inside``: the group's processes keep ``model`` equal with a
    ``DistributedDataParallel`` wrapper of their own making (``model`` may be the wrapper): they start equal
    now, and the wrapper is checked at the first step; ``follow_evaluation``: see :class:`LocalUpdateHandle`."""
    torchft_module()
    fault_tolerance = fault_tolerance.for_group()
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    if ddp_inside:
        broadcast_from_first_rank(model)  # the group's replicas start equal, wrapped in DDP now or later
    device = next(model.parameters()).device
    # no exchange thread of its own: the loop runs the overlapped exchanges (delay > 0) on torchft's group
    session = ExchangeSession(**options.keywords(), exchange_thread=False, device=device, settings=config.settings(),
                              caller=caller)
    if checkpoint_layout is not None:
        session.layout = checkpoint_layout
    loop = fault_tolerant_loop(model, config, session, fault_tolerance, global_device=global_device, layout=model_layout)
    handle = FaultTolerantHandle(loop, [], device, follow_evaluation=follow_evaluation)
    if ddp_inside:
        handle.wrapper_check = require_gradient_all_reduce
    return handle


def start_replicas_equal(model: torch.nn.Module, group: Optional[dist.ProcessGroup], caller: str) -> None:
    """A bare model trained with local updates on every rank of ``group``: no ``DistributedDataParallel`` may
    drive it (:func:`refuse_driving_by_ddp`), and every rank starts from the first rank's values. The
    ranks agree on the model before the broadcast (a rank that never comes is named within
    ``GRADCOMP_WAIT_TIMEOUT``; differently shaped models would broadcast silently on gloo)."""
    refuse_driving_by_ddp(model)
    check_agreement({"entry point": caller, **model_layout(model)}, group, caller=caller)
    broadcast_from_first_rank(model, group)


def refuse_driving_by_ddp(model: torch.nn.Module) -> None:
    """A bare model trained with local updates: not a ``DistributedDataParallel`` wrapper, and no wrapper of it
    may all-reduce its gradients (refused now and at the first step, :func:`refuse_gradient_all_reduce`)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise ValueError("`model` must be the bare model: local updates do not all-reduce gradients, so "
                         "DistributedDataParallel is not wanted (pass ddp.module, and call it in the loop)")
    refuse_gradient_all_reduce(model)


def check_optimizers(optimizers: object) -> list[Optimizer]:
    """``optimizers`` as a non-empty list of ``torch.optim.Optimizer``: the first one's steps count the window,
    so with none no synchronisation would ever happen."""
    if isinstance(optimizers, Optimizer):
        return [optimizers]
    listed = list(optimizers) if isinstance(optimizers, (list, tuple)) else None
    if not listed or not all(isinstance(optimizer, Optimizer) for optimizer in listed):
        raise ValueError(
            "`optimizers` must be the inner torch.optim.Optimizer that steps the model, or a non-empty list of them "
            "(the first one's steps count the window: with none, no synchronisation would ever happen); got "
            f"{optimizers!r:.80}")
    return listed


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


def check_global_device(value: Optional[Union[str, torch.device]]) -> Optional[torch.device]:
    """``global_device``: ``None`` (the parameters' device) or the CPU (host memory)."""
    if value is None:
        return None
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type != "cpu":
        raise ValueError(f"`global_device` must be None (θ_global on the parameters' device) or 'cpu' (host "
                         f"memory), got {value!r}")
    return device


def refuse_gradient_all_reduce(model: torch.nn.Module) -> None:
    """Make a ``DistributedDataParallel`` wrapper of ``model`` that is still driven fail loudly: a loop that
    calls the wrapper's forward and backward all-reduces every gradient, so local updates would save
    nothing while their figures claimed savings (issue 36, item 2). Every live wrapper of ``model`` gets a
    communication hook that raises at its first all-reduce (a wrapper kept but not called stays silent);
    a wrapper that already has a hook is refused now. :func:`local_updates` looks when it is called and at
    the first optimizer step."""
    for wrapper in _ddp_wrappers_of(model):
        hooks = [hook for hook, _ in getattr(wrapper, "_comm_hooks", [])]
        if not hooks:
            wrapper.register_comm_hook(None, _refuse_all_reduce)
        elif hooks != [_refuse_all_reduce]:  # its own hook exchanges the gradients
            raise ValueError(_DDP_STILL_ON)


def require_gradient_all_reduce(model: torch.nn.Module) -> None:
    """A replica group of several processes under fault tolerance keeps its replicas equal with DDP's
    gradient all-reduce; without a wrapper they would drift apart between synchronisations, and each rank's
    part of the exchange would come from a different replica: refused at the first step."""
    wrappers = _ddp_wrappers_of(model)
    if not wrappers:
        raise ValueError(
            f"gradcomp.local_updates(fault_tolerance=...): this replica group has {dist.get_world_size()} processes, "
            "which must train one model: wrap it in DistributedDataParallel inside the group (ddp = "
            "DistributedDataParallel(model); call ddp(x) in the loop), or start one process per group, or shard "
            "the model with FSDP2 over the group's processes")
    if any(hook is _refuse_all_reduce for wrapper in wrappers for hook, _ in getattr(wrapper, "_comm_hooks", [])):
        raise ValueError("gradcomp.local_updates(fault_tolerance=...): the DistributedDataParallel wrapper inside the "
                         "group must all-reduce gradients (DDP's default), it has local updates' refusing hook")


_DDP_STILL_ON = (
    "gradcomp.local_updates: `model` is wrapped in DistributedDataParallel and the loop calls the wrapper, "
    "which all-reduces every gradient: local updates would save nothing. Local updates need no DDP: call the "
    "bare model in the training loop (model = ddp.module, and drop the wrapper); gradient accumulation needs "
    "no no_sync() either.")


def _refuse_all_reduce(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    raise RuntimeError(_DDP_STILL_ON)


# DDP checks a hook's annotations as objects; this module's are strings (``from __future__ import annotations``)
_refuse_all_reduce.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                                      "return": torch.futures.Future[torch.Tensor]}


def _ddp_wrappers_of(model: torch.nn.Module) -> list[torch.nn.parallel.DistributedDataParallel]:
    """The live ``DistributedDataParallel`` objects whose ``module`` is ``model`` (a scan of the garbage
    collector's objects: once at ``local_updates()``, once at the first step)."""
    ddp = torch.nn.parallel.DistributedDataParallel
    return [obj for obj in gc.get_objects() if isinstance(obj, ddp) and obj.module is model]


@torch.no_grad()
def broadcast_from_first_rank(model: torch.nn.Module, group: Optional[dist.ProcessGroup] = None,
                              part: Callable[[torch.Tensor], torch.Tensor] = lambda tensor: tensor.data) -> None:
    """Every parameter and buffer of ``model`` (``part`` of each: an FSDP2 model's local shards) set to the
    group's first rank's (as DDP does at wrapping)."""
    source = dist.get_global_rank(group, 0) if group is not None else 0
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(part(tensor), source, group=group)
