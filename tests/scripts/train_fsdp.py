"""A real multi-process Lightning fit of a sharded model (GradCompFSDPStrategy, compressed HSDP) on the digits.

    python train_fsdp.py --out /tmp/x --shard-size 2 --compressor topk --epochs 2

Every rank writes ``<out>.rank<R>.pt``: its parameter shards, per-step losses and figures, the exchange's
counters. The tests start the 4 ranks themselves (``LOCAL_RANK`` set, as torchrun does), forked from their
fork server; run by hand, Lightning's launcher starts them.
"""

from __future__ import annotations

import argparse
import warnings

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from torch.distributed.fsdp import FSDPModule, fully_shard

import lightning_gradcomp  # (registers "gradcomp_fsdp")
from lightning_gradcomp import GradCompFSDPStrategy
from lightning_gradcomp.callbacks import CompressionMonitor, DGCWarmup, GradientNormTrigger
from lightning_gradcomp.examples.digits import DigitsDataModule

from _fsdp_digits import DigitsTransformer, local_shards


class ShardedDigits(L.LightningModule):
    """The transformer; ``--wrap configure`` shards it in ``configure_model`` (the blocks, then the
    LightningModule itself), ``--wrap policy`` leaves it to the strategy's ``auto_wrap_policy``. The steps call
    the submodules directly, never ``self(x)``: the root's FSDP hooks must come from the strategy."""

    def __init__(self, wrap: str, lr: float) -> None:
        super().__init__()
        self.wrap, self.lr = wrap, lr
        self.model = DigitsTransformer()

    def configure_model(self) -> None:
        if self.wrap != "configure" or isinstance(self, FSDPModule):
            return
        mesh = self.device_mesh["shard"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.model(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class SaveAtEpochEnd(Callback):
    """A checkpoint at the end of epoch ``epoch`` (from 1) while the run goes on."""

    def __init__(self, epoch: int, path: str) -> None:
        self.epoch, self.path = epoch, path
        self.saved_global: dict = {}

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch + 1 == self.epoch:
            trainer.save_checkpoint(self.path)
            loop = trainer.strategy.outer_loop
            if loop is not None:  # what the checkpoint's model should be: θ_global, this rank's shards
                self.saved_global = dict(zip(loop.names, (glob.detach().clone() for glob in loop.outer.global_params)))


class RecordSteps(Callback):
    """This rank's loss and exchange figures after every optimizer step."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        strategy = trainer.strategy
        stats = strategy.step_stats
        self.steps.append({"global_step": trainer.global_step, "loss": float(outputs["loss"]),
                           "bytes_sent": stats.bytes_sent, "bytes_dense": stats.bytes_dense,
                           "density": stats.density, "hook_step": strategy.hook_state.step,
                           "compressor_density": getattr(strategy.hook_state.compressor, "density", None)})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--wrap", default="configure", choices=["configure", "policy"])
    parser.add_argument("--compressor", default="topk")
    parser.add_argument("--shard-size", type=int, default=2)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--save", default=None, help="a checkpoint (directory) at the end of --save-at-epoch")
    parser.add_argument("--save-at-epoch", type=int, default=1)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--single-file", action="store_true", help="save_distributed_checkpoint=False")
    parser.add_argument("--monitor", action="store_true", help="add CompressionMonitor")
    parser.add_argument("--csv", default=None, help="log to a CSVLogger in this directory")
    parser.add_argument("--validate", action="store_true", help="validate at every epoch's end")
    parser.add_argument("--trigger", action="store_true", help="add GradientNormTrigger (density 0.1 / 0.01)")
    parser.add_argument("--warmup", action="store_true", help="add DGCWarmup(steps=4)")
    parser.add_argument("--local-updates", type=int, default=None, help="local updates on the shards, H")
    parser.add_argument("--delay", type=int, default=0, help="with --local-updates: Streaming DiLoCo's delay")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")

    L.seed_everything(7, verbose=False)
    local = (lightning_gradcomp.LocalUpdates(args.local_updates, delay=args.delay) if args.local_updates is not None
             else None)
    strategy = GradCompFSDPStrategy(compressor=args.compressor, shard_size=args.shard_size, min_compress_numel=256,
                                    local_updates=local,
                                    save_distributed_checkpoint=not args.single_file,
                                    auto_wrap_policy={torch.nn.TransformerEncoderLayer} if args.wrap == "policy"
                                    else None)
    recorder = RecordSteps()
    callbacks: list[Callback] = [recorder]
    if args.monitor:
        callbacks.append(CompressionMonitor())
    if args.trigger:
        callbacks.append(GradientNormTrigger(low={"density": 0.1}, high={"density": 0.01}))
    if args.warmup:
        callbacks.append(DGCWarmup(steps=4))
    saver = SaveAtEpochEnd(args.save_at_epoch, args.save) if args.save else None
    if saver is not None:
        callbacks.append(saver)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy, max_epochs=args.epochs,
        accumulate_grad_batches=args.accumulate, callbacks=callbacks, log_every_n_steps=5,
        logger=CSVLogger(args.csv, name="run") if args.csv else False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=1.0 if args.validate else 0,
        deterministic=True,
    )
    module = ShardedDigits(args.wrap, args.lr)
    trainer.fit(module, datamodule=DigitsDataModule(batch_size=16), ckpt_path=args.resume)
    state = strategy.hook_state
    for submodule in module.modules():  # the root keeps its parameters unsharded after a forward (validation)
        if isinstance(submodule, FSDPModule):
            submodule.reshard()
    result = {
        "shards": local_shards(module),
        "full": {name: p.full_tensor().detach().clone() for name, p in module.named_parameters()},
        "fsdp_modules": sorted(name for name, m in module.named_modules() if isinstance(m, FSDPModule)),
        "global_step": trainer.global_step,
        "steps": recorder.steps,
        "hook_step": state.step,
        "hook_calls": state.hook_calls,
        "totals": state.totals.state_dict(),
        "residual_norm": state.memory.squared_residual_norm(),
        "mesh": strategy.device_mesh.get_coordinate(),
        "compression_workers": strategy.compression_workers,
        "sampler": strategy.distributed_sampler_kwargs,
        "val_loss": float(trainer.callback_metrics.get("val_loss", float("nan"))),
    }
    if strategy.outer_loop is not None:
        outer = strategy.outer_loop.outer
        result.update(syncs=outer.syncs, optimizer_steps=outer.optimizer_steps,
                      global_shards=[glob.detach().clone() for glob in outer.global_params],
                      saved_global=saver.saved_global if saver is not None else {})
    torch.save(result, f"{args.out}.rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
