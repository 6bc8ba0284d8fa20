"""The handle the plain entry points return: the common part of DDP's, FSDP2's and the local updates'.

A handle wraps an :class:`~lightning_gradcomp.exchange.session.ExchangeSession` for the user: this step's
figures (``step_stats``), the running ``totals``, the end-of-training ``summary()`` (a collective), the
checkpoint entry (``state_dict()``/``load_state_dict()``, gathered on rank 0 over gloo), ``use_compressor``
and ``close``. :class:`GradientHandle` adds what a per-step exchange of gradients needs: the optimizer it
feeds, checked against the compressor and bound (``bind``, or at its first step by :class:`OptimizerWatch`),
and the fp16 ``GradScaler`` warning.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from lightning_gradcomp.compressors.base import Compressor, get_compressor
from lightning_gradcomp.exchange.checkpoint import (
    CheckpointTimeout,
    forget_checkpoint_group,
    gather_entry,
    own_entry,
    restore_entry,
)
from lightning_gradcomp.exchange.agreement import check_agreement
from lightning_gradcomp.exchange.session import ExchangeSession
from lightning_gradcomp.exchange.waits import Arrival
from lightning_gradcomp.metrics.netmodel import Network
from lightning_gradcomp.metrics.stats import StepStats
from lightning_gradcomp.metrics.summary import summarise


#: how the refusal of a ``state`` that is not a dict goes on (:meth:`ExchangeHandle.load_state_dict`)
_ADVICE = (": state_dict() returns None on the other ranks, so save rank 0's entry and load that saved entry on "
           "every rank, e.g. gradcomp.load_state_dict(torch.load(path, map_location='cpu')['gradcomp'])")


class ExchangeHandle:
    """What the plain entry points return (:func:`~lightning_gradcomp.register`,
    :func:`~lightning_gradcomp.register_fsdp`, :func:`~lightning_gradcomp.local_updates`): the compressed
    exchange of one model on this rank, its figures, summary and checkpoint entry.

    Attributes:
        hook_state: the :class:`~lightning_gradcomp.exchange.session.ExchangeSession` (configuration, memory,
            accounting).
        compressor: the compressor the exchange was configured with.
    """

    #: whether the checkpoint entry holds every rank of the world (each its own shard's or replica group's state)
    #: and the summary averages over them, instead of the exchange's group
    _entry_covers_world = False

    def __init__(self, hook_state: ExchangeSession, compressor: Compressor, device: torch.device) -> None:
        self.hook_state = hook_state
        self.compressor = compressor
        self.device = device
        #: the optimizers checked against the compressor and bound (:meth:`GradientHandle.bind`)
        self._bound: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
        #: ``id(parameter) -> name`` of the model's parameters, the names the exchange gives them (set by the
        #: entry point): a compressor that reads each parameter's group of the optimizer (DeMo's learning
        #: rate) finds it by them
        self.param_names: Optional[Mapping[int, str]] = None
        #: whether :meth:`close` ran (the model may then take another exchange)
        self.closed = False
        self._checkpoint_broken: Optional[str] = None  # the CheckpointTimeout that left the gathers out of step

    @property
    def checkpoint_group(self) -> Optional[dist.ProcessGroup]:
        """The gloo group of :meth:`state_dict`'s gather, made with the handle's ``timeout`` (``None``: the
        exchange state's, as under Fabric, whose saves every rank makes); kept on the exchange state, which
        releases it at exit."""
        return self.hook_state.handle_gather_group

    @checkpoint_group.setter
    def checkpoint_group(self, group: Optional[dist.ProcessGroup]) -> None:
        self.hook_state.handle_gather_group = group

    def use_compressor(self, compressor: Union[Compressor, str, None]) -> None:
        """Switch the compressor between two steps (a name or an instance; ``None``: send uncompressed).
        Residuals and compressor state are kept, keyed by parameter name. This is how a schedule changes
        the compression: a model takes one exchange at a time (DDP accepts one communication hook, and a second
        registration is refused while this handle is open). The optimizers bound (:meth:`GradientHandle.bind`)
        are checked against the new compressor first (``ValueError`` on a conflict, and the compressor stays
        as it was)."""
        new = None if compressor is None else get_compressor(compressor)
        if new is not None:
            for optimizer in list(self._bound):
                new.check_optimizer(optimizer, names=self.param_names)
        self.hook_state.use_compressor(new)

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
        if network is not None and not isinstance(network, Network):
            raise ValueError(f"`network` must be None or a lightning_gradcomp.Network, e.g. "
                             f"Network(bandwidth_gbps=10, latency_us=50), got {network!r}")
        self.hook_state.flush()
        group = self._summary_group()

        def mean_over_ranks(values: torch.Tensor) -> torch.Tensor:
            values = values.to(self._collective_device())
            arrival = Arrival("summary()", group, "every rank's figures",
                              "to print it on one rank, call it on every rank and print there: "
                              "`text = handle.summary()`, then `if rank == 0: print(text)`")
            arrival.wait(dist.all_reduce(values, group=group, async_op=True))
            return values.cpu() / dist.get_world_size(group)

        return summarise(self.hook_state, self.compressor, self._exchange_workers(), network, mean_over_ranks,
                         optimizer_steps=self._optimizer_steps(), dense_per_step=self._dense_per_step())

    def _exchange_workers(self) -> int:
        """The workers of the exchange, for the summary."""
        return self.hook_state.driver.world_size

    def _summary_group(self) -> Optional[dist.ProcessGroup]:
        """The ranks the summary's figures are averaged over: the exchange's (every rank's, see
        :attr:`_entry_covers_world`)."""
        return None if self._entry_covers_world else self.hook_state.driver.group

    def _collective_device(self) -> torch.device:
        """Where the summary's figures are all-reduced: the gradients' device."""
        return self.device

    def _optimizer_steps(self) -> Optional[int]:
        """The optimizer steps the exchanges covered when that is not one each (local updates), else ``None``."""
        return None

    def _dense_per_step(self) -> Optional[float]:
        """Under local updates, what exchanging every step would send per step (this rank), else ``None``."""
        return None

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> Optional[dict[str, Any]]:
        """Every rank's residuals, compressor state, step and totals, gathered on rank 0 in the format of
        the Lightning checkpoints' ``checkpoint["gradcomp"]``; ``None`` on the other ranks. Gathered in host
        memory (over gloo), never on a GPU.

        A collective: every rank calls it, then rank 0 saves. Called on some ranks only (inside
        ``if rank == 0:``), it raises :class:`~lightning_gradcomp.exchange.checkpoint.CheckpointTimeout` after the
        ``timeout`` of :func:`register`, naming the fix, instead of hanging."""
        return self._gather_entry()

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's part of :meth:`state_dict`, with no collective: each rank saves its own (a file per rank,
        or inside a sharded checkpoint's directory) and loads it back with :meth:`load_state_dict`, so that no
        rank holds every rank's state. The Fabric strategies' ``fabric.save``/``fabric.load`` do this."""
        return self._own_entry()

    def _own_entry(self, local: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        rank, workers = self._entry_position()
        return own_entry(self.hook_state, self.compressor, rank, workers, local)

    def _entry_position(self) -> tuple[int, int]:
        """This rank's index among the checkpoint entry's workers and their number: the exchange group's (the
        world's, see :attr:`_entry_covers_world`)."""
        group = None if self._entry_covers_world else self.hook_state.driver.group
        return dist.get_rank(group), dist.get_world_size(group)

    def _gather_entry(self, local: Optional[dict[str, Any]] = None) -> Optional[dict[str, Any]]:
        """:func:`~lightning_gradcomp.exchange.checkpoint.gather_entry` over :attr:`checkpoint_group`. After a
        :class:`CheckpointTimeout` the ranks' gathers are out of step for good: every later call raises at
        once, saying so."""
        if self._checkpoint_broken is not None:
            raise CheckpointTimeout(
                "gradcomp: an earlier state_dict() timed out on this rank, which leaves the ranks' checkpoint "
                "gathers out of step: no later one can succeed. Restart the run (or build a new handle) with "
                f"state_dict() called on every rank. The earlier error: {self._checkpoint_broken}")
        try:
            return gather_entry(self.hook_state, self.compressor, local, group=self.checkpoint_group)
        except CheckpointTimeout as error:
            self._checkpoint_broken = str(error)
            forget_checkpoint_group(self.checkpoint_group)  # out of step: a later handle gets a new one
            raise

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's part of a :meth:`state_dict`: every rank loads the same entry, the one
        rank 0's :meth:`state_dict` returned and saved (load it with ``map_location="cpu"``; each rank
        moves only its own part to its device). A run with another number of workers or another
        compressor keeps only the step counter and the totals, with a warning."""
        self._restore(state, warn_if_local_updates_entry)

    def _restore(self, state: dict[str, Any], check: Callable[[dict[str, Any]], None], advice: str = _ADVICE
                 ) -> tuple[int, bool]:
        """:meth:`load_state_dict`'s work: ``check(state)`` warns of what does not apply (two frames below the
        user's call), :meth:`_load_own` loads this rank's state, the ranks agree on the position restored. This
        rank's place in the entry, and whether its own state was loaded (not only the counters)."""
        if not isinstance(state, dict):
            raise ValueError(f"`state` must be the dict that state_dict() returned on rank 0, got "
                             f"{type(state).__name__}" + advice)
        rank, workers = self._entry_position()
        check(state)
        restored = []
        restore_entry(state, self.hook_state, workers, self.compressor,
                      lambda ranks: restored.append(self._load_own(ranks[rank])), rank)
        self._agree_on_the_restore(self._restored_position())
        return rank, bool(restored)

    def _load_own(self, saved: dict[str, Any]) -> None:
        self.hook_state.load_state_dict(saved, self.device)

    def _restored_position(self) -> str:
        return ""  # what the ranks agree on after a restore besides the step (:meth:`_agree_on_the_restore`)

    def _agree_on_the_restore(self, position: str = "") -> None:
        """After :meth:`load_state_dict`: every rank of the exchange restored the same position (a collective,
        bounded). A load on some ranks only (``if rank == 0: handle.load_state_dict(...)``) would leave their
        step counters apart: Random-k's shared indices, drawn from the step, would then sum values at
        different coordinates, and local updates would pair different synchronisations."""
        check_agreement({"restored step": f"{self.hook_state.step}{position}"}, self.hook_state._agreement_group,
                        caller="load_state_dict()")

    def close(self) -> None:
        """Stop the exchange thread, if one runs; the model may then take another exchange (a DDP model through
        a new ``DistributedDataParallel`` wrapper: DDP keeps the communication hook it was given)."""
        self.hook_state.close()
        self.closed = True


#: each model's live handle and the entry point that made it (weakly: a model or handle dropped is forgotten)
_HANDLES: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[weakref.ref[ExchangeHandle], str]]" = \
    weakref.WeakKeyDictionary()


def refuse_a_second_exchange(model: torch.nn.Module, caller: str) -> None:
    """Raise ``ValueError`` when ``model`` (the bare module whose parameters an exchange owns) already has a
    live compressed exchange: two would both exchange its gradients, or a per-step exchange would defeat
    local updates, or two outer loops would each keep a θ_global. Called on every rank before any collective."""
    held = _HANDLES.get(model)
    handle = held[0]() if held is not None else None
    if handle is not None and not handle.closed:
        raise ValueError(
            f"gradcomp: {caller}: this model already has a compressed exchange, made by {held[1]}, and its handle "
            "is still open: two exchanges on one model would both act on its gradients (or one would exchange "
            "every step under local updates). Call close() on the first handle before this call; to change the "
            "compression between steps, call use_compressor(...) on it instead")


def hold(model: torch.nn.Module, handle: ExchangeHandle, caller: str) -> None:
    """Record ``handle`` as ``model``'s live exchange (see :func:`refuse_a_second_exchange`)."""
    _HANDLES[model] = (weakref.ref(handle), caller)


class GradientHandle(ExchangeHandle):
    """The handle of an exchange of gradients at every step (DDP's buckets, FSDP2's shards): the optimizer
    that steps the averaged gradients is checked against the compressor and bound (:meth:`bind`, or at its
    first step by an :class:`OptimizerWatch`)."""

    def __init__(self, hook_state: ExchangeSession, compressor: Compressor, device: torch.device) -> None:
        super().__init__(hook_state, compressor, device)
        self._examined: Optional[Compressor] = None  # the compressor the first exchange's check looked at
        self._watch: Optional[OptimizerWatch] = None

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        """Check ``optimizer`` against the compressor and bind it; call it after registering, before the
        first ``backward()`` (the strategies do it when ``fit`` starts).

        Raises ``ValueError`` when they conflict: DeMo wants ``torch.optim.SGD`` without momentum (its
        momentum replaces the optimizer's), DGC and Signum refuse an optimizer with momentum of its own.
        DeMo reads the learning rate of its momentum step from the bound optimizer at every step. Unbound,
        the first optimizer that steps the model's parameters is checked and bound at its first step, one
        exchange late (DeMo warns at the first exchange)."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"`optimizer` must be a torch.optim.Optimizer (the one that steps this model), got "
                             f"{type(optimizer).__name__}")
        model = self._watch.model if self._watch is not None else None
        if model is not None and not steps_the_model(optimizer, model):
            raise ValueError(f"bind(): this {type(optimizer).__name__} steps none of the registered model's parameters "
                             "(an optimizer of another model, or built before fully_shard replaced them); bind the "
                             "one that steps this model: `torch.optim.SGD(model.parameters(), ...)` after sharding")
        self.hook_state.compressor.check_optimizer(optimizer, names=self.param_names)
        self._bound.add(optimizer)

    def _check_bound(self) -> None:
        """At an exchange: the first one a compressor makes warns when it reads an optimizer and none is bound."""
        if self.hook_state.compressor is not self._examined:
            self._examined = self.hook_state.compressor
            warn_if_unbound(self._examined)

    def close(self) -> None:
        """Stop the exchange thread, if one runs, and the watch on the optimizers' steps."""
        if self._watch is not None:
            self._watch.remove()
            self._watch = None
        super().close()

    def _memory_follows_the_loss_scale(self) -> bool:
        """Whether the exchange keeps values at the gradients' scale across steps (error feedback, or the
        compressor's state: DGC's velocity, Signum's momentum), which a changing loss scale would spoil."""
        return self.hook_state.error_feedback or self.hook_state.compressor.keeps_state


def optimizer_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter ``optimizer`` steps, group by group."""
    return [parameter for group in optimizer.param_groups for parameter in group["params"]]


def steps_the_model(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> bool:
    """Whether ``optimizer`` steps any of ``model``'s current parameters (by identity)."""
    current = {id(parameter) for parameter in model.parameters()}
    return any(id(parameter) in current for parameter in optimizer_parameters(optimizer))


def refuse_parameters_replaced_by_sharding(optimizer: torch.optim.Optimizer, model: torch.nn.Module, where: str) -> None:
    """Raise ``ValueError`` when ``optimizer`` holds what ``fully_shard`` replaced: parameters of exactly the
    shapes of ``model``'s (their global shapes), none of them the model's and none sharded. Built before
    ``fully_shard``, it would step tensors the model no longer uses: the exchange would run and count, and
    nothing would train. An optimizer of another model, of other shapes or of some parameters only, passes."""
    from torch.distributed.tensor import DTensor

    held = optimizer_parameters(optimizer)
    current = list(model.parameters())
    if not held or any(isinstance(parameter, DTensor) for parameter in held) or \
            not any(isinstance(parameter, DTensor) for parameter in current):
        return
    if sorted(tuple(parameter.shape) for parameter in held) == sorted(tuple(parameter.shape) for parameter in current):
        raise ValueError(
            f"gradcomp: {where}: this {type(optimizer).__name__} holds {len(held)} unsharded parameters of exactly the "
            "model's shapes, none of them the model's: the parameters as they were before fully_shard replaced them "
            "(or another copy of the model's). It would step tensors the model no longer uses (nothing would train). "
            "Build the optimizer after fully_shard: `fully_shard(...)`, then "
            "`optimizer = torch.optim.AdamW(model.parameters(), ...)`")


class OptimizerWatch:
    """The plain handles' look at every optimizer step of the process (torch's global step pre-hook, one
    dictionary look-up per step once an optimizer is known; nothing on the device).

    An optimizer that steps the model's parameters is checked against the compressor and bound at its
    first step, unless :meth:`GradientHandle.bind` did it (a conflict raises ``ValueError`` out of
    ``optimizer.step()``). While the exchange keeps memory at the gradients' scale, a ``GradScaler`` that
    steps such an optimizer is warned about, once. The watch holds the handle weakly; a dead handle's
    watch does nothing (it is removed by :meth:`GradientHandle.close`, never from inside a step, where
    torch iterates over the hooks)."""

    def __init__(self, handle: GradientHandle, model: torch.nn.Module, sharded: bool = False) -> None:
        self._handle = weakref.ref(handle)
        # the model weakly, never its parameters: a weak reference to a tensor makes torch.utils.swap_tensors
        # (FSDP2's model.to()) refuse it; the parameters are read from the model when an optimizer first steps
        self._model = weakref.ref(model)
        #: ``fully_shard`` replaced the model's parameters: an optimizer holding the old ones is refused
        self._sharded = sharded
        self._steps_the_model: "weakref.WeakKeyDictionary[torch.optim.Optimizer, bool]" = weakref.WeakKeyDictionary()
        self.scaler_warned = False
        self._removable = register_optimizer_step_pre_hook(self)
        weakref.finalize(handle, self._removable.remove)  # a handle never closed leaves no hook behind

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        handle = self._handle()
        if handle is None:
            return
        ours = self._steps_the_model.get(optimizer)
        model = self._model()
        if ours is None and model is not None:
            ours = steps_the_model(optimizer, model)
            if not ours and self._sharded:
                refuse_parameters_replaced_by_sharding(optimizer, model, "optimizer.step()")
            if ours and optimizer not in handle._bound:
                handle.bind(optimizer)  # a conflict raises here, and again at the next step
            self._steps_the_model[optimizer] = ours
        if ours and not self.scaler_warned and handle._memory_follows_the_loss_scale():
            scaler = calling_grad_scaler()
            if scaler is not None:
                self.scaler_warned = True
                _warn_grad_scaler(scaler, handle)

    @property
    def model(self) -> Optional[torch.nn.Module]:
        """The registered model, while it lives."""
        return self._model()

    def remove(self) -> None:
        self._removable.remove()


#: The methods of ``torch.amp.GradScaler`` that call ``optimizer.step()`` (``step``, or through ``_maybe_opt_step``).
_SCALER_STEPS = frozenset({"step", "_maybe_opt_step"})


def calling_grad_scaler(depth: int = 12) -> Optional[Any]:
    """The enabled ``torch.amp.GradScaler`` whose ``step(optimizer)`` runs the optimizer step in progress,
    from an optimizer step pre-hook (found among the callers' frames: GradScaler hands the optimizer
    nothing that shows it), or ``None``. Host-side only; reads no tensor."""
    try:
        from torch.amp import GradScaler
    except ImportError:  # pragma: no cover - torch without torch.amp
        return None
    frame = sys._getframe(1) if hasattr(sys, "_getframe") else None
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code.co_name in _SCALER_STEPS:
            owner = frame.f_locals.get("self")
            if isinstance(owner, GradScaler) and owner.is_enabled():
                return owner
        frame = frame.f_back
    return None


def _warn_grad_scaler(scaler: Any, handle: GradientHandle) -> None:
    """The warning, once per handle, that an fp16 ``GradScaler`` steps a model whose exchange keeps memory."""
    compressor = handle.hook_state.compressor
    memory = "error feedback (residuals)" if handle.hook_state.error_feedback else \
        f"the state {type(compressor).__name__} keeps across steps"
    warnings.warn(
        f"gradcomp: {type(scaler).__name__} steps the optimizer of a model whose compressed exchange keeps {memory}: "
        "GradScaler multiplies the gradients by a loss scale it keeps changing (halved at every overflow, doubled "
        "every growth_interval steps), so the memory mixes gradients at scales that no longer hold (the Lightning "
        "strategies refuse precision='16-mixed' for this). Use bf16 autocast "
        "(torch.autocast(device_type, dtype=torch.bfloat16), no GradScaler), or register(..., error_feedback=False) "
        "with a compressor that keeps no state (e.g. 'qsgd', 'randomk', 'fp16'; not DGC, Signum or DeMo)",
        UserWarning, stacklevel=3)


def warn_if_local_updates_entry(state: dict[str, Any]) -> None:
    """Warn when an entry that :func:`~lightning_gradcomp.local_updates` wrote (each rank's replica, outer state
    and window) is loaded where gradients are exchanged every step: only its residuals and counters apply."""
    ranks = state.get("ranks")
    first = not dist.is_initialized() or dist.get_rank() == 0  # every rank loads it: said once
    if first and isinstance(ranks, list) and any(isinstance(entry, dict) and entry.get("local") is not None
                                                 for entry in ranks):
        warnings.warn("gradcomp: this checkpoint entry was written under local updates (local_updates(), or a strategy "
                      "with local_updates=): its replicas, outer-optimizer state and window position do not apply to "
                      "an exchange every step and are ignored; its residuals are those of the outer gradients",
                      UserWarning, stacklevel=4)


def warn_if_unbound(compressor: Compressor) -> None:
    """Warn when ``compressor`` reads its optimizer (DeMo's learning rate) and none is bound."""
    if compressor.awaits_optimizer:
        warnings.warn(
            f"gradcomp: {compressor!r} reads the learning rate of its momentum step from its optimizer, and checks "
            "that it is plain SGD (DeMo's momentum replaces the optimizer's; AdamW on DeMo's signs does not learn), "
            "but no optimizer is bound: this exchange runs with lr=1. Call gradcomp.bind(optimizer) after "
            "register(), before the first backward; unbound, the first optimizer that steps the model is checked "
            "and bound at its first step", UserWarning, stacklevel=3)


