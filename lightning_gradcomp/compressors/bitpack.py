"""Pack unsigned integer codes of ``bits`` bits each into a dense byte stream, and back.

``n`` codes take ``ceil(n / 8) * bits`` bytes: ``bits`` bits per element, up to 7 codes of padding at the
end. Vectorised tensor code: it runs on CPU and CUDA alike.

Codes of at most 8 bits (the quantisers' case) are laid out in lanes, so that packing is a few
element-wise operations on contiguous uint8 rows: the ``n`` codes (padded to a multiple of 8) are split
into ``g`` contiguous lanes of ``m = n/g`` codes, where ``g`` codes of ``bits`` bits fill ``w`` whole
bytes (2 codes of 4 bits fill 1 byte, 4 codes of 6 bits 3 bytes, 8 codes of 3 bits 3 bytes); the stream is ``w`` byte planes of ``m`` bytes, plane ``i`` holding bits
``8i .. 8i+7`` of the little-endian concatenation of the ``g`` lanes' codes at each position. Each plane
is the OR of the shifted lanes that overlap it.

Wider codes are split into their low byte and the remaining high bits; every group of 8 codes occupies
``bits`` bytes, code ``j`` at bits ``j·bits .. (j+1)·bits - 1`` of the group (little-endian).
"""

from __future__ import annotations

import math
import sys
from typing import Optional

import torch
from torch import Tensor

from lightning_gradcomp.compressors.scratch import scratch
from lightning_gradcomp.core.device import device_constant

MAX_BITS = 32


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes that :func:`pack` produces for ``numel`` codes of ``bits`` bits."""
    return -(-numel // 8) * bits


def pack(codes: Tensor, bits: int) -> Tensor:
    """Pack a 1-D tensor of non-negative integers ``< 2**bits`` into a new uint8 tensor (never the memory of
    ``codes``, which callers reuse: 8-bit codes are their own packing, and are copied)."""
    if not 1 <= bits <= MAX_BITS:
        raise ValueError(f"`bits` must be in [1, {MAX_BITS}], got {bits}")
    narrow = bits <= 8
    given = codes
    codes = codes.reshape(-1).to(torch.uint8 if narrow else torch.int64)
    padding = (-codes.numel()) % 8
    if padding:
        codes = torch.cat([codes, codes.new_zeros(padding)])
    if narrow:
        packed = _pack_words(codes, bits)
        return packed.clone() if packed.data_ptr() == given.data_ptr() else packed
    return _pack_groups(codes.view(-1, 8), bits).reshape(-1)


def unpack(packed: Tensor, bits: int, numel: int, dtype: torch.dtype = torch.int64,
           out: Optional[Tensor] = None) -> Tensor:
    """Inverse of :func:`pack`: the first ``numel`` codes, as ``dtype`` (written into ``out`` if given,
    a tensor of ``numel`` elements; codes of at most 8 bits then need no temporary of ``numel`` bytes
    beyond a reused scratch tensor on CPU)."""
    if bits <= 8:
        lanes = None if out is None else scratch("unpack.lanes", packed.numel() * 8 // bits, torch.uint8, packed.device)
        codes = _unpack_words(packed, bits, lanes)[:numel]
        return codes.to(dtype) if out is None else out.copy_(codes)
    if out is not None:
        return out.copy_(unpack(packed, bits, numel, dtype))
    groups = packed.reshape(-1, bits)
    return _unpack_groups(groups, bits).reshape(-1)[:numel].to(dtype)


def _group_layout(bits: int) -> tuple[int, int]:
    """``(codes, bytes)`` of the smallest group of ``bits``-bit codes that fills whole bytes."""
    group = 8 // math.gcd(8, bits)
    return group, group * bits // 8


def _overlaps(bits: int, group: int, width: int) -> list[tuple[int, int, int]]:
    """``(byte, code, shift)`` for every code of a group that has bits in a byte of it: the code's bits
    sit at ``code << shift`` within the byte (a negative shift: ``>>``)."""
    return [(byte, code, code * bits - 8 * byte) for byte in range(width) for code in range(group)
            if code * bits < 8 * byte + 8 and (code + 1) * bits > 8 * byte]


def _shift(values: Tensor, shift: int) -> Tensor:
    """``values << shift`` (``>>`` for a negative shift) in uint8: bits beyond the byte drop out."""
    return values.bitwise_left_shift(shift) if shift >= 0 else values.bitwise_right_shift(-shift)


def _pack_words(codes: Tensor, bits: int) -> Tensor:
    """Lane-planar stream (see the module's docstring): every operation is on contiguous uint8 rows."""
    group, width = _group_layout(bits)
    if group == 1:
        return codes
    lanes = codes.view(group, -1)
    planes = codes.new_zeros(width, lanes.shape[1])
    for byte, code, shift in _overlaps(bits, group, width):
        planes[byte].bitwise_or_(_shift(lanes[code], shift))
    return planes.view(-1)


def _unpack_words(packed: Tensor, bits: int, lanes: Optional[Tensor] = None) -> Tensor:
    """The codes of a lane-planar stream, in ``lanes`` (uint8, as many elements as codes) if given."""
    group, width = _group_layout(bits)
    if group == 1:
        return packed
    planes = packed.view(width, -1)
    lanes = packed.new_zeros(group, planes.shape[1]) if lanes is None else lanes.view(group, -1).zero_()
    for byte, code, shift in _overlaps(bits, group, width):
        lanes[code].bitwise_or_(_shift(planes[byte], -shift))
    return lanes.bitwise_and_((1 << bits) - 1).view(-1)


def _pack_groups(groups: Tensor, bits: int) -> Tensor:
    if bits > 8:
        low = (groups & 0xFF).to(torch.uint8)
        return torch.cat([low, _pack_groups(groups >> 8, bits - 8)], dim=1)
    if bits == 8:
        return groups.to(torch.uint8)
    shifts, byte_shifts = _word_shifts(bits, 8, groups.device), _word_shifts(8, bits, groups.device)
    words = (groups << shifts).sum(dim=1, keepdim=True)  # disjoint bit ranges: sum == bitwise or
    return ((words >> byte_shifts) & 0xFF).to(torch.uint8)


def _unpack_groups(groups: Tensor, bits: int) -> Tensor:
    if bits > 8:
        low = groups[:, :8].to(torch.int64)
        return low | (_unpack_groups(groups[:, 8:], bits - 8) << 8)
    if bits == 8:
        return groups.to(torch.int64)
    shifts, byte_shifts = _word_shifts(bits, 8, groups.device), _word_shifts(8, bits, groups.device)
    words = (groups.to(torch.int64) << byte_shifts).sum(dim=1, keepdim=True)
    return (words >> shifts) & ((1 << bits) - 1)


def pack_signs(negative: Tensor) -> Tensor:
    """One bit per element of a bool tensor whose size is a multiple of 8, element ``8i + j`` in bit
    ``j`` of byte ``i``: two operations (a shift and a sum), whatever the size. The bucket-wise sign
    format (:mod:`~lightning_gradcomp.compressors.sign`); :func:`pack` lays bits out in lanes instead."""
    rows = negative.view(torch.uint8).view(-1, 8)
    return rows.bitwise_left_shift(_word_shifts(1, 8, negative.device, torch.uint8)).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: Tensor) -> Tensor:
    """Inverse of :func:`pack_signs` over the last dimension: ``(..., n)`` bytes -> ``(..., 8n)`` uint8
    0/1, in two operations."""
    bits = packed.unsqueeze(-1).bitwise_right_shift(_word_shifts(1, 8, packed.device, torch.uint8)).bitwise_and_(1)
    return bits.view(*packed.shape[:-1], packed.shape[-1] * 8)


def pack_grouped(codes: Tensor, bits: int) -> Tensor:
    """Codes of ``bits <= 8`` bits (uint8, last dimension a multiple of 8) packed over the last
    dimension in a few operations whatever its length: each group of ``g`` consecutive codes
    (:func:`_group_layout`) fills ``w`` bytes, code ``j`` at bits ``j·bits ..`` of the group's
    little-endian word. The bucket-wise quantisers' format; as many bytes as :func:`pack`
    (``⌈n/8⌉·bits``), in another order."""
    group, width = _group_layout(bits)
    if group == 1:
        return codes
    if width == 1:  # 1, 2 or 4 bits: the group fills one byte, no wider word needed
        shifts = _word_shifts(bits, group, codes.device, torch.uint8)
        return codes.view(*codes.shape[:-1], -1, group).bitwise_left_shift(shifts).sum(dim=-1, dtype=torch.uint8)
    word = _grouped_word(width)
    if word is not None:  # the group's word (the shift widens the uint8 codes), its low bytes in memory order
        shifts = _word_shifts(bits, group, codes.device, word)
        words = codes.view(*codes.shape[:-1], -1, group).bitwise_left_shift(shifts).sum(dim=-1, keepdim=True,
                                                                                          dtype=word)
        return words.view(torch.uint8)[..., :width].reshape(*codes.shape[:-1], -1)
    words = codes.view(*codes.shape[:-1], -1, group).to(torch.int64).bitwise_left_shift_(
        _word_shifts(bits, group, codes.device)).sum(dim=-1, keepdim=True)
    return words.bitwise_right_shift(_word_shifts(8, width, codes.device)).to(torch.uint8).view(*codes.shape[:-1], -1)


def unpack_grouped(packed: Tensor, bits: int, dtype: Optional[torch.dtype] = torch.uint8) -> Tensor:
    """Inverse of :func:`pack_grouped` over the last dimension: the codes, as ``dtype`` (``None``: the
    integer dtype they are decoded in, saving a conversion where the caller's next operation converts)."""
    group, width = _group_layout(bits)
    if group == 1:
        return packed if dtype is None else packed.to(dtype)
    if width == 1:
        codes = packed.unsqueeze(-1).bitwise_right_shift(_word_shifts(bits, group, packed.device, torch.uint8))
        codes = codes.bitwise_and_((1 << bits) - 1)
        codes = codes.view(*packed.shape[:-1], -1)
        return codes if dtype is None else codes.to(dtype)
    word = _grouped_word(width)
    if word is not None:  # each group's bytes, padded to a word and read as one (little-endian)
        size = torch.iinfo(word).bits // 8
        words = torch.nn.functional.pad(packed.view(*packed.shape[:-1], -1, width), (0, size - width)).view(word)
        codes = words.bitwise_right_shift(_word_shifts(bits, group, packed.device, word)).bitwise_and_((1 << bits) - 1)
        codes = codes.view(*packed.shape[:-1], -1)
        return codes if dtype is None else codes.to(dtype)
    if dtype is None:
        dtype = torch.int64
    words = packed.view(*packed.shape[:-1], -1, width).to(torch.int64).bitwise_left_shift_(
        _word_shifts(8, width, packed.device)).sum(dim=-1, keepdim=True)
    codes = words.bitwise_right_shift(_word_shifts(bits, group, packed.device)).bitwise_and_((1 << bits) - 1).to(dtype)
    return codes.view(*packed.shape[:-1], -1)


def _grouped_word(width: int) -> Optional[torch.dtype]:
    """The integer that holds a group of ``width`` bytes (:func:`pack_grouped`) as one word in memory order:
    int32 up to 3 bytes (3- and 6-bit codes: never negative), int64 up to 7 (5- and 7-bit codes); ``None`` on
    a big-endian machine (shifts and byte planes instead)."""
    if sys.byteorder != "little":
        return None
    return torch.int32 if width <= 3 else torch.int64


def pack_rows(codes: Tensor, bits: int) -> Tensor:
    """Codes of ``bits`` bits (non-negative integers, ``(..., n)``) packed row by row over the last
    dimension, in a few operations whatever the number of rows: every row of ``n`` codes becomes
    ``⌈n/8⌉·bits`` bytes (as :func:`pack` counts). A row's bytes depend on that row alone, so rows packed
    apart (one per worker) unpack together (:func:`unpack_rows`).

    Layouts: up to 8 bits :func:`pack_grouped`'s; wider codes whose smallest whole-byte group fits a
    64-bit word (10, 12, 14, 16, 20, 24, 32 bits: 12-bit codes two to 3 bytes) as that group's word
    ``Σ_j c_j·2^(j·bits)``, its low bytes in little-endian order (three operations each way); other
    widths as :func:`pack` lays out groups of 8."""
    if not 1 <= bits <= MAX_BITS:
        raise ValueError(f"`bits` must be in [1, {MAX_BITS}], got {bits}")
    leading, numel = codes.shape[:-1], codes.shape[-1]
    padding = -numel % 8
    if padding:
        codes = torch.nn.functional.pad(codes, (0, padding))
    if bits <= 8:
        return pack_grouped(codes.to(torch.uint8), bits)
    word = _word_layout(bits)
    if word is not None:
        group, width = word
        shifts = _word_shifts(bits, group, codes.device)
        words = codes.view(*leading, -1, group).to(torch.int64).bitwise_left_shift(shifts).sum(dim=-1, keepdim=True)
        return words.view(torch.uint8)[..., :width].reshape(*leading, -1)  # little-endian: the low bytes first
    groups = codes.reshape(-1, 8).to(torch.int64)
    return _pack_groups(groups, bits).view(*leading, -1)


def unpack_rows(packed: Tensor, bits: int, numel: int) -> Tensor:
    """Inverse of :func:`pack_rows`: ``(..., numel)`` int64 codes of ``(..., bytes)`` packed rows
    (``packed`` may be a strided view of rows whose last dimension is contiguous)."""
    leading = packed.shape[:-1]
    if bits <= 8:
        return unpack_grouped(packed, bits, torch.int64)[..., :numel]
    word = _word_layout(bits)
    if word is not None:
        group, width = word
        words = torch.nn.functional.pad(packed.view(*leading, -1, width), (0, 8 - width)).view(torch.int64)
        codes = words.bitwise_right_shift(_word_shifts(bits, group, packed.device)).bitwise_and_((1 << bits) - 1)
        return codes.view(*leading, -1)[..., :numel]
    groups = packed.reshape(-1, bits)
    return _unpack_groups(groups, bits).view(*leading, -1)[..., :numel]


def _word_layout(bits: int) -> Optional[tuple[int, int]]:
    """``(codes, bytes)`` of the smallest group of ``bits > 8``-bit codes that fills whole bytes, where it
    fits a 64-bit word (and the machine is little-endian, which :func:`pack_rows` reads words in);
    ``None`` otherwise."""
    group, width = _group_layout(bits)
    return None if bits <= 8 or width > 8 or sys.byteorder != "little" else (group, width)


def _word_shifts(bits: int, group: int, device: torch.device, dtype: torch.dtype = torch.int64) -> Tensor:
    """``(0, bits, 2·bits, ...)``, ``group`` of them: each code's place in its group's word (``bits = 8``: each
    byte's), as ``dtype``, kept per device."""
    return device_constant(("word shifts", bits, group, dtype), device,
                           lambda: torch.arange(group, dtype=dtype) * bits)
