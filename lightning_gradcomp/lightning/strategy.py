"""``GradCompStrategy``: Lightning's DDP with compressed gradient exchange, registered as ``"gradcomp"``."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.core.checks import check_bool
from lightning_gradcomp.exchange.checkpoint import (agree_on_the_save, CHECKPOINT_KEY, own_entry, parts_stub, save_part,
                                                   saved_states)
from lightning_gradcomp.ddp.hierarchy import check_hierarchy, node_groups
from lightning_gradcomp.exchange.handle import ExchangeHandle
from lightning_gradcomp.exchange.session import ExchangeSession
from lightning_gradcomp.lightning.checkpointing import RestoresCompressionState
from lightning_gradcomp.lightning.local_updates_fit import ShowsGlobalModel
from lightning_gradcomp.local.config import check_local_updates, LocalUpdates
from lightning_gradcomp.local.fault_tolerance import FaultTolerance, TorchftMembership
from lightning_gradcomp.local.handle import LOCAL_STATE_DROPPED, LocalUpdateHandle
from lightning_gradcomp.local.loop import LocalUpdateLoop, ScheduledSyncs
from lightning_gradcomp.wiring.plan import check_fault_tolerance, check_global_device_option
from lightning_gradcomp.lightning.options import (
    check_ddp_kwargs,
    check_fit_setup,
    check_gradient_clipping,
    check_process_group_backend,
    check_start_method,
    check_timeout,
    configure_strategy,
    HoldsOptions,
    ExtendsDDP,
    local_update_ddp_kwargs,
)
from lightning_gradcomp.lightning.trainer_exchange import TrainerExchange
from lightning_gradcomp.metrics.stats import StepStats
from lightning_gradcomp.wiring.plan import attach_exchange, ExchangePlan

if TYPE_CHECKING:
    from lightning_gradcomp.lightning.simulation import GradCompSimStrategy

_REPLACED_DDP_ARGS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")


class GradCompStrategy(TrainerExchange, ShowsGlobalModel, RestoresCompressionState, HoldsOptions, ExtendsDDP,
                       DDPStrategy):
    """Data-parallel training whose gradients cross the network compressed.

    A subclass of Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy` that installs the
    :func:`~lightning_gradcomp.ddp.hook.gradcomp_hook` communication hook on every device type, CPU (gloo)
    included. Every ``DDPStrategy`` argument is accepted, except the ``ddp_comm_*`` hook arguments, which
    this strategy replaces.

    Args:
        compressor: a :class:`~lightning_gradcomp.compressors.Compressor` or a registered name
            (``"none"``, ``"fp16"``, ``"bf16"``, ``"topk"``, ``"randomk"``, ``"threshold"``, ``"qsgd"``...).
            Default: Top-k at density 0.01.
        error_feedback: keep residuals ``e = p - C(p)`` and add them to the next gradient. ``None``
            (default) switches it on for biased compressors and off for unbiased ones.
        min_compress_numel: tensors with fewer elements (biases, norms) are all-reduced dense (in the 16-bit
            format with `"fp16"`/`"bf16"`, so that a bucket stays one all-reduce).
        seed: base seed of the compressors' generators; identical on all ranks.
        log_stats: log ``gradcomp/bytes_sent``, ``bytes_dense``, ``compression_ratio`` and ``density``
            through the Trainer's loggers every ``log_every_n_steps`` (averaged over ranks).
        print_summary: when ``fit`` ends, rank 0 prints a short table of what compression did (bytes sent
            vs dense, ratio, density, compression error, and with a
            :class:`~lightning_gradcomp.lightning.callbacks.CompressionMonitor` the estimated communication time
            saved on its network model); see :mod:`lightning_gradcomp.metrics.summary`.
        exchange_thread: exchange buckets on a thread of their own, in the order DDP hands them over, so
            compression and communication overlap the rest of backward (see
            :mod:`lightning_gradcomp.exchange.thread`); ``False`` runs them in the DDP hook; ``None``
            (default): the thread on GPUs, the hook on CPUs.
        hierarchy: ``"node"``: on several nodes, a dense all-reduce inside each node, the compressed
            exchange only between nodes (each local rank compresses its share of every bucket, with the
            same local rank of the other nodes), and a dense all-reduce inside the node to put the shares
            together; see :mod:`lightning_gradcomp.ddp.hierarchy`. ``"none"`` (default): every rank exchanges
            compressed gradients with every other.
        timeout: the process group's timeout (a ``timedelta``, or seconds): a peer that stops answering
            fails the pending collective on every other rank after this long.
        local_updates: ``None`` (default): exchange gradients every step. A
            :class:`~lightning_gradcomp.local.LocalUpdates` (or an int ``H``): local-update training
            (DiLoCo): each rank takes ``H`` optimizer steps alone (DDP communicates nothing, buffers are not
            broadcast), then the outer gradients ``θ_global − θ`` are exchanged with ``compressor`` and the
            outer optimizer steps the global parameters; see :mod:`lightning_gradcomp.local`. Validation,
            checkpoints' model ``state_dict`` and the weights ``fit`` ends with are the global parameters
            (``fit`` ends with a final synchronisation); see docs/local-updates.md.
        fault_tolerance: with ``local_updates``, a :class:`~lightning_gradcomp.FaultTolerance`: this Trainer is
            one replica group of a job that survives lost groups; the synchronisations go through torchft's
            lighthouse (the ``ft`` extra; see :mod:`lightning_gradcomp.local.fault_tolerance`). With several
            devices, DDP all-reduces the gradients inside the group every step (uncompressed) and the devices
            split the outer exchange between the groups.
            A group that joins a running job continues from the others' step: ``fit`` stops when the outer
            loop's step count reaches ``max_steps``.
        global_device: with ``local_updates``, where ``θ_global`` and the outer optimizer's state live:
            ``None`` (the parameters' device) or ``"cpu"`` (pinned host memory, a copy each way per
            synchronisation: frees a model's worth of accelerator memory, twice with a momentum outer optimizer).
        **kwargs: passed to ``DistributedDataParallel`` (``bucket_cap_mb``, ``static_graph``...).
    """

    strategy_name = "gradcomp"

    def __init__(
        self,
        compressor: Union[Compressor, str] = "topk",
        error_feedback: Optional[bool] = None,
        min_compress_numel: int = 1024,
        seed: int = 0,
        log_stats: bool = True,
        print_summary: bool = True,
        exchange_thread: Optional[bool] = None,
        hierarchy: Literal["none", "node"] = "none",
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[Union[timedelta, float]] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        ddp_comm_state: Optional[object] = None,
        ddp_comm_hook: Optional[Callable] = None,
        ddp_comm_wrapper: Optional[Callable] = None,
        model_averaging_period: Optional[int] = None,
        local_updates: Optional[Union[LocalUpdates, int]] = None,
        fault_tolerance: Optional[FaultTolerance] = None,
        global_device: Optional[Union[str, torch.device]] = None,
        **kwargs: Any,
    ) -> None:
        replaced = {"ddp_comm_state": ddp_comm_state, "ddp_comm_hook": ddp_comm_hook,
                    "ddp_comm_wrapper": ddp_comm_wrapper, "model_averaging_period": model_averaging_period}
        given = [name for name, value in replaced.items() if value is not None]
        if given:
            raise ValueError(
                f"GradCompStrategy installs its own communication hook; `{'`, `'.join(given)}` must be None "
                f"(allowed: leave {', '.join(_REPLACED_DDP_ARGS)} unset; use DDPStrategy for custom hooks)"
            )
        kwargs = check_ddp_kwargs(kwargs, "GradCompStrategy")
        check_start_method(start_method)
        configure_strategy(self, compressor, error_feedback, min_compress_numel, seed, log_stats, print_summary)
        self.exchange_thread = exchange_thread if exchange_thread is None else check_bool(exchange_thread,
                                                                                          "exchange_thread")
        self.hierarchy = check_hierarchy(hierarchy)
        if self.hierarchy == "node" and exchange_thread:
            raise ValueError("hierarchy='node' exchanges in the DDP hook; allowed: exchange_thread=None or False")
        self.local_updates = check_local_updates(local_updates)
        if self.local_updates is not None:
            kwargs = local_update_ddp_kwargs(kwargs, self.hierarchy, exchange_thread)
        self.fault_tolerance = check_fault_tolerance(fault_tolerance, self.local_updates)
        self.global_device = check_global_device_option(global_device, self.local_updates)
        process_group_backend = check_process_group_backend(process_group_backend)
        timeout = check_timeout(timeout)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **kwargs,
        )
        #: this fit's exchange (built in ``_register_ddp_hooks`` by :func:`~lightning_gradcomp.wiring.attach_exchange`,
        #: closed at teardown); ``hook_state`` is its session and ``local_loop`` its outer loop under local updates
        self.gradcomp: Optional[ExchangeHandle] = None
        self.hook_state: Optional[ExchangeSession] = None
        self.local_loop: Optional[LocalUpdateLoop] = None
        self._pending_local: Optional[dict[str, Any]] = None
        self.step_stats = StepStats()

    @classmethod
    def simulated(cls, workers: int = 4, **kwargs: Any) -> "GradCompSimStrategy":
        """The single-device simulation of ``workers`` workers with the same compressor options:
        ``Trainer(devices=1, strategy=GradCompStrategy.simulated(workers=8, compressor=TopK(0.001)))``."""
        from lightning_gradcomp.lightning.simulation import GradCompSimStrategy

        return GradCompSimStrategy(workers=workers, **kwargs)

    @property
    def compression_workers(self) -> int:
        """The number of workers exchanging compressed gradients: the world size (under fault tolerance: the
        replica groups of the last quorum)."""
        if self._fault_tolerant:
            return self.local_loop.exchange.driver.world_size
        return self.world_size

    @property
    def _fault_tolerant(self) -> bool:
        """Whether this process belongs to a replica group under torchft."""
        return self.local_loop is not None and isinstance(self.local_loop.membership, TorchftMembership)

    @property
    def outer_loop(self) -> Optional[ScheduledSyncs]:
        return self.local_loop

    # ------------------------------------------------------------------ hook installation
    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and self.local_loop is None:
            check_fit_setup(self.compressor, self.hook_state.error_feedback, self.optimizers, self.precision_plugin,
                            names={id(p): name for name, p in self.lightning_module.named_parameters()})
            check_gradient_clipping(self.compressor, trainer)
        self._start_showing_global_model(trainer)

    @override
    def _register_ddp_hooks(self) -> None:
        # DDPStrategy registers hooks only on CUDA; gloo on CPU supports them just as well.
        assert isinstance(self.model, DistributedDataParallel)
        assert self.lightning_module is not None
        groups = None
        if self.hierarchy == "node" and self.local_updates is None:
            if self.num_nodes == 1:
                rank_zero_warn("GradCompStrategy(hierarchy='node') on one node: gradients are all-reduced dense "
                               "inside the node (twice DDP's bytes), then still compressed, with error feedback, by "
                               "a 'cross-node' exchange of one node, and the figures count only that exchange's "
                               "bytes; use hierarchy='none' on one node")
            groups = node_groups(self.num_nodes, self.num_processes)
        # under fault tolerance this Trainer is one replica group; the quorum is taken now
        plan = ExchangePlan(self.options, self.local_updates, self.fault_tolerance, self.global_device,
                            exchange_thread=self.exchange_thread, caller="GradCompStrategy", checked_by_caller=True)
        self.gradcomp = attach_exchange(self.lightning_module, plan, ddp=self.model, node_groups=groups)
        self.hook_state = self.gradcomp.hook_state
        self.local_loop = self.gradcomp.loop if isinstance(self.gradcomp, LocalUpdateHandle) else None
        self._restore_pending()

    # ------------------------------------------------------------------ checkpointing
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Lightning's checkpoint (written by rank 0), and each rank's part of the exchange state (residuals,
        compressor state; under local updates its replica, inner-optimizer and outer state) written by that
        rank beside it, in ``<filepath>.gradcomp/``: nothing is gathered on rank 0."""
        part = None
        filepath = self._checkpoint_name(filepath)
        if self.hook_state is not None and dist.is_available() and dist.is_initialized():
            local = self.local_loop.state_dict(self.optimizers) if self.local_loop is not None else None
            agree_on_the_save(filepath, self.hook_state._agreement_group, "trainer.save_checkpoint")
            part = own_entry(self.hook_state, self.compressor, *self._checkpoint_position(), local)
            checkpoint[CHECKPOINT_KEY] = parts_stub(part)
        super().save_checkpoint(checkpoint, filepath, storage_options)
        if part is not None:
            save_part(filepath, self.global_rank, part)

    def _checkpoint_position(self) -> tuple[int, int]:
        """This rank's index among the checkpoint's parts and their number: the ranks of the exchange's
        checkpoint group (the world; under fault tolerance this replica group's processes, whose exchange
        group is torchft's and changes with the quorum)."""
        if self._fault_tolerant:
            return self.global_rank, self.world_size
        group = self.hook_state.checkpoint_group
        return dist.get_rank(group), dist.get_world_size(group)

    #: under time-boxed windows ``ModelCheckpoint`` names a checkpoint by each rank's own epoch and step
    names_checkpoints_alike = True

    def _checkpoint_name(self, filepath: Any) -> Any:
        """``filepath``, or under time-boxed windows rank 0's (a collective: ``ModelCheckpoint`` saves and removes
        after validation, which runs after the same synchronisation on every rank, but names the file by each
        rank's own epoch and step, which differ)."""
        if self.local_loop is not None and self.local_loop.outer.time_boxed and self.world_size > 1:
            return self.broadcast(filepath)
        return filepath

    def _after_restore(self, saved: dict[str, Any]) -> None:
        """A checkpoint of local updates whose state was dropped (another number of workers, compressor or
        layout): say so, as the plain handles do, beyond the residuals :func:`restore_entry` names."""
        dropped = self.local_loop is not None and self._pending_local is None
        if dropped and any(state.get("local") is not None for state in saved_states(saved)):
            rank_zero_warn(LOCAL_STATE_DROPPED)

    def _load_worker_states(self, ranks: list[dict[str, Any]]) -> None:
        self.hook_state.load_state_dict(ranks[self.global_rank], self.root_device)
        # each rank's own parameters and inner-optimizer state, applied once Lightning has restored rank 0's
        self._pending_local = ranks[self.global_rank].get("local")

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self._pending_local is not None and self.local_loop is not None:
            local, self._pending_local = self._pending_local, None
            self.local_loop.load_state_dict(local, self.optimizers)


GradCompStrategy.register_strategies(StrategyRegistry)
