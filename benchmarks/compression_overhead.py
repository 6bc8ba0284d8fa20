"""Compression overhead: compress + decompress per step, as a multiple of one memory pass.

    python benchmarks/compression_overhead.py [--sizes 1e6 1e7 2.5e7] [--repeats 5]

For each compressor and tensor size: median time of ``compress`` and of ``decompress`` (into a dense
tensor) over ``repeats`` runs, and their sum divided by the median time of one copy of the tensor,
all measured in the same run. Bytes are the payload's, from the compressor's own wire format.
"""

from __future__ import annotations

import argparse
import platform

import torch

from _timing import median_seconds, memory_pass_seconds, print_table
from lightning_gradcomp.compressors import DGC, FP16, QSGD, CompressContext, HardThreshold, RandomK, TopK


def compressors(n: int, x: torch.Tensor) -> dict[str, object]:
    k = max(1, round(0.001 * n))
    threshold = float(torch.topk(x.abs(), k).values.min())
    return {
        "fp16": FP16(),
        "topk 0.001": TopK(0.001),
        "randomk 0.001": RandomK(0.001),
        "threshold (k=0.001d)": HardThreshold(threshold),
        "dgc 0.001": DGC(0.001),
        "qsgd s=16": QSGD(levels=16),
        "qsgd s=4": QSGD(levels=4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e7, 2.5e7])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    print(f"# compress + decompress overhead, device {args.device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {platform.machine()}")
    for size in args.sizes:
        n = int(size)
        x = torch.randn(n, device=args.device)
        unit = memory_pass_seconds(x, args.repeats)
        rows = []
        for name, compressor in compressors(n, x).items():
            state: dict = {}
            ctx = CompressContext("w", step=1, state=state)
            payload = compressor.compress(x, ctx)
            out = torch.empty_like(x)

            def decompress() -> None:
                out.zero_()
                compressor.accumulate(payload, out)

            t_c = median_seconds(lambda: compressor.compress(x, CompressContext("w", step=1, state=state)), args.repeats)
            t_d = median_seconds(decompress, args.repeats)
            nbytes = sum(p.numel() * p.element_size() for p in payload.parts)
            rows.append([name, f"{t_c * 1e3:.1f}", f"{t_d * 1e3:.1f}", f"{(t_c + t_d) / unit:.1f}x",
                         f"{4 * n / nbytes:.1f}x"])
        print(f"\n{n / 1e6:g}M elements (one copy: {unit * 1e3:.2f} ms)\n")
        print_table(["compressor", "compress (ms)", "decompress (ms)", "total / copy", "ratio"], rows)


if __name__ == "__main__":
    main()
