"""Two gloo processes train an MLP split into several DDP buckets with multi-round compressors (PowerSGD;
the int8 quantised all-reduce, whose first round is an all-to-all) and a count-exchanging one (hard
threshold), exchanged in the hook and on the exchange thread; run by tests/test_slow_link.py inside a
rate-limited network namespace. Rank 0 writes every rank's final parameters and the hook's counters to ``--out``."""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_gradcomp.compressors import HardThreshold, Int8AllReduce, PowerSGD
from lightning_gradcomp.ddp.hook import GradCompHookState, gradcomp_hook


def _worker(rank: int, port: int, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    results = {}
    for name, compressor, thread in (("powersgd", PowerSGD(rank=2), False), ("threshold", HardThreshold(0.004), False),
                                     ("powersgd_thread", PowerSGD(rank=2), True),
                                     ("threshold_thread", HardThreshold(0.004), True),
                                     ("int8", Int8AllReduce(), False), ("int8_thread", Int8AllReduce(), True)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                              nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.25)
        state = GradCompHookState(compressor, {id(p): n for n, p in model.named_parameters()}, exchange_thread=thread)
        ddp.register_comm_hook(state, gradcomp_hook)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
        generator = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            x, y = torch.randn(32, 784, generator=generator), torch.randint(0, 10, (32,), generator=generator)
            optimizer.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.empty_like(params) for _ in range(2)]
        dist.all_gather(gathered, params)
        results[name] = {"params": gathered, "hook_calls": state.hook_calls, "step": state.step}
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(_worker, args=(port, args.steps, args.out), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
