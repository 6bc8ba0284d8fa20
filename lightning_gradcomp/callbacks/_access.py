"""How callbacks reach the compressor of the running strategy."""

from __future__ import annotations

from typing import Any

from lightning_gradcomp.compressors.base import Compressor


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
