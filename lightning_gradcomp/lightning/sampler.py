"""Batches in the order a real N-process DDP run would see them."""

from __future__ import annotations

from typing import Iterator

from torch.utils.data import DistributedSampler, Sampler


class _RankSamplers:
    """The per-rank samplers, exposed as ``batch_sampler.sampler`` so that Lightning's per-epoch
    ``set_epoch`` call (which looks there) reaches them."""

    def __init__(self, samplers: list[DistributedSampler]) -> None:
        self.samplers = samplers

    def set_epoch(self, epoch: int) -> None:
        for sampler in self.samplers:
            sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return sum(len(s) for s in self.samplers)


class DistributedOrderBatchSampler(Sampler[list[int]]):
    """Batch ``j`` is the concatenation of batch ``j`` of every rank of an ``N``-process DDP run.

    Each rank's indices come from ``DistributedSampler(dataset, N, rank, shuffle, seed)`` (what
    Lightning's DDP uses), cut into batches of ``batch_size`` per worker; the simulated strategy splits
    the concatenated batch back into the same per-worker parts. Lightning calls :meth:`set_epoch`.

    Args:
        dataset: the dataset (only its length is used).
        workers: ``N``.
        batch_size: samples per worker and step.
        shuffle, seed, drop_last: as for ``DistributedSampler`` / ``DataLoader``.
    """

    def __init__(self, dataset, workers: int, batch_size: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False) -> None:
        if workers < 1 or batch_size < 1:
            raise ValueError(f"`workers` and `batch_size` must be >= 1, got {workers} and {batch_size}")
        self.samplers = [DistributedSampler(dataset, workers, rank, shuffle=shuffle, seed=seed) for rank in range(workers)]
        self.sampler = _RankSamplers(self.samplers)
        self.batch_size = batch_size
        self.drop_last = drop_last

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        per_rank = len(self.samplers[0])
        return per_rank // self.batch_size if self.drop_last else -(-per_rank // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        orders = [list(sampler) for sampler in self.samplers]
        for start in range(0, len(orders[0]), self.batch_size):
            parts = [order[start:start + self.batch_size] for order in orders]
            if self.drop_last and len(parts[0]) < self.batch_size:
                return
            yield [index for part in parts for index in part]
