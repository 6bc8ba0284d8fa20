"""The small transformer of the sharded (HSDP) Trainer and Fabric runs (train_fsdp.py, fabric_fsdp.py), on
scikit-learn's digits: each 8x8 image is a sequence of 8 rows of 8 pixels."""

from __future__ import annotations

import torch
from torch import nn


class DigitsTransformer(nn.Module):
    """Row embedding, two pre-norm encoder layers (no dropout: runs compare bit for bit), mean pooling, a head."""

    def __init__(self, width: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList([
            nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=2 * width, dropout=0.0, batch_first=True,
                                       norm_first=True)
            for _ in range(layers)])
        self.head = nn.Linear(width, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.embed(images.view(-1, 8, 8))
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=1))


def local_shards(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's shard of every parameter (a DTensor's local part)."""
    return {name: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
            for name, p in model.named_parameters()}
