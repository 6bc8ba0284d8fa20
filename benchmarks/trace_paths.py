"""Which of the package's files one exchange passes through, measured by tracing the calls: one DDP bucket
(``register()``, its second backward), one FSDP2 shard (``register_fsdp()`` on a 1 x 1 mesh, its second
backward) and one fault-tolerant outer step (``local_updates(..., fault_tolerance=...)`` with a lighthouse in
this process, the optimizer step that synchronises). One process each, gloo on the CPU.

    python benchmarks/trace_paths.py                      # this checkout's package
    PYTHONPATH=/path/to/other/checkout python benchmarks/trace_paths.py   # another version, side by side

Prints, per path, the package files whose functions ran (relative to the package) and their number. Only the
public entry points are used, so any version of the package since 0.2.0 runs it.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

import lightning_gradcomp

PACKAGE = Path(lightning_gradcomp.__file__).resolve().parent


@contextmanager
def traced(files: set[str]) -> Iterator[None]:
    """Record into ``files`` every package file a Python function of which is called meanwhile (any thread)."""
    def profile(frame, event, arg):  # noqa: ANN001 - sys.setprofile's signature
        if event == "call":
            path = frame.f_code.co_filename
            if path.startswith(str(PACKAGE)):
                files.add(str(Path(path).relative_to(PACKAGE)))
    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(None)
        threading.setprofile(None)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, backward: Callable[[torch.Tensor], None]) -> None:
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    backward(nn.functional.cross_entropy(model(x), y))
    optimizer.step()
    optimizer.zero_grad()


def _second_backward(model: nn.Module, optimizer: torch.optim.Optimizer, handle) -> set[str]:  # noqa: ANN001
    """The files the second step's backward passes through (the first builds DDP's buckets), then ``handle`` closed."""
    _step(model, optimizer, lambda loss: loss.backward())
    files: set[str] = set()

    def backward(loss: torch.Tensor) -> None:
        with traced(files):
            loss.backward()
    _step(model, optimizer, backward)
    handle.close()
    return files


def ddp_bucket() -> set[str]:
    model = nn.parallel.DistributedDataParallel(_model())
    handle = lightning_gradcomp.register(model, "topk", min_compress_numel=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle.bind(optimizer)
    return _second_backward(model, optimizer, handle)


def fsdp_shard() -> set[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    model = _model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    handle = lightning_gradcomp.register_fsdp(model, mesh, "topk", min_compress_numel=0)
    return _second_backward(model, torch.optim.SGD(model.parameters(), lr=0.1), handle)


def fault_tolerant_outer_step() -> set[str]:
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=500, heartbeat_timeout_ms=1000)
    try:
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        handle = lightning_gradcomp.local_updates(
            model, optimizer, 2, "int8", min_compress_numel=0,
            fault_tolerance=lightning_gradcomp.FaultTolerance(lighthouse=lighthouse.address(), replica_id="group0",
                                                              timeout=20, quorum_timeout=30, connect_timeout=10))
        for _ in range(2):  # the first window (its synchronisation joins the quorum)
            _step(model, optimizer, lambda loss: loss.backward())
        _step(model, optimizer, lambda loss: loss.backward())
        files: set[str] = set()
        x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
        nn.functional.cross_entropy(model(x), y).backward()
        with traced(files):
            optimizer.step()  # the second window's synchronisation
        optimizer.zero_grad()
        handle.close()
        return files
    finally:
        lighthouse.shutdown()


PATHS = {"ddp bucket": ddp_bucket, "fsdp shard": fsdp_shard, "fault-tolerant outer step": fault_tolerant_outer_step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", nargs="*", default=list(PATHS), choices=list(PATHS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    print(f"package: {PACKAGE}")
    for name in args.paths:
        files = PATHS[name]()
        print(f"\n{name}: {len(files)} files")
        for path in sorted(files):
            print(f"  {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
