"""Selection cost per step: block maxima (the default), sampled DGC threshold, exact Top-k, hard threshold.

    python benchmarks/selection_cost.py [--sizes 1e6 1e7 2.5e7] [--density 0.001] [--repeats 7]

Prints, per tensor size, the median time of each selection (|p| included) and its multiple of one
memory pass over the tensor (a copy), all measured in the same run. The tensor is Gaussian; the
threshold is the one that selects ``k`` of its elements.
"""

from __future__ import annotations

import argparse
import platform

import torch

from _timing import median_seconds, memory_pass_seconds, print_table
from lightning_gradcomp.compressors.selection import block_topk, exact_topk, sampled_topk, threshold_indices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e7, 2.5e7])
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (the slow-link benchmark uses 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# selection cost, density {args.density}, device {args.device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    rows = []
    for size in args.sizes:
        n = int(size)
        x = torch.randn(n, device=args.device)
        k = max(1, round(args.density * n))
        threshold = float(torch.topk(x.abs(), k).values.min())  # a λ that sends k elements on this tensor
        generator = torch.Generator(device=args.device).manual_seed(0)
        unit = memory_pass_seconds(x, args.repeats)
        timings = {
            "blocks (default)": median_seconds(lambda: block_topk(x, k), args.repeats),
            "sampled (DGC)": median_seconds(lambda: sampled_topk(x.abs(), k, generator), args.repeats),
            "exact topk": median_seconds(lambda: exact_topk(x.abs(), k), args.repeats),
            "hard threshold (pruned)": median_seconds(lambda: threshold_indices(x, threshold), args.repeats),
            "hard threshold (nonzero)": median_seconds(lambda: torch.nonzero(x.abs() >= threshold), args.repeats),
        }
        rows.append([f"{n / 1e6:g}M", f"{unit * 1e3:.2f}"] + [
            f"{t * 1e3:.1f} ms ({t / unit:.1f}x)" for t in timings.values()
        ] + [f"{timings['exact topk'] / timings['blocks (default)']:.1f}x"])
    print_table(["elements", "copy (ms)", *timings.keys(), "exact / blocks"], rows)


if __name__ == "__main__":
    main()
