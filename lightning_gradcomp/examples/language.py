"""Word-level language modelling: the 2-layer LSTM of Harris 2020 on any Penn-Treebank-layout directory.

The directory holds ``train.txt``, ``valid.txt`` and ``test.txt``: one sentence a line, tokens
separated by spaces (Penn Treebank and WikiText-2 as distributed). The vocabulary comes from
``train.txt``; words that are not in it become ``<unk>``; every line ends with ``<eos>``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset
from torchmetrics.text import Perplexity

from lightning_gradcomp.lightning.simulation import current_worker

UNK, EOS = "<unk>", "<eos>"
SPLITS = ("train", "valid", "test")


class Vocabulary:
    """Word <-> index, built from the training text; ``<unk>`` and ``<eos>`` always present."""

    def __init__(self, words: list[str]) -> None:
        self.itos: list[str] = [UNK, EOS]
        seen = set(self.itos)
        for word in words:
            if word not in seen:
                seen.add(word)
                self.itos.append(word)
        self.stoi = {w: i for i, w in enumerate(self.itos)}

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, words: list[str]) -> list[int]:
        unk = self.stoi[UNK]
        return [self.stoi.get(w, unk) for w in words]


def read_words(path: Path) -> list[str]:
    """All tokens of a file, ``<eos>`` after every non-empty line (empty lines are skipped)."""
    if not path.is_file():
        raise FileNotFoundError(f"language data: {path} is missing; the directory must hold {', '.join(s + '.txt' for s in SPLITS)}")
    words: list[str] = []
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            tokens = line.split()
            if tokens:
                words.extend(tokens)
                words.append(EOS)
    return words


def batchify(ids: Tensor, columns: int) -> Tensor:
    """A token stream as ``columns`` parallel streams: shape ``(length, columns)``; the tail is dropped."""
    length = ids.numel() // columns
    if length < 2:
        raise ValueError(f"language data: {ids.numel()} tokens cannot fill {columns} columns of at least 2 tokens")
    return ids[: length * columns].view(columns, length).t().contiguous()


class BPTTChunks(Dataset):
    """Consecutive chunks of ``bptt`` time steps: item ``i`` is ``(input, target)`` of shape
    ``(bptt, columns)``, targets shifted by one step. Read in order (no shuffling) so hidden states
    carry over."""

    def __init__(self, streams: Tensor, bptt: int) -> None:
        self.streams, self.bptt = streams, bptt

    def __len__(self) -> int:
        return math.ceil((self.streams.size(0) - 1) / self.bptt)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = index * self.bptt
        length = min(self.bptt, self.streams.size(0) - 1 - start)
        return self.streams[start:start + length], self.streams[start + 1:start + 1 + length]


class PTBDataModule(L.LightningDataModule):
    """Penn-Treebank-layout text for language modelling.

    The training batch has ``batch_size`` columns in total (Harris 2020: 256) split over workers: under DDP
    each rank takes its own contiguous block of ``batch_size / world_size`` columns (set the Trainer's
    ``use_distributed_sampler: false``); the single-device simulation takes all columns and splits them
    along dimension 1 (``batch_dim: 1``) in the same blocks, so worker ``i`` sees what rank ``i`` would.

    Args:
        data_dir: directory with ``train.txt``, ``valid.txt``, ``test.txt``.
        batch_size: total number of columns of a training batch.
        eval_batch_size: columns of validation and test batches.
        bptt: time steps per chunk (Harris 2020: 35).
    """

    def __init__(self, data_dir: str, batch_size: int = 256, eval_batch_size: int = 10, bptt: int = 35) -> None:
        super().__init__()
        self.data_dir, self.batch_size, self.eval_batch_size, self.bptt = Path(data_dir), batch_size, eval_batch_size, bptt
        self.vocab: Optional[Vocabulary] = None

    def setup(self, stage: Optional[str] = None) -> None:
        if self.vocab is not None:
            return
        texts = {split: read_words(self.data_dir / f"{split}.txt") for split in SPLITS}
        self.vocab = Vocabulary(texts["train"])
        self.ids = {split: torch.tensor(self.vocab.encode(words), dtype=torch.long) for split, words in texts.items()}

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        world, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        if self.batch_size % world:
            raise ValueError(f"`batch_size` ({self.batch_size}) must be divisible by the number of processes ({world})")
        streams = batchify(self.ids["train"], self.batch_size)
        width = self.batch_size // world
        return DataLoader(BPTTChunks(streams[:, rank * width:(rank + 1) * width], self.bptt), batch_size=None)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(BPTTChunks(batchify(self.ids["valid"], self.eval_batch_size), self.bptt), batch_size=None)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(BPTTChunks(batchify(self.ids["test"], self.eval_batch_size), self.bptt), batch_size=None)


class LSTMLanguageModel(L.LightningModule):
    """2-layer LSTM word language model with tied embeddings, trained with vanilla SGD (Harris 2020, §4.1).

    Hidden states carry over between chunks, detached, one per simulated worker (Harris 2020, Algorithm 1):
    the module keys them by :func:`~lightning_gradcomp.simulation.current_worker`.

    Args:
        vocab_size: vocabulary size; ``None`` takes it from the data module's ``vocab`` at setup.
        hidden: 100, 300 or 500 in Harris 2020 (small, medium, large); tied embeddings have the same size.
        layers: LSTM layers.
        dropout: dropout on embeddings and between layers.
        lr: SGD learning rate (Harris 2020: 20, divided by 4 when validation perplexity stops improving).
        tie_weights: share the embedding and output weights.
    """

    def __init__(self, vocab_size: Optional[int] = None, hidden: int = 300, layers: int = 2, dropout: float = 0.5,
                 lr: float = 20.0, tie_weights: bool = True) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.drop = nn.Dropout(dropout)
        self.lstm = nn.LSTM(hidden, hidden, layers, dropout=dropout if layers > 1 else 0.0)
        self.hidden: dict[tuple[str, int], tuple[Tensor, Tensor]] = {}
        self.val_ppl = Perplexity()
        self.test_ppl = Perplexity()
        if vocab_size is not None:
            self._build(vocab_size)

    def _build(self, vocab_size: int) -> None:
        hidden = self.hparams.hidden
        self.embedding = nn.Embedding(vocab_size, hidden)
        self.decoder = nn.Linear(hidden, vocab_size)
        if self.hparams.tie_weights:
            self.decoder.weight = self.embedding.weight
        nn.init.uniform_(self.embedding.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        self.hparams.vocab_size = vocab_size

    def setup(self, stage: str) -> None:
        """Without ``vocab_size``, size the embedding from the data module's vocabulary."""
        if getattr(self, "embedding", None) is None:
            vocab = getattr(self.trainer.datamodule, "vocab", None)
            if vocab is None:
                raise ValueError("LSTMLanguageModel: give `vocab_size` or use a data module with a `vocab`")
            self._build(len(vocab))

    def forward(self, x: Tensor, state: Optional[tuple[Tensor, Tensor]] = None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        out, state = self.lstm(self.drop(self.embedding(x)), state)
        return self.decoder(self.drop(out)), state

    def _state(self, stage: str, columns: int) -> Optional[tuple[Tensor, Tensor]]:
        state = self.hidden.get((stage, current_worker(self)))
        if state is None or state[0].size(1) != columns:
            return None
        return state

    def _run(self, batch: tuple[Tensor, Tensor], stage: str) -> tuple[Tensor, Tensor]:
        x, y = batch
        logits, (h, c) = self(x, self._state(stage, x.size(1)))
        self.hidden[(stage, current_worker(self))] = (h.detach(), c.detach())
        return logits, y

    def training_step(self, batch, batch_idx):
        logits, y = self._run(batch, "train")
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
        self.log("train_loss", loss, prog_bar=True, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        logits, y = self._run(batch, "valid")
        self.val_ppl(logits.transpose(0, 1), y.t())
        self.log("val_ppl", self.val_ppl, prog_bar=True)

    def test_step(self, batch, batch_idx):
        logits, y = self._run(batch, "test")
        self.test_ppl(logits.transpose(0, 1), y.t())
        self.log("test_ppl", self.test_ppl)

    def on_validation_epoch_start(self) -> None:
        self.hidden = {k: v for k, v in self.hidden.items() if k[0] != "valid"}

    def on_train_epoch_start(self) -> None:
        self.hidden = {k: v for k, v in self.hidden.items() if k[0] != "train"}

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.25, patience=0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "val_ppl"}}
