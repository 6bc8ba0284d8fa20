"""Per-tensor path against whole-bucket path: ResNet-18's backward with each compressor, on the CPU.

    python benchmarks/bucket_path_cost.py [--repeats 7] [--batch 16] [--size 64] [--compressors topk int8 ...]

For each registered compressor at its default setting, the median time of one ResNet-18 backward pass
(forward excluded) through a ``DistributedDataParallel`` of one gloo process whose communication hook is
the gradcomp hook, divided by the same backward with a hook that communicates nothing
(``no_communication_hook``): the multiple is what the compression costs on top of backward. Three ways:

* ``CPU default``: what a CPU run does today (host reads allowed; every built-in compresses per tensor);
* ``per tensor``: the accelerator code path (no host reads, fixed sizes) with one protocol per tensor
  (``ExchangeEngine(segmented=False)``, the reference the bucket-wise paths are tested against);
* ``one segment each``: the bucket-wise path taken one tensor at a time (each compressed tensor a
  one-segment protocol): the per-tensor path *as* the one-segment case of the whole-bucket path;
* ``whole bucket``: the accelerator code path with the bucket-wise path where the compressor has one
  (``Compressor.segment_alignment``), one protocol for all the bucket's compressed tensors.

The question it answers (issue 45, item 5): can the per-tensor path become the one-segment case of the
whole-bucket path? ``one segment each / CPU default`` is what a CPU run would pay after such a merge (the
bucket-wise code reads nothing on the host, where the per-tensor code may on a CPU);
``one segment each / per tensor`` the same on the accelerator path.
"""

from __future__ import annotations

import argparse
import contextlib
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
from lightning_gradcomp.exchange.engine import ExchangeEngine


class OneSegmentEach(ExchangeEngine):
    """The engine with the bucket-wise path taken one tensor at a time: each compressed tensor its own
    one-segment protocol (what the per-tensor path would cost if it were the whole-bucket path's one-segment
    case); the rounds of all of them are still merged into one collective per kind."""

    def _units(self, entries, contexts, device):  # type: ignore[no-untyped-def]
        compressed = [index for index, entry in enumerate(entries) if self._compressed(entry)]
        dense = [index for index in range(len(entries)) if index not in compressed]
        units = []
        for group in ([dense] if dense else []) + [[index] for index in compressed]:
            for protocol, covered in super()._units([entries[i] for i in group], [contexts[i] for i in group], device):
                units.append((protocol, [group[i] for i in covered]))
        return units


def backward_seconds(model: torch.nn.Module, hooks: list[tuple[object, object, bool]], batch: torch.Tensor,
                     labels: torch.Tensor, repeats: int) -> list[float]:
    """The median wall time of one backward pass of ``model`` wrapped in DDP with each ``(state, hook,
    accelerator path)`` of ``hooks``, the ways interleaved (one pass of each per round, two warm-up rounds),
    so that a slower stretch of the machine falls on every way alike."""
    wrappers = []
    for state, hook, _ in hooks:
        ddp = DistributedDataParallel(model, bucket_cap_mb=25)
        ddp.register_comm_hook(state, hook)
        wrappers.append(ddp)
    times: list[list[float]] = [[] for _ in hooks]
    for _ in range(repeats + 2):
        for ddp, (_, _, accelerated), kept in zip(wrappers, hooks, times):
            with accelerator_path() if accelerated else contextlib.nullcontext():
                loss = torch.nn.functional.cross_entropy(ddp(batch), labels)
                start = time.perf_counter()
                loss.backward()
                kept.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    return [statistics.median(kept[2:]) for kept in times]


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
    print(f"ResNet-18 ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters), batch {args.batch}x3x"
          f"{args.size}x{args.size}, {args.threads} threads, {platform.processor() or platform.machine()}, torch "
          f"{torch.__version__}; medians of {args.repeats} rounds, the ways interleaved\n")
    rows = []
    for name in args.compressors:
        hooks: list[tuple[object, object, bool]] = [(None, no_communication_hook, False)]
        for accelerated, segmented, one_each in ((False, True, False), (True, False, False), (True, True, True),
                                                 (True, True, False)):
            state = GradCompHookState(COMPRESSORS[name](), names, exchange_thread=False)
            state.engine.segmented = segmented
            if one_each:
                state.engine.__class__ = OneSegmentEach
            hooks.append((state, gradcomp_hook, accelerated))
        noop, default, per_tensor, one_each, whole = backward_seconds(model, hooks, batch, labels, args.repeats)
        for state, _, _ in hooks[1:]:
            state.close()
        rows.append((name, noop, default / noop, per_tensor / noop, one_each / noop, whole / noop,
                     one_each / default, one_each / per_tensor, whole / per_tensor))
    print("| compressor | no-communication backward | CPU default | per tensor | one segment each | whole bucket | "
          "one segment each / CPU default | one segment each / per tensor | whole / per tensor |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, noop, default, per_tensor, one_each, whole, merged, one_ratio, ratio in rows:
        print(f"| {name} | {noop * 1e3:.1f} ms | {default:.2f}x | {per_tensor:.2f}x | {one_each:.2f}x | {whole:.2f}x "
              f"| {merged:.2f} | {one_ratio:.2f} | {ratio:.2f} |")
    print("\n(multiples of the backward with the no-communication hook, measured in the same rounds)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
