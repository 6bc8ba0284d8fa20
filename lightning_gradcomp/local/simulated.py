"""N workers' local-update training on one device: replicas that really diverge, one module.

Each simulated worker has its own parameters, buffers and inner-optimizer state; the module holds one
worker's at a time (:meth:`SimulatedLocalUpdates.worker` swaps them in by reference, no copy), so the
user's model, optimizer and training code run unchanged::

    sim = SimulatedLocalUpdates(model, [optimizer], LocalUpdates(sync_every=50), workers=4, compressor="int8")
    for batch in loader:
        for worker, part in enumerate(batch.chunk(4)):
            with sim.worker(worker):
                loss_fn(model(part)).backward(); optimizer.step(); optimizer.zero_grad()
        sim.step()                              # every 50 steps: the outer synchronisation
    with sim.global_weights():                  # θ_global in the module: evaluate, save model.state_dict()
        evaluate(model)
    sim.sync()                                  # the end: every replica (and the module) set to θ_global

The synchronisation runs every worker's outer gradient through the same engine as a real rank, with
the in-process driver (:class:`~lightning_gradcomp.exchange.simulated.SimulatedExchange`), averages the
buffers in worker order and steps the outer optimizer, so that it matches a real N-process run
(``tests/test_local_updates.py``). Memory: N copies of the parameters, buffers and optimizer state.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence, Union

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.exchange.options import exchange_options
from lightning_gradcomp.exchange.simulated import SimulatedExchange
from lightning_gradcomp.local.config import LocalUpdates, warn_compounding_momentum
from lightning_gradcomp.local.global_model import GlobalBuffers
from lightning_gradcomp.local.loop import load_local_state, local_state, PendingSync, ScheduledSyncs
from lightning_gradcomp.local.fragments import buffer_fragments, fragment_assignment
from lightning_gradcomp.local.outer import (
    averaged,
    buffer_dtype,
    OuterModel,
    trainable_parameters,
)


class _Replica:
    """One worker's parameters, buffers and inner-optimizer states."""

    def __init__(self, params: list[Tensor], buffers: list[Tensor], states: list[Any]) -> None:
        self.params = params
        self.buffers = buffers
        self.states = states


class SimulatedLocalUpdates(ScheduledSyncs):
    """``workers`` replicas of ``module`` trained with local updates on one device.

    Args:
        module: the model; its current values start every replica.
        optimizers: the inner optimizers over ``module``'s parameters (each worker gets its own state).
        config: ``sync_every`` and the outer optimizer.
        workers: ``N``.
        compressor, error_feedback, min_compress_numel, seed: the outer gradients' compression, as for
            :class:`~lightning_gradcomp.exchange.simulated.SimulatedExchange` (default: uncompressed).
        exchange: an exchange to use instead (then the four options above must be left as they are).
    """

    def __init__(self, module: torch.nn.Module, optimizers: Sequence[Optimizer], config: LocalUpdates,
                 workers: int = 2, compressor: Union[Compressor, str] = "none", error_feedback: Optional[bool] = None,
                 min_compress_numel: int = 1024, seed: int = 0, exchange: Optional[SimulatedExchange] = None) -> None:
        if exchange is None:
            options = exchange_options(compressor, error_feedback, min_compress_numel, seed)
            exchange = SimulatedExchange(options.compressor, workers, options.error_feedback,
                                         options.min_compress_numel, options.seed)
        self.exchange = exchange
        warn_compounding_momentum(exchange.compressor, config)
        named = trainable_parameters(module)
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.buffers = list(module.named_buffers())
        self.optimizers = list(optimizers)
        self.outer = OuterModel(self.names, self.params, config,
                                fragment_of=fragment_assignment(module, self.names, config))
        self.buffer_fragment = buffer_fragments([name for name, _ in self.buffers], self.names,
                                                self.outer.fragment_of, self.outer.fragments)
        self.global_buffers = GlobalBuffers([buffer for _, buffer in self.buffers], self.buffer_fragment)
        self._record_first_use(module, config)
        self.pending: list[PendingSync] = []
        self.synced = False
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

    @property
    def sync_every(self) -> int:
        return self.outer.sync_every

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
        self.enter(worker)
        try:
            yield
        finally:
            self._keep()
            self.enter(0)

    # ------------------------------------------------------------------ the outer loop (step: ScheduledSyncs)
    @torch.no_grad()
    def _start(self, fragment: int, merge_at: int) -> PendingSync:
        """Every worker's outer gradient of ``fragment`` through the engine, now; merged at ``merge_at``."""
        self._keep()
        indices = self.outer.members(fragment)
        # the real ranks' agreement on this synchronisation (LocalUpdateLoop._agree), counted alike
        elements = sum(self.params[i].numel() for i in indices)
        self.exchange.driver.all_gather([torch.tensor([self.outer.optimizer_steps, fragment, elements])
                                         for _ in range(self.workers)])
        names = [self.names[i] for i in indices]
        shapes = {self.names[i]: tuple(self.params[i].shape) for i in indices}
        for worker, replica in enumerate(self.replicas):
            deltas = self.outer.outer_gradients(replica.params, indices)
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
        with self._replica_shown():
            self._keep()
            everything = range(len(self.params))
            for replica in self.replicas:
                self.outer.merge(replica.params, everything, 0.0)
                self.global_buffers.copy_into(replica.buffers)
            self.enter(self.current)

    # ------------------------------------------------------------------ checkpoint
    def state_dicts(self) -> list[dict[str, Any]]:
        """Every worker's local-update state (:func:`~lightning_gradcomp.local.loop.local_state`); the outer
        state once, in worker 0's (the replicas, also inside :meth:`global_weights`)."""
        with self._replica_shown():
            self._keep()
            current = self.current
            states = []
            for worker in range(self.workers):
                self.enter(worker)
                states.append(local_state(self.names, self.params, self.buffers, self.optimizers,
                                          self.outer if worker == 0 else None))
            states[0]["pending"] = [pending.state_dict() for pending in self.pending]
            states[0]["global_buffers"] = self.global_buffers.state_dict()
            self.enter(current)
            return states

    def load_state_dicts(self, states: Sequence[dict[str, Any]]) -> None:
        if len(states) != self.workers:
            raise ValueError(f"gradcomp: the checkpoint holds the local-update state of {len(states)} workers, this "
                             f"simulation has {self.workers}")
        self._adopt_saved_fragments(states[0].get("outer") if states else None)
        with self._replica_shown():
            self._keep()
            current = self.current
            for worker, state in enumerate(states):
                self.enter(worker)
                load_local_state(state, self.names, self.params, self.buffers, self.optimizers,
                                 self.outer if worker == 0 else None)
                self._keep()
            device = self.params[0].device if self.params else torch.device("cpu")
            self.pending = [PendingSync.from_state_dict(pending, device) for pending in states[0].get("pending", [])]
            self.global_buffers.load_state_dict(states[0].get("global_buffers"))
            self.enter(current)
