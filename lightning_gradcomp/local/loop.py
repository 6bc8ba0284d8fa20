"""One rank's local-update training (DiLoCo's outer loop, Streaming DiLoCo's fragments), driven by
``torch.distributed``: :class:`LocalUpdateLoop`, and the schedule it shares with the simulation
(:class:`ScheduledSyncs`). Nothing is communicated between two synchronisations.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager, ExitStack
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
from torch import Tensor
from torch.futures import Future
from torch.optim import Optimizer

from lightning_gradcomp.exchange.session import ExchangeSession
from lightning_gradcomp.exchange.agreement import out_of_step, ScheduleMismatch
from lightning_gradcomp.exchange.drivers import collective_device, CollectiveError
from lightning_gradcomp.exchange.engine import Entry
from lightning_gradcomp.exchange.waits import Arrival
from lightning_gradcomp.local.config import LocalUpdates, warn_compounding_momentum
from lightning_gradcomp.local.global_model import CopiedIn, GlobalBuffers, SwappedIn
from lightning_gradcomp.local.fragments import (
    buffer_fragments,
    checked_assignment,
    FirstUse,
    fragment_assignment,
    uses_block_strides,
)
from lightning_gradcomp.local.outer import (
    averaged,
    buffer_dtype,
    cpu_copy,
    OuterModel,
    trainable_parameters,
)
from lightning_gradcomp.local.windows import (
    check_figures,
    combine_within_group,
    group_figures,
    GroupFigures,
    merge_weights,
    plan_windows,
    WindowClock,
)

#: the largest bucket of outer gradients exchanged at once (DDP's default bucket size)
SYNC_BUCKET_BYTES = 25 * 2**20


@dataclass
class PendingSync:
    """A fragment's exchange that has started and is merged after inner step ``merge_at``: where its
    average goes, and the exchanges still in flight (on the exchange thread)."""

    fragment: int
    merge_at: int
    averaged: list[Tensor]
    futures: list[Future] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        """CPU copies (waits for the exchange first)."""
        for future in self.futures:
            future.wait()
        self.futures = []
        return {"fragment": self.fragment, "merge_at": self.merge_at, "averaged": cpu_copy(self.averaged)}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], device: torch.device) -> "PendingSync":
        return cls(int(state["fragment"]), int(state["merge_at"]), [t.to(device) for t in state["averaged"]])


class WholeModel:
    """The layout of a model each rank holds whole (the default of :class:`LocalUpdateLoop`): the loop works on
    the parameters themselves, ``θ_global`` is shown in them by reference (by copy where it lives on another
    device), the inner optimizers' states are saved as they are, and each rank is its replica alone. The
    sharded layout (:class:`~lightning_gradcomp.local.sharded.ShardsOfModel`) is the other one: a loop takes
    its layout, so fault tolerance and the shards combine without a class for each combination."""

    def tensors(self, parameters: list[Tensor]) -> list[Tensor]:
        """What the loop trains and synchronises of ``parameters``."""
        return parameters

    def show(self, tensors: list[Tensor], values: list[Optional[Tensor]]) -> Union[SwappedIn, CopiedIn]:
        """``values`` shown in ``tensors`` (see :meth:`ScheduledSyncs.global_weights`): by reference, or by
        copying where ``θ_global`` lives on another device than the parameters (host memory)."""
        if any(value is not None and value.device != tensor.device for tensor, value in zip(tensors, values)):
            return CopiedIn(tensors, values)
        return SwappedIn(tensors, values)

    def ranks_per_replica(self) -> int:
        """The ranks that train one replica together."""
        return 1

    def sum_within_replica(self, tensor: Tensor) -> None:
        """Sum ``tensor`` in place over the replica's ranks (one rank: nothing to do)."""

    #: the sum over the replica's shards of the outer step's verdict and norm
    #: (:meth:`~lightning_gradcomp.local.outer.OuterModel.apply`); ``None``: the rank holds the whole model
    sum_over_shards: Optional[Callable[[Tensor], None]] = None

    def exchanged(self, index: int, tensor: Tensor) -> Optional[tuple[slice, tuple[int, ...]]]:
        """The part of parameter ``index`` (the loop's tensor ``tensor``) this rank exchanges, as (flat
        elements, shape), ``None`` for none: all of it here (an empty shard sends nothing)."""
        return (slice(0, tensor.numel()), tuple(tensor.shape)) if tensor.numel() else None

    def share(self, indices: Sequence[int], averaged: Sequence[Tensor]) -> None:
        """After the exchange: make every rank of the replica hold the whole average (nothing to do where
        each rank exchanged all it holds)."""

    def equalise_buffers(self, buffers: Sequence[Tensor]) -> None:
        """Before the buffers are averaged between replicas: make the replica's ranks agree on them."""

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """An inner optimizer's state for this rank's checkpoint part (CPU copies)."""
        return cpu_copy(optimizer.state_dict())

    def load_optimizer_state(self, optimizer: Optimizer, state: dict[str, Any]) -> None:
        optimizer.load_state_dict(state)


def _part(flat: Tensor, elements: slice) -> Tensor:
    """``flat[elements]``, or ``flat`` itself where that is all of it."""
    return flat if elements.start == 0 and elements.stop == flat.numel() else flat[elements]


class FixedMembership:
    """Who takes part in the loop's synchronisations, the default policy: every rank of the exchange's process
    group, every time. Ranks out of step are an error on every rank
    (:class:`~lightning_gradcomp.exchange.agreement.ScheduleMismatch`, :meth:`LocalUpdateLoop.agree_on_schedule`),
    a failed exchange raises its :class:`~lightning_gradcomp.exchange.drivers.CollectiveError`, every
    synchronisation is applied, and a checkpoint is always this run's own. The other policy,
    :class:`~lightning_gradcomp.local.fault_tolerance.TorchftMembership`, takes a quorum of replica groups at
    each synchronisation, votes, rolls back and heals: the loop calls the same hooks either way."""

    #: the schedule position when this rank joined the run (0: at its start)
    joined_at_step = 0
    #: what the membership did, for telemetry and the summary (torchft's quorums; ``None``: nothing to report)
    figures: Any = None

    def attach(self, loop: "LocalUpdateLoop") -> None:
        """Called once, at the end of ``loop``'s construction (a membership serves one loop)."""
        if getattr(self, "loop", loop) is not loop:
            raise ValueError("gradcomp: a membership serves one local-update loop; make one per loop")
        self.loop = loop

    def begin(self, fragment: int, merge_at: int) -> bool:
        """Before a synchronisation's first collective: whether this rank exchanges its outer gradients."""
        return True

    def agree(self, fragment: int, merge_at: int) -> None:
        """The synchronisation's first collective: check that every participant starts the same one."""
        self.loop.agree_on_schedule(fragment, merge_at)

    def exchange_failed(self, error: CollectiveError) -> bool:
        """An exchange failed (a dead peer): whether the membership absorbs the failure (False: it is raised)."""
        return False

    def settle(self, pending: PendingSync) -> None:
        """Wait for ``pending``'s exchange in flight (its error raised)."""
        for future in pending.futures:
            future.wait()
        pending.futures = []

    def commit(self, pending: PendingSync) -> bool:
        """Whether ``pending``'s average is applied (after :meth:`settle`); False rolls the fragment back."""
        return True

    def accepts_checkpoint(self) -> bool:
        """Whether a checkpoint's local-update state is loaded."""
        return True

    def shutdown(self) -> None:
        """Leave the run (nothing to leave for a fixed group)."""


class ScheduledSyncs:
    """The schedule every outer loop follows (one rank's, the simulation's): after each inner step, merge
    the synchronisations due now, then start those whose turn it is (merged at once without ``delay``);
    :meth:`sync` synchronises every fragment now (the end of training); :meth:`global_weights` shows
    ``θ_global`` in the module. Subclasses provide :attr:`outer`, :attr:`params`, :attr:`buffers` (then
    :meth:`_set_up`), :meth:`_start`, :meth:`_merge` (which sets :attr:`synced`) and :meth:`adopt_global`."""

    outer: OuterModel
    pending: list[PendingSync]
    params: list[Tensor]
    buffers: list[tuple[str, Tensor]]
    global_buffers: GlobalBuffers
    synced: bool = False
    #: ``θ_global`` shown in the module (:meth:`global_weights`), ``None`` while the replica is
    _view: Optional[Union[SwappedIn, CopiedIn]] = None
    #: this rank's step times and counts (:mod:`~lightning_gradcomp.local.windows`)
    clock: WindowClock
    #: ``weight_by`` of the configuration
    weight_by: Optional[str] = "samples"
    #: whether :meth:`sync` (the end of a loop) is running
    _ending = False
    #: how the loop holds the model (the simulation's: whole) and who takes part (every worker, from the start)
    layout: WholeModel = WholeModel()
    membership: FixedMembership = FixedMembership()

    def _set_up(self, module: torch.nn.Module, config: LocalUpdates) -> None:
        """After :attr:`outer` is built: the buffers' fragments and global values, the schedule's state."""
        self.buffer_fragment = buffer_fragments([name for name, _ in self.buffers], self.names,
                                                self.outer.fragment_of, self.outer.fragments)
        self.global_buffers = GlobalBuffers([buffer for _, buffer in self.buffers], self.buffer_fragment)
        self._record_first_use(module, config)
        self.pending: list[PendingSync] = []
        self.clock = WindowClock(self.outer.fragments)
        self.weight_by = config.weight_by

    def _use_figures(self, fragment: int, groups: Sequence[GroupFigures], me: int) -> list[float]:
        """The groups' figures of a synchronisation (every rank's, from its all-gather): refuse what does not fit
        (on every rank alike), plan the next time-boxed window at a window's last synchronisation (group ``me``'s
        length is this rank's), and return ``M·w_m`` of every group, the factors of their outer gradients."""
        problem = check_figures(groups, self.weight_by, self.outer.time_boxed)
        if problem is not None:
            raise ScheduleMismatch(f"gradcomp: local updates: {problem}")
        self.clock.started(fragment)
        if self.outer.time_boxed and not self._ending and fragment == self.outer.fragments - 1:
            window = 0.0 if self.outer.window_auto else self.outer.window_seconds  # "auto": from this window's times
            plan = plan_windows(groups, window, self.outer.sync_every, self.outer.fragments, self.outer.delay)
            self.outer.adopt_plan(plan.lengths[me], plan.window_seconds, plan.last, plan.ends_now)
            self.clock.planned()
        if self.weight_by is None:
            return [1.0] * len(groups)
        return merge_weights([group.units for group in groups])

    def count(self, units: int) -> None:
        """``units`` samples (or tokens) processed by the coming inner step (its outer gradient's weight)."""
        self.clock.count(units)

    @property
    def finished(self) -> bool:
        """Whether a time-boxed run reached its planned end (see :mod:`~lightning_gradcomp.local.windows`)."""
        return self.outer.finished

    @property
    def sync_every(self) -> int:
        return self.outer.sync_every

    @property
    def steps_taken_here(self) -> int:
        """The inner steps this rank's exchanges covered, for the summary's per-step figures: those since this
        rank joined the run (all of them, unless a fault-tolerant group joined a running job)."""
        return self.outer.optimizer_steps - self.membership.joined_at_step

    def dense_bytes_per_step(self) -> int:
        """What exchanging every optimizer step would send (the summary's reference): the fp32 all-reduce of
        every parameter this rank exchanges, whole model, every fragment (its shard on a sharded model, its
        row blocks in a replica group of several processes), counted as ``bytes_dense`` is."""
        return 4 * sum(self._exchanged_elements(index) for index in range(len(self.params)))

    def _exchanged_elements(self, index: int) -> int:
        """The elements of parameter ``index`` this rank exchanges at a synchronisation."""
        part = self.layout.exchanged(index, self.params[index])
        return 0 if part is None else part[0].stop - part[0].start

    # ------------------------------------------------------------------ the default fragments, by first use
    def _record_first_use(self, module: torch.nn.Module, config: LocalUpdates) -> None:
        """Where the default fragments group blocks, record which modules the first forward pass calls
        before the first block (:class:`~lightning_gradcomp.local.fragments.FirstUse`): the grouping is
        settled at the first inner step, before any exchange."""
        self._first_use: Optional[FirstUse] = None
        self._first_use_module, self._first_use_config = module, config
        if uses_block_strides(module, self.names, config):
            self._first_use = FirstUse(module)

    def _settle_fragments(self) -> None:
        """Group the parameters outside the blocks by the order the first forward pass used them (nothing
        to do once settled, or where the default grouping does not apply)."""
        recorder = getattr(self, "_first_use", None)
        if recorder is None or not recorder.recording:
            return
        order = recorder.stop()
        if order:  # eager forward passes recorded it: no compiled graph holds the hooks, which go now
            recorder.remove()
            self._use_fragments(fragment_assignment(self._first_use_module, self.names, self._first_use_config, order))

    def _adopt_saved_fragments(self, outer_state: Optional[dict[str, Any]]) -> None:
        """A checkpoint's grouping, taken before this run's first forward pass (a checkpoint written after
        one holds the grouping by first use, which this run would settle on too)."""
        recorder = getattr(self, "_first_use", None)
        saved = (outer_state or {}).get("fragment_of")
        if recorder is not None and recorder.recording and saved is not None and len(saved) == len(self.names):
            recorder.stop()
            if list(saved) != self.outer.fragment_of:
                self._use_fragments(list(saved))

    def _use_fragments(self, fragment_of: Sequence[int]) -> None:
        self.outer.fragment_of = checked_assignment(fragment_of, self.names, self.outer.fragments)
        self.buffer_fragment = buffer_fragments([name for name, _ in self.buffers], self.names,
                                                self.outer.fragment_of, self.outer.fragments)
        self.global_buffers.fragment_of = list(self.buffer_fragment)

    def forget_first_use(self) -> None:
        """Remove the recorder's hooks (when the handle closes)."""
        recorder = getattr(self, "_first_use", None)
        if recorder is not None:
            recorder.remove()

    def step(self) -> bool:
        """Count one inner optimizer step; merge the synchronisations due now, start those whose turn it
        is. Whether a synchronisation was merged."""
        self._refuse_inside_the_view("an inner optimizer step (the optimizer stepped θ_global itself)")
        if self.outer.finished:
            raise RuntimeError(
                f"gradcomp: local updates: an inner step after the run's end (inner step {self.outer.ends_at}, planned "
                "by every group under window_seconds): stop the loop when handle.finished is True (the groups took "
                "different numbers of steps; the one whose steps ran out first ended the run for all)")
        self._settle_fragments()
        self.clock.stepped()
        if self._keeps_deadlines() and self.clock.past_deadline():
            self.outer.end_window_at_this_step()
        starting = self.outer.count_step()
        now = self.outer.optimizer_steps
        self.synced = False
        for pending in [pending for pending in self.pending if pending.merge_at <= now]:
            self._complete(pending)
        for fragment in starting:
            self._run(fragment, self.outer.delay)
        self.clock.ready(self.outer.window_seconds if self.outer.window_ended else 0.0)
        return self.synced

    def _keeps_deadlines(self) -> bool:
        """Whether this rank's group ends a time-boxed window at its deadline (a group of one process: the
        ranks of a larger one keep to the steps they agreed on)."""
        return self.outer.time_boxed and self.layout.ranks_per_replica() == 1

    def sync(self) -> bool:
        """Synchronise now, on every worker (a collective; every rank calls it at the same point): merge the
        exchanges in flight, then exchange and merge at once every fragment whose parameters moved since
        (:meth:`~lightning_gradcomp.local.outer.OuterModel.unsynchronised`), and put ``θ_global`` (and the
        averaged buffers) into every worker's parameters (the end of training, see
        :meth:`~lightning_gradcomp.local.handle.LocalUpdateHandle.sync`). Whether anything was exchanged."""
        self._leave_evaluation()  # an evaluation that ended: the replica takes part
        self._refuse_inside_the_view("sync()")
        self._settle_fragments()
        self.synced = False
        self._ending = True
        try:
            for pending in list(self.pending):
                self._complete(pending)
            due = [fragment for fragment in range(self.outer.fragments) if self.outer.unsynchronised(fragment)]
            for fragment in due:
                self._run(fragment, 0)
        finally:
            self._ending = False
        self.adopt_global()
        return bool(due)

    @contextmanager
    def global_weights(self) -> Iterator[None]:
        """Inside, the module holds ``θ_global`` and the buffers of the last synchronisation (the same on
        every worker; by reference, no communication): for evaluation and for the model's
        ``state_dict()`` in a checkpoint. Afterwards it holds the worker's replica again. A checkpoint of
        the loop (``state_dict``) taken inside still holds the replica; training inside is refused."""
        if self._view is not None:  # nested: already shown
            yield
            return
        self._view = self.layout.show([*self.params, *(buffer for _, buffer in self.buffers)],
                                      [*self.outer.global_params, *self.global_buffers.values])
        try:
            yield
        finally:
            view, self._view = self._view, None
            view.restore()

    @property
    def shown_by_copy(self) -> bool:
        """Whether :meth:`global_weights` is open and shows ``θ_global`` by copying it into the module's
        tensors (sharded parameters, ``θ_global`` in host memory): what is read from the module meanwhile
        without copying (a ``state_dict`` on the CPU) changes when the view closes."""
        return isinstance(self._view, CopiedIn)

    @contextmanager
    def _replica_shown(self) -> Iterator[None]:
        """The worker's replica in the module meanwhile, also inside :meth:`global_weights`."""
        if self._view is None:
            yield
            return
        with self._view.own_data():
            yield

    def _refuse_inside_the_view(self, what: str) -> None:
        if self._view is not None and self._evaluation_view is not None:
            raise RuntimeError(f"gradcomp: {what} while the model shows θ_global for evaluation (its last forward "
                               "pass ran in eval mode without gradients); run a training forward pass (model.train(), "
                               "gradients on) before stepping")
        if self._view is not None:
            raise RuntimeError(f"gradcomp: {what} inside global_weights(), where the model holds θ_global for "
                               "evaluation and saving; train and synchronise outside it")

    #: θ_global shown because the model is being evaluated (:meth:`follow_forward`), ``None`` otherwise
    _evaluation_view: Optional[ExitStack] = None

    def follow_forward(self, evaluating: bool) -> None:
        """The evaluation rule of the plain and Fabric loops, called before each forward pass of the model: a
        pass in eval mode without gradients (``model.eval()`` under ``torch.no_grad()`` or inference mode:
        an evaluation) sees ``θ_global``, the model that synchronisation keeps and training ends with; any
        other pass sees the replica again. (The Trainer shows θ_global during its validation itself.)"""
        if evaluating and self._view is None:
            stack = ExitStack()
            stack.enter_context(self.global_weights())
            self._evaluation_view = stack
        elif not evaluating and self._evaluation_view is not None:
            self._leave_evaluation()

    def _leave_evaluation(self) -> None:
        view, self._evaluation_view = self._evaluation_view, None
        if view is not None:
            view.close()

    def adopt_global(self) -> None:
        """Every worker's parameters and floating-point buffers set to ``θ_global``'s (no communication)."""
        raise NotImplementedError

    def _run(self, fragment: int, merge_in: int) -> None:
        """Start ``fragment``'s synchronisation, merged ``merge_in`` inner steps from now (0: at once)."""
        pending = self._begin(fragment, self.outer.optimizer_steps + merge_in)
        if merge_in == 0:
            self._complete(pending)

    def _begin(self, fragment: int, merge_at: int) -> PendingSync:
        self.outer.started_at[fragment] = self.outer.optimizer_steps
        return self._start(fragment, merge_at)

    def _complete(self, pending: PendingSync) -> None:
        self._merge(pending)
        self.outer.merged_at[pending.fragment] = self.outer.optimizer_steps

    def _start(self, fragment: int, merge_at: int) -> PendingSync:
        raise NotImplementedError

    def _merge(self, pending: PendingSync) -> None:
        raise NotImplementedError


class LocalUpdateLoop(ScheduledSyncs):
    """The outer loop of one rank.

    Args:
        module: the model this rank trains (not wrapped in DDP, or DDP's ``module``).
        config: the schedule and the outer optimizer (:class:`~lightning_gradcomp.local.config.LocalUpdates`).
        exchange: the rank's exchange state (compressor, error feedback, memory, accounting), built with
            the module's parameter names (and ``exchange_thread=True`` when ``config.delay > 0``); it is
            the strategy's ``hook_state`` in checkpoints and callbacks, as for per-step compression.
        global_device: where ``θ_global`` and the outer optimizer's state live (default: the parameters'
            device; ``"cpu"``: host memory).
        layout: how the rank holds the model: whole (:class:`WholeModel`, the default) or its FSDP2 shards
            (:class:`~lightning_gradcomp.local.sharded.ShardsOfModel`).
        membership: who takes part in each synchronisation: every rank, always (:class:`FixedMembership`, the
            default), or the replica groups of a torchft quorum
            (:class:`~lightning_gradcomp.local.fault_tolerance.TorchftMembership`).

    Attributes:
        synced: whether the last :meth:`step` merged a synchronisation.
    """

    def __init__(self, module: torch.nn.Module, config: LocalUpdates, exchange: ExchangeSession,
                 global_device: Optional[Union[str, torch.device]] = None, layout: Optional[WholeModel] = None,
                 membership: Optional[FixedMembership] = None) -> None:
        self.module = module
        self.layout = layout if layout is not None else WholeModel()
        named = trainable_parameters(module)
        self.names = [name for name, _ in named]
        self._parameters = [p for _, p in named]
        self.buffers = list(module.named_buffers())
        self.exchange = exchange
        warn_compounding_momentum(exchange.compressor, config)
        self.outer = OuterModel(self.names, self.params, config,
                                fragment_of=fragment_assignment(module, self.names, config), device=global_device)
        self._set_up(module, config)
        #: ``M·w`` of this rank's group at the last synchronisation, and whether every group's was 1
        self.weight = 1.0
        self.weights_equal = True
        #: each parameter's dtype and device when θ_global was built from it (checked at each synchronisation)
        self._built_as = [(p.dtype, p.device) for p in self._parameters]
        self.membership = membership if membership is not None else FixedMembership()
        self.membership.attach(self)

    @property
    def params(self) -> list[Tensor]:  # type: ignore[override]
        """The tensors this rank trains and synchronises, in the order of :attr:`names` (a sharded layout reads
        the local shards afresh each time: FSDP2 may re-point them at new storage)."""
        return self.layout.tensors(self._parameters)

    @torch.no_grad()
    def _start(self, fragment: int, merge_at: int) -> PendingSync:
        """Start ``fragment``'s synchronisation: its exchange when the membership lets this rank take part
        (and the exchange does not fail), else one that applies nothing."""
        if self.membership.begin(fragment, merge_at):
            try:
                return self._exchange_fragment(fragment, merge_at)
            except CollectiveError as error:
                if not self.membership.exchange_failed(error):
                    raise
        return self._nothing_to_apply(fragment, merge_at)

    def _nothing_to_apply(self, fragment: int, merge_at: int) -> PendingSync:
        """A synchronisation this rank did not exchange: zero averages (which a replica's ranks still share
        with one another, every rank alike), applied nowhere."""
        pending = PendingSync(fragment, merge_at, [torch.zeros_like(self.outer.global_params[i]).view(-1)
                                                   for i in self.outer.members(fragment)])
        self.pending = [p for p in self.pending if p.fragment != fragment] + [pending]
        return pending

    def _exchange_fragment(self, fragment: int, merge_at: int) -> PendingSync:
        """Exchange ``fragment``'s outer gradients (on the exchange thread when delayed)."""
        self._refuse_a_cast_model()
        self.membership.agree(fragment, merge_at)
        indices = self.outer.members(fragment)
        params = self.params
        deltas = self.outer.outer_gradients(params, indices)
        self._warn_if_weighted_inexactly()
        if self.weight != 1.0:  # Σ_m w_m·Δ_m: the weight applied before compression (see local/windows.py)
            torch._foreach_mul_(deltas, self.weight)
        pending = PendingSync(fragment, merge_at, [torch.empty_like(delta) for delta in deltas])
        entries = self._exchange_entries(indices, deltas, pending.averaged)
        buckets = sync_buckets(entries)
        for number, bucket in enumerate(buckets):
            last = number == len(buckets) - 1
            if self.outer.delay:
                pending.futures.append(self.exchange.exchange(bucket, last=last, overlap=True))
            else:
                self.exchange.exchange(bucket, last=last)
        self.pending.append(pending)
        return pending

    def _refuse_a_cast_model(self) -> None:
        """Raise when a parameter changed dtype or device since :func:`local_updates` (``model.double()``,
        ``model.to("cuda")`` afterwards): θ_global and the outer optimizer keep what they were built with, and
        each synchronisation would round the model back to it (or fail across devices)."""
        for name, parameter, (dtype, device) in zip(self.names, self._parameters, self._built_as):
            if parameter.dtype != dtype or parameter.device != device:
                raise RuntimeError(
                    f"gradcomp: local updates: parameter {name!r} is now {parameter.dtype} on {parameter.device}, but "
                    f"was {dtype} on {device} when local updates were set up; θ_global and the outer optimizer keep "
                    "that, and every synchronisation would round the model back to it. Cast or move the model before "
                    "local_updates() (or close() the handle and call local_updates() again)")

    def agree_on_schedule(self, fragment: int, merge_at: int) -> None:
        """Before any payload moves, check that every rank of the exchange starts the same synchronisation
        (one all-gather of a few integers per rank: the inner step, or the window under ``window_seconds``, the
        fragment, the elements it exchanges, then the figures of :mod:`~lightning_gradcomp.local.windows`: the
        samples behind its outer gradient, its step time, its loop's length). A rank that called :meth:`sync`
        alone mid-window, or counted other steps, would otherwise pair its exchange with another one of the
        others' and train on a silent mix of averages; here every rank raises
        :class:`~lightning_gradcomp.exchange.agreement.ScheduleMismatch`, naming the ranks out of step. The
        figures give this rank's weight (:attr:`weight`) and, at a window's last synchronisation, the next
        time-boxed window."""
        driver = self.exchange.driver
        elements = sum(self.params[i].numel() for i in self.outer.members(fragment))
        position = self.outer.windows if self.outer.time_boxed else self.outer.optimizer_steps
        device = collective_device(driver.group)
        rows, groups = self._gather_rows([position, fragment, elements], fragment, device, device, lambda: Arrival(
            "local updates' sync()", driver.group, "every rank's step at this synchronisation",
            "every rank synchronises after the same number of inner steps (a rank that stopped early, or is stuck in "
            "a collective of its own, holds up the others)"))
        if len(set(rows)) > 1:
            unit = "window" if self.outer.time_boxed else "step"
            shown = "; ".join(f"rank {rank}: {unit} {step}, fragment {part}, {count:,} elements"
                              for rank, (step, part, count) in enumerate(rows))
            late = out_of_step(rows)
            who = "the ranks of the exchange are" if len(late) == len(rows) else \
                f"rank{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} of the exchange {'are' if len(late) > 1 else 'is'}"
            raise ScheduleMismatch(
                f"gradcomp: local updates: {who} out of step at this synchronisation ({shown}). Every rank must synchronise at the same inner step: call sync() on every rank at the "
                "same point, count every optimizer step on every rank (handle.step() after each one where a "
                "GradScaler may skip it), load a checkpoint on every rank (load_state_dict() is for each rank), "
                "and give every rank the same model and fragments")
        self._take_weight(fragment, groups, driver.rank)

    def _gather_rows(self, shared: list[int], fragment: int, device: torch.device, on: Optional[torch.device] = None,
                     arrival: Callable[[], Optional[Arrival]] = lambda: None
                     ) -> tuple[list[tuple[int, ...]], list[GroupFigures]]:
        """Every rank's row of this synchronisation, one all-gather between steps (of a tensor on ``on``,
        ``arrival`` made just before): ``shared``, what the ranks must agree on, then its group's figures
        (:meth:`_group_row`, summed on ``device``). The rows' ``shared`` parts, and the groups' figures."""
        mine = torch.tensor([*shared, *self._group_row(fragment, device)], dtype=torch.int64, device=on)
        gathered = self.exchange.driver.all_gather(mine, arrival()).tolist()
        return [tuple(row[:len(shared)]) for row in gathered], [group_figures(row[len(shared):]) for row in gathered]

    def _take_weight(self, fragment: int, groups: Sequence[GroupFigures], me: int) -> None:
        self.weight = self._use_figures(fragment, groups, me)[me]
        self.weights_equal = len({group.units for group in groups}) == 1 or self.weight_by is None

    def _warn_if_weighted_inexactly(self) -> None:
        compressor = self.exchange.compressor
        if not self.weights_equal and compressor.averages_over_senders and not self._warned_inexact:
            self._warned_inexact = True
            warnings.warn(
                f"gradcomp: the groups' outer gradients are weighted by their samples, but {compressor!r} "
                "averages each coordinate over the workers that chose it, which undoes part of the weights: the "
                "merge is weighted only approximately. A compressor that averages over every worker merges them "
                "exactly (SparseLoCo(aggregate='all')), or weight_by=None gives equal weights", UserWarning,
                stacklevel=5)

    #: whether the warning that the compressor's aggregate weights only approximately was given
    _warned_inexact = False

    def _group_row(self, fragment: int, device: torch.device) -> list[int]:
        """This rank's group's figures (:data:`~lightning_gradcomp.local.windows.ROW_FIELDS`): its own, or, where
        several ranks train one replica (the layout's), theirs combined with one small all-reduce."""
        final = self._ending and self.outer.time_boxed
        figures = self.clock.row(fragment, final, self.outer.left_after_window(self.clock.total_steps))
        ranks = self.layout.ranks_per_replica()
        if ranks == 1:
            return figures
        summed = torch.tensor(figures, dtype=torch.int64, device=device)
        self.layout.sum_within_replica(summed)
        return combine_within_group(summed.tolist(), ranks)

    def _exchange_entries(self, indices: Sequence[int], deltas: Sequence[Tensor], outs: Sequence[Tensor]) -> list[Entry]:
        """What this rank hands the engine: each parameter's flat outer gradient (the layout's part of it) and
        where its average goes."""
        params = self.params
        parts = [(i, delta, out, self.layout.exchanged(i, params[i])) for i, delta, out in zip(indices, deltas, outs)]
        return [Entry(self.names[i], shape, _part(delta, elements), _part(out, elements))
                for i, delta, out, part in parts if part is not None for elements, shape in [part]]

    @torch.no_grad()
    def _merge(self, pending: PendingSync) -> None:
        """Wait for the exchange, average the fragment's buffers, step its global parameters, merge them (or,
        when the membership does not commit it, roll the fragment back)."""
        self.membership.settle(pending)
        self.layout.share(self.outer.members(pending.fragment), pending.averaged)
        if not self.membership.commit(pending):
            self._roll_back(pending)
            return
        self.pending.remove(pending)
        self._average_buffers(pending.fragment)
        indices = self.outer.members(pending.fragment)
        applied = self.outer.apply(pending.averaged, indices, self.layout.sum_over_shards)
        self.outer.merge(self.params, indices, self.outer.alpha if applied else 0.0)
        self.synced = True

    @torch.no_grad()
    def _roll_back(self, pending: PendingSync) -> None:
        """Drop ``pending``: its fragment restarts from its unchanged global parameters and buffers, and the
        residuals of its parameters (whose last update may hold the dropped window) from zero."""
        self.pending.remove(pending)
        self.outer.merge(self.params, self.outer.members(pending.fragment), 0.0)
        self.global_buffers.copy_into([buffer for _, buffer in self.buffers], pending.fragment)
        for index in self.outer.members(pending.fragment):
            residual = self.exchange.memory.residuals.get(self.names[index])
            if residual is not None:
                residual.zero_()  # in place: it may be a view of its bucket's flat residual
        self.synced = True

    def _average_buffers(self, fragment: int) -> None:
        owned = [buffer for (_, buffer), owner in zip(self.buffers, self.buffer_fragment) if owner == fragment]
        self.layout.equalise_buffers(owned)
        tensors = averaged(owned)
        if not tensors:
            return
        flat = torch.cat([buffer.reshape(-1).to(buffer_dtype(tensors)) for buffer in tensors])
        self.exchange.driver.all_reduce(flat)
        flat /= self.exchange.driver.world_size
        for buffer, part in zip(tensors, flat.split([buffer.numel() for buffer in tensors])):
            buffer.copy_(part.view_as(buffer))
        self.global_buffers.record(fragment, [buffer for _, buffer in self.buffers])

    @torch.no_grad()
    def adopt_global(self) -> None:
        with self._replica_shown():
            self.outer.merge(self.params, range(len(self.params)), 0.0)
            self.global_buffers.copy_into([buffer for _, buffer in self.buffers])

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self, optimizers: Sequence[Optimizer] = ()) -> dict[str, Any]:
        """This rank's part of the checkpoint: its parameters and buffers (they differ between ranks inside a
        window), its inner optimizers' states, the outer state (the same on every rank) and the
        synchronisations started but not merged (their averages; waits for them). Inside
        :meth:`global_weights` too, it holds the replica."""
        for pending in self.pending:
            self.membership.settle(pending)
        with self._replica_shown():
            return {**local_state(self.names, self.params, self.buffers, optimizers, self.outer,
                                  self.layout.optimizer_state),
                    "pending": [pending.state_dict() for pending in self.pending],
                    "global_buffers": self.global_buffers.state_dict(), "counts": self.clock.state_dict()}

    def load_state_dict(self, state: dict[str, Any], optimizers: Sequence[Optimizer] = ()) -> None:
        if not self.membership.accepts_checkpoint():
            return
        self._adopt_saved_fragments(state.get("outer"))
        with self._replica_shown():
            load_local_state(state, self.names, self.params, self.buffers, optimizers, self.outer,
                             self.layout.load_optimizer_state)
        self.global_buffers.load_state_dict(state.get("global_buffers"))
        self.clock.load_state_dict(state.get("counts"))
        device = self.params[0].device if self.params else torch.device("cpu")
        self.pending = [PendingSync.from_state_dict(pending, device) for pending in state.get("pending", [])]

    def close(self) -> None:
        """Wait for the exchanges in flight and count their figures (at the end of training; they are merged
        if training goes on)."""
        self.exchange.flush()

    def shutdown(self) -> None:
        """Leave the run (under fault tolerance: the quorum; the other groups go on)."""
        self.membership.shutdown()


def sync_buckets(entries: list[Entry], cap: int = SYNC_BUCKET_BYTES) -> list[list[Entry]]:
    """``entries`` in order, cut into buckets of at most ``cap`` bytes (a larger tensor is a bucket alone)."""
    buckets: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        nbytes = entry.grad.numel() * entry.grad.element_size()
        if buckets[-1] and size + nbytes > cap:
            buckets.append([])
            size = 0
        buckets[-1].append(entry)
        size += nbytes
    return buckets


def local_state(names: Sequence[str], params: Sequence[Tensor], buffers: Sequence[tuple[str, Tensor]],
                optimizers: Sequence[Optimizer], outer: Optional[OuterModel],
                optimizer_state: Callable[[Optimizer], dict[str, Any]] = WholeModel().optimizer_state
                ) -> dict[str, Any]:
    """One worker's local-update state (CPU copies): parameters, buffers, inner optimizers, outer state."""
    return {"params": {name: p.detach().cpu().clone() for name, p in zip(names, params)},
            "buffers": {name: b.detach().cpu().clone() for name, b in buffers},
            "optimizers": [optimizer_state(optimizer) for optimizer in optimizers],
            "outer": outer.state_dict() if outer is not None else None}


@torch.no_grad()
def load_local_state(state: dict[str, Any], names: Sequence[str], params: Sequence[Tensor],
                     buffers: Sequence[tuple[str, Tensor]], optimizers: Sequence[Optimizer],
                     outer: Optional[OuterModel],
                     load_optimizer_state: Callable[[Optimizer, dict[str, Any]], None] = WholeModel().load_optimizer_state
                     ) -> None:
    """Restore a :func:`local_state` into a worker's parameters, buffers, optimizers and ``outer``."""
    saved = state["params"]
    missing = sorted(set(names) - set(saved))
    if missing:
        raise ValueError(f"gradcomp: the checkpoint's local-update state lacks parameters {missing}")
    saved_optimizers = state.get("optimizers", [])
    if len(saved_optimizers) != len(optimizers):  # refused before anything is overwritten
        raise ValueError(f"gradcomp: the checkpoint holds {len(saved_optimizers)} inner optimizer states, the run "
                         f"has {len(optimizers)} optimizers")
    for name, p in zip(names, params):
        p.copy_(saved[name])
    for name, buffer in buffers:
        if name in state["buffers"]:
            buffer.copy_(state["buffers"][name])
    for optimizer, optimizer_state in zip(optimizers, saved_optimizers):
        load_optimizer_state(optimizer, optimizer_state)
    if outer is not None and state.get("outer") is not None:
        outer.load_state_dict(state["outer"])
