"""One rank of a 2-process gloo job whose peer fails mid-training (run by tests/test_dead_peer.py).

Rank 1 fails at step 3 (``--fault exit``: leaves at once; ``kill``: SIGKILL; ``hang``: stops answering).
Rank 0 must end with an error naming the failed collective and its rank, within the process group's
timeout: it prints ``FAILED <seconds> <type> <message>`` (``type``: the error's type once
:func:`~lightning_gradcomp.exchange_failures` has unwrapped what DDP raised) and exits 3, or prints
``FINISHED`` if training ended.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from lightning_gradcomp.ddp.hook import GradCompHookState, exchange_failures, gradcomp_hook
from lightning_gradcomp import local_updates


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--compressor", default="topk")
    parser.add_argument("--fault", choices=["exit", "kill", "hang"], default="exit")
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--min-compress-numel", type=int, default=1024)
    parser.add_argument("--thread", action="store_true", help="exchange on gradcomp's exchange thread")
    parser.add_argument("--local", type=int, default=0,
                        help="local updates synchronising every LOCAL steps (no DDP): the peer dies before a sync")
    parser.add_argument("--fsdp", action="store_true",
                        help="with --local: 4 ranks, 2 replicas x 2 FSDP2 shards; rank 3 fails (rank 1 is its replica "
                             "partner, rank 0 sees rank 2's failure in its own exchange)")
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(1)
    world = 4 if args.fsdp else 2
    dist.init_process_group("gloo", rank=args.rank, world_size=world, timeout=timedelta(seconds=args.timeout))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    outer = state = None
    if args.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from lightning_gradcomp import local_updates as sharded_local_updates

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        for layer in (model[0], model[2], model):
            fully_shard(layer, mesh=mesh["shard"])
        ddp = model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        outer = sharded_local_updates(model, optimizer, sync_every=args.local, compressor=args.compressor,
                                      min_compress_numel=args.min_compress_numel, mesh=mesh)
    elif args.local:
        ddp = model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        outer = local_updates(model, optimizer, sync_every=args.local, compressor=args.compressor,
                              min_compress_numel=args.min_compress_numel)
    else:
        ddp = nn.parallel.DistributedDataParallel(model)
        names = {id(p): n for n, p in model.named_parameters()}
        state = GradCompHookState(args.compressor, names, min_compress_numel=args.min_compress_numel,
                                  exchange_thread=args.thread)
        ddp.register_comm_hook(state, gradcomp_hook)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    began = None
    try:
        for step in range(8):
            if args.rank == world - 1 and step == 3:
                if args.fault == "exit":
                    os._exit(0)
                if args.fault == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(args.timeout * 6)
                os._exit(0)
            began = time.monotonic()
            optimizer.zero_grad()
            with exchange_failures(state):
                nn.functional.cross_entropy(ddp(torch.randn(16, 64)), torch.randint(0, 10, (16,))).backward()
            optimizer.step()
            if outer is not None:
                outer.step()
    except Exception as error:  # noqa: BLE001 - reported to the test
        message = " ".join(str(error).split())
        print(f"FAILED {time.monotonic() - began:.2f} {type(error).__name__} {message}", flush=True)
        os._exit(3)
    print("FINISHED", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
