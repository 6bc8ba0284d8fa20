"""Lightning on one GPU with the gradcomp strategy (NCCL, world size 1): precisions, save and resume.

Run by tests/test_cuda.py as ``python cuda_lightning.py --out results.json``; writes one JSON object.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import warnings
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_gradcomp  # noqa: F401  (registers "gradcomp")
from lightning_gradcomp import GradCompStrategy, TopK


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):  # noqa: ANN001
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.losses.append(float(loss.detach().float()))
        return loss

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.SGD(self.parameters(), lr=0.2)


def data() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 64, generator=generator)
    y = x[:, :10].argmax(dim=1)  # learnable by a linear map
    return DataLoader(TensorDataset(x, y), batch_size=64)


def trainer(precision: str, epochs: int, compressor="topk", thread=None) -> L.Trainer:  # noqa: ANN001
    return L.Trainer(accelerator="gpu", devices=1, precision=precision, max_epochs=epochs, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     strategy=GradCompStrategy(compressor=compressor, exchange_thread=thread, print_summary=False))


def fit(precision: str, compressor, thread=None) -> dict:  # noqa: ANN001
    model = Classifier()
    run = trainer(precision, 3, compressor, thread)
    run.fit(model, data())
    residuals = run.strategy.hook_state.memory.residuals
    return {"first_loss": model.losses[0], "last_loss": sum(model.losses[-8:]) / 8,
            "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
            "param_dtype": str(next(model.parameters()).dtype),
            "residual_dtypes": sorted({str(r.dtype) for r in residuals.values()}),
            "steps": run.strategy.hook_state.step}


def refused(precision: str, compressor: str) -> str:
    try:
        trainer(precision, 1, compressor).fit(Classifier(), data())
    except ValueError as error:
        return str(error)
    return ""


def resume(thread) -> bool:  # noqa: ANN001
    whole = Classifier()
    trainer("32-true", 2, thread=thread).fit(whole, data())
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "one.ckpt")
        first = trainer("32-true", 1, thread=thread)
        first.fit(Classifier(), data())
        first.save_checkpoint(path)
        resumed = Classifier()
        trainer("32-true", 2, thread=thread).fit(resumed, data(), ckpt_path=path)
    return all(torch.equal(a, b) for a, b in zip(whole.parameters(), resumed.parameters()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = parser.parse_args().out
    warnings.filterwarnings("ignore")
    results = {
        "32-true": fit("32-true", TopK(0.1)),
        "32-true-hook": fit("32-true", TopK(0.1), thread=False),
        "bf16-mixed": fit("bf16-mixed", TopK(0.1)),
        "16-mixed": fit("16-mixed", "qsgd"),
        "bf16-true": fit("bf16-true", TopK(0.1)),
        "bf16-true-powersgd": fit("bf16-true", "powersgd"),
        "16-mixed-topk-refused": refused("16-mixed", "topk"),
        "resume-thread": resume(None),
        "resume-hook": resume(False),
    }
    Path(out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
