"""``GradCompFSDPStrategy``: compressed HSDP for the Trainer, registered as ``"gradcomp_fsdp"``: FSDP2 inside
each replica, the compressed exchange of :func:`~lightning_gradcomp.register_fsdp` between replicas; see
docs/sharded.md."""

from __future__ import annotations

from collections.abc import Generator, Iterable
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy, ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from typing_extensions import override

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.core.checks import check_bool
from lightning_gradcomp.exchange.checkpoint import (
    agree_on_the_save,
    CHECKPOINT_KEY,
    DEFAULT_CHECKPOINT_TIMEOUT,
    parts_stub,
    resolve_entry_on_every_rank,
    save_part,
)
from lightning_gradcomp.exchange.session import ExchangeSession
from lightning_gradcomp.lightning.local_updates_fit import ShowsGlobalModel
from lightning_gradcomp.lightning.sharding import (
    check_auto_wrap_policy,
    check_fully_shard_options,
    check_shard_size,
    is_fsdp_module,
    refuse_fsdp1,
    refuse_options,
    replicas_exchanging,
    shard_by_policy,
    ShardsInReplicas,
    UNREADABLE_CHECKPOINT,
)
from lightning_gradcomp.wiring.plan import attach_exchange, check_fault_tolerance, check_global_device_option, ExchangePlan
from lightning_gradcomp.lightning.options import (
    check_fit_setup,
    check_gradient_clipping,
    check_process_group_backend,
    check_timeout,
    configure_strategy,
    HoldsOptions,
)
from lightning_gradcomp.lightning.trainer_exchange import TrainerExchange
from lightning_gradcomp.local.config import check_local_updates, LocalUpdates
from lightning_gradcomp.local.fault_tolerance import FaultTolerance
from lightning_gradcomp.local.handle import FaultTolerantHandle, LocalUpdateHandle
from lightning_gradcomp.local.loop import ScheduledSyncs
from lightning_gradcomp.metrics.stats import StepStats


class GradCompFSDPStrategy(TrainerExchange, ShowsGlobalModel, HoldsOptions, ShardsInReplicas, ModelParallelStrategy):
    """Sharded data parallelism (FSDP2) inside each replica, the compressed exchange between replicas (HSDP).

    The processes form a 2-D ``DeviceMesh`` with dimensions ``("replicate", "shard")``: ``shard_size``
    processes per replica (default: the devices per node, so the replicas are the nodes). The model is
    sharded over ``mesh["shard"]``, by the LightningModule's own ``configure_model`` (which reads the mesh
    as ``self.device_mesh["shard"]``) or by ``auto_wrap_policy``; then
    :func:`~lightning_gradcomp.register_fsdp` attaches the compressed exchange over
    ``mesh["replicate"]`` to every FSDP module. Every process sees its own share of the data.

    Args:
        compressor, error_feedback, min_compress_numel, seed, log_stats, print_summary: as for
            :class:`~lightning_gradcomp.GradCompStrategy`, on shards: every compressor works on each parameter's
            local row block, the residuals ``e = p - C(p)`` are kept per parameter shard (fp32), and parameter
            shards with fewer than ``min_compress_numel`` elements are exchanged dense.
        local_updates: ``None`` (default): exchange gradients every step (compressed HSDP). A
            :class:`~lightning_gradcomp.LocalUpdates` (or an int ``H``): local-update training on the shards
            (DiLoCo, SparseLoCo's schedule, Streaming DiLoCo's fragments, ``delay``, ``alpha``): FSDP runs
            inside each replica every step, nothing crosses between replicas between synchronisations, and
            every ``H`` steps each rank's outer gradient of its local shard is exchanged with the same shard
            of the other replicas through ``compressor`` (see :mod:`lightning_gradcomp.local.sharded`).
            As with :class:`~lightning_gradcomp.GradCompStrategy`, validation, checkpoints' ``state_dict`` and
            the end of ``fit`` see ``θ_global`` (see docs/local-updates.md).
        global_device: with ``local_updates``, where each rank's shard of ``θ_global`` and of the outer
            optimizer's state lives: ``None`` (the parameters' device) or ``"cpu"`` (host memory).
        fault_tolerance: with ``local_updates``, a :class:`~lightning_gradcomp.FaultTolerance`: this Trainer is
            one replica group, its processes sharding the model (``shard_size`` = the world size), of a job that
            survives lost groups; each rank exchanges its shard with the same rank of the other groups through
            torchft (see :mod:`lightning_gradcomp.local.fault_tolerance`), and ``fit`` stops when the groups'
            step count reaches ``max_steps``.
        shard_size: the processes of one replica (the ``"shard"`` dimension); the world size must be a
            multiple of it, and the number of replicas is ``world_size // shard_size``. ``None`` (default):
            the devices per node (one replica per node).
        auto_wrap_policy: ``None`` (default): the LightningModule's ``configure_model`` shards the model. Or
            module classes (a set, list or tuple of ``nn.Module`` subclasses, or their import paths as
            strings, e.g. ``{"torch.nn.TransformerEncoderLayer"}``): every instance of them is sharded with
            ``fully_shard(module, mesh=mesh["shard"])``, innermost first, then the LightningModule itself,
            as Lightning's ``FSDPStrategy(auto_wrap_policy={Block})`` does.
        mp_policy: with ``auto_wrap_policy``, FSDP2's ``MixedPrecisionPolicy`` for every ``fully_shard``
            (the exchange keeps fp32 residuals whatever it is); ``None``: FSDP's default.
        reshard_after_forward: with ``auto_wrap_policy``, FSDP2's ``reshard_after_forward`` for every
            ``fully_shard`` (``None``, FSDP's default: ``True`` for the blocks, ``False`` for the root; ``True``,
            ``False``, or an int: a smaller shard size after forward).
        save_distributed_checkpoint: ``True`` (default): every rank writes its shard of the model and
            optimizer (a checkpoint directory); ``False``: rank 0 writes one file with everything gathered.
            Either way each rank writes its own part of the exchange state (in the directory's ``gradcomp/``,
            or in ``<file>.gradcomp/``).
        process_group_backend: ``None`` (nccl on GPUs, gloo on CPUs) or a backend name.
        timeout: the process group's timeout (a ``timedelta`` or seconds), also the limit of the checkpoint's
            gather of the exchange state.

    Refused: ``hierarchy``, ``exchange_thread``, and
    ``ModelParallelStrategy``'s ``data_parallel_size`` / ``tensor_parallel_size``, with a message that says why.
    """

    strategy_name = "gradcomp_fsdp"

    def __init__(
        self,
        compressor: Union[Compressor, str] = "topk",
        error_feedback: Optional[bool] = None,
        min_compress_numel: int = 1024,
        seed: int = 0,
        log_stats: bool = True,
        print_summary: bool = True,
        local_updates: Optional[Union[LocalUpdates, int]] = None,
        global_device: Optional[Union[str, torch.device]] = None,
        fault_tolerance: Optional[FaultTolerance] = None,
        shard_size: Optional[int] = None,
        auto_wrap_policy: Optional[Iterable[Union[type[nn.Module], str]]] = None,
        mp_policy: Optional[Any] = None,
        reshard_after_forward: Optional[Union[bool, int]] = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[Union[timedelta, float]] = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        refuse_options(kwargs)
        configure_strategy(self, compressor, error_feedback, min_compress_numel, seed, log_stats, print_summary)
        self.local_updates = check_local_updates(local_updates)
        self.global_device = check_global_device_option(global_device, self.local_updates)
        self.fault_tolerance = check_fault_tolerance(fault_tolerance, self.local_updates)
        self.shard_size = check_shard_size(shard_size)
        self.auto_wrap_policy = check_auto_wrap_policy(auto_wrap_policy)
        self.fully_shard_kwargs = check_fully_shard_options(self.auto_wrap_policy, mp_policy, reshard_after_forward)
        super().__init__(
            save_distributed_checkpoint=check_bool(save_distributed_checkpoint, "save_distributed_checkpoint"),
            process_group_backend=check_process_group_backend(process_group_backend),
            timeout=check_timeout(timeout),
        )
        self.step_stats = StepStats()

    # ------------------------------------------------------------------ the exchange, as the callbacks see it
    @property
    def hook_state(self) -> Optional[ExchangeSession]:
        """The running exchange state (:class:`~lightning_gradcomp.exchange.state.ExchangeState`), ``None``
        before ``fit`` sets the model up."""
        return self.gradcomp.hook_state if self.gradcomp is not None else None

    @property
    def outer_loop(self) -> Optional[ScheduledSyncs]:
        """The outer loop of local updates on the shards (``None``: compressed HSDP every step)."""
        return self.gradcomp.loop if isinstance(self.gradcomp, LocalUpdateHandle) else None

    @property
    def local_loop(self) -> Optional[ScheduledSyncs]:
        """The outer loop, under the name the summary and the callbacks read."""
        return self.outer_loop

    @property
    def compression_workers(self) -> int:
        """The processes that exchange one shard compressed: the number of replicas (under fault tolerance:
        the replica groups of the last quorum)."""
        return replicas_exchanging(self.gradcomp, self.device_mesh)

    @property
    def _fault_tolerant(self) -> bool:
        return isinstance(self.gradcomp, FaultTolerantHandle)

    # ------------------------------------------------------------------ the mesh
    @override
    def setup_environment(self) -> None:
        """Start the processes' group, build the ``("replicate", "shard")`` mesh and show it to the
        LightningModule (``self.device_mesh`` in ``configure_model``)."""
        ParallelStrategy.setup_environment(self)
        self._setup_mesh("GradCompFSDPStrategy")
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    # ------------------------------------------------------------------ sharding and the exchange
    @override
    def setup(self, trainer: Any) -> None:
        """Shard the model (``auto_wrap_policy``, or the module's ``configure_model`` has done it), set it up
        as ``ModelParallelStrategy`` does and, when fitting, attach the exchange and check the optimizers."""
        assert self.model is not None and self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        if self.auto_wrap_policy is not None:
            shard_by_policy(self.lightning_module, self.auto_wrap_policy, self.device_mesh["shard"],
                            self.fully_shard_kwargs)
        elif not is_overridden("configure_model", self.lightning_module):
            raise ValueError(
                "GradCompFSDPStrategy shards the model in one of two ways; allowed: a configure_model() in the "
                "LightningModule that applies fully_shard(module, mesh=self.device_mesh['shard']) to its blocks and "
                "then to the model, or GradCompFSDPStrategy(auto_wrap_policy={BlockClass, ...})")
        refuse_fsdp1(self.model)
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self._attach_exchange()
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
            if isinstance(self.gradcomp, LocalUpdateHandle):
                self.gradcomp.optimizers = list(self.optimizers)  # their per-rank states go into checkpoints
            else:
                self._check_optimizers(trainer)
        self._start_showing_global_model(trainer)

    def _attach_exchange(self) -> None:
        """The exchange between the replicas, on the LightningModule (the sharded rows of
        :func:`~lightning_gradcomp.wiring.attach_exchange`)."""
        if self.gradcomp is not None:
            self.gradcomp.close()
        plan = ExchangePlan(self.options, self.local_updates, self.fault_tolerance, self.global_device,
                            timeout=self._timeout or DEFAULT_CHECKPOINT_TIMEOUT, caller="GradCompFSDPStrategy")
        self.gradcomp = attach_exchange(self.lightning_module, plan, mesh=self.device_mesh)

    def _check_optimizers(self, trainer: Any) -> None:
        """Refuse settings that would train something else (see :func:`check_fit_setup`) and bind the
        optimizers to the compressor (DeMo reads its learning rate)."""
        assert self.gradcomp is not None
        check_fit_setup(self.compressor, self.gradcomp.hook_state.error_feedback, self.optimizers,
                        self.precision_plugin, names=self.gradcomp.param_names)
        check_gradient_clipping(self.compressor, trainer)
        for optimizer in self.optimizers:
            self.gradcomp.bind(optimizer)

    # ------------------------------------------------------------------ steps
    def _step(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run the LightningModule's ``method``; when the module is itself an FSDP module (the root of the
        sharding), through its ``forward``, so that FSDP's root hooks run even if ``method`` calls only
        submodules (what Lightning does for a wrapped model)."""
        assert self.lightning_module is not None
        if is_fsdp_module(self.lightning_module):
            return self._forward_redirection(self.lightning_module, self.lightning_module, method, *args, **kwargs)
        return getattr(self.lightning_module, method)(*args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._step("training_step", *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._step("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._step("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._step("predict_step", *args, **kwargs)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: no reduce-scatter and no exchange on the non-final micro-batches (FSDP
        keeps the unsharded gradients), so one compressed exchange per optimizer step."""
        modules = [module for module in self.model.modules() if is_fsdp_module(module)] if self.model else []
        for module in modules:
            module.set_requires_gradient_sync(False, recurse=False)
        try:
            yield None
        finally:
            for module in modules:
                module.set_requires_gradient_sync(True, recurse=False)

    # ------------------------------------------------------------------ checkpointing
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Lightning's sharded checkpoint, and each rank's part of the exchange state (its shard's residuals;
        under local updates its replica shard, inner-optimizer state and shard of the outer state, for an
        exact resume in the middle of a window) written by that rank in the checkpoint's directory
        (``gradcomp/``; beside a one-file checkpoint): nothing is gathered on rank 0. Every rank calls it, as
        ``trainer.save_checkpoint`` does."""
        part = None
        if self.gradcomp is not None:
            agree_on_the_save(filepath, self.gradcomp.hook_state._agreement_group, "trainer.save_checkpoint")
            part = self.gradcomp.rank_state_dict()
            checkpoint[CHECKPOINT_KEY] = parts_stub(part)
        super().save_checkpoint(checkpoint, filepath, storage_options)
        if part is not None:
            save_part(filepath, self.global_rank, part)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Lightning's load (the model's and optimizers' shards; after ``setup``), then this rank's exchange
        state (its part, from its file) when fitting. Another world size or compressor keeps only the counters,
        with a warning."""
        try:
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        except IndexError as error:
            raise RuntimeError(UNREADABLE_CHECKPOINT.format(path=checkpoint_path)) from error
        entry = checkpoint.get(CHECKPOINT_KEY)
        if entry is not None and self.gradcomp is not None:
            self.gradcomp.load_state_dict(resolve_entry_on_every_rank(
                entry, checkpoint_path, self.global_rank, self.world_size, self.gradcomp.hook_state._agreement_group,
                "fit(ckpt_path=...)"))
        return checkpoint


GradCompFSDPStrategy.register_strategies(StrategyRegistry)
