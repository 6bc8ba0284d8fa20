"""Checkpoint bytes per rank: the exchange's state, gathered on rank 0 or a part per rank, against the model
and optimizer state.

    python benchmarks/checkpoint_size.py [--worlds 2 4] [--width 1024] [--methods topk int8 diloco]

For each world size (gloo processes on this machine) and method, a 3-layer MLP (512 -> width -> 512 -> 10)
takes 3 AdamW steps, then rank 0 reports the bytes of ``torch.save`` of the model's and optimizer's
``state_dict()`` (what DDP's checkpoint holds), of the handle's ``state_dict()`` (the exchange state
gathered from every rank: residuals and compressor state per rank; under local updates, ``diloco``, also
every rank's replica, inner-optimizer state and the outer state), which grows with the number of ranks,
and of the largest ``rank_state_dict()`` (one rank's part, what the strategies' checkpoints write on each
rank), which does not. "Rank 0 writes" is what rank 0 writes with parts: the model and optimizer and its
own part; the ratio is to DDP's checkpoint.
"""

from __future__ import annotations

import argparse
import io
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def _bytes(obj: Any) -> int:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.tell()


def _rank(rank: int, world: int, port: int, method: str, width: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import lightning_gradcomp

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, width), nn.ReLU(), nn.Linear(width, 512), nn.ReLU(), nn.Linear(512, 10))
    inputs = torch.randn(16, 512, generator=torch.Generator().manual_seed(rank))
    if method == "diloco":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        handle = lightning_gradcomp.local_updates(model, optimizer, 4, "none")
        step = model
    else:
        step = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(step.parameters(), lr=1e-3)
        handle = lightning_gradcomp.register(step, method)
    for _ in range(3):
        step(inputs).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    entry = handle.state_dict()  # a collective: every rank
    part = torch.tensor([float(_bytes(handle.rank_state_dict()))])
    own = float(part)
    dist.all_reduce(part, op=dist.ReduceOp.MAX)
    if rank == 0:
        dense = _bytes({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
        with open(out, "a") as handle_out:
            handle_out.write(f"| {world} | {method} | {dense / 1e6:.2f} | {_bytes(entry) / 1e6:.2f} | "
                             f"{float(part) / 1e6:.2f} | {(dense + own) / 1e6:.2f} | {(dense + own) / dense:.2f} |\n")
    handle.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--methods", nargs="+", default=["topk", "int8", "diloco"])
    args = parser.parse_args()
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"checkpoint_size.{os.getpid()}.md")
    with open(out, "w") as table:
        table.write("| ranks | method | DDP: model + optimizer (MB) | gathered entry on rank 0 (MB) | largest part "
                    "per rank (MB) | rank 0 writes, with parts (MB) | ratio to DDP |\n|---|---|---|---|---|---|---|\n")
    port = 29700 + os.getpid() % 200
    for world in args.worlds:
        for method in args.methods:
            port += 1
            mp.start_processes(_rank, args=(world, port, method, args.width, out), nprocs=world, start_method="fork")
    with open(out) as table:
        print(table.read(), end="")
    os.remove(out)


if __name__ == "__main__":
    main()
