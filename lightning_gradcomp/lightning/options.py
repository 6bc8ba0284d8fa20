"""The Lightning strategies' options (Trainer, Fabric, simulation), validated in one place, the checks made
when ``fit`` starts, and the DDP strategies' registered names and samplers (:class:`ExtendsDDP`).

Bad input is a ``ValueError`` naming the parameter and the allowed values, raised at construction,
before any process is started.
"""

from __future__ import annotations

import inspect
import math
import os
from datetime import timedelta
from typing import Any, Mapping, Optional, Union

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.core.checks import check_bool
from lightning_gradcomp.exchange.options import ExchangeOptions
from lightning_gradcomp.local.fault_tolerance import FaultTolerance


def configure_strategy(strategy: Any, compressor: Union[Compressor, str], error_feedback: Optional[bool],
                       min_compress_numel: int, seed: int, log_stats: bool, print_summary: bool) -> None:
    """Validate the options the Trainer and simulation strategies share and set them as the strategy's attributes
    (``compressor``, ``error_feedback``, ``min_compress_numel``, ``seed``: :attr:`HoldsOptions.options`;
    ``log_stats``, ``print_summary``)."""
    options = ExchangeOptions(compressor, error_feedback, min_compress_numel, seed)
    strategy.compressor = options.compressor
    strategy.error_feedback = options.error_feedback
    strategy.min_compress_numel = options.min_compress_numel
    strategy.seed = options.seed
    strategy.log_stats = check_bool(log_stats, "log_stats")
    strategy.print_summary = check_bool(print_summary, "print_summary")


class HoldsOptions:
    """Mixin of the Trainer and simulation strategies, whose compression options are attributes (set by
    :func:`configure_strategy`; changed after construction, the new value is the one ``fit`` uses)."""

    compressor: Compressor
    error_feedback: Optional[bool]
    min_compress_numel: int
    seed: int

    @property
    def options(self) -> ExchangeOptions:
        """The :class:`~lightning_gradcomp.ExchangeOptions` the strategy's attributes make now (what ``fit`` uses
        when it starts, as the callbacks and the checks see it)."""
        return ExchangeOptions(self.compressor, self.error_feedback, self.min_compress_numel, self.seed)


def check_process_group_backend(backend: Optional[str]) -> Optional[str]:
    """``None`` (Lightning's choice: nccl on GPUs, gloo on CPUs) or a backend torch.distributed knows."""
    allowed = sorted(name for name in getattr(dist.Backend, "backend_list", ["gloo", "nccl", "mpi", "ucc"])
                     if name != "undefined")
    if backend is not None and (not isinstance(backend, str) or backend.lower() not in allowed):
        raise ValueError(f"`process_group_backend` must be None or one of {', '.join(allowed)}, got {backend!r}")
    return backend


def check_timeout(timeout: Any) -> Optional[timedelta]:
    """A positive ``timedelta``, or a number of seconds > 0 (converted); ``None`` keeps torch's default."""
    if timeout is None:
        return None
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and 0 < timeout < math.inf:
        return timedelta(seconds=timeout)
    if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
        return timeout
    raise ValueError(f"`timeout` must be a datetime.timedelta > 0 or a number of seconds > 0, got {timeout!r}")


_DDP_SIGNATURE = inspect.signature(DistributedDataParallel.__init__).parameters
DDP_KWARGS = frozenset(_DDP_SIGNATURE) - {"self", "module"}
_DDP_DEFAULTS = {name: parameter.default for name, parameter in _DDP_SIGNATURE.items()}
#: DDP arguments the strategy sets itself; LightningCLI passes them as None, which is accepted and dropped.
_STRATEGY_OWNED_DDP_KWARGS = ("device_ids", "output_device", "process_group")
#: the DDP argument that stops the buffer broadcast in forward (newer torch versions renamed it)
_NO_FORWARD_BUFFER_SYNC = "forward_sync_buffers" if "forward_sync_buffers" in DDP_KWARGS else "broadcast_buffers"
START_METHODS = ("popen", "spawn", "fork", "forkserver")
#: The registered names of the DDP strategies (Trainer and Fabric) and the start method each stands for.
REGISTERED_VARIANTS = (("gradcomp", "popen"), ("gradcomp_spawn", "spawn"), ("gradcomp_fork", "fork"),
                       ("gradcomp_notebook", "fork"))

#: ``strategy="gradcomp_find_unused_parameters_true"``: DDP's ``find_unused_parameters=True`` (the name
#: Lightning's own error message suggests is ``"ddp_find_unused_parameters_true"``, which has no compression)
FIND_UNUSED_VARIANT = "gradcomp_find_unused_parameters_true"


def check_ddp_kwargs(kwargs: dict[str, Any], strategy: str) -> dict[str, Any]:
    """The ``DistributedDataParallel`` arguments a strategy passes on: known names only, booleans where
    DDP's default is one, a valid ``bucket_cap_mb``; those the strategy sets itself must be ``None``
    (and are dropped)."""
    unknown = sorted(set(kwargs) - DDP_KWARGS)
    if unknown:
        raise ValueError(f"{strategy}: unknown DistributedDataParallel argument(s) {unknown}; "
                         f"allowed: {', '.join(sorted(DDP_KWARGS))}")
    kwargs = dict(kwargs)
    for name in _STRATEGY_OWNED_DDP_KWARGS:
        if kwargs.pop(name, None) is not None:
            raise ValueError(f"`{name}` is set by the strategy from the devices it is given; allowed: None")
    cap = kwargs.get("bucket_cap_mb")  # DDP's bucket size in MB (None: DDP's default)
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < math.inf):
        raise ValueError(f"`bucket_cap_mb` must be a number > 0, got {cap!r}")
    for name, value in kwargs.items():
        if isinstance(_DDP_DEFAULTS.get(name), bool):  # "yes" is not True
            check_bool(value, name)
    return kwargs


def check_start_method(start_method: Any) -> str:
    """How the strategy starts its processes: one of :data:`START_METHODS`."""
    if start_method not in START_METHODS:
        raise ValueError(f"`start_method` must be one of {', '.join(map(repr, START_METHODS))}, got {start_method!r}")
    return start_method


def check_fit_setup(compressor: Compressor, error_feedback: bool, optimizers: list, precision_plugin: Any,
                    names: Optional[Mapping[int, str]] = None) -> None:
    """Refuse, before the first step, settings that would silently train something else.

    * an optimizer that conflicts with the compressor (DGC's momentum on top of the optimizer's); the
      compressor checks and binds each optimizer, with ``names`` (``id(parameter) -> name``, the names the
      exchange gives the parameters) where it reads each parameter's group (DeMo's learning rate);
    * fp16 mixed precision with memory (error feedback, or state a compressor keeps across steps:
      DGC's velocity, Signum's momentum, the quantised all-reduce's owner residual): the hook sees
      gradients times a loss scale that GradScaler changes and whose overflow steps it skips, so the
      memory would be kept at stale scales and advanced on skipped steps.
    """
    for optimizer in optimizers:
        compressor.check_optimizer(optimizer, names=names)
    if getattr(precision_plugin, "scaler", None) is not None and (error_feedback or compressor.keeps_state):
        memory = "error feedback" if error_feedback else "the state it keeps across steps"
        raise ValueError(
            f"precision='16-mixed' scales gradients by a changing loss scale, which {type(compressor).__name__}'s "
            f"memory ({memory}) would keep at stale scales; allowed: precision='bf16-mixed', 'bf16-true', "
            "'32-true' or '64-true', or a compressor without memory (error_feedback=False, and no DGC, Signum "
            "momentum or owner_error_feedback)"
        )


def check_gradient_clipping(compressor: Compressor, trainer: Any) -> None:
    """Refuse the Trainer's gradient clipping (``gradient_clip_val > 0``) after a compressor whose aggregate
    is signs (:attr:`~lightning_gradcomp.compressors.base.Compressor.produces_signs`: DeMo, SignSGD with
    ``scale="none"``); see :func:`check_clipping_after_signs`. Called when ``fit`` starts."""
    clip = getattr(trainer, "gradient_clip_val", None)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0:
        return  # None or 0: Lightning does not clip (it refuses a value that is not a number itself)
    algorithm = getattr(trainer, "gradient_clip_algorithm", None)
    algorithm = getattr(algorithm, "value", algorithm) or "norm"
    check_clipping_after_signs(compressor, f"gradient_clip_val={clip!r} (gradient_clip_algorithm={algorithm!r})",
                               "gradient_clip_val=None (or 0)")


def check_clipping_after_signs(compressor: Compressor, setting: str, instead: str) -> None:
    """Refuse ``setting``, a clipping of what the exchange hands the optimizer, when ``compressor``'s
    aggregate is signs (``instead``: the setting that does not clip, for the message, which says why)."""
    if not compressor.produces_signs:
        return
    raise ValueError(
        f"{setting} clips what {compressor!r} hands the optimizer, which is signs: every coordinate ±1, a norm of "
        "about √d whatever the gradient, so clipping by norm shrinks every step by about √d / max_norm (about 600x "
        "for 360k parameters) and the model stops learning, and clipping by value only rescales the ±1s (the sign "
        f"already bounds each coordinate's step to ±lr: tune the learning rate instead); allowed: {instead} with "
        "this compressor, or clipping with a compressor whose aggregate keeps the gradients' size "
        "(SignSGD(scale='mean'), EFSignSGD, DeMo(sign=False), topk, ...)"
    )


def local_update_ddp_kwargs(kwargs: dict[str, Any], hierarchy: str, exchange_thread: Optional[bool]) -> dict[str, Any]:
    """DDP's arguments under local updates: no buffer broadcast (buffers are averaged at each
    synchronisation); refuse the options that have no meaning there."""
    if hierarchy != "none":
        raise ValueError("local_updates: hierarchy must be 'none' (allowed: 'none'); the outer gradients are "
                         "exchanged among all ranks")
    if exchange_thread:
        raise ValueError("local_updates synchronise in the training loop, every H steps; allowed: "
                         "exchange_thread=None or False")
    given = [name for name in ("broadcast_buffers", "forward_sync_buffers") if kwargs.get(name)]
    if given:
        raise ValueError(f"local_updates average buffers at each synchronisation; allowed: {given[0]}=False "
                         "(the default under local updates) or unset")
    # buffers are made equal once, when DDP wraps the model, and never in forward
    return {**kwargs, _NO_FORWARD_BUFFER_SYNC: False}


class ExtendsDDP:
    """Mixin of the DDP strategies (the Trainer's and Fabric's), before Lightning's ``DDPStrategy`` in the bases:
    the registered names, and DDP's environment and samplers under fault tolerance."""

    fault_tolerance: Optional[FaultTolerance]

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``gradcomp`` and its ``_spawn``, ``_fork``, ``_notebook`` variants, and
        :data:`FIND_UNUSED_VARIANT`."""
        for name, start_method in REGISTERED_VARIANTS:
            strategy_registry.register(
                name, cls, override=True, start_method=start_method,
                description=f"DDP with compressed gradients (lightning-gradcomp), start_method '{start_method}'",
            )
        strategy_registry.register(
            FIND_UNUSED_VARIANT, cls, override=True, find_unused_parameters=True,
            description="DDP with compressed gradients (lightning-gradcomp), find_unused_parameters=True",
        )

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """DDP's, with each replica group's own shuffling seed under fault tolerance (:func:`group_sampler_kwargs`)."""
        return group_sampler_kwargs(super().distributed_sampler_kwargs, self.fault_tolerance)  # type: ignore[misc]

    @override
    def setup_environment(self) -> None:
        """DDP's; under fault tolerance, then one group name for every process (:meth:`FaultTolerance.for_group`:
        its samplers' seed and torchft's replica id)."""
        super().setup_environment()  # type: ignore[misc]
        if self.fault_tolerance is not None:
            self.fault_tolerance = self.fault_tolerance.for_group()


def group_sampler_kwargs(kwargs: dict[str, Any], fault_tolerance: Optional[FaultTolerance]) -> dict[str, Any]:
    """A strategy's ``distributed_sampler_kwargs``; under fault tolerance with the group's own shuffling seed
    (:meth:`~lightning_gradcomp.FaultTolerance.data_seed` of the run's seed), so that groups started from the
    same script do not train on the same batches."""
    if fault_tolerance is not None:
        kwargs["seed"] = fault_tolerance.data_seed(int(os.getenv("PL_GLOBAL_SEED", 0)))
    return kwargs


