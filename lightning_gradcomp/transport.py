"""Collectives for compressed payloads, and the count of the bytes handed to ``torch.distributed``.

* Summable payloads (and small tensors sent dense) go through ``all_reduce``.
* Everything else is packed into one uint8 buffer per bucket and goes through ``all_gather``. When
  payload sizes depend on the data (hard threshold), the per-payload counts are exchanged first with a
  small blocking ``all_gather``; every rank then pads its buffer to the largest size, since gloo (and
  ``all_gather_single``) need equal sizes on all ranks.

Every collective is issued from the calling thread, at once, never from a future's callback: DDP calls
the hook bucket by bucket in the same order on every rank, so collectives are issued in the same order
everywhere. (Collectives issued from ``.then()`` callbacks can be reordered between ranks when several
buckets are in flight, and gloo then pairs mismatched messages.)
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist
from torch import Tensor
from torch.futures import Future


class Transport:
    """Issues collectives on one process group and counts the bytes of every tensor it hands over.

    ``bytes_sent`` counts what this rank hands to ``torch.distributed`` as input: payload, padding and
    size headers included. What the network then carries depends on the collective's algorithm; see
    :mod:`lightning_gradcomp.netmodel`.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None) -> None:
        self.group = group
        self.bytes_sent = 0
        self._log: list[tuple[str, int]] = []

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def _count(self, kind: str, tensor: Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self.bytes_sent += nbytes
        self._log.append((kind, nbytes))

    def take_log(self) -> list[tuple[str, int]]:
        """``(kind, input bytes)`` of every collective issued since the last call."""
        log, self._log = self._log, []
        return log

    def all_reduce_sum(self, tensor: Tensor) -> Future:
        """Sum ``tensor`` over ranks, in place; the future's value is the tensor."""
        self._count("all_reduce", tensor)
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        return work.get_future().then(lambda _: tensor)

    def all_gather(self, tensor: Tensor) -> Future:
        """Gather equal-sized 1-D tensors; the future's value has shape ``(world_size, numel)``."""
        self._count("all_gather", tensor)
        output = tensor.new_empty(self.world_size * tensor.numel())
        work = _all_gather_single()(output, tensor, group=self.group, async_op=True)
        return work.get_future().then(lambda _: output.view(self.world_size, -1))

    def exchange_counts(self, counts: Tensor) -> Tensor:
        """Blocking gather of a small int tensor of counts; shape ``(world_size, numel)``."""
        return self.all_gather(counts).wait()


def _all_gather_single():
    # torch >= 2.14 renamed all_gather_into_tensor; looked up at call time.
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
