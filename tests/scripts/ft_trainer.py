"""One replica group of a fault-tolerant local-updates job under the Trainer (``devices=1``, one process;
run by tests/test_fault_tolerance.py, which starts torchft's lighthouse on 127.0.0.1):
``GradCompStrategy(compressor="int8", local_updates=4, fault_tolerance=FaultTolerance(...))`` on the digits MLP,
``max_steps=--steps``. ``--die-at K`` leaves with ``os._exit`` after optimizer step K. Writes ``<out>.pt``: the
final parameters, the outer loop's counters and the fault-tolerance figures, and the logged ``gradcomp/ft_*``."""

from __future__ import annotations

import argparse
import os
import time
import warnings

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_gradcomp import FaultTolerance, GradCompStrategy
from lightning_gradcomp.callbacks import CompressionMonitor
from lightning_gradcomp.examples.digits import DigitsDataModule


class MLP(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Steps(Callback):
    """Slows each step (the MLP's takes a millisecond), records losses, and leaves at ``die_at``."""

    def __init__(self, die_at, seconds: float) -> None:
        self.die_at, self.seconds, self.losses, self.logged = die_at, seconds, [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))
        time.sleep(self.seconds)
        if self.die_at is not None and trainer.global_step == self.die_at:
            os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replica", required=True)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--die-at", type=int, default=None)
    parser.add_argument("--step-seconds", type=float, default=0.1)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(int(args.replica) + 100)
    steps = Steps(args.die_at, args.step_seconds)
    strategy = GradCompStrategy(compressor="int8", min_compress_numel=256, local_updates=4,
                                fault_tolerance=FaultTolerance(lighthouse=args.lighthouse, replica_id=f"group{args.replica}",
                                                               timeout=20, quorum_timeout=60))
    csv = L.pytorch.loggers.CSVLogger(os.path.dirname(args.out), name=os.path.basename(args.out))
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=args.steps, max_epochs=-1,
                        callbacks=[steps, CompressionMonitor(log_every_n_steps=1)], logger=csv, log_every_n_steps=1, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    module = MLP()
    trainer.fit(module, datamodule=DigitsDataModule(batch_size=32))
    loop = strategy.local_loop
    figures = loop.membership.figures
    torch.save({"params": [p.detach().clone() for p in module.parameters()], "optimizer_steps": loop.outer.optimizer_steps,
                "syncs": loop.outer.syncs, "participants": list(figures.participants), "commits": figures.commits,
                "rollbacks": figures.rollbacks, "heals": figures.heals, "losses": steps.losses,
                "global_step": trainer.global_step, "metrics_dir": csv.log_dir}, f"{args.out}.pt")


if __name__ == "__main__":
    main()
