"""Where each parameter's gradient lies in the shard FSDP2 hands its all-reduce hook.

FSDP2 (``torch.distributed.fsdp.fully_shard``) reduce-scatters one flat buffer per parameter group. This
rank's output is, for each parameter of the group in order, its local row block (the parameter sharded
on dim 0: ``sharded_size``, contiguous), then zero padding up to ``padded_dim0 / shard_size`` rows
(``torch.distributed.fsdp._fully_shard._fsdp_collectives.foreach_reduce``). The per-parameter metadata
is FSDP2's private ``FSDPParam`` (``sharded_size``, ``padded_sharded_param_size``, ``sharded_param``,
``fsdp_placement``) and ``FSDPParamGroup`` (``fsdp_params``, ``mesh_info``); :func:`group_layout` reads
exactly these; ``tests/test_fsdp.py`` compares the uncompressed exchange with native HSDP bit for bit,
which holds only if every slot is where FSDP reads it back, so a PyTorch upgrade that moves them fails
there first.

Which parameters the buffer holds depends on which received a gradient; :func:`register_fsdp` sets
``set_reduce_scatter_unused_params(True)`` so that every trainable parameter is always in it (a zero
gradient when unused), the same on every replica.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_gradcomp.exchange.engine import Entry


@dataclass(frozen=True)
class ShardSlot:
    """One parameter's place in the reduce-scatter output: ``numel`` elements of shape ``shape`` (its local
    row block) at ``offset``, then padding up to ``offset + padded_numel``."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int
    padded_numel: int


@dataclass(frozen=True)
class GroupLayout:
    """The slots of one FSDP parameter group's reduce-scatter output on this rank."""

    module: str
    slots: tuple[ShardSlot, ...]

    @property
    def numel(self) -> int:
        """The output's expected length (padding included)."""
        return sum(slot.padded_numel for slot in self.slots)

    def entries(self, reduce_output: Tensor) -> list[Entry]:
        """The engine's entries: each parameter's local rows of ``reduce_output`` (a view, which also
        receives the replicas' average); padding is never sent, and an empty shard (a parameter with
        fewer rows than shards) has no entry."""
        if reduce_output.numel() != self.numel:
            raise RuntimeError(
                f"gradcomp: FSDP handed the all-reduce hook of {self.module or 'the root module'} a shard of "
                f"{reduce_output.numel()} elements where its trainable parameters take {self.numel}: a parameter "
                "was left out of the reduce-scatter (FSDP's set_reduce_scatter_unused_params was switched off "
                "after register_fsdp, or a parameter's requires_grad changed); every replica must send the same "
                "parameters")
        flat = reduce_output.view(-1)
        return [Entry(slot.name, slot.shape, flat[slot.offset:slot.offset + slot.numel],
                      flat[slot.offset:slot.offset + slot.numel])
                for slot in self.slots if slot.numel]


def group_layout(module_name: str, param_group: Any, names: dict[int, str]) -> GroupLayout:
    """The layout of ``param_group`` (an ``FSDPParamGroup``) on this rank; ``names``: ``id(sharded
    parameter) -> name`` (the model's ``named_parameters()``)."""
    slots, offset = [], 0
    for fsdp_param in param_group.fsdp_params:
        parameter = fsdp_param.sharded_param
        if not parameter.requires_grad:
            continue
        if getattr(fsdp_param.fsdp_placement, "dim", 0) != 0:
            raise ValueError(f"gradcomp: {names.get(id(parameter), '?')} is sharded on dim "
                             f"{fsdp_param.fsdp_placement.dim}; compressed HSDP supports FSDP2's default Shard(0) "
                             "(no shard_placement_fn)")
        name = names.get(id(parameter))
        if name is None:
            raise ValueError("gradcomp: an FSDP parameter is not among the model's named_parameters(); pass the "
                             "root module that fully_shard was applied to")
        shape = tuple(int(size) for size in fsdp_param.sharded_size)
        padded = int(torch.Size(fsdp_param.padded_sharded_param_size).numel())
        numel = int(torch.Size(shape).numel())
        slots.append(ShardSlot(name, shape, offset, numel, padded))
        offset += padded
    return GroupLayout(module_name, tuple(slots))
