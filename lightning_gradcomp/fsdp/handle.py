"""Plain PyTorch: compressed HSDP, FSDP2 inside a replica, the compressed exchange between replicas
(:func:`~lightning_gradcomp.register_fsdp`, its handle and its row of the wiring, :func:`attach_fsdp`).

FSDP2 reduce-scatters each parameter group's gradient inside the replica (the ``"shard"`` mesh
dimension) and hands this rank's shard to the group's all-reduce hook
(``FSDPModule.set_all_reduce_hook``); the hook exchanges it with the ranks of the same shard in the
other replicas (the ``"replicate"`` dimension) through the exchange engine, per parameter (each
parameter's local row block, :mod:`lightning_gradcomp.fsdp.layout`), and leaves the replicas' average in
it: FSDP's reduce-scatter averaged over the shard group (or divides after the hook, for an fp16 reduce or
forced sums), so the result is native HSDP's mean over every rank. Replicas with the same shard rank hold the same row blocks, so PowerSGD's factors and DeMo's tiles
line up. Error feedback and compressor state are per rank (each owns a different shard), fp32, keyed by
parameter name; the checkpoint entry carries every rank's.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.distributed.device_mesh import DeviceMesh

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.core.fsdp2 import check_every_parameter_sharded, check_group, check_mesh, fsdp_modules, shard_layout
from lightning_gradcomp.exchange.handle import GradientHandle, OptimizerWatch
from lightning_gradcomp.exchange.options import ExchangeOptions
from lightning_gradcomp.exchange.session import ExchangeSession
from lightning_gradcomp.exchange.drivers import world_collective_device
from lightning_gradcomp.fsdp.layout import group_layout, GroupLayout


class FSDPHandle(GradientHandle):
    """What :func:`register_fsdp` returns: the compressed exchange between the replicas of one sharded model
    on this rank (``step_stats``, ``totals``, ``summary()``, ``state_dict()``, ``load_state_dict()``,
    ``failure``, ``use_compressor()``, ``bind()``; see :class:`~lightning_gradcomp.exchange.handle.ExchangeHandle`).

    Attributes:
        layouts: each FSDP parameter group's shard layout, in the order the modules were found.
    """

    _entry_covers_world = True  # each rank holds its own shard's state; the summary averages over every rank

    def __init__(self, hook_state: ExchangeSession, compressor: Compressor, device: torch.device,
                 layouts: list[GroupLayout]) -> None:
        super().__init__(hook_state, compressor, device)
        self.layouts = layouts
        self._step_open = False  # a backward has exchanged, and its end is queued

    def all_reduce_hook(self, layout: GroupLayout, param_group: Any) -> Callable[[torch.Tensor], None]:
        """FSDP's all-reduce hook of one parameter group: the replicas' average of ``reduce_output``, in place.
        The step ends with the backward that exchanged (an autograd final callback), however many groups
        were reduced in it."""
        def hook(reduce_output: torch.Tensor) -> None:
            _check_reduce_settings(layout.module, param_group)
            if not self._step_open:
                self._step_open = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_step)
            self._check_bound()
            if reduce_output.is_cuda:
                # FSDP allocated the shard on its reduce-scatter stream and may free it (a reduce dtype other
                # than the parameters') right after the hook: keep the block from being reused before the
                # exchange issued here on the all-reduce stream (the hook's current stream) has read it
                reduce_output.record_stream(torch.cuda.current_stream(reduce_output.device))
            try:
                self.hook_state.exchange(layout.entries(reduce_output), last=False)
            except Exception as error:
                if self.hook_state.failure is None:
                    self.hook_state.failure = error
                raise
        return hook

    def _end_step(self) -> None:
        self._step_open = False
        self.hook_state.end_step()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's part of a :meth:`state_dict` (every rank loads the entry rank 0 saved; the
        entry holds every rank of the world, each its own shard's state). Another mesh, world size or
        compressor keeps only the step counter and the totals, with a warning."""
        self._restore(state, lambda state: None)  # an exchange every step: no warning of local updates' entries

    def _collective_device(self) -> torch.device:
        return world_collective_device()


def attach_fsdp(model: torch.nn.Module, mesh: DeviceMesh, options: ExchangeOptions) -> FSDPHandle:
    """The compressed exchange of every step between the replicas of an FSDP2-sharded ``model`` (the row of
    :func:`~lightning_gradcomp.wiring.attach_exchange` that :func:`~lightning_gradcomp.register_fsdp` and the
    sharded strategies take): each FSDP module's all-reduce hook exchanges its replica shard."""
    shard_group, replicate_group = check_mesh(mesh)
    modules = fsdp_modules(model, "register_fsdp", hooks=True)
    names = {id(p): name for name, p in model.named_parameters()}
    layouts = []
    for module_name, module, param_group in modules:
        check_group(module_name, param_group, shard_group, "register_fsdp")
        _check_reduce_settings(module_name, param_group)
        layouts.append(group_layout(module_name, param_group, names))
    check_every_parameter_sharded(model, {slot.name for layout in layouts for slot in layout.slots},
                                  "gradcomp: the trainable parameters {} are not sharded by any fully_shard, so no "
                                  "process would average their gradients")
    device = next(model.parameters()).device
    hook_state = ExchangeSession(**options.keywords(), group=replicate_group, exchange_thread=False, device=device,
                                 caller="register_fsdp()", settings={"shard layout": shard_layout(model),
                                                                     "FSDP modules": fsdp_module_layout(layouts)})
    # residuals and state fit this mesh's shards only: a resume on another split drops them, saying so
    hook_state.layout = f"hsdp:replicate={mesh['replicate'].size()},shard={mesh['shard'].size()}"
    handle = FSDPHandle(hook_state, hook_state.compressor, device, layouts)
    handle.param_names = names  # the exchange's names: bind() finds each parameter's group by them
    handle._watch = OptimizerWatch(handle, model, sharded=True)  # binds the optimizer at its first step
    for (_, module, param_group), layout in zip(modules, layouts):
        module.set_reduce_scatter_unused_params(True, recurse=False)
        if layout.slots:
            module.set_all_reduce_hook(handle.all_reduce_hook(layout, param_group))
    return handle


def _check_reduce_settings(name: str, param_group: Any) -> None:
    """Refuse FSDP settings under which the hook's average would be wrong (checked at registration and at
    every exchange, since they can be set later): a gradient divide factor (FSDP then divides by it alone,
    expecting the hook to sum), ``set_requires_all_reduce(False)`` (FSDP calls a 1-D mesh's hook anyway)
    and compiled autograd (the hook's bookkeeping would run once, at tracing)."""
    module = name or "the root module"
    if getattr(param_group, "gradient_divide_factor", None) is not None:
        raise ValueError(f"gradcomp: {module} has a gradient divide factor (set_gradient_divide_factor); the compressed "
                         "exchange averages the replicas itself, which the factor would divide again: leave it unset")
    if not getattr(param_group, "all_reduce_grads", True):
        raise ValueError(f"gradcomp: {module} has set_requires_all_reduce(False); for gradient accumulation use "
                         "set_requires_gradient_sync(False) on the non-final micro-batches (one compressed exchange per "
                         "optimizer step)")
    if _compiled_autograd_active():
        raise RuntimeError("gradcomp: register_fsdp's all-reduce hook does not run under compiled autograd "
                           "(torch._dynamo.config.compiled_autograd); run backward eagerly")


def _compiled_autograd_active() -> bool:
    try:
        from torch._dynamo import compiled_autograd
    except ImportError:  # pragma: no cover - torch without compiled autograd
        return False
    flag = getattr(compiled_autograd, "in_compiled_autograd_region", False)  # a module-level flag in torch 2.14
    return bool(flag() if callable(flag) else flag)


def fsdp_module_layout(layouts: list[GroupLayout]) -> str:
    """Which FSDP module reduces which parameters, as text: each module's reduce-scatter is one exchange, so
    the ranks of one shard index must wrap the model alike (a shard layout alone does not show it on a
    replicate x 1 mesh, where every shard is the whole parameter)."""
    return "; ".join(f"{layout.module or '<root>'}: {', '.join(slot.name for slot in layout.slots)}"
                     for layout in layouts)

