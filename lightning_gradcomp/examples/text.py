"""Byte-level language modelling on any folder of text: a small decoder-only transformer.

The corpus is every ``*.txt`` file under a directory the user points to (read in sorted order, joined by
a newline), as bytes: no tokenizer, no vocabulary file, any language. Offline on Debian:
``apt-get install python3.11-doc`` puts about 11 MB of reStructuredText under
``/usr/share/doc/python3.11/html/_sources/``. The last ``val_fraction`` of the bytes is held out; the
model's validation loss (nats per byte) is the measure the local-update and DeMo benchmarks report.

Training samples are the non-overlapping windows of ``context + 1`` bytes of the training part (input:
the first ``context``, target: the last), shuffled by a seeded sampler; validation uses the first
``val_windows`` windows of the held-out part.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal, Optional

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

DEBIAN_PYTHON_DOCS = "/usr/share/doc/python3.11/html/_sources"


def read_corpus(directory: str, max_bytes: Optional[int] = None) -> Tensor:
    """Every ``*.txt`` file under ``directory`` (sorted), joined by newlines, as a uint8 tensor."""
    root = Path(directory)
    files = sorted(path for path in root.rglob("*.txt") if path.is_file())
    if not files:
        raise FileNotFoundError(f"`corpus`: no *.txt files under {str(root)!r} (on Debian, "
                                f"`apt-get install python3.11-doc` gives {DEBIAN_PYTHON_DOCS})")
    data = bytearray()
    for path in files:
        data += path.read_bytes() + b"\n"
        if max_bytes is not None and len(data) >= max_bytes:
            break
    if max_bytes is not None:
        del data[max_bytes:]
    if len(data) < 2:
        raise ValueError(f"`corpus`: the *.txt files under {str(root)!r} hold {len(data)} bytes; a language model "
                         "needs text")
    return torch.frombuffer(data, dtype=torch.uint8)


class Windows(Dataset):
    """Non-overlapping windows of ``context + 1`` bytes: ``(input, target)`` shifted by one."""

    def __init__(self, data: Tensor, context: int, limit: Optional[int] = None) -> None:
        self.data, self.context = data, context
        count = (data.numel() - 1) // context
        self.count = count if limit is None else min(count, limit)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        window = self.data[index * self.context: (index + 1) * self.context + 1].long()
        return window[:-1], window[1:]


class TextCorpusDataModule(L.LightningDataModule):
    """Byte windows of a text folder (see the module docstring).

    Args:
        corpus: a directory; every ``*.txt`` file under it is read.
        context: bytes the model sees.
        batch_size: windows per optimizer step (the simulated strategy splits them among its workers;
            under DDP it is per process).
        val_fraction: share of the bytes held out.
        val_windows: held-out windows evaluated.
        max_bytes: read at most this many bytes (None: all).
        seed: the training order's seed.
    """

    def __init__(self, corpus: str = DEBIAN_PYTHON_DOCS, context: int = 64, batch_size: int = 64,
                 val_fraction: float = 0.05, val_windows: int = 512, max_bytes: Optional[int] = None,
                 seed: int = 0) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"`val_fraction` must be in (0, 1), got {val_fraction!r}")
        self.save_hyperparameters()
        self.train_set: Optional[Windows] = None
        self.val_set: Optional[Windows] = None

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        data = read_corpus(self.hparams.corpus, self.hparams.max_bytes)
        split = int(data.numel() * (1.0 - self.hparams.val_fraction))
        self.train_set = Windows(data[:split], self.hparams.context)
        self.val_set = Windows(data[split:], self.hparams.context, self.hparams.val_windows)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.hparams.seed)
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True, drop_last=True,
                          generator=generator)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)


class ByteTransformer(L.LightningModule):
    """A small decoder-only transformer over bytes (pre-norm blocks, learned positions, causal mask).

    Args:
        context: the longest input.
        width, layers, heads: the blocks (``4·width`` hidden units in each feed-forward).
        optimizer: ``"adamw"`` (``lr``, ``weight_decay``, betas 0.9/0.95) or ``"sgd"`` (``lr``, ``momentum``,
            ``weight_decay``: SGD without momentum for DeMo and DGC, which hold their own).
    """

    def __init__(self, context: int = 64, width: int = 128, layers: int = 2, heads: int = 4,
                 optimizer: Literal["adamw", "sgd"] = "adamw", lr: float = 1e-3, momentum: float = 0.0,
                 weight_decay: float = 0.0) -> None:
        super().__init__()
        if optimizer not in ("adamw", "sgd"):
            raise ValueError(f"`optimizer` must be 'adamw' or 'sgd', got {optimizer!r}")
        self.save_hyperparameters()
        self.embed = nn.Embedding(256, width)
        self.position = nn.Parameter(torch.randn(context, width) * 0.02)
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256)

    def forward(self, x: Tensor) -> Tensor:
        length = x.shape[1]
        mask = torch.triu(torch.full((length, length), float("-inf"), device=x.device), diagonal=1)
        h = self.embed(x) + self.position[:length]
        return self.head(self.norm(self.blocks(h, mask=mask, is_causal=True)))

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x).reshape(-1, 256), y.reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_bits_per_byte", loss / math.log(2), sync_dist=True)

    def configure_optimizers(self):
        if self.hparams.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, betas=(0.9, 0.95),
                                     weight_decay=self.hparams.weight_decay)
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum,
                               weight_decay=self.hparams.weight_decay)
