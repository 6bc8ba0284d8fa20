"""The options of a compressed exchange, declared once: every entry point (``register``,
``register_fsdp``, ``local_updates``, the Trainer, Fabric and simulation strategies) takes these keywords
and builds one :class:`ExchangeOptions` from them, which is what travels inside the package.

Bad input is a ``ValueError`` naming the parameter and the allowed values, raised when the options are
made, before any process is started. (The Lightning strategies' own options:
:mod:`lightning_gradcomp.lightning.options`.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from lightning_gradcomp.compressors.base import Compressor, get_compressor
from lightning_gradcomp.core.checks import check_int
from lightning_gradcomp.exchange.pipeline import resolve_error_feedback


@dataclass(frozen=True)
class ExchangeOptions:
    """How every parameter's gradient (or outer gradient) is compressed, whatever the entry point::

        options = ExchangeOptions("int8", min_compress_numel=4096)
        gradcomp = lightning_gradcomp.register(ddp_model, **options.keywords())

    Attributes:
        compressor: the compressor, or its registered name (made into an instance here).
        error_feedback: keep each parameter's residual ``e ← g + e − C(g + e)`` and add it to the next
            gradient (Seide et al. 2014; Karimireddy et al. 2019, arXiv 1901.09847); ``None``: the
            compressor's default (on when it is biased, unless it keeps its own residual, like DGC).
        min_compress_numel: tensors with fewer elements are sent dense (biases, norms).
        seed: base seed of the compressors' generators (Random-k's indices, QSGD's and TernGrad's rounding),
            identical on every rank.
    """

    compressor: Union[Compressor, str] = "topk"
    error_feedback: Optional[bool] = None
    min_compress_numel: int = 1024
    seed: int = 0

    def __post_init__(self) -> None:
        compressor = get_compressor(self.compressor)
        if self.error_feedback is not None and not isinstance(self.error_feedback, bool):
            raise ValueError(f"`error_feedback` must be None, True or False, got {self.error_feedback!r}")
        resolve_error_feedback(compressor, self.error_feedback)
        object.__setattr__(self, "compressor", compressor)
        object.__setattr__(self, "min_compress_numel", check_int(self.min_compress_numel, "min_compress_numel", 0))
        object.__setattr__(self, "seed", check_int(self.seed, "seed", 0))

    def keywords(self) -> dict[str, Any]:
        """The options as the keywords every entry point and :class:`~lightning_gradcomp.ExchangeSession` take."""
        return {"compressor": self.compressor, "error_feedback": self.error_feedback,
                "min_compress_numel": self.min_compress_numel, "seed": self.seed}
