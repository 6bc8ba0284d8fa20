"""How callbacks reach the running exchange: its compressor, and its state through the declared
contract (:class:`~lightning_gradcomp.exchange.state.ExchangeState`)."""

from __future__ import annotations

from typing import Any, cast

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.exchange.state import ExchangeState


def strategy_compressor(trainer: Any, needs: str = "", caller: str = "this callback") -> Compressor:
    """The compressor of ``trainer.strategy``; ``ValueError`` if there is none or it lacks ``needs``."""
    compressor = getattr(trainer.strategy, "compressor", None)
    if not isinstance(compressor, Compressor):
        raise ValueError(
            f"{caller} needs a gradcomp strategy (GradCompStrategy or its simulation), got "
            f"{type(trainer.strategy).__name__}"
        )
    if needs and not hasattr(compressor, needs):
        raise ValueError(
            f"{caller} needs a compressor with a `{needs}` parameter, got {type(compressor).__name__}"
        )
    return compressor


def exchange_state(trainer: Any) -> ExchangeState:
    """``trainer.strategy.hook_state``, the running exchange (built when ``fit`` starts)."""
    state = getattr(trainer.strategy, "hook_state", None)
    if state is None:
        raise RuntimeError(f"the strategy {type(trainer.strategy).__name__} has no gradcomp exchange state (yet); "
                           "callbacks reach it from on_train_start on")
    return cast(ExchangeState, state)


def local_update_loop(trainer: Any) -> Any:
    """The strategy's outer loop under local updates, or ``None`` when gradients are exchanged every step."""
    return getattr(trainer.strategy, "outer_loop", None)
