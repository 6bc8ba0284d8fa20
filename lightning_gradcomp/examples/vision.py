"""Vision examples: ResNet-18 on CIFAR-10, a small CNN on Fashion-MNIST (needs torchvision).

Data is read from ``data_dir``; with ``download=True`` torchvision fetches it where the network allows.
Fashion-MNIST also works offline from Debian's ``dataset-fashion-mnist`` package (IDX files in
``/usr/share/datasets/fashion-mnist``), which :class:`FashionMNISTDataModule` copies into torchvision's
``raw/`` folder.
"""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path
from typing import Optional

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, random_split
from torchmetrics.classification import MulticlassAccuracy

from lightning_gradcomp.examples.digits import _Classifier

DEBIAN_FASHION_MNIST = "/usr/share/datasets/fashion-mnist"
_FASHION_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                  "t10k-labels-idx1-ubyte")


def _torchvision():
    try:
        import torchvision
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("the vision examples need torchvision: pip install 'lightning-gradcomp[vision]'") from err
    return torchvision


class ImageClassifier(_Classifier):
    """Cross-entropy classifier around any backbone, with accuracy from torchmetrics; SGD or AdamW.

    Args:
        backbone: ``"resnet18_cifar"``, ``"fashion_cnn"`` or ``"fashion_mlp"``.
        num_classes: output classes.
        lr, momentum, weight_decay: the optimizer's settings (SGD: momentum 0 with DGC and DeMo, which hold
            their own; AdamW ignores ``momentum``).
        max_epochs_for_schedule: if set, cosine-anneal the learning rate over this many epochs.
        optimizer: ``"sgd"`` or ``"adamw"``.
    """

    def __init__(self, backbone: str = "resnet18_cifar", num_classes: int = 10, lr: float = 0.1,
                 momentum: float = 0.0, weight_decay: float = 5e-4, max_epochs_for_schedule: Optional[int] = None,
                 optimizer: str = "sgd") -> None:
        super().__init__()
        if optimizer not in ("sgd", "adamw"):
            raise ValueError(f"`optimizer` must be 'sgd' or 'adamw', got {optimizer!r}")
        self.save_hyperparameters()
        if backbone == "resnet18_cifar":
            self.net = resnet18_cifar(num_classes)
        elif backbone == "fashion_cnn":
            self.net = fashion_cnn(num_classes)
        elif backbone == "fashion_mlp":
            self.net = fashion_mlp(num_classes)
        else:
            raise ValueError(f"`backbone` must be 'resnet18_cifar', 'fashion_cnn' or 'fashion_mlp', got {backbone!r}")
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True, on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self):
        if self.hparams.optimizer == "adamw":
            optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        else:
            optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum,
                                        weight_decay=self.hparams.weight_decay)
        if not self.hparams.max_epochs_for_schedule:
            return optimizer
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.hparams.max_epochs_for_schedule)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


def resnet18_cifar(num_classes: int = 10) -> nn.Module:
    """torchvision's ResNet-18 with the usual CIFAR stem: a 3x3 stride-1 convolution, no max-pool."""
    model = _torchvision().models.resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def fashion_cnn(num_classes: int = 10) -> nn.Module:
    """Two convolutions and two linear layers (about 420k parameters) for 28x28 grey images."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, num_classes),
    )


def fashion_mlp(num_classes: int = 10) -> nn.Module:
    """784-256-128-10 (about 235k parameters): fast enough for benchmark grids on a CPU."""
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
                         nn.Linear(128, num_classes))


class _SplitDataModule(L.LightningDataModule):
    """Train/validation split of a torchvision training set, plus its test set."""

    def __init__(self, data_dir: str, batch_size: int, val_size: int, num_workers: int, split_seed: int = 0) -> None:
        super().__init__()
        self.data_dir, self.batch_size, self.val_size = data_dir, batch_size, val_size
        self.num_workers, self.split_seed = num_workers, split_seed

    def _load(self, dataset, train_transform, test_transform, missing: str) -> None:
        """The torchvision ``dataset`` read from ``data_dir``, its training set split; ``missing``: the message
        where it is not there."""
        try:
            full_train = dataset(self.data_dir, train=True, transform=train_transform)
            self.test_set = dataset(self.data_dir, train=False, transform=test_transform)
        except RuntimeError as err:
            raise FileNotFoundError(missing) from err
        generator = torch.Generator().manual_seed(self.split_seed)
        self.train_set, self.val_set = random_split(full_train, [len(full_train) - self.val_size, self.val_size],
                                                    generator=generator)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers,
                          drop_last=True, persistent_workers=self.num_workers > 0)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=512, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=512, num_workers=self.num_workers)


class CIFAR10DataModule(_SplitDataModule):
    """CIFAR-10 with the standard augmentation (random crop with padding 4, horizontal flip).

    Args:
        data_dir: where ``cifar-10-batches-py`` is, or will be downloaded to.
        download: fetch the data if it is missing (needs network access); otherwise a missing data set
            is an error naming ``data_dir``.
        batch_size: per-process batch size (DGC and PowerSGD use 128 per worker).
        val_size: images held out of the training set for validation.
    """

    MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)

    def __init__(self, data_dir: str = "data", download: bool = True, batch_size: int = 128, val_size: int = 5000,
                 num_workers: int = 2) -> None:
        super().__init__(data_dir, batch_size, val_size, num_workers)
        self.download = download

    def prepare_data(self) -> None:
        datasets = _torchvision().datasets
        if self.download:
            datasets.CIFAR10(self.data_dir, train=True, download=True)
            datasets.CIFAR10(self.data_dir, train=False, download=True)

    def setup(self, stage: Optional[str] = None) -> None:
        tv = _torchvision()
        t = tv.transforms
        normalize = t.Normalize(self.MEAN, self.STD)
        train_tf = t.Compose([t.RandomCrop(32, padding=4), t.RandomHorizontalFlip(), t.ToTensor(), normalize])
        self._load(tv.datasets.CIFAR10, train_tf, t.Compose([t.ToTensor(), normalize]),
                   f"CIFAR-10 not found in data_dir={self.data_dir!r}; put cifar-10-batches-py there or set "
                   "download=True")


class FashionMNISTDataModule(_SplitDataModule):
    """Fashion-MNIST, offline from Debian's ``dataset-fashion-mnist`` when present.

    Args:
        data_dir: torchvision's root (``<data_dir>/FashionMNIST/raw``).
        debian_dir: where Debian's package puts the IDX files; copied into ``raw/`` when needed.
        download: let torchvision download when neither copy exists (needs network access).
    """

    def __init__(self, data_dir: str = "data", debian_dir: str = DEBIAN_FASHION_MNIST, download: bool = False,
                 batch_size: int = 64, val_size: int = 5000, num_workers: int = 0) -> None:
        super().__init__(data_dir, batch_size, val_size, num_workers)
        self.debian_dir, self.download = debian_dir, download

    def prepare_data(self) -> None:
        raw = Path(self.data_dir) / "FashionMNIST" / "raw"
        source = Path(self.debian_dir)
        for name in _FASHION_FILES:
            if (raw / name).exists():
                continue
            for candidate in (source / name, source / f"{name}.gz"):
                if candidate.exists():
                    raw.mkdir(parents=True, exist_ok=True)
                    if candidate.suffix == ".gz":
                        with gzip.open(candidate, "rb") as src, open(raw / name, "wb") as dst:
                            shutil.copyfileobj(src, dst)
                    else:
                        shutil.copyfile(candidate, raw / name)
                    break
        if self.download:
            _torchvision().datasets.FashionMNIST(self.data_dir, train=True, download=True)
            _torchvision().datasets.FashionMNIST(self.data_dir, train=False, download=True)

    def setup(self, stage: Optional[str] = None) -> None:
        tv = _torchvision()
        transform = tv.transforms.Compose([tv.transforms.ToTensor(), tv.transforms.Normalize((0.2860,), (0.3530,))])
        self._load(tv.datasets.FashionMNIST, transform, transform,
                   f"Fashion-MNIST not found under data_dir={self.data_dir!r} nor debian_dir={self.debian_dir!r}; "
                   "apt-get install dataset-fashion-mnist, or set download=True")
