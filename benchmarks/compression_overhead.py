"""Compression overhead: one worker's whole per-tensor exchange, as a multiple of one memory pass.

    python benchmarks/compression_overhead.py [--sizes 1e6 1e7 2.5e7] [--repeats 7] [--threads 1]
    python benchmarks/compression_overhead.py --device cuda --sizes 1e6 1e7 2.5e7 1e8   # the GPU mode

For each compressor at its usual setting and each tensor size, the median time of everything one worker
does for one gradient tensor in a step: the finiteness check, error feedback or the compressor's own
state (DGC's momentum and velocity), selection or quantisation, packing, decoding the aggregate and
writing it into the gradient (the DDP bucket), run through the same engine as the DDP hook, with an
in-process driver for one worker (the collective is an in-process copy of the payload; no network).
The time is divided by the median time of one copy of the tensor (a "pass"), measured in the same run,
so the figures compare across machines; "÷ copy bandwidth" is its inverse, the exchange's throughput as
a fraction of the device's copy bandwidth (1 would be as fast as one copy). On a GPU the times are wall
times of the whole call (kernel launches included), synchronised before and after. Bytes and ratio are
those handed to the collective. The column
"compress alone" is ``compressor.compress`` by itself, in passes: selection and payload for the
sparsifiers (with DGC's state update), quantise + pack for QSGD; "-" for multi-round methods (PowerSGD).
"""

from __future__ import annotations

import argparse
import platform
from typing import Optional

import torch

from _timing import median_seconds, memory_pass_seconds, print_table
from lightning_gradcomp.compressors import (
    BF16,
    DGC,
    FP16,
    QSGD,
    EFSignSGD,
    FP8AllReduce,
    HardThreshold,
    Int4AllReduce,
    Int8AllReduce,
    NoCompression,
    PowerSGD,
    RandomK,
    SignSGD,
    TernGrad,
    TopK,
)
from lightning_gradcomp.compressors.base import CompressContext, Compressor
from lightning_gradcomp.exchange.drivers import InProcessDriver
from lightning_gradcomp.exchange.engine import Entry, ExchangeEngine
from lightning_gradcomp.exchange.pipeline import resolve_error_feedback, WorkerPipeline


def compressors(x: torch.Tensor) -> dict[str, object]:
    k = max(1, round(0.001 * x.numel()))
    threshold = float(torch.topk(x.abs(), k).values.min())  # a λ that sends about k elements of this tensor
    candidates = {
        "fp16": lambda: FP16(),
        "topk 0.001": lambda: TopK(0.001),
        "topk 0.001, exact topk": lambda: TopK(0.001, selection="exact"),
        "topk 0.01": lambda: TopK(0.01),
        "randomk 0.001": lambda: RandomK(0.001),
        "threshold (k≈0.001d)": lambda: HardThreshold(threshold),
        "dgc 0.001": lambda: DGC(0.001),
        "qsgd s=16": lambda: QSGD(levels=16),
        "qsgd s=4": lambda: QSGD(levels=4),
        "powersgd r=2": lambda: PowerSGD(rank=2),
        "none": lambda: NoCompression(),
        "bf16": lambda: BF16(),
        "terngrad": lambda: TernGrad(),
        "signsgd (Signum)": lambda: SignSGD(momentum=0.9),
        "efsignsgd": lambda: EFSignSGD(),
        "int8 all-reduce": lambda: Int8AllReduce(),
        "fp8 all-reduce": lambda: FP8AllReduce(),
        "int4 all-reduce": lambda: Int4AllReduce(),
    }
    built = {}
    for name, make in candidates.items():
        try:
            built[name] = make()
        except TypeError:  # an option this version does not have (e.g. Top-k's selection before 0.2)
            continue
    return built


def exchange_seconds(compressor, source: torch.Tensor, shape: tuple[int, ...], repeats: int) -> tuple[float, int]:
    """Median time of one worker's exchange of one tensor, and the bytes handed to the collective."""
    pipeline = WorkerPipeline(compressor, resolve_error_feedback(compressor, None))
    engine = ExchangeEngine(pipeline, min_compress_numel=1024)
    driver = InProcessDriver(1)
    bucket = torch.empty_like(source)
    step = [0]

    def one_step() -> None:
        driver.start(0, engine.bucket([Entry("w", shape, bucket, bucket)], step[0], 0, 1))
        driver.finish()
        step[0] += 1

    times = []
    for repeat in range(repeats + 2):  # two warm-up steps (first residual, warm-started state)
        bucket.copy_(source)
        seconds = median_seconds(one_step, repeats=1, warmup=0)
        if repeat >= 2:
            times.append(seconds)
    bytes_sent = driver.counters[0].bytes_sent // (repeats + 2)
    return sorted(times)[len(times) // 2], bytes_sent


def compress_seconds(compressor, source: torch.Tensor, repeats: int) -> Optional[float]:
    """Median time of ``compressor.compress`` alone on ``source`` (state kept between calls), or None for
    a compressor that overrides the exchange instead."""
    if type(compressor).compress is Compressor.compress:
        return None
    ctx = CompressContext("w", shape=tuple(source.shape))
    step = [0]

    def one() -> None:
        ctx.step, ctx.finite = step[0], True
        compressor.compress(source, ctx)
        step[0] += 1

    return median_seconds(one, repeats=repeats, warmup=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e7, 2.5e7])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (the slow-link benchmark uses 1)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# one worker's per-tensor exchange, device {args.device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {platform.machine()}")
    for size in args.sizes:
        n = int(size)
        shape = (1000, n // 1000) if n % 1000 == 0 else (n,)
        generator = torch.Generator(device=args.device).manual_seed(0)
        x = torch.randn(n, device=args.device, generator=generator)
        unit = memory_pass_seconds(x, args.repeats)
        rows = []
        for name, compressor in compressors(x).items():
            seconds, nbytes = exchange_seconds(compressor, x, shape, args.repeats)
            alone = compress_seconds(compressor, x, args.repeats)
            rows.append([name, f"{seconds * 1e3:.2f}", f"{seconds / unit:.1f}", f"{unit / seconds:.2f}",
                         "-" if alone is None else f"{alone / unit:.1f}", f"{nbytes:,}", f"{4 * n / max(nbytes, 1):.0f}x"])
        print(f"\n{n / 1e6:g}M elements as {shape} (one copy: {unit * 1e3:.2f} ms)\n")
        print_table(["compressor", "exchange (ms)", "passes (÷ copy)", "÷ copy bandwidth", "compress alone (÷ copy)",
                     "bytes handed over",
                     "ratio"], rows)


if __name__ == "__main__":
    main()
