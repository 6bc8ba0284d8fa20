"""Hierarchical exchange for multi-node clusters: compress only what crosses between nodes.

A cluster of ``M`` nodes with ``L`` processes each (``N = M·L``) exchanges a DDP bucket in three steps,
every collective issued from the hook, in bucket order, on every rank:

1. **inside the node**, a dense all-reduce of the bucket (fast links), divided by ``L``: every process
   holds its node's average gradient;
2. **between nodes**, the compressed exchange (the same engine and compressors as the flat mode) of the
   parameters this process owns, with the process of the same local rank on every other node (``M``
   participants instead of ``N``). The bucket's parameters are shared out among the ``L`` local ranks by
   size (:func:`partition`), so each process compresses and sends about ``1/L`` of the bucket, and error
   feedback and compressor state live with the owner;
3. **inside the node**, the owners' results are put together by a dense all-reduce of the bucket with
   the parameters a process does not own zeroed.

The result is the average over all ``N`` processes of the decoded exchange, as in the flat mode;
with ``"none"`` it equals DDP's all-reduce. Only step 2 crosses the slow links, and it carries ``1/L`` of
a flat exchange's payloads per process, among ``M`` instead of ``N`` participants (which matters most
for gathered compressors, whose traffic grows with the number of participants).

Non-finite gradients: step 1 spreads a NaN to the whole node; the owner's engine then makes that
parameter group's result NaN on every rank (the bucket's other parameters are unaffected), and its
memory stays as it was.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch.futures import Future

from lightning_gradcomp.ddp.hook import GradCompHookState
from lightning_gradcomp.exchange.drivers import TorchDriver

T = TypeVar("T")


def node_groups(num_nodes: int, local_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's group inside its node and its group across nodes (same local rank). Every rank must
    call it (``new_group`` is collective); ranks are numbered ``node · local_size + local_rank``, as
    torchrun, SLURM and Lightning number them."""
    world = dist.get_world_size()
    if num_nodes * local_size != world:
        raise ValueError(f"hierarchy='node': num_nodes ({num_nodes}) × processes per node ({local_size}) must equal "
                         f"the world size ({world})")
    rank = dist.get_rank()
    intra: Optional[dist.ProcessGroup] = None
    cross: Optional[dist.ProcessGroup] = None
    for node in range(num_nodes):
        ranks = [node * local_size + local for local in range(local_size)]
        group = dist.new_group(ranks)
        intra = group if rank in ranks else intra
    for local in range(local_size):
        ranks = [node * local_size + local for node in range(num_nodes)]
        group = dist.new_group(ranks)
        cross = group if rank in ranks else cross
    assert intra is not None and cross is not None
    return intra, cross


def partition(items: Sequence[T], sizes: Sequence[int], parts: int) -> list[list[T]]:
    """Share ``items`` out among ``parts`` owners so that their total sizes are balanced: the largest
    first, each to the owner with the least so far (the lowest index on ties). Deterministic, so every
    rank computes the same ownership; each owner's items keep their original order."""
    loads = [0] * parts
    owner_of = [0] * len(items)
    for index in sorted(range(len(items)), key=lambda i: (-sizes[i], i)):
        owner = min(range(parts), key=lambda p: (loads[p], p))
        owner_of[index] = owner
        loads[owner] += sizes[index]
    return [[item for item, owner in zip(items, owner_of) if owner == part] for part in range(parts)]


class HierarchicalHookState(GradCompHookState):
    """The state of the ``gradcomp`` hook in hierarchical mode (see the module's docstring).

    Args:
        compressor, param_names, error_feedback, min_compress_numel, seed: as for
            :class:`~lightning_gradcomp.ddp.hook.GradCompHookState`.
        intra_group / cross_group: from :func:`node_groups`.

    The collectives are logged as ``node:all_reduce`` (inside the node) and ``cross:<kind>`` (between
    nodes) for the network model; ``bytes_sent`` counts what crosses between nodes, and ``bytes_dense``
    what a flat DDP all-reduce would hand over.
    """

    def __init__(self, compressor: Any, param_names: dict[int, str], *, intra_group: dist.ProcessGroup,
                 cross_group: dist.ProcessGroup, **kwargs: Any) -> None:
        if kwargs.get("exchange_thread"):
            raise ValueError("hierarchy='node' exchanges in the DDP hook; allowed: exchange_thread=None or False")
        kwargs["exchange_thread"] = False
        super().__init__(compressor, param_names, group=cross_group, **kwargs)
        self.driver = TorchDriver(cross_group, scope="cross")
        self.intra = TorchDriver(intra_group, scope="node")
        self.layout = f"nodes={self.driver.world_size},local={self.intra.world_size}"
        self.local_size, self.local_rank = self.intra.world_size, self.intra.rank

    @property
    def checkpoint_group(self) -> Optional[dist.ProcessGroup]:
        """Every rank of the world: each holds the memory of the parameters it owns."""
        return None

    def exchange_bucket(self, bucket: dist.GradBucket) -> Future:
        """Dense inside the node, compressed between nodes (this rank's share), dense inside the node
        (on CUDA on the exchange stream, as the flat mode)."""
        self._close_step()
        buffer = bucket.buffer()
        device = buffer.device
        entries = self.entries(bucket)
        with self.streams.entered(device):
            self.intra.all_reduce(buffer)
            buffer.div_(self.local_size)
            shares = partition(entries, [entry.grad.numel() for entry in entries], self.local_size)
            protocol = self._begin(shares[self.local_rank], bucket.is_last())
            report = self.driver.run(protocol, device=device, stream=self.streams.get(device)).wait()
            zero_unowned(shares, self.local_rank)
            self.intra.all_reduce(buffer)
            self._account(replace(report, bytes_dense=buffer.numel() * buffer.element_size()))
            done: Future = Future(devices=[device]) if device.type == "cuda" else Future()
            done.set_result(buffer)
        return done

    def _take_collective_log(self) -> list[tuple[str, int]]:
        return self.intra.take_log() + self.driver.take_log()


def zero_unowned(shares: Sequence[Sequence[Any]], owner: int) -> None:
    """Zero the gradients (views of the bucket) of the entries ``owner`` does not own, by one multi-tensor
    ``zero_`` (one operation per bucket, a few kernels on a GPU, where a ``zero_`` per entry would be one
    kernel per parameter)."""
    grads = [entry.grad for share, entries in enumerate(shares) if share != owner for entry in entries]
    if grads:
        torch._foreach_zero_(grads)


def check_hierarchy(value: Any) -> str:
    """``hierarchy`` must be ``"none"`` or ``"node"``."""
    if value not in ("none", "node"):
        raise ValueError(f"`hierarchy` must be 'none' or 'node', got {value!r}")
    return value


def local_average(node_gradients: list[list[tuple[str, torch.Tensor]]]) -> list[tuple[str, torch.Tensor]]:
    """The average of one node's workers' gradients, by name (the simulation's step 1)."""
    first = dict(node_gradients[0])
    total = {name: grad.clone() for name, grad in first.items()}
    for gradients in node_gradients[1:]:
        named = dict(gradients)
        if named.keys() != first.keys():
            raise ValueError("GradCompSimStrategy(hierarchy='node'): the workers of a node produced gradients for "
                             "different parameters; every worker's training_step must use the same parameters")
        for name, grad in named.items():
            total[name].add_(grad)
    return [(name, grad.div_(len(node_gradients))) for name, grad in total.items()]
