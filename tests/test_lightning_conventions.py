"""Guards on how we plug into Lightning: private hooks still called, overrides marked, options typed."""

from __future__ import annotations

import inspect

import pytest
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from lightning_gradcomp import GradCompFabricStrategy, GradCompSimStrategy, GradCompStrategy
from lightning_gradcomp.lightning.checkpointing import RestoresCompressionState


def test_lightning_ddp_still_calls_the_private_hook_we_override() -> None:
    # GradCompStrategy installs its hook in DDPStrategy._register_ddp_hooks (DDPStrategy only does so on
    # CUDA). If a Lightning upgrade stops calling it from configure_ddp, gradients would silently go
    # uncompressed: this test names the place to look.
    source = inspect.getsource(DDPStrategy.configure_ddp)
    assert "self._register_ddp_hooks()" in source, (
        "lightning.pytorch.strategies.DDPStrategy.configure_ddp no longer calls _register_ddp_hooks(); "
        "GradCompStrategy._register_ddp_hooks must move to wherever Lightning now wraps the model in DDP"
    )
    assert "_register_ddp_hooks" in vars(GradCompStrategy)


def _lightning_methods(cls: type) -> set[str]:
    """Names defined by Lightning classes in ``cls``'s MRO."""
    return {name for base in cls.__mro__ if base.__module__.startswith("lightning.") for name in vars(base)}


@pytest.mark.parametrize("cls", [GradCompStrategy, GradCompSimStrategy, GradCompFabricStrategy,
                                 RestoresCompressionState])
def test_every_overridden_lightning_method_is_marked_override(cls: type) -> None:
    bases = {GradCompStrategy: DDPStrategy, GradCompSimStrategy: SingleDeviceStrategy,
             GradCompFabricStrategy: FabricDDPStrategy, RestoresCompressionState: DDPStrategy}[cls]
    inherited = _lightning_methods(bases)
    unmarked = []
    for name, member in vars(cls).items():
        if name.startswith("_abc") or name.startswith("__") or name not in inherited:
            continue
        function = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
        if not inspect.isfunction(function):  # class attributes such as strategy_name
            continue
        if not getattr(function, "__override__", False) and not getattr(member, "__override__", False):
            unmarked.append(name)
    assert not unmarked, f"{cls.__name__}: overrides without @override: {unmarked}"


def test_the_unused_parameters_variant_is_registered_for_the_trainer_and_fabric() -> None:
    """Lightning's advice for unused parameters names ``ddp_find_unused_parameters_true``, which does not
    compress; ours keeps the compression (issue 36, item 11)."""
    import lightning as L
    from lightning.fabric import Fabric

    trainer = L.Trainer(strategy="gradcomp_find_unused_parameters_true", accelerator="cpu", devices=2, logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    assert isinstance(trainer.strategy, GradCompStrategy)
    assert trainer.strategy._ddp_kwargs == {"find_unused_parameters": True}
    fabric = Fabric(strategy="gradcomp_find_unused_parameters_true", accelerator="cpu", devices=2)
    assert isinstance(fabric.strategy, GradCompFabricStrategy)
    assert fabric.strategy._ddp_kwargs == {"find_unused_parameters": True}
