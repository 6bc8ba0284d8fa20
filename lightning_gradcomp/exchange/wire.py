"""Byte layout of gathered payloads: many typed parts in one uint8 buffer, and back.

All payloads of one DDP bucket that are not all-reducible travel in a single uint8 tensor, so one
``all_gather`` moves them. Each part starts at an offset aligned to its own item size (so it can be
re-read with ``Tensor.view(dtype)`` without a copy) and the buffer is padded to a multiple of 8 bytes.
Sender and receivers derive the same layout from each part's ``(dtype, numel)`` alone: nothing but the
parts and, for data-dependent counts, the counts themselves crosses the wire.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from lightning_gradcomp.core.tensors import itemsize

#: ``(dtype, numel)`` of one part.
PartSpec = tuple[torch.dtype, int]

ALIGNMENT = 8


@dataclass(frozen=True)
class Slot:
    """Where one payload part lives in the buffer."""

    offset: int
    dtype: torch.dtype
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


def _align(offset: int, to: int) -> int:
    return -(-offset // to) * to


def layout(payloads: Sequence[Sequence[PartSpec]]) -> tuple[list[list[Slot]], int]:
    """Slots of every part of every payload, given ``(dtype, numel)`` per part, and the total size."""
    offset = 0
    slots: list[list[Slot]] = []
    for specs in payloads:
        payload_slots = []
        for dtype, part_numel in specs:
            offset = _align(offset, itemsize(dtype))
            payload_slots.append(Slot(offset, dtype, part_numel))
            offset += payload_slots[-1].nbytes
        slots.append(payload_slots)
    return slots, _align(offset, ALIGNMENT)


def serialize(parts: Sequence[Sequence[Tensor]], slots: Sequence[Sequence[Slot]], total: int,
              device: torch.device) -> Tensor:
    """Every part in its slot of a new uint8 buffer of ``total`` bytes (padding is zero): one ``cat`` of
    the parts' bytes and the zero padding between them (one kernel on a GPU, however many parts)."""
    return serialize_rows([parts], [slots], total, device)


def serialize_rows(rows: Sequence[Sequence[Sequence[Tensor]]], slots: Sequence[Sequence[Sequence[Slot]]],
                   total: int, device: torch.device) -> Tensor:
    """:func:`serialize` of several rows of ``total`` bytes each, one after the other, in one ``cat``."""
    pieces: list[Tensor] = []
    for parts, row_slots in zip(rows, slots):
        pieces.extend(_pieces(parts, row_slots, total, device))
    if not pieces:
        return torch.zeros(total * len(rows), dtype=torch.uint8, device=device)
    return torch.cat(pieces)


def _pieces(parts: Sequence[Sequence[Tensor]], slots: Sequence[Sequence[Slot]], total: int,
            device: torch.device) -> list[Tensor]:
    """The byte views of one row's parts and the zero padding around them, in order."""
    pieces: list[Tensor] = []
    offset = 0
    for payload_parts, payload_slots in zip(parts, slots):
        for part, slot in zip(payload_parts, payload_slots):
            if part.dtype != slot.dtype or part.numel() != slot.numel:
                raise RuntimeError(
                    f"payload part is {part.dtype}[{part.numel()}], the layout expects {slot.dtype}[{slot.numel}]"
                )
            if slot.offset > offset:
                pieces.append(_zeros(slot.offset - offset, device))
            if slot.nbytes:
                pieces.append(part.reshape(-1).view(torch.uint8))
            offset = slot.offset + slot.nbytes
    if total > offset:
        pieces.append(_zeros(total - offset, device))
    return pieces


_ZEROS: dict[tuple[int, str], Tensor] = {}


def _zeros(nbytes: int, device: torch.device) -> Tensor:
    """A kept zero tensor of ``nbytes`` bytes (padding: a few bytes, so few sizes)."""
    key = (nbytes, str(device))
    zeros = _ZEROS.get(key)
    if zeros is None:
        zeros = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        if nbytes <= 4096:
            _ZEROS[key] = zeros
    return zeros


def deserialize(buffer: Tensor, slots: Sequence[Sequence[Slot]]) -> list[tuple[Tensor, ...]]:
    """Views (no copies) of every part in ``buffer``."""
    return [tuple(_read(buffer, slot) for slot in payload_slots) for payload_slots in slots]


def _read(buffer: Tensor, slot: Slot) -> Tensor:
    if slot.nbytes == 0:  # an empty slice may sit at any storage offset, which view(dtype) refuses
        return torch.empty(0, dtype=slot.dtype, device=buffer.device)
    return buffer[slot.offset:slot.offset + slot.nbytes].view(slot.dtype)
