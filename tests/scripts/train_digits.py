"""A real (multi-process) Lightning run on scikit-learn's digits, driven by the tests.

Every rank writes ``<out>.rank<R>.pt`` with its final parameters, per-step figures and the hook's
counters, so tests can compare runs and ranks. Run as ``python train_digits.py --out /tmp/x ...``;
Lightning's ``popen`` launcher starts the other ranks by re-running this script.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

import lightning_gradcomp  # noqa: F401  (registers "gradcomp")
from lightning_gradcomp import CollectiveError, GradCompStrategy, LocalUpdates
from lightning_gradcomp.callbacks import AdaptiveCompression, CompressionMonitor, DGCWarmup
from lightning_gradcomp.metrics.netmodel import Network
from lightning_gradcomp.simulation import DistributedOrderBatchSampler, GradCompSimStrategy
from torch.utils.data import DataLoader
from lightning_gradcomp.compressors import COMPRESSORS
from lightning_gradcomp.examples.digits import DigitsClassifier, DigitsDataModule


class SimulatedOrderDigits(DigitsDataModule):
    """Digits in the batch order of a real N-process DDP run (Lightning seeds its sampler with the
    global seed)."""

    def __init__(self, workers: int, seed: int) -> None:
        super().__init__(batch_size=32)
        self.workers, self.seed = workers, seed

    def train_dataloader(self) -> DataLoader:
        sampler = DistributedOrderBatchSampler(self.train_set, self.workers, 32, shuffle=True, seed=self.seed)
        return DataLoader(self.train_set, batch_sampler=sampler)


class SaveAtEpochEnd(Callback):
    """Writes a checkpoint at the end of epoch ``epoch`` (counted from 1) while the run goes on: the
    checkpoint a job stopped there would have left, taken from a run that was not stopped."""

    def __init__(self, epoch: int, path: str) -> None:
        self.epoch, self.path = epoch, path

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch + 1 == self.epoch:
            trainer.save_checkpoint(self.path)


class PeerDies(Callback):
    """Rank 1 leaves the job at once when optimizer step ``step`` begins (a crashed or preempted node)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == 1 and trainer.global_step == self.step:
            os._exit(3)


class SlowLastRank(Callback):
    """The last rank's batches take ``seconds`` longer (a slower machine)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == trainer.world_size - 1:
            time.sleep(self.seconds)


class RecordSteps(Callback):
    """Keeps this rank's figures of every optimizer step."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.validated: list[float] = []  # the parameters' sum each validation saw

    def on_validation_start(self, trainer, pl_module) -> None:
        self.validated.append(float(sum(p.detach().double().sum() for p in pl_module.parameters())))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, (GradCompStrategy, GradCompSimStrategy)):
            stats = strategy.step_stats
            self.steps.append({"global_step": trainer.global_step, "buckets": stats.buckets,
                               "epoch": trainer.current_epoch,
                               "compressor_density": getattr(strategy.compressor, "density", None),
                               "lr": trainer.optimizers[0].param_groups[0]["lr"],
                               "active": repr(strategy.hook_state.compressor),
                               "bytes_sent": stats.bytes_sent, "bytes_dense": stats.bytes_dense,
                               "density": stats.density, "hook_step": strategy.hook_state.step,
                               # inside the batch: this rank's replica (local updates: apart between syncs)
                               "param_sum": float(sum(p.detach().double().sum() for p in pl_module.parameters()))})


class TwoOptimizers(DigitsClassifier):
    """Manual optimization with two optimizers stepped after one backward (a GAN-shaped loop): the first
    layer's and the rest's."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        first, rest = self.optimizers()
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.manual_backward(loss)
        first.step()
        rest.step()
        first.zero_grad()
        rest.zero_grad()
        self.log("train_loss", loss)

    def configure_optimizers(self):
        layers = list(self.net.children())
        return (torch.optim.SGD(layers[0].parameters(), lr=self.hparams.lr),
                torch.optim.SGD([p for layer in layers[1:] for p in layer.parameters()], lr=self.hparams.lr))


def _logger(args: argparse.Namespace):
    if args.tensorboard:
        return TensorBoardLogger(args.tensorboard, name="run")
    return CSVLogger(args.csv, name="run") if args.csv else False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategy", default="gradcomp", choices=["gradcomp", "ddp"])
    parser.add_argument("--compressor", default="topk", choices=sorted(COMPRESSORS))
    parser.add_argument("--density", type=float, default=None)
    parser.add_argument("--compressor-kwargs", type=json.loads, default={}, help="JSON constructor arguments")
    parser.add_argument("--warmup-epochs", type=int, default=None, help="add DGCWarmup(epochs=N)")
    parser.add_argument("--lr-warmup", action="store_true", help="with --warmup-epochs: warm the LR up too")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1, help="with NODE_RANK set by the caller for each node")
    parser.add_argument("--hierarchy", default="none", choices=["none", "node"])
    parser.add_argument("--simulate", type=int, default=0, help="simulate N workers on one process")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--resume", default=None, help="checkpoint to resume from")
    parser.add_argument("--save", default=None, help="write a checkpoint here after fit")
    parser.add_argument("--save-at-epoch", type=int, default=None,
                        help="with --save: write it at the end of this epoch instead, and go on training")
    parser.add_argument("--test", action="store_true", help="report test accuracy")
    parser.add_argument("--csv", default=None, help="log to a CSVLogger in this directory")
    parser.add_argument("--tensorboard", default=None, help="log to a TensorBoardLogger in this directory")
    parser.add_argument("--monitor", action="store_true", help="add CompressionMonitor(layer_every_n_steps=5)")
    parser.add_argument("--adaptive", action="store_true", help="add an AdaptiveCompression schedule on val_acc")
    parser.add_argument("--validate", action="store_true", help="run validation every epoch")
    parser.add_argument("--two-optimizers", action="store_true", help="manual optimization, two optimizers")
    parser.add_argument("--local", type=int, default=0, help="local updates: synchronise every LOCAL steps")
    parser.add_argument("--window-seconds", default=None, help="local updates: time-boxed windows ('auto' or seconds)")
    parser.add_argument("--slow-rank-sleep", type=float, default=0.0, help="the last rank sleeps this long per batch")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="add ModelCheckpoint(dirpath, save_on_train_epoch_end=False, save_top_k=-1)")
    parser.add_argument("--peer-dies-at-step", type=int, default=None,
                        help="rank 1 exits at this step; rank 0 prints COLLECTIVE_ERROR and exits 3 on CollectiveError")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")

    L.seed_everything(args.seed, verbose=False)
    compressor = COMPRESSORS[args.compressor](**args.compressor_kwargs)
    if args.density is not None:
        compressor.density = args.density
    if args.simulate:
        strategy = GradCompSimStrategy(workers=args.simulate, compressor=compressor, local_updates=args.local or None)
        args.devices = 1
    else:
        local = args.local or None
        if args.window_seconds is not None:
            window = args.window_seconds if args.window_seconds == "auto" else float(args.window_seconds)
            local = LocalUpdates(args.local, window_seconds=window)
        strategy = (GradCompStrategy(compressor=compressor, hierarchy=args.hierarchy, local_updates=local)
                    if args.strategy == "gradcomp" else "ddp")
    recorder = RecordSteps()
    callbacks = [recorder]
    if args.monitor:
        callbacks.append(CompressionMonitor(network=Network(bandwidth_gbps=10, latency_us=50), layer_every_n_steps=5))
    if args.adaptive:
        callbacks.append(AdaptiveCompression(monitor="val_acc", levels=[{"bits": 2}, {"bits": 4}, {"bits": 8}, None],
                                             thresholds=[0.5, 0.85, 0.99], patience=2, escape_epochs=1))
    if args.warmup_epochs:
        callbacks.append(DGCWarmup(epochs=args.warmup_epochs, lr_warmup=args.lr_warmup))
    if args.slow_rank_sleep:
        callbacks.append(SlowLastRank(args.slow_rank_sleep))
    if args.checkpoint_dir:
        callbacks.append(ModelCheckpoint(dirpath=args.checkpoint_dir, save_on_train_epoch_end=False, save_top_k=-1))
    if args.peer_dies_at_step is not None:
        callbacks.append(PeerDies(args.peer_dies_at_step))
    if args.save and args.save_at_epoch:
        callbacks.append(SaveAtEpochEnd(args.save_at_epoch, args.save))  # last: after the others' epoch end
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes, strategy=strategy, max_epochs=args.epochs,
        max_steps=args.max_steps, accumulate_grad_batches=args.accumulate, callbacks=callbacks,
        logger=_logger(args), log_every_n_steps=5,
        enable_checkpointing=bool(args.checkpoint_dir), enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=1.0 if args.validate else 0, deterministic=True,
    )
    model = (TwoOptimizers if args.two_optimizers else DigitsClassifier)(lr=args.lr, momentum=args.momentum)
    data = SimulatedOrderDigits(args.simulate, args.seed) if args.simulate else DigitsDataModule(batch_size=32)
    try:
        trainer.fit(model, datamodule=data, ckpt_path=args.resume)
    except CollectiveError as error:
        print("COLLECTIVE_ERROR", " ".join(str(error).split()), flush=True)
        sys.exit(3)
    if args.save and not args.save_at_epoch:
        trainer.save_checkpoint(args.save)
    result = {
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "global_step": trainer.global_step,
        "steps": recorder.steps,
        "validated": recorder.validated,
        "world_size": trainer.world_size,
    }
    if isinstance(trainer.strategy, GradCompSimStrategy):
        state = trainer.strategy.hook_state
        result.update(hook_step=state.step, totals=state.totals.state_dict(),
                      residual_norms=[p.memory.squared_residual_norm() for p in state.pipelines])
    if isinstance(trainer.strategy, GradCompStrategy):
        state = trainer.strategy.hook_state
        result.update(hook_calls=state.hook_calls, hook_step=state.step,
                      residual_norm=state.memory.squared_residual_norm(), totals=state.totals.state_dict())
    outer = getattr(getattr(trainer.strategy, "local_loop", None) or getattr(trainer.strategy, "local", None),
                    "outer", None)
    if outer is not None:
        result.update(global_params=[g.detach().clone() for g in outer.global_params], global_names=outer.names,
                      syncs=outer.syncs, windows=outer.windows, finished=outer.finished,
                      inner_steps=outer.inner_steps)
    if args.test:
        result["test_acc"] = trainer.test(model, datamodule=data, verbose=False)[0]["test_acc"]
    torch.save(result, f"{args.out}.rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
