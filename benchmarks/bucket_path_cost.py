"""Per-tensor path against whole-bucket path: ResNet-18's backward with each compressor, on the CPU.

    python benchmarks/bucket_path_cost.py [--repeats 7] [--batch 16] [--size 64] [--compressors topk int8 ...]

For each registered compressor at its default setting, the median time of one ResNet-18 backward pass
(forward excluded) through a ``DistributedDataParallel`` of one gloo process whose communication hook is
the gradcomp hook, divided by the same backward with a hook that communicates nothing
(``no_communication_hook``): the multiple is what the compression costs on top of backward. Three ways:

* ``CPU default``: what a CPU run does today (host reads allowed; every built-in compresses per tensor);
* ``per tensor``: the accelerator code path (no host reads, fixed sizes) with one protocol per tensor
  (``ExchangeEngine(segmented=False)``, the reference the bucket-wise paths are tested against);
* ``whole bucket``: the accelerator code path with the bucket-wise path where the compressor has one
  (``Compressor.segment_alignment``), one protocol for all the bucket's compressed tensors.

The question it answers (issue 45, item 5): can the per-tensor path be the one-segment case of the
whole-bucket path? Where ``whole bucket`` costs within 10% of ``per tensor`` (or less), one path would do.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
import torchvision
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp.compressors.base import COMPRESSORS
from lightning_gradcomp.core.device import accelerator_path
from lightning_gradcomp.ddp.hook import GradCompHookState, gradcomp_hook, no_communication_hook


def backward_seconds(model: torch.nn.Module, hook_state: object, hook: object, batch: torch.Tensor,
                     labels: torch.Tensor, repeats: int) -> float:
    """The median wall time of one backward pass of ``model`` wrapped in DDP with ``hook`` (two warm-ups)."""
    ddp = DistributedDataParallel(model, bucket_cap_mb=25)
    ddp.register_comm_hook(hook_state, hook)
    times = []
    for index in range(repeats + 2):
        loss = torch.nn.functional.cross_entropy(ddp(batch), labels)
        start = time.perf_counter()
        loss.backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=64, help="image side in pixels")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--compressors", nargs="*", default=sorted(COMPRESSORS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    names = {id(p): name for name, p in model.named_parameters()}
    batch = torch.randn(args.batch, 3, args.size, args.size)
    labels = torch.randint(0, 10, (args.batch,))
    noop = backward_seconds(model, None, no_communication_hook, batch, labels, args.repeats)
    print(f"ResNet-18 ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters), batch {args.batch}x3x"
          f"{args.size}x{args.size}, {args.threads} threads, {platform.processor() or platform.machine()}, torch "
          f"{torch.__version__}; backward with the no-communication hook: {noop * 1e3:.1f} ms (median of "
          f"{args.repeats})\n")
    rows = []
    for name in args.compressors:
        figures = []
        for accelerated, segmented in ((False, True), (True, False), (True, True)):
            state = GradCompHookState(COMPRESSORS[name](), names, exchange_thread=False)
            state.engine.segmented = segmented
            if accelerated:
                with accelerator_path():
                    figures.append(backward_seconds(model, state, gradcomp_hook, batch, labels, args.repeats))
            else:
                figures.append(backward_seconds(model, state, gradcomp_hook, batch, labels, args.repeats))
            state.close()
        default, per_tensor, whole = figures
        rows.append((name, default / noop, per_tensor / noop, whole / noop, whole / per_tensor))
    print("| compressor | CPU default | per tensor | whole bucket | whole / per tensor |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, default, per_tensor, whole, ratio in rows:
        print(f"| {name} | {default:.2f}x | {per_tensor:.2f}x | {whole:.2f}x | {ratio:.2f} |")
    print("\n(multiples of the backward with the no-communication hook; medians)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
