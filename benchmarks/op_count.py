"""ATen operations per bucket: one worker's compress + exchange + decode of a bucket of P tensors.

    python benchmarks/op_count.py [--tensors 1 10 100] [--workers 2] [--cpu-path]
    python benchmarks/op_count.py --model torchvision:resnet50     # one training step of a real model

Counts non-view ATen calls (views, slices, reshapes and detaches launch no kernel and are not counted)
made by worker 0's exchange engine for one bucket of P tensors of 128 x 128 elements, two workers (or
``--workers``), in process (tests/_op_count.py; the collectives themselves are the driver's and not counted). By default
along the accelerator path, the code a GPU runs (no host reads; compressors that can compress a whole
bucket at once do so); ``--cpu-path`` counts the CPU path. On a GPU each op is at least one kernel
launch, 5-10 µs of host time: the issue's budget is 40 + 3·P. The last column: the bytes of indices,
masks and plans the engine keeps per bucket layout (GPU memory for as long as the buckets last), per
gradient element, for 4 tensors of 300 x 301 and 8 workers. The two traffic columns: the bytes those ops
read and write per gradient element, estimated from their arguments (``OpCounter.traffic``): on a GPU,
where element-wise kernels are bound by memory bandwidth, the cost beside the launches (one fp32 copy of
the gradient is 8 bytes per element).

With ``--model`` (``torchvision:<name>``, ``mlp:<widths>`` or a class path, as ``gradcomp estimate``
takes), one step of that model's parameters in DDP's buckets (25 MB, the first 1 MB; tensors under 1024
elements sent dense): the ops of the step, per compressed tensor, the step's budget (the sum of
40 + 3·P over its buckets) and the per-tensor path's count beside it.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_gradcomp.compressors import COMPRESSORS  # noqa: E402
from lightning_gradcomp.tools.estimate import build_model  # noqa: E402
from tests._op_count import (  # noqa: E402
    bound,
    count_bucket_ops,
    count_step_ops,
    ddp_buckets,
    layout_constant_bytes,
)

#: The compressors of the issue's budget, then the others.
ORDER = ["topk", "dgc", "qsgd", "terngrad", "signsgd", "efsignsgd", "int8", "int4", "fp8", "fp4", "powersgd",
         "fp16", "bf16", "none", "randomk", "threshold"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, nargs="+", default=[1, 10, 100])
    parser.add_argument("--workers", type=int, default=2, help="simulated workers (the count should not depend on it)")
    parser.add_argument("--cpu-path", action="store_true", help="count the CPU path instead")
    parser.add_argument("--model", help="count one step of this model's DDP buckets instead")
    args = parser.parse_args()
    names = [name for name in ORDER if name in COMPRESSORS] + sorted(set(COMPRESSORS) - set(ORDER))
    if args.model:
        model_table(args.model, names, args.workers)
        return
    print(f"| compressor (default settings) | {' | '.join(f'P={count}' for count in args.tensors)} | "
          f"whole bucket at once | kept per layout (bytes per element) | traffic, P={TRAFFIC_TENSORS} "
          f"(bytes per element) | traffic, one 1024 x 1024 tensor |")
    print("|---|" + "---|" * (len(args.tensors) + 4))
    for name in names:
        cells = []
        for count in args.tensors:
            total = sum(count_bucket_ops(COMPRESSORS[name], count, accelerator=not args.cpu_path,
                                         workers=args.workers).ops.values())
            cells.append(f"{total}" + (" **over**" if total > bound(count) else ""))
        segmented = COMPRESSORS[name]().segment_alignment(torch.device("cuda")) is not None
        kept = (f"{layout_constant_bytes(COMPRESSORS[name], 4, shape=(300, 301), workers=8) / (4 * 300 * 301):.3f}"
                if segmented else "-")
        traffic = [traffic_per_element(COMPRESSORS[name], tensors, shape, not args.cpu_path, args.workers)
                   for tensors, shape in ((TRAFFIC_TENSORS, (128, 128)), (1, (1024, 1024)))]
        print(f"| {name} | {' | '.join(cells)} | {'yes' if segmented else 'no'} | {kept} | "
              f"{traffic[0]:.0f} | {traffic[1]:.0f} |")
    print(f"\nbudget: {', '.join(f'P={count}: {bound(count)}' for count in args.tensors)}; kept per layout: "
          "the indices, masks and plans the engine keeps for a bucket of 4 tensors of 300 x 301 and 8 workers "
          "(GPU memory for as long as the buckets last); traffic: the bytes the ops read and write per gradient "
          "element, estimated (tests/_op_count.py: a GPU's memory traffic; one fp32 copy is 8)")


#: Tensors of 128 x 128 in the bucket whose memory traffic is estimated.
TRAFFIC_TENSORS = 10


def traffic_per_element(make, tensors: int, shape: tuple[int, int], accelerator: bool, workers: int) -> float:
    """Estimated bytes read and written per gradient element by one worker's exchange of a bucket."""
    counter = count_bucket_ops(make, tensors, shape=shape, accelerator=accelerator, workers=workers)
    return sum(counter.traffic.values()) / (tensors * math.prod(shape))


def model_table(spec: str, names: list[str], workers: int) -> None:
    """Ops of one step of ``spec``'s buckets per compressor, whole-bucket path and per-tensor path."""
    buckets = ddp_buckets(build_model(spec))
    compressed = [sum(1 for shape in bucket.values() if math.prod(shape) >= 1024) for bucket in buckets]
    budget = sum(bound(count) for count in compressed)
    print(f"# {spec}: {sum(len(bucket) for bucket in buckets)} parameters in {len(buckets)} DDP buckets, "
          f"{sum(compressed)} of at least 1024 elements; budget {budget} (the sum of 40 + 3·P over buckets)")
    print("| compressor (default settings) | ops per step | per compressed tensor | per-tensor path |")
    print("|---|---|---|---|")
    for name in names:
        ops = [sum(count_step_ops(COMPRESSORS[name], buckets, steps=2, accelerator=accelerator,
                                  workers=workers).ops.values()) for accelerator in (True, False)]
        over = " **over**" if ops[0] > budget else ""
        print(f"| {name} | {ops[0]}{over} | {ops[0] / sum(compressed):.1f} | {ops[1]} |")


if __name__ == "__main__":
    main()
