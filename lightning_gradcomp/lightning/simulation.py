"""``GradCompSimStrategy``: N data-parallel workers simulated on one device (Harris 2020, §3.2, Algorithm 1)."""

from __future__ import annotations

from functools import partial
from typing import Any, Literal, Optional, Union

import torch
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.strategies import SingleDeviceStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.core.checks import check_int
from lightning_gradcomp.exchange.checkpoint import CHECKPOINT_KEY, pack
from lightning_gradcomp.ddp.hierarchy import check_hierarchy, local_average
from lightning_gradcomp.exchange.simulated import SimulatedExchange
from lightning_gradcomp.lightning.checkpointing import RestoresCompressionState
from lightning_gradcomp.lightning.local_updates_fit import ShowsGlobalModel
from lightning_gradcomp.lightning.options import configure_strategy, HoldsOptions
from lightning_gradcomp.lightning.options import check_fit_setup, check_gradient_clipping
from lightning_gradcomp.lightning.trainer_exchange import print_fit_summary
from lightning_gradcomp.local.config import check_local_updates, LocalUpdates
from lightning_gradcomp.local.loop import ScheduledSyncs
from lightning_gradcomp.local.simulated import SimulatedLocalUpdates
from lightning_gradcomp.metrics.stats import StepStats



class GradCompSimStrategy(ShowsGlobalModel, RestoresCompressionState, HoldsOptions, SingleDeviceStrategy):
    """Simulate ``workers`` data-parallel workers with compressed gradient exchange on one device.

    Each batch is split into ``workers`` equal parts along ``batch_dim``. For each part in turn: the
    LightningModule's ``training_step`` (forward), backward, and compression of that worker's gradient
    with that worker's own error-feedback memory (or DGC state); the decoded results are averaged, and
    one optimizer step follows (Harris 2020, §3.2, Algorithm 1). The same compressors, callbacks and
    LightningModule run unchanged; a batch of ``N * b`` samples here is the equivalent of ``N`` real
    processes with ``b`` each (see :class:`~lightning_gradcomp.simulation.DistributedOrderBatchSampler`
    for their exact data order).

    Recurrent models: while worker ``i`` runs, ``trainer.strategy.current_worker == i`` (use
    :func:`~lightning_gradcomp.simulation.current_worker`), so a module can keep one hidden state per
    worker across batches.

    Telemetry matches the real strategy: ``step_stats`` (figures averaged over workers, bytes as each
    worker would hand them to ``torch.distributed``) and, with
    :class:`~lightning_gradcomp.lightning.callbacks.CompressionMonitor`, errors and estimated communication time
    on a network model. Memory: the model once, plus per-worker residuals and compressor state.

    Args:
        workers: number of simulated workers ``N``.
        compressor, error_feedback, min_compress_numel, seed, log_stats, print_summary: as for
            :class:`~lightning_gradcomp.GradCompStrategy`.
        batch_dim: the dimension along which batches are split (1 for ``(seq, batch)`` layouts).
        uneven_batches: what happens to a batch whose size is not divisible by ``workers`` (typically
            the last one of an epoch): ``"pad"`` (default) repeats its first samples up to the next
            multiple, as DDP's ``DistributedSampler`` pads the data set so that every rank gets as many
            samples; ``"split"`` lets ``torch.tensor_split`` make the parts differ by one sample (each
            worker still weighs ``1/N``); ``"error"`` refuses it.
        hierarchy, nodes: ``hierarchy="node"`` simulates the hierarchical exchange of
            :class:`~lightning_gradcomp.GradCompStrategy` on ``nodes`` nodes of ``workers / nodes``
            workers: each node's workers average their gradients, and the nodes exchange compressed.
        local_updates: ``None`` (default): exchange gradients every step. A
            :class:`~lightning_gradcomp.local.LocalUpdates` (or an int ``H``): local-update training of
            ``workers`` replicas that really diverge (each its own parameters, buffers, optimizer state and
            share of every batch; :class:`~lightning_gradcomp.local.SimulatedLocalUpdates`), synchronised
            every ``H`` optimizer steps as :class:`~lightning_gradcomp.GradCompStrategy` does. Validation,
            checkpoints' model ``state_dict`` and the weights ``fit`` ends with are the global parameters, as
            in a real run (docs/local-updates.md); inside a training batch the
            module holds worker 0's. Memory: ``workers`` copies of the parameters and optimizer state.
        device: the device; default: the accelerator's first device.
    """

    strategy_name = "gradcomp_sim"

    def __init__(
        self,
        workers: int = 4,
        compressor: Union[Compressor, str] = "topk",
        error_feedback: Optional[bool] = None,
        min_compress_numel: int = 1024,
        seed: int = 0,
        log_stats: bool = True,
        print_summary: bool = True,
        batch_dim: int = 0,
        uneven_batches: Literal["pad", "split", "error"] = "pad",
        hierarchy: Literal["none", "node"] = "none",
        nodes: int = 1,
        device: Optional[Union[str, torch.device]] = None,
        local_updates: Optional[Union[LocalUpdates, int]] = None,
        accelerator: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Any] = None,
    ) -> None:
        self.workers = check_int(workers, "workers", 1)
        configure_strategy(self, compressor, error_feedback, min_compress_numel, seed, log_stats, print_summary)
        self.batch_dim = check_int(batch_dim, "batch_dim", 0)
        self.hierarchy = check_hierarchy(hierarchy)
        self.nodes = check_int(nodes, "nodes", 1)
        if self.workers % self.nodes:
            raise ValueError(f"`nodes` must divide `workers` ({self.workers}) into equal nodes, got {nodes!r}")
        if uneven_batches not in ("pad", "split", "error"):
            raise ValueError(f"`uneven_batches` must be 'pad', 'split' or 'error', got {uneven_batches!r}")
        self.uneven_batches = uneven_batches
        self.local_updates = check_local_updates(local_updates)
        if self.local_updates is not None and self.hierarchy != "none":
            raise ValueError("local_updates: hierarchy must be 'none' (allowed: 'none'); the outer gradients are "
                             "exchanged among all workers")
        self.local: Optional[SimulatedLocalUpdates] = None
        self._pending_local: Optional[list[dict[str, Any]]] = None
        self._device_given = device is not None
        super().__init__(device=device if device is not None else "cpu", accelerator=accelerator,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self.hook_state: Optional[SimulatedExchange] = None
        self.step_stats = StepStats()
        self.current_worker = 0
        self._worker_losses: list[Tensor] = []

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            "gradcomp_sim", cls, description="N workers with compressed gradients simulated on one device",
            override=True,
        )

    @property
    def compression_workers(self) -> int:
        """The number of workers whose exchange is compressed (here: simulated)."""
        return self.workers

    @property
    @override
    def root_device(self) -> torch.device:
        if not self._device_given and self.accelerator is not None:
            kind = type(self.accelerator).__name__.lower()
            if "cuda" in kind and torch.cuda.is_available():
                return torch.device("cuda", torch.cuda.current_device())
            if "mps" in kind:
                return torch.device("mps")
        return self._root_device

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: Any) -> None:
        # Lightning reduces Trainer(devices=2) to one device for a single-device strategy without a word;
        # the devices asked for are only on the (private) accelerator connector. tests/test_bad_inputs.py
        # guards this against a Lightning upgrade.
        asked = len(getattr(trainer._accelerator_connector, "_parallel_devices", None) or [None])
        if asked > 1 or trainer.num_nodes > 1:
            raise ValueError(
                f"GradCompSimStrategy simulates {self.workers} workers in one process on one device; got "
                f"devices={asked}, num_nodes={trainer.num_nodes} (allowed: 1). For real processes "
                "use strategy='gradcomp' (GradCompStrategy)."
            )
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if not self.lightning_module.automatic_optimization:
            raise ValueError("GradCompSimStrategy needs automatic optimization (`automatic_optimization = True`)")
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                "GradCompSimStrategy: `accumulate_grad_batches` must be 1 (allowed: 1); give each simulated "
                "worker a larger share of the batch instead"
            )
        nodes, local_size = (self.nodes, self.workers // self.nodes) if self.hierarchy == "node" else (self.workers, 1)
        self.hook_state = SimulatedExchange(self.compressor, nodes, self.error_feedback, self.min_compress_numel,
                                            self.seed, local_size=local_size)
        if self.local_updates is not None:
            self.local = SimulatedLocalUpdates(self.lightning_module, self.optimizers, self.local_updates,
                                               exchange=self.hook_state)
        else:
            check_fit_setup(self.compressor, self.hook_state.error_feedback, self.optimizers, self.precision_plugin,
                            names={id(p): name for name, p in self.lightning_module.named_parameters()})
            check_gradient_clipping(self.compressor, trainer)
        self._restore_pending()
        self._start_showing_global_model(trainer)

    @property
    def outer_loop(self) -> Optional[ScheduledSyncs]:
        return self.local

    # ------------------------------------------------------------------ one step, N workers
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch, rest = args[0], args[1:]
        if self.local is not None:  # local updates: the current worker's share only (see optimizer_step)
            with self.precision_plugin.train_step_context():
                return self.lightning_module.training_step(self._split(batch)[self.current_worker], *rest, **kwargs)
        outputs = []
        for worker, part in enumerate(self._split(batch)):
            self.current_worker = worker
            with self.precision_plugin.train_step_context():
                outputs.append(self.lightning_module.training_step(part, *rest, **kwargs))
        self.current_worker = 0
        losses = [out["loss"] if isinstance(out, dict) else out for out in outputs]
        if any(loss is None for loss in losses):
            raise ValueError("GradCompSimStrategy: every simulated worker's training_step must return a loss")
        self._worker_losses = losses
        mean = torch.stack([loss.detach() for loss in losses]).mean().requires_grad_()
        if isinstance(outputs[-1], dict):
            return {**outputs[-1], "loss": mean}
        return mean

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        """Backward and compression worker by worker; the parameters end up with the averaged result."""
        if self.local is not None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        assert self.hook_state is not None and self.lightning_module is not None
        module = self.lightning_module
        params = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        node_grads: list[list[tuple[str, Tensor]]] = []
        for worker, loss in enumerate(self._worker_losses):
            for _, p in params:
                p.grad = None
            self.current_worker = worker
            super().backward(loss, optimizer, *args, **kwargs)
            grads = [(name, p.grad) for name, p in params if p.grad is not None]
            local_size = self.hook_state.local_size
            if local_size == 1:
                self.hook_state.add_worker(worker, grads)
                continue
            node_grads.append(grads)
            if len(node_grads) == local_size:  # the node's last worker: its average goes to the exchange
                self.hook_state.add_worker(worker // local_size, local_average(node_grads))
                node_grads = []
        self.current_worker = 0
        self._worker_losses = []
        aggregate = self.hook_state.finish_step()
        for name, p in params:
            p.grad = aggregate[name].view_as(p) if name in aggregate else None
        self.step_stats = self.hook_state.step_stats
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self.local is None:
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
        else:  # local updates: every worker's own forward, backward and step, then the outer loop's count
            for worker in range(self.workers):
                self.current_worker = worker
                with self.local.worker(worker):
                    output = super().optimizer_step(optimizer, closure, model, **kwargs)
            self.current_worker = 0
            self.step_stats = self.hook_state.step_stats if self.local.step() else StepStats()
        if self.log_stats:
            trainer = self.lightning_module.trainer
            interval = trainer.log_every_n_steps
            if trainer.loggers and interval > 0 and trainer.global_step % interval == 0:
                metrics = self.step_stats.metrics()
                if self.local is not None and self.local.synced:
                    metrics["gradcomp/outer_grad_norm"] = self.local.outer.last_norm
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=trainer.global_step)
        return output

    def _split(self, batch: Any) -> list[Any]:
        sizes = []
        apply_to_collection(batch, Tensor, lambda t: sizes.append(t.shape[self.batch_dim]) if t.dim() > self.batch_dim else None)
        if not sizes:
            raise ValueError(f"GradCompSimStrategy: the batch holds no tensor with a dimension {self.batch_dim} to split")
        uneven = any(size % self.workers for size in sizes)
        if uneven and self.uneven_batches == "error":
            raise ValueError(
                f"GradCompSimStrategy: a batch of {sizes[0]} samples cannot be split equally among {self.workers} "
                f"workers; use a batch size divisible by `workers`, drop_last=True, or uneven_batches='pad' or 'split'"
            )
        if uneven and self.uneven_batches == "pad":
            batch = apply_to_collection(batch, Tensor, partial(_pad, dim=self.batch_dim, multiple=self.workers))
        elif min(sizes) < self.workers:
            raise ValueError(f"GradCompSimStrategy: a batch of {min(sizes)} samples is smaller than `workers` "
                             f"({self.workers}); use uneven_batches='pad'")
        return [
            apply_to_collection(batch, Tensor, partial(_part, dim=self.batch_dim, parts=self.workers, index=worker))
            for worker in range(self.workers)
        ]

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        print_fit_summary(self)

    # ------------------------------------------------------------------ checkpoint
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if self.hook_state is not None:
            ranks = self.hook_state.state_dicts()
            if self.local is not None:
                for rank, local in zip(ranks, self.local.state_dicts()):
                    rank["local"] = local
            checkpoint[CHECKPOINT_KEY] = pack(self.workers, self.compressor, ranks, self.hook_state.layout)
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def _load_worker_states(self, ranks: list[dict[str, Any]]) -> None:
        self.hook_state.load_state_dicts(ranks, self.root_device)
        if all(rank.get("local") is not None for rank in ranks):
            self._pending_local = [rank["local"] for rank in ranks]  # after Lightning restores the optimizers

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self._pending_local is not None and self.local is not None:
            states, self._pending_local = self._pending_local, None
            self.local.load_state_dicts(states)


def _pad(tensor: Tensor, dim: int, multiple: int) -> Tensor:
    """``tensor`` with its first samples repeated along ``dim`` up to a multiple of ``multiple`` (as
    ``DistributedSampler`` pads the data set with its first samples)."""
    if tensor.dim() <= dim or tensor.shape[dim] % multiple == 0:
        return tensor
    size = tensor.shape[dim]
    missing = multiple - size % multiple
    repeats = torch.arange(missing, device=tensor.device) % size
    return torch.cat([tensor, tensor.index_select(dim, repeats)], dim=dim)


def _part(tensor: Tensor, dim: int, parts: int, index: int) -> Tensor:
    """Worker ``index``'s share of ``tensor`` (tensors without the batch dimension are shared)."""
    if tensor.dim() <= dim:
        return tensor
    return torch.tensor_split(tensor, parts, dim=dim)[index]


def current_worker(module: Any) -> int:
    """The simulated worker whose share of the batch ``module`` is processing (0 outside a simulation).

    A recurrent LightningModule keeps one hidden state per worker with it::

        hidden = self.hidden.get(current_worker(self))
    """
    trainer = getattr(module, "_trainer", None)
    strategy = getattr(trainer, "strategy", None) if trainer is not None else None
    return int(getattr(strategy, "current_worker", 0))


GradCompSimStrategy.register_strategies(StrategyRegistry)
