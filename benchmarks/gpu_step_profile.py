"""One GPU: what the communication hook adds to a training step — step time, kernel launches, host syncs.

    python benchmarks/gpu_step_profile.py [--models resnet50 transformer] [--steps 20]

A DDP process group of one rank (NCCL) on one GPU, so the collectives cost almost nothing and what
remains is the hook's own work: for each model, plain DDP (fp32 all-reduce), DDP with torch's
``bf16_compress_hook`` (the honest baseline: gradients cross the network in bf16), torch's PowerSGD
hook, and the gradcomp hook with several compressors, exchange thread on and off. Per row: the median
step time (forward, backward, optimizer step; CUDA synchronised at the end of each step), its ratio to
the bf16 DDP row, the CUDA kernels launched per step (``torch.profiler``: runtime launch calls) and the
host synchronisations per step (``torch.cuda.set_sync_debug_mode("warn")`` warnings, and the profiler's
stream, device and event synchronisations). ResNet-50: torchvision, batch 64 of 224x224, channels
last, bf16 autocast. Transformer: 6 encoder layers, d=512, 8 heads, sequence 256, batch 32, bf16
autocast.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

import lightning_gradcomp
from _timing import print_table
from lightning_gradcomp.compressors import BF16, DGC, PowerSGD, QSGD, Int8AllReduce, TopK

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 8192, width: int = 512, layers: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 8, 4 * width, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


def model_and_batch(name: str) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    torch.manual_seed(0)
    if name == "resnet50":
        import torchvision

        model = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
        x = torch.randn(64, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (64,), device="cuda")
        return model, lambda m: nn.functional.cross_entropy(m(x), y)
    model = TinyTransformer().cuda()
    tokens = torch.randint(0, 8192, (32, 256), device="cuda")
    return model, lambda m: nn.functional.cross_entropy(m(tokens).flatten(0, 1), tokens.flatten())


def rows_to_run() -> list[tuple[str, Optional[Callable[[nn.parallel.DistributedDataParallel], object]]]]:
    def torch_hook(hook, state=None):  # noqa: ANN001, ANN202
        return lambda ddp: ddp.register_comm_hook(state, hook)

    def gradcomp(compressor, thread):  # noqa: ANN001, ANN202
        return lambda ddp: lightning_gradcomp.register(ddp, compressor, exchange_thread=thread)

    return [
        ("DDP fp32", None),
        ("DDP + torch bf16 hook", torch_hook(default_hooks.bf16_compress_hook)),
        ("torch PowerSGD r=4", lambda ddp: ddp.register_comm_hook(
            powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2),
            powerSGD_hook.powerSGD_hook)),
        ("gradcomp bf16, thread", gradcomp(BF16(), True)),
        ("gradcomp topk 0.01, thread", gradcomp(TopK(0.01), True)),
        ("gradcomp topk 0.01, hook", gradcomp(TopK(0.01), False)),
        ("gradcomp dgc 0.001, thread", gradcomp(DGC(0.001, momentum=0.0), True)),
        ("gradcomp qsgd s=16, thread", gradcomp(QSGD(levels=16), True)),
        ("gradcomp int8 all-reduce, thread", gradcomp(Int8AllReduce(), True)),
        ("gradcomp powersgd r=4, thread", gradcomp(PowerSGD(rank=4), True)),
        ("gradcomp powersgd r=4, hook", gradcomp(PowerSGD(rank=4), False)),
    ]


def measure(name: str, install, steps: int) -> tuple[float, float, float, float]:  # noqa: ANN001
    """(median step seconds, kernel launches per step, sync-debug warnings per step, profiler syncs per step)."""
    model, loss_of = model_and_batch(name)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[0])
    handle = install(ddp) if install is not None else None
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_of(ddp)
        loss.backward()
        optimizer.step()

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    profiled = 3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(profiled):
            step()
        torch.cuda.synchronize()
    events = profiler.key_averages()
    launches = sum(event.count for event in events if event.key in LAUNCHES) / profiled
    profiled_syncs = sum(event.count for event in events if event.key in SYNCS) / profiled
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(profiled):
            step()
    torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    debug_syncs = sum("synchroniz" in str(w.message) for w in caught) / profiled
    if handle is not None and hasattr(handle, "close"):
        handle.close()
    return statistics.median(times), launches, debug_syncs, profiled_syncs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["resnet50", "transformer"])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    print(f"# one rank (NCCL) on {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    for name in args.models:
        results = []
        for label, install in rows_to_run():
            results.append((label, *measure(name, install, args.steps)))
        baseline = next(seconds for label, seconds, *_ in results if label == "DDP + torch bf16 hook")
        rows = [[label, f"{seconds * 1e3:.2f}", f"{seconds / baseline:.2f}", f"{launches:.0f}", f"{debug:.0f}",
                 f"{profiled:.0f}"] for label, seconds, launches, debug, profiled in results]
        print(f"\n{name}: median of {args.steps} steps\n")
        print_table(["hook", "step (ms)", "÷ bf16 DDP", "kernel launches / step", "host syncs / step (debug mode)",
                     "stream/device/event syncs / step (profiler)"], rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
