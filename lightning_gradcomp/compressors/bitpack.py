"""Pack unsigned integer codes of ``bits`` bits each into a dense byte stream, and back.

Every group of 8 codes occupies exactly ``bits`` bytes, so ``n`` codes take ``ceil(n / 8) * bits``
bytes: ``bits`` bits per element, up to 7 codes of padding at the end. Codes wider than 8 bits are split
into their low byte and the remaining high bits, each packed the same way. Vectorised tensor code: it
runs on CPU and CUDA alike.
"""

from __future__ import annotations

import torch
from torch import Tensor

MAX_BITS = 32


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes that :func:`pack` produces for ``numel`` codes of ``bits`` bits."""
    return -(-numel // 8) * bits


def pack(codes: Tensor, bits: int) -> Tensor:
    """Pack a 1-D tensor of non-negative integers ``< 2**bits`` into a uint8 tensor."""
    if not 1 <= bits <= MAX_BITS:
        raise ValueError(f"`bits` must be in [1, {MAX_BITS}], got {bits}")
    codes = codes.reshape(-1).to(torch.int64)
    padding = (-codes.numel()) % 8
    if padding:
        codes = torch.cat([codes, codes.new_zeros(padding)])
    return _pack_groups(codes.view(-1, 8), bits).reshape(-1)


def _pack_groups(groups: Tensor, bits: int) -> Tensor:
    if bits > 8:
        low = (groups & 0xFF).to(torch.uint8)
        return torch.cat([low, _pack_groups(groups >> 8, bits - 8)], dim=1)
    if bits == 8:
        return groups.to(torch.uint8)
    shifts = torch.arange(8, device=groups.device, dtype=torch.int64) * bits
    words = (groups << shifts).sum(dim=1, keepdim=True)  # disjoint bit ranges: sum == bitwise or
    byte_shifts = torch.arange(bits, device=groups.device, dtype=torch.int64) * 8
    return ((words >> byte_shifts) & 0xFF).to(torch.uint8)


def unpack(packed: Tensor, bits: int, numel: int) -> Tensor:
    """Inverse of :func:`pack`: the first ``numel`` codes, as int64."""
    groups = packed.reshape(-1, bits)
    return _unpack_groups(groups, bits).reshape(-1)[:numel]


def _unpack_groups(groups: Tensor, bits: int) -> Tensor:
    if bits > 8:
        low = groups[:, :8].to(torch.int64)
        return low | (_unpack_groups(groups[:, 8:], bits - 8) << 8)
    if bits == 8:
        return groups.to(torch.int64)
    byte_shifts = torch.arange(bits, device=groups.device, dtype=torch.int64) * 8
    words = (groups.to(torch.int64) << byte_shifts).sum(dim=1, keepdim=True)
    shifts = torch.arange(8, device=groups.device, dtype=torch.int64) * bits
    return (words >> shifts) & ((1 << bits) - 1)
