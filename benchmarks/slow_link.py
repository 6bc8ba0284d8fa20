"""Step time of 2 real processes on a rate-limited link: plain DDP, PyTorch's hooks, and gradcomp.

    sudo python benchmarks/slow_link.py --rate 100mbit                   # the MLP
    sudo python benchmarks/slow_link.py --rate 100mbit --model resnet18  # ResNet-18, CIFAR-sized input
    sudo python benchmarks/slow_link.py --rate 1gbit
    python benchmarks/slow_link.py --no-netns                             # plain loopback, for comparison
    sudo python benchmarks/slow_link.py --rates 10mbit 100mbit 1gbit --plot step_time_vs_bandwidth.png

Both processes run inside a private network namespace whose loopback is shaped by ``tc tbf`` (see the
README's benchmark section), talk gloo over 127.0.0.1 with one CPU thread each, and train the same model
on synthetic batches: an MLP 784-2048-512-10 (2.66M parameters, batch 64 per process) or a ResNet-18
with torchvision's stem (11.2M parameters, CIFAR-sized 3x32x32 inputs, batch 32 per process). Each
method runs in its own pair of processes with DDP's default buckets, one after the other in the same
session, so a method that crashes is reported as such and the others still run: plain DDP, DDP with
PyTorch's ``bf16_compress_hook`` (the honest baseline), ``fp16_compress_hook``, PyTorch's
``powerSGD_hook`` (rank 2), gradcomp's PowerSGD (rank 2), Top-k and DGC at density 0.001, hard
threshold, QSGD, the int8 quantised all-reduce, DeMo (32 of every 64 x 64 DCT tile of its momentum), and
``noop_hook``, the bound where communication costs nothing. Printed: the median step time over
``--steps`` steps after warm-up, and the ratios to plain DDP, to bf16 DDP, to the bound and to PyTorch's
PowerSGD. ``--rates`` runs every method at each rate in turn (the namespace's ``tbf`` reshaped in
between; a table per rate), and ``--plot PATH`` draws the median step time against the bandwidth, one
line per method (needs matplotlib). With ``--rounds R`` every method runs R times in turn and its steps
are pooled, so that a slow spell of the machine (a shared VM's steal time) does not fall on one method alone.

``--local`` prints the local-updates table instead: DDP fp32 and bf16, the noop bound, ``alone`` (the bare
model with no DDP and no communication, the bound of local updates), per-step Top-k 0.1%, and DiLoCo
(fp32 and int8 outer gradients), SparseLoCo and Streaming DiLoCo at H = 10 and 50, each a bare model
with :func:`lightning_gradcomp.local_updates`; their time is per optimizer step averaged over whole
windows (synchronisations included), the median over windows, and the last column is the bytes handed
to torch.distributed per optimizer step against fp32 DDP's.
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
from pathlib import Path

NETNS = "gcnet"
#: ``alone``: the bare model, no DDP and no communication: the bound of local updates (``noop`` still pays
#: DDP's bucket copies).
METHODS = ["ddp", "bf16", "noop", "fp16", "torch_powersgd", "powersgd", "topk", "dgc", "threshold", "qsgd", "int8",
           "demo"]
#: Local updates, each at H = 10 and 50 (``<method>_h<H>``): DiLoCo with fp32 and with int8 outer gradients,
#: SparseLoCo (its compressor, outer SGD at lr 1), Streaming DiLoCo (2 fragments, merged 1 step late, α = 0.5,
#: fp4 outer gradients). Their time is per optimizer step, averaged over whole windows (synchronisation
#: included), the median over windows.
LOCAL_METHODS = [f"{name}_h{h}" for h in (10, 50) for name in ("diloco", "diloco8", "sparseloco", "streaming")]
#: The table of ``--local``: the per-step baselines and the local-update methods
LOCAL_TABLE = ["ddp", "bf16", "noop", "alone", "topk", *LOCAL_METHODS]
#: Variants: ``<method>_1b`` puts the whole model in one DDP bucket (PyTorch's PowerSGD runs there);
#: ``<gradcomp method>_thread`` exchanges on gradcomp's exchange thread (the default on CPUs is the hook).
VARIANTS = ["torch_powersgd_1b", "powersgd_1b", "powersgd_thread", "topk_thread", "dgc_thread"]
MODELS = {"mlp": "MLP 784-2048-512-10 (2.66M params), batch 64 per process",
          "resnet18": "ResNet-18 (torchvision, 11.2M params), 3x32x32 inputs, batch 32 per process",
          "transformer": "Transformer encoder, 8 layers of width 512, 8 heads (25.3M params), 4 sequences of 32 "
                         "per process"}


def build_model(name: str):
    """The benchmark's model and one synthetic batch shape."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if name == "resnet18":
        import torchvision

        return torchvision.models.resnet18(num_classes=10), (32, 3, 32, 32)
    if name == "transformer":
        return SequenceClassifier(), (4, 32, 64)
    return nn.Sequential(nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 512), nn.ReLU(), nn.Linear(512, 10)), (64, 784)


def SequenceClassifier(width: int = 512, layers: int = 8, heads: int = 8):  # noqa: N802 - a model factory
    """A transformer encoder over sequences of 64 features, mean-pooled into 10 classes (25.3M params)."""
    from torch import nn

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(64, width)
            self.layers = nn.ModuleList(nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                                                   batch_first=True) for _ in range(layers))
            self.head = nn.Linear(width, 10)

        def forward(self, x):
            x = self.embed(x)
            for layer in self.layers:
                x = layer(x)
            return self.head(x.mean(dim=1))

    return Classifier()


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


def worker(rank: int, port: int, steps: int, warmup: int, method: str, model_name: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks, powerSGD_hook

    from lightning_gradcomp.compressors import DGC, QSGD, DeMo, HardThreshold, Int8AllReduce, PowerSGD, TopK
    from _timing import ddp_step_times
    from lightning_gradcomp.ddp.hook import GradCompHookState, gradcomp_hook

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model, batch_shape = build_model(model_name)
    if method in LOCAL_METHODS:
        step_times = local_update_times(model, batch_shape, rank, method, steps)
        if rank == 0:
            Path(out).write_text(json.dumps({"times": step_times, "bytes_per_step": BYTES_PER_STEP[method]}))
        dist.destroy_process_group()
        return
    if method == "alone":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        generator = torch.Generator().manual_seed(rank)
        x = torch.randn(batch_shape, generator=generator)
        y = torch.randint(0, 10, (batch_shape[0],), generator=generator)
        step_times = ddp_step_times(model, optimizer, x, y, steps, warmup)
        if rank == 0:
            Path(out).write_text(json.dumps(step_times))
        dist.destroy_process_group()
        return
    threaded = method.endswith("_thread")
    one_bucket = method.endswith("_1b")
    method = method.removesuffix("_thread").removesuffix("_1b")
    ddp = nn.parallel.DistributedDataParallel(model, **({"bucket_cap_mb": 1000} if one_bucket else {}))
    names = {id(p): n for n, p in model.named_parameters()}
    k = 0.001 * sum(p.numel() for p in model.parameters())
    if method == "noop":
        ddp.register_comm_hook(None, debugging_hooks.noop_hook)
    elif method == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif method == "bf16":  # the honest baseline: DDP with PyTorch's own bf16 hook (half of fp32's bytes)
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif method == "torch_powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif method != "ddp":
        compressor = {"topk": TopK(0.001), "dgc": DGC(0.001, momentum=0.9), "powersgd": PowerSGD(rank=2),
                      "threshold": HardThreshold(1 / (2 * k ** 0.5)), "qsgd": QSGD(levels=16),
                      "int8": Int8AllReduce(), "demo": DeMo()}[method]
        ddp.register_comm_hook(GradCompHookState(compressor, names, exchange_thread=threaded or None), gradcomp_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch_shape, generator=generator), torch.randint(0, 10, (batch_shape[0],), generator=generator)
    step_times = ddp_step_times(ddp, optimizer, x, y, steps, warmup)
    if rank == 0:
        Path(out).write_text(json.dumps(step_times))
    dist.destroy_process_group()


def local_update_times(model, batch_shape: tuple, rank: int, method: str, steps: int) -> list[float]:
    """Seconds per optimizer step of a local-update method over whole windows (at least 2, about ``steps``
    optimizer steps in all, after one window of warm-up)."""
    import functools

    import torch

    from _timing import window_step_times
    from lightning_gradcomp.compressors import FP4AllReduce, Int8AllReduce, SparseLoCo
    from lightning_gradcomp import local_updates

    name, _, h = method.rpartition("_h")
    window = int(h)
    options = {"diloco": {"compressor": "none"}, "diloco8": {"compressor": Int8AllReduce()},
               "sparseloco": {"compressor": SparseLoCo(),
                              "outer_optimizer": functools.partial(torch.optim.SGD, lr=1.0)},
               "streaming": {"compressor": FP4AllReduce(), "fragments": 2, "delay": 1, "alpha": 0.5}}[name]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    handle = local_updates(model, optimizer, sync_every=window, **options)
    generator = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch_shape, generator=generator), torch.randint(0, 10, (batch_shape[0],), generator=generator)
    times = window_step_times(model, optimizer, x, y, handle.step, window, windows=max(2, -(-steps // window)))
    handle.loop.close()
    BYTES_PER_STEP[method] = handle.totals.bytes_sent / handle.loop.outer.optimizer_steps
    return times


#: bytes sent (the package's definition) per optimizer step by the local-update methods (written with the times)
BYTES_PER_STEP: dict[str, float] = {}


def run_method(method: str, args: argparse.Namespace, prefix: list[str]) -> tuple[list[float], str]:
    """Two worker processes for one method; their step times, or an empty list and why they failed."""
    out = Path(args.out).with_suffix(f".{method}.json")
    out.unlink(missing_ok=True)
    common = ["--port", str(_free_port()), "--steps", str(args.steps), "--warmup", str(args.warmup),
              "--out", str(out), "--methods", method, "--model", args.model]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    here = str(Path(__file__).resolve())
    procs = [subprocess.Popen([*prefix, sys.executable, here, "--worker", str(r), *common], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        outputs = [p.communicate(timeout=args.timeout)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        return [], f"timed out after {args.timeout} s"
    if any(p.returncode for p in procs) or not out.exists():
        lines = [line for text in outputs for line in text.splitlines() if line.strip()]
        known = ("doesn't match", "Connection closed", "Timed out", "terminate called")
        reason = next((line for line in lines if any(k in line for k in known)),
                      next((line for line in reversed(lines) if "Error" in line), lines[-1] if lines else ""))
        return [], f"crashed (exit codes {[p.returncode for p in procs]}): {reason.strip()[-200:]}"
    result = json.loads(out.read_text())
    if isinstance(result, dict):
        BYTES_PER_STEP[method] = result["bytes_per_step"]
        return result["times"], ""
    return result, ""


RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
              "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}


def rate_bits_per_second(rate: str) -> float:
    """A ``tc`` rate (``100mbit``, ``1gbit``, ``500kbps``: bytes; a bare number: bits) in bits per second."""
    text = rate.strip().lower()
    digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(digits):] or "bit"
    if unit not in RATE_UNITS or not digits:
        raise ValueError(f"not a tc rate: {rate!r} (e.g. 100mbit, 1gbit)")
    return float(digits) * RATE_UNITS[unit]


def measure(methods: list[str], args: argparse.Namespace, prefix: list[str], label: str) -> tuple[dict, dict]:
    """Every method ``--rounds`` times in turn on the link set up for ``prefix``: the median step time (s) of
    each method that ran, and why each of the others failed."""
    steps: dict[str, list[float]] = {method: [] for method in methods}
    failures: dict[str, str] = {}
    for round_index in range(args.rounds):
        for method in methods:
            if method in failures:
                continue
            times, failure = run_method(method, args, prefix)
            if times:
                steps[method].extend(times)
            else:
                failures[method] = failure
            shown = f"{statistics.median(times) * 1e3:.1f} ms" if times else failure
            print(f"{label}, round {round_index + 1}, {method}: {shown}", file=sys.stderr, flush=True)
    medians = {method: statistics.median(times) for method, times in steps.items() if times and method not in failures}
    return medians, failures


def print_rate_table(methods: list[str], medians: dict, failures: dict, link: str, args: argparse.Namespace) -> None:
    """The Markdown table of one link: step times and the ratios to DDP, DDP bf16, the bound and PowerSGD."""
    from _timing import print_table

    print(f"# 2 processes, gloo, 1 thread each, {link}; {MODELS[args.model]}; DDP's default buckets; "
          f"median of {args.steps} steps after {args.warmup} warm-up" +
          (f", pooled over {args.rounds} rounds that run every method in turn" if args.rounds > 1 else ""))
    powersgd_reference = "torch_powersgd" if "torch_powersgd" in medians else "torch_powersgd_1b"

    def ratio(method: str, reference: str, inverse: bool = False) -> str:
        if method not in medians or reference not in medians:
            return "-"
        value = medians[reference] / medians[method] if inverse else medians[method] / medians[reference]
        return f"{value:.2f}"

    model_bytes = 4 * sum(p.numel() for p in build_model(args.model)[0].parameters())  # fp32 DDP per step

    def fewer_bytes(method: str) -> str:
        if method in BYTES_PER_STEP:
            return f"{model_bytes / BYTES_PER_STEP[method]:,.0f}x"
        return {"ddp": "1x", "bf16": "2x", "alone": "∞"}.get(method, "-")

    rows = []
    for method in methods:
        if method in failures:
            rows.append([method, failures[method], "-", "-", "-", "-", "-"])
            continue
        rows.append([method, f"{medians[method] * 1e3:.1f}", ratio(method, "ddp", inverse=True) + "x",
                     ratio(method, "bf16", inverse=True) + "x", ratio(method, "noop"),
                     ratio(method, powersgd_reference), fewer_bytes(method)])
    print_table(["method", "step (ms)", "speed-up vs DDP", "speed-up vs DDP bf16", "time / noop bound",
                 f"time / {powersgd_reference}", "fewer bytes / step than DDP fp32"], rows)
    if "alone" in medians:
        print("time / alone (no DDP, no communication): " + ", ".join(
            f"{method} {ratio(method, 'alone')}" for method in methods
            if method in LOCAL_METHODS and method in medians))


#: how each method is drawn in ``--plot``: the baselines in grey and black, the bound dotted
LABELS = {"ddp": "DDP fp32", "bf16": "DDP bf16 hook", "fp16": "DDP fp16 hook", "noop": "noop_hook (bound)",
          "alone": "alone (no DDP, bound)", "torch_powersgd": "PyTorch powerSGD_hook",
          "torch_powersgd_1b": "PyTorch powerSGD_hook, 1 bucket"}
BASELINE_STYLES = {"ddp": {"color": "black", "linestyle": "-", "marker": "o"},
                   "bf16": {"color": "0.45", "linestyle": "--", "marker": "s"},
                   "fp16": {"color": "0.65", "linestyle": "--", "marker": "D"},
                   "noop": {"color": "black", "linestyle": ":", "marker": "x"},
                   "alone": {"color": "0.3", "linestyle": ":", "marker": "+"}}


def _bandwidth_label(mbits: float) -> str:
    """``20 Mbit/s``, ``1 Gbit/s``."""
    return f"{mbits / 1e3:g} Gbit/s" if mbits >= 1e3 else f"{mbits:g} Mbit/s"


def plot(results: dict[str, dict[str, float]], methods: list[str], args: argparse.Namespace, path: str) -> None:
    """Median step time (ms, log) against the link's bandwidth (Mbit/s, log), one line per method;
    ``results`` maps each rate to its methods' median step times in seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rates = sorted(results, key=rate_bits_per_second)
    mbits = [rate_bits_per_second(rate) / 1e6 for rate in rates]
    figure, axis = plt.subplots(figsize=(9.5, 5.5))
    palette = [colour for index, colour in enumerate(plt.get_cmap("tab10").colors) if index != 7]  # 7: grey
    colours = iter(palette * 3)
    markers = iter("v^<>PX*hpd" * 3)
    for method in methods:
        points = [(x, results[rate][method] * 1e3) for x, rate in zip(mbits, rates) if method in results[rate]]
        if not points:
            continue
        style = BASELINE_STYLES.get(method) or {"color": next(colours), "linestyle": "-", "marker": next(markers)}
        axis.plot([x for x, _ in points], [ms for _, ms in points], label=LABELS.get(method, f"gradcomp {method}"),
                  linewidth=2.2 if method in BASELINE_STYLES else 1.4, markersize=6, **style)
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xticks(mbits, [_bandwidth_label(x) for x in mbits])
    axis.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    axis.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}"))
    axis.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    axis.set_xlabel("link bandwidth (tc tbf on the loopback; log)")
    axis.set_ylabel("median step time (ms, log)")
    rounds = f", {args.rounds} rounds pooled" if args.rounds > 1 else ""
    axis.set_title(f"2 gloo processes, 1 CPU thread each: {MODELS[args.model]}\n"
                   f"median of {args.steps} steps after {args.warmup} warm-up{rounds}", fontsize=10)
    axis.grid(True, which="major", alpha=0.3)
    axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"\nplot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="100mbit", help="the link's rate (tc units: 100mbit, 1gbit)")
    parser.add_argument("--rates", nargs="+", default=None,
                        help="several rates, one after the other in one invocation (overrides --rate): a table each")
    parser.add_argument("--no-netns", action="store_true", help="plain loopback, no shaping")
    parser.add_argument("--model", default="mlp", choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per method")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every method in turn this many times and pool the steps (evens out drift)")
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS + VARIANTS + LOCAL_METHODS + ["alone"])
    parser.add_argument("--local", action="store_true",
                        help=f"the local-updates table: {', '.join(LOCAL_TABLE)} (overrides --methods)")
    parser.add_argument("--plot", default=None,
                        help="write the median step time against the bandwidth of every rate to this PNG (matplotlib)")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="/tmp/gradcomp_slow_link.json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.port, args.steps, args.warmup, args.methods[0], args.model, args.out)
        return
    rates = args.rates or [args.rate]
    if args.plot and args.no_netns:
        parser.error("--plot draws against the shaped rates: it needs the network namespace (drop --no-netns)")
    for rate in rates:
        try:
            rate_bits_per_second(rate)
        except ValueError as err:
            parser.error(str(err))
    methods = list(dict.fromkeys(LOCAL_TABLE if args.local else args.methods))
    results: dict[str, dict[str, float]] = {}
    for index, rate in enumerate(rates):
        prefix: list[str] = []
        if not args.no_netns:
            ensure_netns(rate)
            prefix = ["ip", "netns", "exec", NETNS]
        link = "loopback (unshaped)" if args.no_netns else f"{rate} (tc tbf in netns {NETNS})"
        medians, failures = measure(methods, args, prefix, link)
        results[rate] = medians
        print("" if index == 0 else "\n", end="")
        print_rate_table(methods, medians, failures, link, args)
        sys.stdout.flush()
        if args.no_netns:
            break  # one unshaped table: the rates do not apply
    if args.plot:
        plot(results, methods, args, args.plot)


if __name__ == "__main__":
    main()
