r"""``gradcomp estimate``: will compression pay on my cluster? A prediction before any GPU-hour is spent.

    gradcomp estimate --model torchvision:resnet18 --batch-shape 32,3,32,32 --workers 8 \
        --bandwidth 1gbit --latency 50us --topology ring

It measures, on this machine, one forward + backward pass and SGD step of the model (median of ``--repeats``) and
every compressor's own cost on the model's gradients: the exchange of one step through the same engine as
the DDP hook, with ``min(N, 8)`` workers simulated in process, timed on one of them (its compression,
and its decoding of the aggregate; the engine's stopwatches, so the other simulated workers' work and
the in-process combining of their collectives, the simulation's own costs, are not counted). The
collectives of that step, priced by :mod:`lightning_gradcomp.metrics.netmodel` for ``N`` workers, give
the communication time; its bytes sent are those a run's ``step_stats`` reports (one definition,
:func:`~lightning_gradcomp.metrics.stats.collective_bytes_sent`: an all-to-all's own row is not sent).
The prediction assumes no overlap of communication with backward:

.. math::  T_{step} = T_{fwd+bwd+opt} + T_{compress+decode} + T_{comm}(N, B, α)

and DDP is the same sum with no compression cost at all: one all-reduce per DDP bucket (25 MB, the first
1 MB) of the gradients in fp32, and in bf16 and fp16 as PyTorch's hooks send them. It prints, for each
compressor, the predicted step time, the speed-up over DDP fp32 and bf16 (the honest baseline), bytes per
step, and a recommendation; ``--plot`` writes the predicted speed-up against bandwidth.

With ``--sync-every H`` (local updates: DiLoCo and its family, :mod:`lightning_gradcomp.local`) every
compressor, and ``none`` (DiLoCo itself), is also priced exchanging the outer gradient once every ``H``
optimizer steps: :math:`T_{step} = T_{fwd+bwd+opt} + (T_{compress+decode} + T_{comm}) / H` (the outer
gradient has the gradients' shapes, so the same measured exchange prices it; Streaming DiLoCo's fragments
spread the same bytes over the window and can hide them behind compute, which this does not count).

Where the prediction is weakest: communication that DDP overlaps with backward (its prediction is then
pessimistic on fast links), and gathered compressors at large ``N`` beyond the 8 simulated workers (their
collectives are re-priced for ``N``; each worker's decoding of ``N`` payloads is timed for 8).
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import statistics
import time
import typing
from dataclasses import dataclass, replace
from typing import Any, Optional, Union

import torch
import yaml
from torch import nn

from lightning_gradcomp.compressors import Compressor, NoCompression
from lightning_gradcomp.exchange.simulated import SimulatedExchange
from lightning_gradcomp.metrics.netmodel import TOPOLOGIES, Network
from lightning_gradcomp.metrics.stats import logged_bytes_sent
from lightning_gradcomp.tools.presets import preset_root

#: The compressors priced by default (one or two settings per family; ``--compressors all`` prices every
#: preset in ``configs/compressors``, see :func:`preset_root`), and what is used where those are not on disk.
DEFAULT_COMPRESSORS = {name: {"class_path": f"lightning_gradcomp.compressors.{cls}", "init_args": init_args}
                       for name, cls, init_args in (
    ("topk_50x", "TopK", {"density": 0.01}), ("topk_500x", "TopK", {"density": 0.001}),
    ("dgc_500x", "DGC", {"density": 0.001}), ("powersgd_r2", "PowerSGD", {"rank": 2}),
    ("qsgd_8bit", "QSGD", {"levels": 127}), ("efsignsgd", "EFSignSGD", {}), ("int8_allreduce", "Int8AllReduce", {}),
    ("fp4_allreduce", "FP4AllReduce", {}), ("sparseloco", "SparseLoCo", {}))}
MAX_SIMULATED = 8
_BANDWIDTH = re.compile(r"^\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*(gbit|mbit|kbit|gbps|mbps|kbps|gb|mb)?\s*$", re.I)
_LATENCY = re.compile(r"^\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*(us|µs|ms|s|ns)?\s*$", re.I)


def parse_bandwidth(text: str) -> float:
    """``"1gbit"``, ``"100mbit"``, ``"25gbps"``, ``"10"`` (Gbit/s) -> Gbit/s."""
    match = _BANDWIDTH.match(str(text))
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"`--bandwidth` must be a rate > 0 such as 100mbit, 1gbit, 25gbit; got {text!r}")
    unit = (match.group(2) or "gbit").lower()
    scale = {"g": 1.0, "m": 1e-3, "k": 1e-6}[unit[0]]
    return float(match.group(1)) * scale


def parse_latency(text: str) -> float:
    """``"50us"``, ``"0.2ms"``, ``"50"`` (µs) -> µs."""
    match = _LATENCY.match(str(text))
    if not match:
        raise ValueError(f"`--latency` must be a time >= 0 such as 50us, 0.5ms; got {text!r}")
    unit = (match.group(2) or "us").lower()
    return float(match.group(1)) * {"ns": 1e-3, "us": 1.0, "µs": 1.0, "ms": 1e3, "s": 1e6}[unit]


def build_model(spec: str, model_args: Optional[dict[str, Any]] = None) -> nn.Module:
    """A model from ``torchvision:<name>``, ``mlp:<in>,<hidden>...,<out>``, or the path of a class or a
    factory function (``package.module.Class``, ``package.module:make_model``; a LightningModule or any
    ``nn.Module``) called with ``model_args``. An argument annotated with a class and given as a JSON object
    is built from it (``--model litgpt.GPT --model-args '{"config": {"n_layer": 2, ...}}'`` builds
    ``GPT(Config(n_layer=2, ...))``)."""
    model_args = model_args or {}
    if spec.startswith("torchvision:"):
        import torchvision

        return torchvision.models.get_model(spec.split(":", 1)[1], **model_args)
    if spec.startswith("mlp:"):
        widths = [int(width) for width in spec[4:].split(",")]
        if len(widths) < 2:
            raise ValueError(f"`--model mlp:...` needs at least an input and an output width, got {spec!r}")
        layers: list[nn.Module] = []
        for i, (width_in, width_out) in enumerate(zip(widths, widths[1:])):
            layers += [nn.Linear(width_in, width_out)] + ([nn.ReLU()] if i < len(widths) - 2 else [])
        return nn.Sequential(*layers)
    module_name, _, class_name = spec.replace(":", ".").rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(f"`--model`: cannot import {spec!r} ({error}); allowed: torchvision:<name>, "
                         "mlp:<widths>, or a class path such as my_package.models.MyModule") from None
    model = cls(**built_arguments(cls, model_args))
    if not isinstance(model, nn.Module):
        raise ValueError(f"`--model` {spec!r} built a {type(model).__name__}, not a torch.nn.Module")
    return model


def built_arguments(factory: Any, arguments: dict[str, Any]) -> dict[str, Any]:
    """``arguments`` for ``factory``, each JSON object whose parameter is annotated with a class (a config
    dataclass) built into that class (recursively); the others as given."""
    try:
        hints = typing.get_type_hints(factory.__init__ if isinstance(factory, type) else factory)
    except Exception:  # noqa: BLE001 - unresolvable annotations: pass the arguments as they are
        return dict(arguments)
    built = {}
    for name, value in arguments.items():
        kind = hints.get(name)
        kind = next((option for option in typing.get_args(kind) if isinstance(option, type)), kind) \
            if typing.get_origin(kind) is Union else kind
        if isinstance(value, dict) and isinstance(kind, type) and kind not in (dict, object) and \
                not issubclass(kind, dict):
            value = kind(**built_arguments(kind, value))
        built[name] = value
    return built


def input_vocabulary(model: nn.Module, given: Optional[int] = None) -> int:
    """The range integer inputs are drawn from: ``given``, else the smallest vocabulary of the model's
    embeddings (a token id must be valid in each), else 10,000."""
    if given is not None:
        return given
    sizes = [module.num_embeddings for module in model.modules() if isinstance(module, (nn.Embedding, nn.EmbeddingBag))]
    return min(sizes) if sizes else 10000


def load_compressors(names: Optional[list[str]] = None) -> dict[str, Compressor]:
    """The presets to compare, by name (``configs/compressors/*.yaml`` of :func:`preset_root`, in a checkout
    or inside the installed package): ``names``, ``["all"]`` for every preset, or by default those of
    :data:`DEFAULT_COMPRESSORS`."""
    specs: dict[str, dict[str, Any]] = {}
    root = preset_root()
    if root is not None:
        specs = {path.stem: yaml.safe_load(path.read_text())
                 for path in sorted((root / "configs" / "compressors").glob("*.yaml"))}
    specs = specs or dict(DEFAULT_COMPRESSORS)
    specs.pop("none", None)
    specs.pop("fp16", None)
    if not names:
        names = [name for name in DEFAULT_COMPRESSORS if name in specs]
    elif names == ["all"]:
        names = list(specs)
    if names:
        unknown = sorted(set(names) - set(specs))
        if unknown:
            raise ValueError(f"`--compressors`: unknown preset(s) {unknown}; allowed: all, {', '.join(sorted(specs))}")
        specs = {name: specs[name] for name in names}
    built = {}
    for name, spec in specs.items():
        module, _, cls = spec["class_path"].rpartition(".")
        built[name] = getattr(importlib.import_module(module), cls)(**(spec.get("init_args") or {}))
    return built


def measure_compute(model: nn.Module, batch_shape: tuple[int, ...], input_dtype: torch.dtype, device: torch.device,
                    repeats: int, vocab: int = 10000) -> float:
    """Median seconds of one forward + backward pass and an SGD step on a random batch (loss: mean of the
    squared outputs): the step without communication, the "noop" bound."""
    model = model.to(device).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    if input_dtype.is_floating_point:
        batch = torch.randn(batch_shape, dtype=input_dtype, device=device)
    else:
        batch = torch.randint(0, vocab, batch_shape, device=device)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        output = model(batch)
        output = output[0] if isinstance(output, (tuple, list)) else output
        output = output.logits if hasattr(output, "logits") else output
        output.float().pow(2).mean().backward()
        optimizer.step()

    step()  # warm-up
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


@dataclass
class Exchange:
    """One step's exchange of a compressor on the model's gradients."""

    name: str
    compressor: Optional[Compressor]  # None: plain DDP (PyTorch's all-reduce, or its 16-bit hooks)
    seconds: float  # one worker's compression + decoding
    bytes_sent: float  # per worker, as ``step_stats`` counts them (metrics.stats.collective_bytes_sent)
    collectives: list[tuple[str, int]]  # (kind, input bytes), priced by the network model
    sync_every: int = 1  # local updates: one exchange every ``sync_every`` optimizer steps


#: DDP's bucket sizes: ``bucket_cap_mb`` (25 MB) and the first bucket's 1 MB.
DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES = 25 * 2**20, 2**20


def ddp_exchange(name: str, gradients: list[tuple[str, torch.Tensor]], itemsize: int, workers: int) -> Exchange:
    """Plain DDP among ``workers``: one all-reduce per bucket of ``itemsize``-byte values (fp32: 4; PyTorch's
    bf16 and fp16 hooks: 2), filled in reverse parameter order as DDP fills them, and no compression cost
    (the casts of the 16-bit hooks are one pass over the gradients, left out). Its bytes sent are counted
    as a rank's (:func:`~lightning_gradcomp.metrics.stats.logged_bytes_sent`)."""
    collectives: list[tuple[str, int]] = []
    bucket, cap = 0, DDP_FIRST_BUCKET_BYTES
    for _, grad in reversed(gradients):
        bucket += grad.numel() * itemsize
        if bucket >= cap:
            collectives.append(("all_reduce", bucket))
            bucket, cap = 0, DDP_BUCKET_BYTES
    if bucket:
        collectives.append(("all_reduce", bucket))
    return Exchange(name, None, 0.0, float(logged_bytes_sent(collectives, workers)), collectives)


def measure_exchange(name: str, compressor: Compressor, gradients: list[tuple[str, torch.Tensor]], workers: int,
                     repeats: int) -> Exchange:
    """Median over ``repeats`` steps of one worker's compression + decoding, among ``min(workers, 8)``
    simulated workers (the engine's stopwatches on worker 0, which also writes the aggregate)."""
    simulated = min(workers, MAX_SIMULATED)
    exchange = SimulatedExchange(compressor, simulated)
    engine = exchange.engines[0]
    engine.timed = True
    inputs = [[(param, grad.clone()) for param, grad in gradients] for _ in range(simulated)]

    def step() -> float:
        for worker in range(simulated):
            exchange.add_worker(worker, inputs[worker])
        exchange.finish_step()
        for clock in (engine.compress_clock, engine.decompress_clock):
            clock.close_step()
        return sum(sum(clock.read()) for clock in (engine.compress_clock, engine.decompress_clock))

    step()  # warm-up
    seconds = statistics.median(step() for _ in range(max(1, repeats)))
    stats = exchange.step_stats
    return Exchange(name, compressor, seconds, stats.bytes_sent, list(stats.collectives))


@dataclass
class Prediction:
    name: str
    step_s: float
    compress_s: float
    comm_s: float
    bytes_sent: float


def predict(exchanges: list[Exchange], compute_s: float, network: Network, workers: int) -> list[Prediction]:
    """Step time of each exchange on ``network`` with ``workers`` workers (no overlap assumed)."""
    predictions = []
    for exchange in exchanges:
        every = exchange.sync_every
        comm = network.step_time(exchange.collectives, workers) / every
        compress = exchange.seconds / every
        predictions.append(Prediction(exchange.name, compute_s + compress + comm, compress, comm,
                                      exchange.bytes_sent / every))
    return predictions


#: The plain-DDP rows every estimate prices (no compression cost), fp32 first, bf16 the honest baseline.
BASELINES = {"DDP fp32": 4, "DDP bf16": 2, "DDP fp16": 2}


def recommend(predictions: list[Prediction], dense: Prediction, half: Prediction) -> str:
    """``dense``: DDP fp32; ``half``: DDP bf16."""
    baselines = [p for p in predictions if p.name in BASELINES]
    best = min(predictions, key=lambda p: p.step_s)
    baseline = min(baselines, key=lambda p: p.step_s)
    if best.name in BASELINES or best.step_s > 0.9 * baseline.step_s:
        return (f"stay with {baseline.name}: no compressor is predicted to be more than 10% faster "
                f"(best: {best.name}, {baseline.step_s / best.step_s:.2f}x)")
    return (f"{best.name}: predicted {dense.step_s / best.step_s:.2f}x faster than DDP fp32 and "
            f"{half.step_s / best.step_s:.2f}x faster than DDP bf16 (check accuracy with a short run first)")


def _table(predictions: list[Prediction], dense: Prediction, half: Prediction, compute_s: float) -> str:
    header = ("| compressor | step (ms) | vs DDP fp32 | vs DDP bf16 | compress+decode (ms) | comm (ms) | "
              "MB / step |")
    lines = [header, "|---|---|---|---|---|---|---|"]
    lines.append(f"| (compute only) | {compute_s * 1e3:.1f} | | | | | |")
    for p in sorted(predictions, key=lambda p: p.step_s):
        lines.append(f"| {p.name} | {p.step_s * 1e3:.1f} | {dense.step_s / p.step_s:.2f}x | "
                     f"{half.step_s / p.step_s:.2f}x | {p.compress_s * 1e3:.1f} | {p.comm_s * 1e3:.1f} | "
                     f"{p.bytes_sent / 1e6:.3f} |")
    return "\n".join(lines)


def plot(path: str, exchanges: list[Exchange], compute_s: float, network: Network, workers: int) -> None:
    """Predicted speed-up over DDP fp32 against bandwidth (0.1 to 100 Gbit/s), one line per compressor."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("gradcomp estimate --plot needs matplotlib: pip install matplotlib") from None
    rates = [0.1 * 10 ** (i / 8) for i in range(25)]
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for exchange in exchanges[1:]:
        speedups = []
        for rate in rates:
            link = Network(rate, network.latency_us, network.topology, network.server_bandwidth_gbps)
            dense, this = predict([exchanges[0], exchange], compute_s, link, workers)
            speedups.append(dense.step_s / this.step_s)
        axes.plot(rates, speedups, label=exchange.name)
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xscale("log")
    axes.set_xlabel("link bandwidth (Gbit/s)")
    axes.set_ylabel("predicted speed-up over DDP fp32")  # the other baselines are lines of their own
    axes.set_title(f"{workers} workers, {network.topology}, {network.latency_us:g} µs")
    axes.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gradcomp estimate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True,
                        help="torchvision:<name>, mlp:<in>,<hidden>...,<out>, or the path of a class or factory "
                             "(package.module:make_model; nn.Module/LightningModule)")
    parser.add_argument("--model-args", type=json.loads, default={}, help="JSON keyword arguments of the model")
    parser.add_argument("--batch-shape", required=True, help="per-worker input shape, e.g. 32,3,224,224")
    parser.add_argument("--input-dtype", default="float32", choices=["float32", "float16", "bfloat16", "int64"])
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="int64 inputs are drawn from [0, vocab-size) (default: the model's smallest "
                             "nn.Embedding, else 10000)")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--bandwidth", default="10gbit", help="link rate: 100mbit, 1gbit, 25gbit... (default 10gbit)")
    parser.add_argument("--latency", default="50us", help="per-message latency: 50us, 0.5ms... (default 50us)")
    parser.add_argument("--topology", default="ring", choices=list(TOPOLOGIES))
    parser.add_argument("--compressors", nargs="+", default=None,
                        help=f"preset names, or 'all' (every preset); default: {' '.join(DEFAULT_COMPRESSORS)}")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--plot", default=None, help="write predicted speed-up against bandwidth to this PNG")
    parser.add_argument("--sync-every", type=int, default=None,
                        help="also price local updates: each compressor (and 'none', DiLoCo) exchanging the outer "
                             "gradient once every SYNC_EVERY optimizer steps")
    return parser


def run(argv: Optional[list[str]] = None) -> list[Prediction]:
    """Run the estimator (``argv`` replaces the command line after ``estimate``); returns the predictions."""
    args = build_parser().parse_args(argv)
    for flag, value, note in (("--workers", args.workers, ""), ("--repeats", args.repeats, ""),
                              ("--threads", args.threads, " (or left out: torch's default)"),
                              ("--sync-every", args.sync_every, "")):
        if value is not None and value < 1:
            raise ValueError(f"`{flag}` must be an integer >= 1{note}, got {value}")
    try:
        batch_shape = tuple(int(size) for size in args.batch_shape.split(","))
    except ValueError:
        raise ValueError(f"`--batch-shape` must be comma-separated sizes such as 32,3,224,224, got "
                         f"{args.batch_shape!r}") from None
    network = Network(parse_bandwidth(args.bandwidth), parse_latency(args.latency), args.topology)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    compressors = load_compressors(args.compressors)
    model = build_model(args.model, args.model_args)
    compute_s = measure_compute(model, batch_shape, getattr(torch, args.input_dtype), device, args.repeats,
                                input_vocabulary(model, args.vocab_size))
    gradients = [(name, p.grad.detach().clone()) for name, p in model.named_parameters() if p.grad is not None]
    numel = sum(grad.numel() for _, grad in gradients)
    exchanges = [ddp_exchange(name, gradients, itemsize, args.workers) for name, itemsize in BASELINES.items()]
    exchanges += [measure_exchange(name, compressor, gradients, args.workers, args.repeats)
                  for name, compressor in compressors.items()]
    if args.sync_every:
        local = list(exchanges[len(BASELINES):])
        if not any(exchange.compressor is not None and exchange.compressor.name == "none" for exchange in local):
            local.insert(0, measure_exchange("none", NoCompression(), gradients, args.workers, args.repeats))
        exchanges += [replace(exchange, name=f"{exchange.name}, every {args.sync_every} steps",
                              sync_every=args.sync_every) for exchange in local]
    predictions = predict(exchanges, compute_s, network, args.workers)
    dense, half = predictions[0], predictions[1]
    print(f"# {args.model}: {numel / 1e6:.2f}M parameters, batch {args.batch_shape} per worker, "
          f"{args.workers} workers, {network.bandwidth_gbps:g} Gbit/s {network.topology}, "
          f"{network.latency_us:g} µs; "
          f"measured on {device} ({torch.get_num_threads()} threads): forward+backward+SGD step {compute_s * 1e3:.1f} ms")
    print(_table(predictions, dense, half, compute_s))
    print(f"recommendation: {recommend(predictions, dense, half)}")
    if args.workers > MAX_SIMULATED:
        print(f"note: {MAX_SIMULATED} workers simulated; collectives re-priced for {args.workers}")
    if args.plot:
        plot(args.plot, exchanges, compute_s, network, args.workers)
        print(f"wrote {args.plot}")
    return predictions
