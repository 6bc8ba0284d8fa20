"""One replica group of a fault-tolerant local-updates job under the Trainer (one process, or `--devices`;
run by tests/test_fault_tolerance.py, which starts torchft's lighthouse on 127.0.0.1):
``GradCompStrategy(compressor="int8", local_updates=4, fault_tolerance=FaultTolerance(...))`` on the digits MLP,
``max_steps=--steps``, on ``--devices`` processes (DDP inside the group). ``--die-at K``: every process of the
group leaves with ``os._exit`` after optimizer step K. Writes ``<out>.pt`` (rank 0; ``<out>-rankR.pt``): the
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

from lightning_gradcomp import FaultTolerance, GradCompFSDPStrategy, GradCompStrategy
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
    parser.add_argument("--devices", type=int, default=1, help="processes in this replica group (DDP inside it)")
    parser.add_argument("--fsdp", action="store_true", help="GradCompFSDPStrategy: the devices shard the model")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(int(args.replica) + 100)
    steps = Steps(args.die_at, args.step_seconds)
    fault_tolerance = FaultTolerance(lighthouse=args.lighthouse, replica_id=f"group{args.replica}", timeout=20,
                                     quorum_timeout=60)
    if args.fsdp:
        strategy = GradCompFSDPStrategy(compressor="int8", min_compress_numel=256, local_updates=4,
                                        fault_tolerance=fault_tolerance, auto_wrap_policy={nn.Linear})
    else:
        strategy = GradCompStrategy(compressor="int8", min_compress_numel=256, local_updates=4,
                                    fault_tolerance=fault_tolerance)
    csv = L.pytorch.loggers.CSVLogger(os.path.dirname(args.out), name=os.path.basename(args.out))
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps, max_epochs=-1,
                        callbacks=[steps, CompressionMonitor(log_every_n_steps=1)], logger=csv, log_every_n_steps=1, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    module = MLP()
    trainer.fit(module, datamodule=DigitsDataModule(batch_size=32))
    loop = strategy.local_loop
    figures = loop.membership.figures
    torch.save({"params": [getattr(p, "_local_tensor", p).detach().clone() for p in module.parameters()], "optimizer_steps": loop.outer.optimizer_steps,
                "syncs": loop.outer.syncs, "participants": list(figures.participants), "commits": figures.commits,
                "rollbacks": figures.rollbacks, "heals": figures.heals, "losses": steps.losses,
                "global_step": trainer.global_step, "metrics_dir": csv.log_dir, "totals": strategy.hook_state.totals,
                "sampler_seed": trainer.train_dataloader.sampler.seed},
               f"{args.out}.pt" if trainer.global_rank == 0 else f"{args.out}-rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
