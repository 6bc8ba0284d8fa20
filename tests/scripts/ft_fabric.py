"""One replica group of a fault-tolerant local-updates job under Fabric (``--devices``, DDP inside; run by
tests/test_fault_tolerance.py with torchft's lighthouse on 127.0.0.1):
``GradCompFabricStrategy(compressor=args.compressor, local_updates=4, fault_tolerance=FaultTolerance(...))`` on the
digits MLP, looping while the groups' step count is below ``--steps``. Writes ``<out>.pt`` (``<out>-rankR.pt``)."""

from __future__ import annotations

import argparse
import warnings

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from sklearn.datasets import load_digits
from torch import nn

from lightning_gradcomp import FaultTolerance, GradCompFabricStrategy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replica", required=True)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--compressor", default="sparseloco")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    strategy = GradCompFabricStrategy(compressor=args.compressor, min_compress_numel=256, local_updates=4,
                                      fault_tolerance=FaultTolerance(lighthouse=args.lighthouse,
                                                                     replica_id=f"fabric{args.replica}", timeout=20))
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    fabric.launch()
    torch.manual_seed(int(args.replica))
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    digits = load_digits()
    images, labels = torch.tensor(digits.data, dtype=torch.float32) / 16.0, torch.tensor(digits.target)
    gradcomp = fabric.strategy.gradcomp
    losses = []
    while gradcomp.optimizer_steps < args.steps:
        generator = torch.Generator().manual_seed(1000 * gradcomp.optimizer_steps + 10 * int(args.replica)
                                                + fabric.global_rank)
        order = torch.randint(0, len(labels), (32,), generator=generator)
        loss = F.cross_entropy(model(images[order]), labels[order])
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    figures = gradcomp.fault_tolerance
    torch.save({"params": [p.detach().clone() for p in model.parameters()], "losses": losses,
                "commits": figures.commits, "participants": list(figures.participants),
                "syncs": gradcomp.loop.outer.syncs, "summary": fabric.strategy.summary()},
               f"{args.out}.pt" if fabric.global_rank == 0 else f"{args.out}-rank{fabric.global_rank}.pt")
    fabric.strategy.teardown()


if __name__ == "__main__":
    main()
