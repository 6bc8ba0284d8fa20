"""A real (multi-process) Lightning Fabric run on scikit-learn's digits, driven by the tests.

    python fabric_digits.py --out /tmp/x --strategy gradcomp --compressor topk --epochs 10

Fabric's ``popen`` launcher starts the second process by re-running this script. Every rank writes
``<out>.rank<R>.pt`` (final parameters, test accuracy, per-step figures, the exchange's counters).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, DistributedSampler

import lightning_gradcomp  # noqa: F401  (registers "gradcomp" with Fabric)
from lightning_gradcomp import GradCompFabricStrategy, LocalUpdates
from lightning_gradcomp.compressors import COMPRESSORS
from lightning_gradcomp.examples.digits import DigitsDataModule, digits_mlp


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategy", default="gradcomp", choices=["gradcomp", "gradcomp-by-name", "ddp"])
    parser.add_argument("--compressor", default="topk", choices=sorted(COMPRESSORS))
    parser.add_argument("--compressor-kwargs", type=json.loads, default={})
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save-at", type=int, default=None, help="fabric.save after this many epochs")
    parser.add_argument("--save", default=None)
    parser.add_argument("--resume", default=None, help="fabric.load this checkpoint before training")
    parser.add_argument("--local", type=int, default=0, help="local updates: synchronise every LOCAL steps")
    parser.add_argument("--window-seconds", default=None, help="local updates: time-boxed windows ('auto' or seconds)")
    parser.add_argument("--slow-rank-sleep", type=float, default=0.0, help="rank 1 sleeps this long per batch")
    args = parser.parse_args()
    torch.set_num_threads(1)

    if args.strategy == "gradcomp":
        local = args.local or None
        if args.window_seconds is not None:
            local = LocalUpdates(args.local, window_seconds=args.window_seconds if args.window_seconds == "auto"
                                 else float(args.window_seconds))
        strategy = GradCompFabricStrategy(compressor=COMPRESSORS[args.compressor](**args.compressor_kwargs),
                                          local_updates=local)
    else:
        strategy = "gradcomp" if args.strategy == "gradcomp-by-name" else "ddp"
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(7)
    data = DigitsDataModule()
    data.setup()
    model = digits_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9 if args.local else 0.0)
    model, optimizer = fabric.setup(model, optimizer)
    # Our own sampler: Fabric's data loader wrapper numbers epochs by its own iteration count, which a
    # resumed run restarts at zero.
    sampler = DistributedSampler(data.train_set, fabric.world_size, fabric.global_rank, shuffle=True, seed=7)
    train = DataLoader(data.train_set, batch_size=32, sampler=sampler)
    state = {"model": model, "optimizer": optimizer, "epoch": 0}
    if args.resume:
        fabric.load(args.resume, state)
    steps = []
    if args.window_seconds is not None:  # the groups take different numbers of steps: say this loop's length
        fabric.strategy.gradcomp.run_for(args.epochs * len(train))
    for epoch in range(state["epoch"], args.epochs):
        sampler.set_epoch(epoch)
        for x, y in train:
            if args.window_seconds is not None and fabric.strategy.gradcomp.finished:
                break  # the run's planned end, the same synchronisation on every rank
            optimizer.zero_grad()
            fabric.backward(F.cross_entropy(model(x), y))
            if fabric.global_rank == 1:
                time.sleep(args.slow_rank_sleep)
            optimizer.step()
            if args.strategy != "ddp":
                stats = fabric.strategy.step_stats
                steps.append({"bytes_sent": stats.bytes_sent, "bytes_dense": stats.bytes_dense,
                              "density": stats.density, "buckets": stats.buckets})
        state["epoch"] = epoch + 1
        if args.save_at == epoch + 1:
            fabric.save(args.save, state)
    result = {"replica_params": {k: v.detach().clone() for k, v in model.module.state_dict().items()}}
    if args.local:
        fabric.strategy.gradcomp.sync()  # the end of training: every rank's model set to θ_global
    with torch.no_grad():
        x, y = data.test_set.tensors
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    result.update({"params": {k: v.detach().clone() for k, v in model.module.state_dict().items()},
                   "test_acc": accuracy, "steps": steps, "inner_steps": len(steps)})
    if args.strategy != "ddp":
        handle = fabric.strategy.gradcomp
        result.update(hook_step=handle.hook_state.step, totals=handle.totals.state_dict(),
                      residual_norm=handle.hook_state.memory.squared_residual_norm(),
                      summary=fabric.strategy.summary())
    torch.save(result, f"{args.out}.rank{fabric.global_rank}.pt")


if __name__ == "__main__":
    main()
