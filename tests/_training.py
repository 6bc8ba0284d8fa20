"""A few SGD steps of a DDP model on random classification batches, shared by the worker modules."""

from __future__ import annotations

import torch
from torch import nn


def sgd_steps(ddp: nn.Module, rank: int, steps: int, inputs: int, batch: int = 16, lr: float = 0.05,
              classes: int = 10) -> torch.Tensor:
    """``steps`` SGD steps of ``ddp`` on batches drawn from a generator seeded by ``rank`` (so ranks see
    different data); the flat parameters afterwards."""
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x, y = torch.randn(batch, inputs, generator=generator), torch.randint(0, classes, (batch,), generator=generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
