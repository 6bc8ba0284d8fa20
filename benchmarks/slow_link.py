"""Step time of 2 real processes on a rate-limited link: plain DDP, PyTorch's hooks, and gradcomp.

    sudo python benchmarks/slow_link.py --rate 100mbit     # creates the network namespace if needed
    sudo python benchmarks/slow_link.py --rate 1gbit
    python benchmarks/slow_link.py --no-netns               # plain loopback, for comparison

Both processes run inside a private network namespace whose loopback is shaped by ``tc tbf`` (see the
README's benchmark section), talk gloo over 127.0.0.1, and train the same MLP (about 2.6M parameters,
10.5 MB of fp32 gradients) on synthetic batches. Every method runs in the same session: plain DDP,
``fp16_compress_hook``, PowerSGD (rank 2), gradcomp's Top-k, DGC, hard threshold and QSGD, and
``noop_hook``, the bound where communication costs nothing. Printed: the median step time over
``--steps`` steps after warm-up, the time per epoch of Fashion-MNIST at that rate (60,000 images,
batch 64 per process), and the ratios to plain DDP and to the bound.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

NETNS = "gcnet"
METHODS = ["ddp", "noop", "fp16", "powersgd", "topk", "dgc", "threshold", "qsgd"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_netns(rate: str) -> None:
    """A namespace ``gcnet`` whose loopback is rate-limited to ``rate`` (root only)."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        raise SystemExit("slow_link: needs `ip` and `tc` (apt-get install iproute2) and root")
    existing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    if NETNS not in existing.split():
        subprocess.run(["ip", "netns", "add", NETNS], check=True)
        subprocess.run(["ip", "netns", "exec", NETNS, "ip", "link", "set", "lo", "up"], check=True)
    subprocess.run(["ip", "netns", "exec", NETNS, "tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", rate,
                    "burst", "256kb", "latency", "100ms"], check=True)


def worker(rank: int, port: int, steps: int, warmup: int, methods: list[str], out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks, powerSGD_hook

    from lightning_gradcomp.compressors import DGC, QSGD, HardThreshold, TopK
    from lightning_gradcomp.hook import GradCompHookState, gradcomp_hook

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    times: dict[str, list[float]] = {}
    for method in methods:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 512), nn.ReLU(), nn.Linear(512, 10))
        kwargs = {"bucket_cap_mb": 64} if method == "powersgd" else {}
        ddp = nn.parallel.DistributedDataParallel(model, **kwargs)
        names = {id(p): n for n, p in model.named_parameters()}
        k = 0.001 * sum(p.numel() for p in model.parameters())
        if method == "noop":
            ddp.register_comm_hook(None, debugging_hooks.noop_hook)
        elif method == "fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif method == "powersgd":
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2)
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        elif method != "ddp":
            compressor = {"topk": TopK(0.001), "dgc": DGC(0.001, momentum=0.9),
                          "threshold": HardThreshold(1 / (2 * k ** 0.5)), "qsgd": QSGD(levels=16)}[method]
            ddp.register_comm_hook(GradCompHookState(compressor, names), gradcomp_hook)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
        generator = torch.Generator().manual_seed(rank)
        x, y = torch.randn(64, 784, generator=generator), torch.randint(0, 10, (64,), generator=generator)
        step_times = []
        for step in range(warmup + steps):
            dist.barrier()
            began = time.perf_counter()
            optimizer.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()
            if step >= warmup:
                step_times.append(time.perf_counter() - began)
        times[method] = step_times
        del ddp
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--no-netns", action="store_true", help="plain loopback, no shaping")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="/tmp/gradcomp_slow_link.json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.port, args.steps, args.warmup, args.methods, args.out)
        return
    prefix: list[str] = []
    if not args.no_netns:
        ensure_netns(args.rate)
        prefix = ["ip", "netns", "exec", NETNS]
    port = _free_port()
    here = str(Path(__file__).resolve())
    common = ["--port", str(port), "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", args.out,
              "--methods", *args.methods]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([*prefix, sys.executable, here, "--worker", str(r), *common], env=env) for r in range(2)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"slow_link: a worker failed ({codes})")
    times = json.loads(Path(args.out).read_text())
    medians = {m: statistics.median(t) for m, t in times.items()}
    steps_per_epoch = 60_000 // (2 * 64)
    link = "loopback (unshaped)" if args.no_netns else f"{args.rate} (tc tbf in netns {NETNS})"
    print(f"# 2 processes, gloo, {link}; MLP 784-2048-512-10 (2.66M params), batch 64 per process; "
          f"median of {args.steps} steps after {args.warmup} warm-up")
    from _timing import print_table

    rows = [[m, f"{medians[m] * 1e3:.1f}", f"{medians[m] * steps_per_epoch:.1f}",
             f"{medians['ddp'] / medians[m]:.2f}x" if "ddp" in medians else "-",
             f"{medians[m] / medians['noop']:.2f}" if "noop" in medians else "-"] for m in medians]
    print_table(["method", "step (ms)", "epoch (s)", "speed-up vs DDP", "time / noop bound"], rows)


if __name__ == "__main__":
    main()
