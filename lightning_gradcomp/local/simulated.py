"""N workers' local-update training on one device: replicas that really diverge, one module
(:class:`SimulatedLocalUpdates`)."""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.exchange.options import ExchangeOptions
from lightning_gradcomp.exchange.simulated import SimulatedExchange
from lightning_gradcomp.local.config import LocalUpdates, warn_compounding_momentum
from lightning_gradcomp.local.loop import load_local_state, local_state, PendingSync, ScheduledSyncs
from lightning_gradcomp.local.fragments import fragment_assignment
from lightning_gradcomp.local.outer import (
    averaged,
    buffer_dtype,
    OuterModel,
    trainable_parameters,
)
from lightning_gradcomp.local.windows import GroupFigures, UNBOUNDED

#: ``stalls``: per worker, the windows in which it stalls and for how many time units
Stalls = Mapping[int, Sequence[tuple[int, float]]]


class _Replica:
    """One worker's parameters, buffers and inner-optimizer states."""

    def __init__(self, params: list[Tensor], buffers: list[Tensor], states: list[Any]) -> None:
        self.params = params
        self.buffers = buffers
        self.states = states


class SimulatedLocalUpdates(ScheduledSyncs):
    """``workers`` replicas of ``module`` trained with local updates on one device.

    Each simulated worker has its own parameters, buffers and inner-optimizer state; the module holds one
    worker's at a time (:meth:`worker` swaps them in by reference, no copy), so the user's model, optimizer
    and training code run unchanged:

    ```python
    sim = SimulatedLocalUpdates(model, [optimizer], LocalUpdates(sync_every=50), workers=4, compressor="int8")
    for batch in loader:
        for worker, part in enumerate(batch.chunk(4)):
            with sim.worker(worker):
                loss_fn(model(part)).backward(); optimizer.step(); optimizer.zero_grad()
        sim.step()                              # every 50 steps: the outer synchronisation
    with sim.global_weights():                  # θ_global in the module: evaluate, save model.state_dict()
        evaluate(model)
    sim.sync()                                  # the end: every replica (and the module) set to θ_global
    ```

    Heterogeneous workers, reproducibly (``speeds``, ``stalls``): time runs in units of one inner step of a
    worker of speed 1; a worker of speed ``v`` takes ``1/v`` units per step, and a stall adds units to one
    window. Lock-step (``window_seconds=None``): every worker takes ``H`` steps per window, which lasts as long
    as its slowest worker (``max_m H/v_m + stall``). Time-boxed (``window_seconds``: ``"auto"``, ``H/max v``
    units, or a number of units): a window lasts ``W`` units and worker ``m`` takes ``F·round((W − stall)·v_m/F)``
    steps of it, spread over the window's ticks (a tick is one step of the fastest worker); the loop steps the
    workers of :meth:`stepping` at each tick, and :attr:`elapsed` and :attr:`samples` count the simulated time
    units and each worker's inner steps.

    The synchronisation runs every worker's outer gradient through the same engine as a real rank, with the
    in-process driver (:class:`~lightning_gradcomp.exchange.simulated.SimulatedExchange`), averages the buffers
    in worker order and steps the outer optimizer, so that it matches a real N-process run. Memory: N copies of
    the parameters, buffers and optimizer state.

    Args:
        module: the model; its current values start every replica.
        optimizers: the inner optimizers over ``module``'s parameters (each worker gets its own state).
        config: ``sync_every`` and the outer optimizer.
        workers: ``N``.
        compressor, error_feedback, min_compress_numel, seed: the outer gradients' compression, as for
            :class:`~lightning_gradcomp.exchange.simulated.SimulatedExchange` (default: uncompressed).
        exchange: an exchange to use instead (then the four options above must be left as they are).
        speeds: each worker's inner steps per time unit (default: all 1; see above).
        stalls: ``{worker: [(window, units), ...]}``: the windows (counted from 0) in which a worker stalls, and
            for how many time units.
    """

    def __init__(self, module: torch.nn.Module, optimizers: Sequence[Optimizer], config: LocalUpdates,
                 workers: int = 2, compressor: Union[Compressor, str] = "none", error_feedback: Optional[bool] = None,
                 min_compress_numel: int = 1024, seed: int = 0, exchange: Optional[SimulatedExchange] = None,
                 speeds: Optional[Sequence[float]] = None, stalls: Optional[Stalls] = None) -> None:
        if exchange is None:
            options = ExchangeOptions(compressor, error_feedback, min_compress_numel, seed)
            exchange = SimulatedExchange(options.compressor, workers, options.error_feedback,
                                         options.min_compress_numel, options.seed)
        self.exchange = exchange
        warn_compounding_momentum(exchange.compressor, config)
        named = trainable_parameters(module)
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.buffers = list(module.named_buffers())
        self.optimizers = list(optimizers)
        self.speeds = check_speeds(speeds, exchange.workers)
        self.stalls = check_stalls(stalls, exchange.workers)
        self.config = config
        #: time-boxed: the window in ticks (steps of the fastest worker) and in time units
        self.window_units = window_units(config, max(self.speeds))
        ticks = config.sync_every if config.window_seconds in (None, "auto") else max(
            config.fragment_count, config.fragment_count * round(self.window_units * max(self.speeds) / config.fragment_count))
        self.outer = OuterModel(self.names, self.params,
                                dataclasses.replace(config, sync_every=ticks, window_seconds=None),
                                fragment_of=fragment_assignment(module, self.names, config))
        #: simulated time units so far, and each worker's inner steps so far
        self.elapsed = 0.0
        self.samples = [0] * exchange.workers
        #: per fragment, each worker's units (inner steps, or what :meth:`count` reported) since its last start
        self._units = [[0] * exchange.workers for _ in range(self.outer.fragments)]
        self._reported: list[Optional[int]] = [None] * exchange.workers
        self._steps_this_window = self._plan_window(0)
        self._set_up(module, config)
        first = _Replica([p.data for p in self.params], [b.data for _, b in self.buffers],
                         [optimizer.state for optimizer in self.optimizers])
        self.replicas = [first] + [
            _Replica([p.detach().clone() for p in self.params], [b.detach().clone() for _, b in self.buffers],
                     [defaultdict(dict) for _ in self.optimizers])
            for _ in range(exchange.workers - 1)]
        self.current = 0

    @property
    def workers(self) -> int:
        return self.exchange.workers

    # ------------------------------------------------------------------ heterogeneous workers
    def _stalled(self, worker: int, window: int) -> float:
        return sum(units for at, units in self.stalls.get(worker, ()) if at == window)

    def _plan_window(self, window: int) -> list[int]:
        """Each worker's inner steps in ``window``: ``H`` in lock-step, else ``F·round((W − stall)·v/F)``."""
        if not self.config.time_boxed:
            return [self.outer.sync_every] * self.workers
        fragments, ticks = self.outer.fragments, self.outer.sync_every
        return [min(ticks, fragments * round(max(0.0, self.window_units - self._stalled(worker, window)) * speed
                                             / fragments))
                for worker, speed in enumerate(self.speeds)]

    def _window_time(self, window: int) -> float:
        """A window's simulated duration: ``W`` time-boxed, the slowest worker's ``H/v + stall`` in lock-step."""
        if self.config.time_boxed:
            return self.window_units
        return max(self.outer.sync_every / speed + self._stalled(worker, window)
                   for worker, speed in enumerate(self.speeds))

    def stepping(self) -> list[int]:
        """The workers that take an inner step at this tick: every worker in lock-step; time-boxed, worker
        ``m``'s ``k_m`` steps of the window spread evenly over its ticks."""
        ticks = self.outer.sync_every
        tick = self.outer.optimizer_steps % ticks
        return [worker for worker, steps in enumerate(self._steps_this_window)
                if (tick + 1) * steps // ticks > tick * steps // ticks]

    def count(self, units: int) -> None:
        """``units`` samples (or tokens) of the current worker's inner step (inside :meth:`worker`)."""
        self._reported[self.current] = (self._reported[self.current] or 0) + units

    def step(self) -> bool:
        """One tick: :meth:`ScheduledSyncs.step`; at a window's end the simulated clock advances and the next
        window's steps are planned."""
        synced = super().step()
        if self.outer.optimizer_steps % self.outer.sync_every == 0:
            window = self.outer.optimizer_steps // self.outer.sync_every - 1
            self.elapsed += self._window_time(window)
            self._steps_this_window = self._plan_window(window + 1)
        return synced

    # ------------------------------------------------------------------ which worker the module holds
    def enter(self, worker: int) -> None:
        """Put worker ``worker``'s parameters, buffers and optimizer states into the module (by reference)."""
        replica = self.replicas[worker]
        for p, data in zip(self.params, replica.params):
            p.data = data
        for (_, buffer), data in zip(self.buffers, replica.buffers):
            buffer.data = data
        for optimizer, state in zip(self.optimizers, replica.states):
            optimizer.state = state
        self.current = worker

    def _keep(self) -> None:
        """Record the current worker's tensors and optimizer states (an optimizer may have replaced its
        ``state`` dict, e.g. on ``load_state_dict``)."""
        replica = self.replicas[self.current]
        replica.params = [p.data for p in self.params]
        replica.buffers = [b.data for _, b in self.buffers]
        replica.states = [optimizer.state for optimizer in self.optimizers]

    @contextmanager
    def worker(self, worker: int) -> Iterator[None]:
        """Run worker ``worker``'s inner step inside; the module holds worker 0 again afterwards."""
        self._refuse_inside_the_view("a simulated worker's step")
        if self.config.time_boxed and worker not in self.stepping():
            raise RuntimeError(f"gradcomp: simulated worker {worker} takes no inner step at this tick (its speed "
                               f"{self.speeds[worker]:g}, time-boxed windows): step the workers of sim.stepping()")
        self.enter(worker)
        try:
            yield
        finally:
            self._keep()
            self.enter(0)
        units = self._reported[worker]
        self.samples[worker] += 1
        for counts in self._units:
            counts[worker] += 1 if units is None else units
        self._reported[worker] = None

    # ------------------------------------------------------------------ the outer loop (step: ScheduledSyncs)
    @torch.no_grad()
    def _start(self, fragment: int, merge_at: int) -> PendingSync:
        """Every worker's outer gradient of ``fragment`` through the engine, now; merged at ``merge_at``."""
        self._keep()
        indices = self.outer.members(fragment)
        # the real ranks' agreement on this synchronisation (LocalUpdateLoop.agree_on_schedule), counted alike
        elements = sum(self.params[i].numel() for i in indices)
        units = self._units[fragment]
        groups = [GroupFigures(0, self._ending, count, 0.0, UNBOUNDED) for count in units]
        self.exchange.driver.all_gather([torch.tensor([self.outer.optimizer_steps, fragment, elements, 0, 0, count,
                                                       0, UNBOUNDED]) for count in units])
        weights = self._use_figures(fragment, groups, 0)  # (its schedule is in ticks: planned by the speeds)
        self._units[fragment] = [0] * self.workers
        names = [self.names[i] for i in indices]
        shapes = {self.names[i]: tuple(self.params[i].shape) for i in indices}
        for worker, replica in enumerate(self.replicas):
            deltas = self.outer.outer_gradients(replica.params, indices)
            if weights[worker] != 1.0:  # Σ_m w_m·Δ_m, before compression (see local/windows.py)
                torch._foreach_mul_(deltas, weights[worker])
            self.exchange.add_worker(worker, list(zip(names, deltas)), shapes)
        if self.outer.delay == 0:  # counted with the exchange's step, as a real rank counts it
            self._average_buffers(fragment)
        aggregate = self.exchange.finish_step()
        pending = PendingSync(fragment, merge_at, [aggregate[name] for name in names])
        self.pending.append(pending)
        return pending

    @torch.no_grad()
    def _merge(self, pending: PendingSync) -> None:
        self._keep()
        self.pending.remove(pending)
        if self.outer.delay:
            self._average_buffers(pending.fragment)
        indices = self.outer.members(pending.fragment)
        applied = self.outer.apply(pending.averaged, indices)
        for replica in self.replicas:
            self.outer.merge(replica.params, indices, self.outer.alpha if applied else 0.0)
        self.enter(self.current)
        self.synced = True

    def _average_buffers(self, fragment: int) -> None:
        """The workers' floating-point buffers of ``fragment`` averaged as a real rank does: one flat fp32
        all-reduce (summed in worker order, counted in the bytes), divided by ``N``."""
        def mine(replica: _Replica) -> list[Tensor]:
            pairs = zip(replica.buffers, self.buffer_fragment)
            return averaged([buffer for buffer, owner in pairs if owner == fragment])

        if not mine(self.replicas[0]):
            return
        dtype = buffer_dtype(mine(self.replicas[0]))
        flats = [torch.cat([buffer.reshape(-1).to(dtype) for buffer in mine(replica)]) for replica in self.replicas]
        mean = self.exchange.driver.all_reduce(flats) / self.workers
        parts = mean.split([buffer.numel() for buffer in mine(self.replicas[0])])
        for replica in self.replicas:
            for buffer, part in zip(mine(replica), parts):
                buffer.copy_(part.view_as(buffer))
        self.global_buffers.record(fragment, self.replicas[0].buffers)

    @torch.no_grad()
    def adopt_global(self) -> None:
        """Every replica's parameters and floating-point buffers set to ``θ_global``'s."""
        with self._visiting():
            for replica in self.replicas:
                self.outer.merge(replica.params, range(len(self.params)), 0.0)
                self.global_buffers.copy_into(replica.buffers)

    @contextmanager
    def _visiting(self) -> Iterator[None]:
        """Inside, the module holds the replicas (also inside :meth:`global_weights`), the current worker's
        recorded first, and the workers may be entered in turn; afterwards it holds the current worker's again."""
        with self._replica_shown():
            self._keep()
            current = self.current
            yield
            self.enter(current)

    # ------------------------------------------------------------------ checkpoint
    def state_dicts(self) -> list[dict[str, Any]]:
        """Every worker's local-update state (:func:`~lightning_gradcomp.local.loop.local_state`); the outer
        state once, in worker 0's (the replicas, also inside :meth:`global_weights`)."""
        with self._visiting():
            states = []
            for worker in range(self.workers):
                self.enter(worker)
                states.append(local_state(self.names, self.params, self.buffers, self.optimizers,
                                          self.outer if worker == 0 else None))
            states[0]["pending"] = [pending.state_dict() for pending in self.pending]
            states[0]["global_buffers"] = self.global_buffers.state_dict()
            states[0]["simulation"] = {"elapsed": self.elapsed, "samples": list(self.samples),
                                       "units": [list(units) for units in self._units],
                                       "steps_this_window": list(self._steps_this_window)}
        return states

    def load_state_dicts(self, states: Sequence[dict[str, Any]]) -> None:
        if len(states) != self.workers:
            raise ValueError(f"gradcomp: the checkpoint holds the local-update state of {len(states)} workers, this "
                             f"simulation has {self.workers}")
        self._adopt_saved_fragments(states[0].get("outer") if states else None)
        with self._visiting():
            for worker, state in enumerate(states):
                self.enter(worker)
                load_local_state(state, self.names, self.params, self.buffers, self.optimizers,
                                 self.outer if worker == 0 else None)
                self._keep()
            device = self.params[0].device if self.params else torch.device("cpu")
            self.pending = [PendingSync.from_state_dict(pending, device) for pending in states[0].get("pending", [])]
            self.global_buffers.load_state_dict(states[0].get("global_buffers"))
            simulation = states[0].get("simulation")
            if simulation is not None:  # absent before time-boxed windows: every worker took every step
                self.elapsed, self.samples = float(simulation["elapsed"]), list(simulation["samples"])
                self._units = [list(units) for units in simulation["units"]]
                self._steps_this_window = list(simulation["steps_this_window"])


def check_speeds(speeds: Optional[Sequence[float]], workers: int) -> list[float]:
    """``speeds``: one finite number > 0 per worker (default: all 1)."""
    if speeds is None:
        return [1.0] * workers
    values = list(speeds) if isinstance(speeds, (list, tuple)) else None
    if values is None or len(values) != workers or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf for v in values):
        raise ValueError(f"`speeds` must be {workers} numbers > 0, one per worker (inner steps per time unit), got "
                         f"{speeds!r}")
    return [float(v) for v in values]


def check_stalls(stalls: Optional[Stalls], workers: int) -> dict[int, list[tuple[int, float]]]:
    """``stalls``: ``{worker: [(window, units), ...]}`` with workers in range, windows >= 0 and units >= 0."""
    if stalls is None:
        return {}
    allowed = (f"`stalls` must map a worker (0 to {workers - 1}) to a list of (window, time units) pairs, the window "
               "counted from 0 and the units >= 0")
    if not isinstance(stalls, Mapping):
        raise ValueError(f"{allowed}; got {stalls!r}")
    checked: dict[int, list[tuple[int, float]]] = {}
    for worker, entries in stalls.items():
        if not isinstance(worker, int) or not 0 <= worker < workers or not isinstance(entries, (list, tuple)):
            raise ValueError(f"{allowed}; got {worker!r}: {entries!r}")
        for entry in entries:
            if (not isinstance(entry, (list, tuple)) or len(entry) != 2 or not isinstance(entry[0], int)
                    or entry[0] < 0 or not isinstance(entry[1], (int, float)) or not 0 <= entry[1] < math.inf):
                raise ValueError(f"{allowed}; got {worker!r}: {entries!r}")
        checked[worker] = [(int(at), float(units)) for at, units in entries]
    return checked


def window_units(config: LocalUpdates, fastest: float) -> float:
    """``W`` in simulated time units: ``window_seconds``, or ``H`` steps of the fastest worker (``"auto"``, and
    lock-step's nominal window)."""
    if isinstance(config.window_seconds, (int, float)) and not isinstance(config.window_seconds, bool):
        return float(config.window_seconds)
    return config.sync_every / fastest
