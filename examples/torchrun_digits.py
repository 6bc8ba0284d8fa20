"""Plain PyTorch + torchrun: compressed gradients on a bare DistributedDataParallel model.

Train scikit-learn's digits on 2 CPU processes with Top-k at 1%, checkpointing every epoch::

    torchrun --standalone --nproc-per-node 2 examples/torchrun_digits.py --epochs 10 --checkpoint /tmp/digits.pt

Stop it (or pass ``--stop-after 4``) and run the same command again: it resumes from the checkpoint, error
feedback residuals included, and ends with the same parameters as an uninterrupted run. On GPUs use
``--backend nccl``; every rank then trains on ``cuda:LOCAL_RANK``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

import lightning_gradcomp
from lightning_gradcomp.examples.digits import DigitsDataModule, digits_mlp
from lightning_gradcomp.metrics.netmodel import Network


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compressor", default="topk", help="a registered compressor name (default: topk)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--checkpoint", default=None, help="save here after every epoch; resume from it if it exists")
    parser.add_argument("--stop-after", type=int, default=None, help="stop after this many epochs (to try a resume)")
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--out", default=None, help="write this rank's final parameters to <out>.rank<R>.pt")
    args = parser.parse_args()

    dist.init_process_group(args.backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if args.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(7)

    data = DigitsDataModule()
    data.setup()
    sampler = DistributedSampler(data.train_set, world_size, rank, shuffle=True, seed=7)
    loader = DataLoader(data.train_set, batch_size=32, sampler=sampler)
    model = DistributedDataParallel(digits_mlp().to(device), device_ids=[device.index] if device.type == "cuda" else None)
    gradcomp = lightning_gradcomp.register(model, compressor=args.compressor)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    gradcomp.bind(optimizer)  # checks it against the compressor (DGC and DeMo refuse an optimizer with its own momentum)

    start = 0
    if args.checkpoint and os.path.exists(args.checkpoint):
        # on the CPU: every rank reads every rank's residuals, and keeps (on its device) only its own
        checkpoint = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
        model.module.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        gradcomp.load_state_dict(checkpoint["gradcomp"])  # this rank's residuals and compressor state
        start = checkpoint["epoch"]
        if rank == 0:
            print(f"resumed from {args.checkpoint} at epoch {start}")

    last = args.epochs if args.stop_after is None else min(args.epochs, args.stop_after)
    for epoch in range(start, last):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            with lightning_gradcomp.exchange_failures(gradcomp):  # a dead peer: CollectiveError on every rank
                F.cross_entropy(model(x.to(device)), y.to(device)).backward()
            optimizer.step()
        stats = gradcomp.step_stats
        if rank == 0:
            print(f"epoch {epoch + 1}: last step sent {stats.bytes_sent:.0f} bytes ({stats.compression_ratio:.1f}x less)")
        if args.checkpoint:
            entry = gradcomp.state_dict()  # a collective: every rank calls it; rank 0 gets every rank's state
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "gradcomp": entry, "epoch": epoch + 1}, args.checkpoint)
            dist.barrier()

    summary = gradcomp.summary(Network(bandwidth_gbps=1.0, latency_us=50))  # every rank takes part
    with torch.no_grad():
        x, y = data.test_set.tensors
        accuracy = (model.module(x.to(device)).argmax(1).cpu() == y).float().mean().item()
    if rank == 0:
        print(summary)
        print(f"test accuracy {accuracy:.4f}")
    if args.out:
        torch.save({"params": {k: v.cpu() for k, v in model.module.state_dict().items()}, "test_acc": accuracy,
                    "residual_norm": gradcomp.hook_state.memory.squared_residual_norm(),
                    "totals": gradcomp.totals.state_dict(), "epochs": last}, f"{args.out}.rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
