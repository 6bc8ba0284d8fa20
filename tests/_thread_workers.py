"""Worker functions: the exchange thread next to other collectives of the training's process group."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import lightning_gradcomp
from lightning_gradcomp.compressors import PowerSGD, TopK

from tests._training import sgd_steps


class AllReduceInBackward(torch.autograd.Function):
    """Identity forward; backward averages the incoming gradient over the world (a collective on the
    default group, issued by the autograd thread in the middle of backward, as SyncBatchNorm does)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad / dist.get_world_size()


class Net(nn.Module):
    """Several DDP buckets, a branch unused in every step (``find_unused_parameters=True`` then
    all-reduces DDP's map of used parameters), and a collective in backward between the layers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(64, 512)
        self.middle = nn.Linear(512, 512)
        self.last = nn.Linear(512, 512)
        self.head = nn.Linear(512, 10)
        self.unused = nn.Linear(512, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.first(x))
        x = torch.relu(self.middle(AllReduceInBackward.apply(x)))
        return self.head(torch.relu(self.last(x)))


def _train(rank: int, compressor, thread: bool, steps: int = 6) -> torch.Tensor:
    net = Net()
    ddp = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.5, find_unused_parameters=True)
    handle = lightning_gradcomp.register(ddp, compressor, min_compress_numel=256, exchange_thread=thread)
    params = sgd_steps(ddp, rank, steps, inputs=64, batch=32)
    handle.close()
    return params


def check_thread_beside_other_collectives(rank: int, world_size: int) -> None:
    """Exchange thread on, ``find_unused_parameters=True`` and an all-reduce in backward: the job runs,
    every rank ends with bit-identical parameters, equal to the run with the exchange in the hook."""
    for compressor in (TopK(0.02), PowerSGD(rank=2)):
        threaded = _train(rank, compressor, thread=True)
        gathered = [torch.empty_like(threaded) for _ in range(world_size)]
        dist.all_gather(gathered, threaded)
        assert all(torch.equal(gathered[0], other) for other in gathered), compressor
        in_hook = _train(rank, compressor, thread=False)
        torch.testing.assert_close(threaded, in_hook, rtol=1e-6, atol=1e-7)
