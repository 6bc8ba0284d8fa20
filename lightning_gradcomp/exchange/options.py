"""The compression options every way in shares (DDP hook, strategies, simulation), validated once.

Bad input is a ``ValueError`` naming the parameter and the allowed values, raised at construction,
before any process is started. (The Lightning strategies' own options: :mod:`lightning_gradcomp.lightning.options`.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from lightning_gradcomp.compressors.base import Compressor, get_compressor
from lightning_gradcomp.core.checks import check_int
from lightning_gradcomp.exchange.pipeline import resolve_error_feedback


@dataclass(frozen=True)
class ExchangeOptions:
    """Validated compression options.

    Attributes:
        compressor: the compressor instance.
        error_feedback: as given (``None``: the compressor's default; see
            :func:`~lightning_gradcomp.exchange.pipeline.resolve_error_feedback`).
        min_compress_numel: tensors with fewer elements are sent dense.
        seed: base seed of the compressors' generators.
    """

    compressor: Compressor
    error_feedback: Optional[bool]
    min_compress_numel: int
    seed: int


def exchange_options(compressor: Union[Compressor, str], error_feedback: Optional[bool] = None,
                     min_compress_numel: int = 1024, seed: int = 0) -> ExchangeOptions:
    """Validate the compression options shared by every way in."""
    compressor = get_compressor(compressor)
    if error_feedback is not None and not isinstance(error_feedback, bool):
        raise ValueError(f"`error_feedback` must be None, True or False, got {error_feedback!r}")
    resolve_error_feedback(compressor, error_feedback)
    return ExchangeOptions(compressor, error_feedback, check_int(min_compress_numel, "min_compress_numel", 0),
                           check_int(seed, "seed", 0))
