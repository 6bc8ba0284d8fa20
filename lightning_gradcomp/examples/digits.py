"""scikit-learn's bundled handwritten digits (1,797 8x8 images, offline) and a small MLP classifier."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy


def digits_mlp(hidden: int = 128) -> nn.Sequential:
    """The classifier's network on its own (64 -> hidden -> hidden -> 10), for Fabric and plain PyTorch."""
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


class DigitsDataModule(L.LightningDataModule):
    """scikit-learn's ``load_digits``: pixel values scaled to [0, 1]; a fixed, stratified test split.

    Args:
        batch_size: per-process batch size.
        test_fraction: share of the 1,797 images held out (used for validation and test).
        split_seed: seed of the train/test split (independent of training seeds).
    """

    def __init__(self, batch_size: int = 32, test_fraction: float = 0.25, split_seed: int = 0) -> None:
        super().__init__()
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"`test_fraction` must be in (0, 1), got {test_fraction!r}")
        self.batch_size = batch_size
        self.test_fraction = test_fraction
        self.split_seed = split_seed

    def setup(self, stage: str | None = None) -> None:
        try:
            from sklearn.datasets import load_digits
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError("DigitsDataModule needs scikit-learn: pip install 'lightning-gradcomp[examples]'") from err
        data = load_digits()
        images = torch.tensor(data.data, dtype=torch.float32) / 16.0
        labels = torch.tensor(data.target, dtype=torch.long)
        generator = torch.Generator().manual_seed(self.split_seed)
        order = torch.randperm(len(labels), generator=generator)
        n_test = int(round(len(labels) * self.test_fraction))
        test, train = order[:n_test], order[n_test:]
        self.train_set = TensorDataset(images[train], labels[train])
        self.test_set = TensorDataset(images[test], labels[test])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=256)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=256)


class _Classifier(L.LightningModule):
    """A classifier's forward pass (``self.net``) and its validation and test steps (``val_acc``, ``test_acc``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.test_acc(self(x), y)
        self.log("test_acc", self.test_acc)


class DigitsClassifier(_Classifier):
    """A two-hidden-layer MLP (64 -> hidden -> hidden -> 10) trained with SGD.

    Args:
        hidden: width of the hidden layers.
        lr: learning rate.
        momentum: SGD momentum (set 0 with DGC, which holds the momentum itself).
        weight_decay: L2 penalty.
    """

    def __init__(self, hidden: int = 128, lr: float = 0.1, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = digits_mlp(hidden)
        self.val_acc = MulticlassAccuracy(num_classes=10, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=10, average="micro")

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(
            self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum,
            weight_decay=self.hparams.weight_decay,
        )
