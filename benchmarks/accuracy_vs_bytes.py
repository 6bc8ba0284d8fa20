"""Accuracy (or validation loss) against bytes sent, per compressor and setting, side by side with no compression.

    python benchmarks/accuracy_vs_bytes.py [--epochs 3] [--workers 4] [--seeds 0 1 2] [--suite grid|adaptive|local|demo] [--plot out.png]
    python benchmarks/accuracy_vs_bytes.py --task text [--corpus DIR] [--steps 400] --suite local|demo

``--task fashion`` (default): Fashion-MNIST (offline: ``apt-get install dataset-fashion-mnist``), a
784-256-128-10 MLP, ``workers`` workers simulated on one device (Harris 2020, §3.2) with batch 64 per
worker, SGD. ``--task text``: a byte-level transformer (2 blocks of width 128, context 64, about 0.47M
parameters) on every ``*.txt`` file under ``--corpus`` (default: Debian's Python documentation,
``apt-get install python3.11-doc``), batch 8 windows per worker, AdamW (lr 1e-3, betas 0.9/0.95),
``--steps`` optimizer steps; it reports the validation loss in nats per byte (lower is better).

Suites. ``grid`` (fashion) is Harris 2020's table: Top-k and DGC at 50x/500x/5000x, QSGD with 64/16/4
levels, hard threshold (λ = 1/(2√k) for k = 0.1% of the model per step), uncompressed; and the families
added since: PowerSGD (rank 2 and 4), signSGD with majority vote, EF-signSGD, TernGrad, the int8 / int4 /
fp8 quantised all-reduce. ``adaptive`` (fashion) is paper Tirupati et al.'s comparison: uncompressed,
constant 8-bit, and the adaptive schedule. ``local`` compares local updates at equal optimizer steps
(``workers`` replicas that really diverge, each its own optimizer): DDP (every step, uncompressed),
per-step Top-k 0.1%, DiLoCo (uncompressed and int8 outer gradients), SparseLoCo (outer SGD lr 1) and
Streaming DiLoCo (2 fragments, τ = 1, α = 0.5, fp4), at H = 10 and 50; the inner optimizer is the task's
(SGD with momentum 0.9 on fashion, AdamW on text). ``demo`` compares DeMo (SGD without momentum at
AdamW's learning rate, weight decay as AdamW's) with AdamW DDP, and with Top-k (AdamW, error feedback)
and DGC (momentum 0.9, its SGD at the task's SGD learning rate) at the density that sends DeMo's bytes
per step; and DeMo as the outer compressor of local updates (H = 10, ``sign=False``, decay 0.95, outer
SGD at lr 1: SparseLoCo's recipe with DeMo's DCT tiles).

Every setting runs once per seed (``--seeds``; the seed drives the initialisation, the data order and
the compressors' generators) and the table reports the mean ± sample standard deviation over seeds of
the final test accuracy (fashion) or validation loss (text), with the bytes each worker handed to the
collectives over training, the measured compression ratio against fp32 DDP at every optimizer step and
average density, wall time, and the communication time estimated on a 10 Gbit/s parameter server
(Harris 2020's setting). ``--plot PATH`` (needs matplotlib) draws each row's final score against the MB
each worker sent (log scale), the spread over the seeds as error bars, one colour and marker per method,
each point labelled with its setting, the uncompressed row's mean dashed.
"""

from __future__ import annotations

import argparse
import copy
import functools
import math
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Optional

import lightning as L
import torch

from _timing import print_table
from lightning_gradcomp.callbacks import AdaptiveCompression, CompressionMonitor
from lightning_gradcomp.compressors import (
    DGC,
    DeMo,
    QSGD,
    EFSignSGD,
    FP4AllReduce,
    FP8AllReduce,
    HardThreshold,
    Int4AllReduce,
    Int8AllReduce,
    NoCompression,
    PowerSGD,
    SignSGD,
    SparseLoCo,
    TernGrad,
    TopK,
)
from lightning_gradcomp.local import LocalUpdates
from lightning_gradcomp.examples.text import DEBIAN_PYTHON_DOCS, ByteTransformer, TextCorpusDataModule
from lightning_gradcomp.examples.vision import FashionMNISTDataModule, ImageClassifier
from lightning_gradcomp.core.tensors import itemsize
from lightning_gradcomp.metrics.netmodel import Network
from lightning_gradcomp.simulation import GradCompSimStrategy

NETWORK = Network(bandwidth_gbps=10, latency_us=50, topology="parameter_server")
PARAMS = 784 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10
MIN_COMPRESS_NUMEL = 1024
#: the base optimizer of each task (AdamW's learning rate is also DeMo's) and the SGD of DGC
OPTIMIZERS = {"fashion": {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.0},
              "text": {"optimizer": "adamw", "lr": 1e-3, "weight_decay": 0.0}}
ADAMW_LR = OPTIMIZERS["text"]["lr"]
SGD_LR = {"fashion": OPTIMIZERS["fashion"]["lr"], "text": 0.1}


@dataclass
class Run:
    """One row: a method, its setting, and what it changes from the task's defaults."""

    method: str
    setting: str
    compressor: object
    callbacks: list = field(default_factory=list)
    local_updates: object = None
    optimizer: Optional[dict] = None  # None: the task's base optimizer


def grid(task: str) -> list[Run]:
    k = 0.001 * PARAMS
    runs = [Run("none", "-", NoCompression())]
    for ratio, density in (("50x", 0.01), ("500x", 0.001), ("5000x", 0.0001)):
        runs.append(Run("topk", ratio, TopK(density)))
    for ratio, density in (("50x", 0.01), ("500x", 0.001), ("5000x", 0.0001)):
        runs.append(Run("dgc", ratio, DGC(density, momentum=0.9)))
    for levels in (64, 16, 4):
        runs.append(Run("qsgd", f"s={levels}", QSGD(levels=levels)))
    runs.append(Run("threshold", "λ=1/(2√k), k=0.1%", HardThreshold(1 / (2 * math.sqrt(k)))))
    for rank in (2, 4):
        runs.append(Run("powersgd", f"rank {rank}", PowerSGD(rank=rank)))
    runs += [Run("signsgd", "majority vote", SignSGD()), Run("efsignsgd", "-", EFSignSGD()),
             Run("terngrad", "-", TernGrad()), Run("int8", "block 256", Int8AllReduce()),
             Run("int4", "block 256", Int4AllReduce()), Run("fp8", "e4m3", FP8AllReduce())]
    return runs


def adaptive(task: str) -> list[Run]:
    schedule = AdaptiveCompression(monitor="val_acc", levels=[{"bits": 4}, {"bits": 8}, {"bits": 16}, None],
                                   thresholds=[0.85, 0.87, 0.89], loss_delta=0.005,
                                   patience=3, escape_epochs=1)
    return [Run("none", "-", NoCompression()), Run("qsgd", "constant 8-bit", QSGD(bits=8)),
            Run("qsgd", "adaptive 4/8/16/32-bit", QSGD(bits=4), [schedule])]


def local(task: str) -> list[Run]:
    """Local updates against per-step exchanges, at equal optimizer steps."""
    outer_sgd = functools.partial(torch.optim.SGD, lr=1.0)
    runs = [Run("none", "every step", NoCompression()), Run("topk", "0.1%, every step", TopK(0.001))]
    for h in (10, 50):
        runs += [Run("diloco", f"H={h}", NoCompression(), local_updates=LocalUpdates(h)),
                 Run("diloco int8", f"H={h}", Int8AllReduce(), local_updates=LocalUpdates(h)),
                 Run("sparseloco", f"H={h}", SparseLoCo(), local_updates=LocalUpdates(h, outer_optimizer=outer_sgd)),
                 Run("streaming", f"H={h}, F=2, τ=1, α=0.5", FP4AllReduce(),
                     local_updates=LocalUpdates(h, fragments=2, delay=1, alpha=0.5))]
    return runs


def equal_bytes_density(model: torch.nn.Module, compressor) -> float:
    """The Top-k density whose payload (fp32 value + int32 index per coordinate) has the bytes of
    ``compressor``'s, over the tensors that are compressed."""
    sent, numel = 0, 0
    for parameter in model.parameters():
        if parameter.numel() >= MIN_COMPRESS_NUMEL:
            rounds = compressor.wire_format(tuple(parameter.shape), torch.float32)
            sent += sum(count * itemsize(dtype) for requests in rounds for dtype, count in requests)
            numel += parameter.numel()
    return sent / (8 * numel)


def demo(task: str) -> list[Run]:
    """DeMo against AdamW DDP, and Top-k and DGC at DeMo's bytes per step."""
    density = equal_bytes_density(build_model(task, OPTIMIZERS[task]), DeMo())
    adamw = {"optimizer": "adamw", "lr": ADAMW_LR, "weight_decay": 0.0}
    sign_sgd = {"optimizer": "sgd", "lr": ADAMW_LR, "momentum": 0.0, "weight_decay": 0.0}
    plain_sgd = {"optimizer": "sgd", "lr": SGD_LR[task], "momentum": 0.0, "weight_decay": 0.0}
    return [Run("none", "AdamW", NoCompression(), optimizer=adamw),
            Run("demo", "k=32 of 64x64, SGD", DeMo(), optimizer=sign_sgd),
            Run("demo", "bf16 values", DeMo(value_dtype="bfloat16"), optimizer=sign_sgd),
            Run("topk", f"density {density:.4f}, AdamW", TopK(density), optimizer=adamw),
            Run("dgc", f"density {density:.4f}", DGC(density, momentum=0.9), optimizer=plain_sgd),
            Run("demo outer", "H=10, decay 0.95, outer SGD lr 1", DeMo(decay=0.95, sign=False), optimizer=adamw,
                local_updates=LocalUpdates(10, outer_optimizer=functools.partial(torch.optim.SGD, lr=1.0)))]


def build_model(task: str, optimizer: dict) -> L.LightningModule:
    if task == "text":
        return ByteTransformer(**optimizer)
    return ImageClassifier(backbone="fashion_mlp", **optimizer)


def build_data(task: str, args: argparse.Namespace, seed: int) -> L.LightningDataModule:
    if task == "text":
        return TextCorpusDataModule(args.corpus, batch_size=8 * args.workers, seed=seed)
    return FashionMNISTDataModule(data_dir=args.data_dir, batch_size=64 * args.workers)


def run(spec: Run, args: argparse.Namespace, seed: int) -> dict:
    L.seed_everything(seed, verbose=False)
    optimizer = dict(spec.optimizer or OPTIMIZERS[args.task])
    if spec.optimizer is None and isinstance(spec.compressor, DGC) and spec.local_updates is None:
        optimizer.update(optimizer="sgd", lr=SGD_LR[args.task], momentum=0.0)  # DGC holds the momentum
    model = build_model(args.task, optimizer)
    data = build_data(args.task, args, seed)
    strategy = GradCompSimStrategy(workers=args.workers, compressor=copy.deepcopy(spec.compressor),
                                   min_compress_numel=MIN_COMPRESS_NUMEL, seed=seed, print_summary=False,
                                   local_updates=spec.local_updates)
    monitor = CompressionMonitor(network=NETWORK, log_every_n_steps=1)
    length = {"max_steps": args.steps, "max_epochs": -1} if args.task == "text" else {"max_epochs": args.epochs}
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[monitor, *copy.deepcopy(spec.callbacks)], num_sanity_val_steps=0,
                        limit_val_batches=0 if args.task == "text" else None, **length)
    comm = []
    original = monitor.on_train_batch_end

    def record(trainer_, module, outputs, batch, batch_idx):
        comm.append(NETWORK.step_time(trainer_.strategy.step_stats.collectives, args.workers))
        original(trainer_, module, outputs, batch, batch_idx)

    monitor.on_train_batch_end = record
    began = time.perf_counter()
    trainer.fit(model, datamodule=data)
    wall = time.perf_counter() - began
    totals = strategy.hook_state.totals
    if args.task == "text":
        trainer.limit_val_batches = 1.0
        score = trainer.validate(model, datamodule=data, verbose=False)[0]["val_loss"]
    else:
        score = trainer.test(model, datamodule=data, verbose=False)[0]["test_acc"] * 100
    # against dense fp32 DDP exchanging at every optimizer step (local updates exchange every H steps)
    per_step_dense = totals.bytes_dense / max(totals.steps, 1) * trainer.global_step
    return {"score": score, "bytes": totals.bytes_sent, "ratio": per_step_dense / totals.bytes_sent,
            "density": totals.density, "wall": wall, "comm": sum(comm)}


#: the colours of the methods in ``--plot``, saturated and told apart on white (no grey: the baseline's)
PALETTE = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
           "tab:cyan", "navy", "darkgoldenrod", "teal", "maroon", "darkolivegreen", "indigo"]
#: the marker of each method in ``--plot`` (its colour: one per method, in the order of the table)
MARKERS = {"none": "*", "topk": "o", "dgc": "s", "qsgd": "^", "threshold": "D", "powersgd": "P", "signsgd": "v",
           "efsignsgd": "<", "terngrad": ">", "int8": "X", "int4": "x", "fp8": "h", "diloco": "o", "diloco int8": "X",
           "sparseloco": "s", "streaming": "^", "demo": "D", "demo outer": "P"}


def point_label(method: str, setting: str) -> str:
    """A point's label: the method and the first part of its setting (``topk 50x``, ``diloco H=10``)."""
    first = setting.split(",")[0].strip()
    return method if first in ("-", "") else f"{method} {first}"


#: where ``place_labels`` tries a label: directions (degrees) on rings of growing radius (points) around its point
LABEL_DIRECTIONS = (20, -20, 160, -160, 60, -60, 120, -120, 0, 180, 90, -90)
LABEL_RINGS = (7, 15, 25, 37, 52, 70, 90)


def _marks(axis, points: list[tuple[float, float, float]]) -> list:
    """The display boxes of the points' markers and error bars (x, y, the bar's half-height)."""
    from matplotlib.transforms import Bbox

    pixels = axis.transData.transform
    boxes = []
    for x, y, spread in points:
        (px, py), (_, low), (_, high) = pixels((x, y)), pixels((x, y - spread)), pixels((x, y + spread))
        boxes += [Bbox.from_extents(px - 6, py - 6, px + 6, py + 6), Bbox.from_extents(px - 3, low - 3, px + 3, high + 3)]
    return boxes


def _annotate(axis, label: str, point: tuple[float, float], offset: tuple[float, float], colour):
    """``label`` at ``offset`` points from ``point``, aligned away from it (a leader line beyond the first ring)."""
    dx, dy = offset
    leader = math.hypot(dx, dy) > LABEL_RINGS[0] + 0.5
    return axis.annotate(label, point, xytext=offset, textcoords="offset points", fontsize=7, color=colour,
                         ha="left" if dx > 1 else "right" if dx < -1 else "center",
                         va="bottom" if dy > 1 else "top" if dy < -1 else "center",
                         arrowprops={"arrowstyle": "-", "color": colour, "lw": 0.6, "alpha": 0.7} if leader else None)


def place_labels(axis, points: list[tuple[float, float, float]], labels: list[str], colours: list) -> None:
    """Label each point (x, y, its error bar's half-height) at the first spot, ring by ring around it, whose
    text overlaps no label placed before, no marker and no error bar, inside the axes; where none is free, at
    the first spot. Call once the layout is final (it draws the figure to read the positions)."""
    from matplotlib.text import Text

    axis.figure.canvas.draw()  # the axes' limits and the layout as they will be saved
    renderer = axis.figure.canvas.get_renderer()
    frame = axis.get_window_extent(renderer)
    taken = _marks(axis, points)
    offsets = [(radius * math.cos(math.radians(degrees)), radius * math.sin(math.radians(degrees)))
               for radius in LABEL_RINGS for degrees in LABEL_DIRECTIONS]
    for (x, y, _), label, colour in zip(points, labels, colours):
        for offset in offsets:
            text = _annotate(axis, label, (x, y), offset, colour)
            text.update_positions(renderer)
            box = Text.get_window_extent(text, renderer).expanded(1.06, 1.15)  # the text alone, not its leader
            inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
            if inside and not any(box.overlaps(other) for other in taken):
                taken.append(box)
                break
            text.remove()
        else:
            _annotate(axis, label, (x, y), offsets[0], colour)


def plot(results: list[tuple[str, str, dict]], args: argparse.Namespace, measure: str, path: str) -> None:
    """The final score (mean ± std over the seeds) of every row against the MB each worker sent (log x); a
    colour and marker per method, each point labelled, the uncompressed row's mean as a reference line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    figure, axis = plt.subplots(figsize=(10.5, 6.5))
    methods = list(dict.fromkeys(method for method, _, _ in results))
    colour_of = {method: PALETTE[index % len(PALETTE)] for index, method in enumerate(m for m in methods if m != "none")}
    colour_of["none"] = "black"
    for _, _, result in (row for row in results if row[0] == "none"):
        axis.axhline(result["score_mean"], color="0.6", linestyle="--", linewidth=1, zorder=0)
    points, labels, colours = [], [], []
    for method in methods:
        rows = [(setting, result) for name, setting, result in results if name == method]
        axis.errorbar([result["bytes"] / 1e6 for _, result in rows], [result["score_mean"] for _, result in rows],
                      yerr=[result["score_std"] for _, result in rows], marker=MARKERS.get(method, "o"),
                      markersize=9 if method == "none" else 6, color=colour_of[method], capsize=3, linestyle="none",
                      label=method if method != "none" else "none (fp32, uncompressed; dashed: its mean)")
        for setting, result in rows:
            points.append((result["bytes"] / 1e6, result["score_mean"], result["score_std"]))
            labels.append(point_label(method, setting))
            colours.append(colour_of[method])
    axis.set_xscale("log")
    axis.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_xlabel("MB sent per worker over the whole run (log scale)")
    axis.set_ylabel(f"final {measure}, mean ± std over seeds")
    axis.grid(True, which="major", alpha=0.3)
    axis.margins(x=0.08, y=0.08)
    if args.task == "text":
        task = f"byte-level transformer, {args.steps} steps"
    else:
        task = f"Fashion-MNIST MLP ({PARAMS / 1e3:.0f}k params), {args.epochs} epoch{'s' if args.epochs != 1 else ''}"
    seeds = f"{len(args.seeds)} seed{'s' if len(args.seeds) != 1 else ''} ({', '.join(map(str, args.seeds))})"
    axis.set_title(f"{task}, {args.workers} simulated workers, suite {args.suite}\n"
                   f"final score: mean ± std over {seeds}", fontsize=10)
    axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False, title="method",
                title_fontsize=8)
    figure.tight_layout()
    place_labels(axis, points, labels, colours)
    figure.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=["fashion", "text"], default="fashion")
    parser.add_argument("--epochs", type=int, default=3, help="fashion: epochs")
    parser.add_argument("--steps", type=int, default=400, help="text: optimizer steps")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--suite", choices=["grid", "adaptive", "local", "demo"], default="grid")
    parser.add_argument("--data-dir", default="data", help="fashion: torchvision's data folder")
    parser.add_argument("--corpus", default=DEBIAN_PYTHON_DOCS, help="text: a folder of *.txt files")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--plot", default=None, help="write accuracy against bytes to this PNG (needs matplotlib)")
    parser.add_argument("--only", nargs="+", default=None, help="run only the rows of these methods")
    args = parser.parse_args()
    if args.task == "text" and args.suite in ("grid", "adaptive"):
        parser.error("--task text runs the 'local' and 'demo' suites")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    runs = {"grid": grid, "adaptive": adaptive, "local": local, "demo": demo}[args.suite](args.task)
    runs = [spec for spec in runs if args.only is None or spec.method in args.only]
    if args.task == "text":
        size = sum(p.numel() for p in build_model("text", OPTIMIZERS["text"]).parameters())
        print(f"# byte-level transformer ({size} parameters) on {args.corpus}, {args.workers} simulated workers x "
              f"8 windows of 64 bytes, {args.steps} steps, suite {args.suite}; comm estimated on {NETWORK}")
        measure = "validation loss (nats/byte)"
    else:
        print(f"# Fashion-MNIST MLP ({PARAMS} parameters), {args.workers} simulated workers x batch 64, "
              f"{args.epochs} epochs, suite {args.suite}; comm estimated on {NETWORK}")
        measure = "test acc (%)"
    results, rows = [], []
    baseline_wall = None
    for spec in runs:
        per_seed = [run(spec, args, seed) for seed in args.seeds]
        scores = [result["score"] for result in per_seed]
        result = {key: statistics.mean(r[key] for r in per_seed) for key in per_seed[0]}
        result["score_mean"] = statistics.mean(scores)
        result["score_std"] = statistics.stdev(scores) if len(scores) > 1 else 0.0
        baseline_wall = baseline_wall or result["wall"]
        results.append((spec.method, spec.setting, result))
        digits = 3 if args.task == "text" else 2
        rows.append([spec.method, spec.setting, f"{result['score_mean']:.{digits}f} ± {result['score_std']:.{digits}f}",
                     f"{result['bytes'] / 1e6:.2f}", f"{result['ratio']:.1f}x", f"{result['density']:.4g}",
                     f"{result['wall']:.1f}", f"{result['wall'] / baseline_wall:.2f}", f"{result['comm']:.2f}"])
        print(f"done: {spec.method} {spec.setting}: {rows[-1]} (seeds: {', '.join(f'{a:.{digits}f}' for a in scores)})",
              flush=True)
    print()
    print_table(["method", "setting", f"{measure}, mean ± std over {len(args.seeds)} seeds", "MB sent / worker",
                 "ratio", "avg density", "wall (s)", "wall / none", "comm est (s)"], rows)
    if args.plot:
        plot(results, args, measure, args.plot)


if __name__ == "__main__":
    main()
