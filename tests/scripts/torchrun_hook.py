"""A plain ``torchrun`` script with the gradcomp hook on a bare DDP model (used by the exit stress test).

    torchrun --standalone --nproc-per-node 2 tests/scripts/torchrun_hook.py --compressor topk
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

from lightning_gradcomp.ddp.hook import GradCompHookState, gradcomp_hook


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--compressor", default="topk")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no-destroy", action="store_true", help="exit without destroy_process_group()")
    parser.add_argument("--thread", action="store_true", help="exchange on gradcomp's exchange thread")
    parser.add_argument("--torch-hook", action="store_true", help="PyTorch's allreduce_hook instead, for comparison")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    ddp = nn.parallel.DistributedDataParallel(model)
    if args.torch_hook:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    else:
        names = {id(p): n for n, p in model.named_parameters()}
        ddp.register_comm_hook(GradCompHookState(args.compressor, names, exchange_thread=args.thread),
                               gradcomp_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(args.steps):
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(torch.randn(16, 64)), torch.randint(0, 10, (16,))).backward()
        optimizer.step()
    if not args.no_destroy:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
