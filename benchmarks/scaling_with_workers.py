"""How the cost of each compressor grows with the number of workers N.

    python benchmarks/scaling_with_workers.py [--model mlp|resnet18] [--workers 2 4 8 16]
                                              [--bandwidth-gbps 10] [--latency-us 50]

For every preset in ``configs/compressors/`` and every N: one step of N simulated workers (random
Gaussian gradients with the model's parameter shapes, DDP's default ``min_compress_numel``), the bytes
each worker hands to torch.distributed (what a real rank would hand over: the simulation counts them
from the same engine), and the communication time the network model (``lightning_gradcomp.metrics.netmodel``)
estimates for those collectives on a ring and on a parameter server. Dense fp32 and fp16 all-reduce
are the reference rows. The last column is the number of workers from which a compressor's ring time
exceeds dense fp32's: every worker of a gathered compressor receives N - 1 payloads, while an
all-reduce (and the quantised all-reduce) moves about 2(N-1)/N of a tensor whatever N. It is found by
re-pricing the collectives of the largest simulated N for N up to 65536 (valid where a worker's bytes
do not depend on N, which the table shows).
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import torch
import yaml

from _timing import print_table
from lightning_gradcomp.compressors import FP16, NoCompression
from lightning_gradcomp.metrics.netmodel import Network
from lightning_gradcomp.simulation import SimulatedExchange

PRESETS = Path(__file__).resolve().parents[1] / "configs" / "compressors"


def shapes(model: str) -> list[tuple[str, tuple[int, ...]]]:
    if model == "resnet18":
        import torchvision

        net = torchvision.models.resnet18(num_classes=10)
    else:
        net = torch.nn.Sequential(torch.nn.Linear(784, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512),
                                  torch.nn.ReLU(), torch.nn.Linear(512, 10))
    return [(name, tuple(p.shape)) for name, p in net.named_parameters()]


def presets() -> dict[str, object]:
    built = {"dense fp32 (DDP)": NoCompression(), "dense fp16": FP16()}
    for path in sorted(PRESETS.glob("*.yaml")):
        spec = yaml.safe_load(path.read_text())
        module, _, name = spec["class_path"].rpartition(".")
        compressor = getattr(importlib.import_module(module), name)(**(spec.get("init_args") or {}))
        if path.stem not in ("none", "fp16"):
            built[path.stem] = compressor
    return built


def one_step(compressor, workers: int, layout: list[tuple[str, tuple[int, ...]]]) -> tuple[int, list]:
    """Bytes one worker hands over in one step, and its collectives ``(kind, bytes)``."""
    exchange = SimulatedExchange(compressor, workers)
    generator = torch.Generator().manual_seed(0)
    for worker in range(workers):
        exchange.add_worker(worker, [(name, torch.randn(shape, generator=generator)) for name, shape in layout])
    exchange.finish_step()
    return exchange.step_stats.bytes_sent, exchange.step_stats.collectives


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mlp", choices=["mlp", "resnet18"])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--bandwidth-gbps", type=float, default=10.0)
    parser.add_argument("--latency-us", type=float, default=50.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    layout = shapes(args.model)
    ring = Network(args.bandwidth_gbps, args.latency_us, "ring")
    server = Network(args.bandwidth_gbps, args.latency_us, "parameter_server")
    numel = sum(torch.Size(shape).numel() for _, shape in layout)
    print(f"# {args.model} ({numel / 1e6:.2f}M parameters), one step, {args.bandwidth_gbps:g} Gbit/s, "
          f"{args.latency_us:g} us; bytes: what one worker hands to torch.distributed (MB); times: ms")
    rows, dense_logs = [], None
    for label, compressor in presets().items():
        row = [label]
        largest = None
        for workers in args.workers:
            nbytes, log = one_step(compressor, workers, layout)
            largest = log
            row.append(f"{nbytes / 1e6:.2f} / {ring.step_time(log, workers) * 1e3:.1f} / "
                       f"{server.step_time(log, workers) * 1e3:.1f}")
        if dense_logs is None:
            dense_logs = largest
        if any(kind == "all_to_all" for kind, _ in largest):
            row.append("never (flat in N)")
        else:
            row.append(_break_even(largest, dense_logs, ring, label == "dense fp32 (DDP)"))
        rows.append(row)
    print_table(["compressor", *[f"N={n}: MB / ring / PS" for n in args.workers], "slower than DDP from N ="],
                rows)


def _break_even(log: list, dense: list, network: Network, is_dense: bool) -> str:
    if is_dense:
        return "-"
    workers = 2
    while workers <= 65536:
        if network.step_time(log, workers) >= network.step_time(dense, workers):
            return str(workers)
        workers *= 2
    return "> 65536"


if __name__ == "__main__":
    main()
