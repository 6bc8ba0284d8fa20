"""TernGrad: stochastic ternarisation (Wen, Xu, Yan, Wu, Wang, Chen & Li, NeurIPS 2017)."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import CompressContext, Payload, check_int
from lightning_gradcomp.compressors.qsgd import QSGD
from lightning_gradcomp.compressors.selection import peak_magnitudes
from lightning_gradcomp.core.checks import check_number
from lightning_gradcomp.core.segments import Segments

#: A block size no tensor reaches: one scale per tensor.
_WHOLE_TENSOR = 2**62


class TernGrad(QSGD):
    r"""TernGrad: each element becomes ``-s``, ``0`` or ``+s``, unbiased.

    .. math::
        \tilde g_i = s \cdot \operatorname{sign}(g_i) \cdot b_i, \qquad s = \|g\|_\infty, \qquad
        b_i \sim \operatorname{Bernoulli}(|g_i| / s),

    so :math:`\mathbb{E}[\tilde g] = g` (error feedback off by default). This is QSGD's quantiser with
    one level and the max norm: the code :math:`\lfloor 1 + g_i/s + u_i \rfloor \in \{0, 1, 2\}` (offset
    binary) takes 2 bits per element, bit-packed, plus one fp32 scale per tensor (``block_size=None``,
    the paper's per-layer scale) or per block of ``block_size`` elements (smaller variance).

    ``clip_sigma=c`` applies the paper's layer-wise gradient clipping (§3.3) first:
    :math:`g_i \leftarrow \max(-c\sigma, \min(c\sigma, g_i))` with :math:`\sigma` the standard deviation of
    the tensor's elements (the paper uses ``c = 2.5``). It lowers ``s`` and so the variance, at the cost
    of a small bias on the clipped elements. Off by default.

    Args:
        block_size: elements per scale, or ``None`` for one scale per tensor.
        clip_sigma: ``c`` of the layer-wise clipping, or ``None``.
    """

    name = "terngrad"
    capabilities = QSGD.capabilities

    def __init__(self, block_size: Optional[int] = None, clip_sigma: Optional[float] = None) -> None:
        super().__init__(levels=1, bucket_size=_WHOLE_TENSOR if block_size is None else
                         check_int(block_size, "block_size", 1))
        self.clip_sigma = None if clip_sigma is None else check_number(
            clip_sigma, "clip_sigma", "None or a finite number > 0", lambda value: 0 < value < math.inf)

    @property
    def levels(self) -> int:
        """Always 1 (ternary)."""
        return 1

    @levels.setter
    def levels(self, value: int) -> None:
        if value != 1:
            raise ValueError(f"TernGrad is ternary: `levels` must be 1, got {value!r} (use QSGD for more levels)")

    @property
    def block_size(self) -> Optional[int]:
        return None if self.bucket_size == _WHOLE_TENSOR else self.bucket_size

    def hparams(self) -> dict[str, Any]:
        return {"block_size": self.block_size, "clip_sigma": self.clip_sigma}

    @staticmethod
    def _bucket_norms(rows: Tensor) -> Tensor:
        """``s = ||v||_inf`` per row (a max and a min, vectorised)."""
        return peak_magnitudes(rows, 1)

    def segment_alignment(self, device: torch.device) -> Optional[int]:
        """As QSGD's, except with the layer-wise clipping (a standard deviation per tensor: per tensor)."""
        return None if self.clip_sigma is not None else super().segment_alignment(device)

    def _tensor_norms(self, rows: Tensor, segments: Segments) -> Tensor:
        """``s = ||v||_inf`` per tensor: its rows' peaks, then the largest per tensor."""
        return torch.segment_reduce(torch.linalg.vector_norm(rows, math.inf, dim=1), "max",
                                    lengths=segments.row_lengths(rows.device), unsafe=True)

    def compress(self, tensor: Tensor, ctx: CompressContext) -> Payload:
        if self.clip_sigma is not None and tensor.numel() > 1:
            tensor = tensor.float()
            limit = self.clip_sigma * torch.std(tensor)
            tensor = torch.clamp(tensor, -limit, limit)
        return super().compress(tensor, ctx)
