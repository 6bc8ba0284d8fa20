"""The TensorBoard figures of docs/telemetry.md, drawn from the event files of real runs.

    python docs/make_tensorboard_figures.py [--out docs/figures] [--epochs 10]

Runs the quick-start recipe (2 real CPU processes, scikit-learn's digits, CompressionMonitor on a
10 Gbit/s network model) once with Top-k at 1% and once with Top-k at 0.1% (``gradcomp fit``), reads the
``gradcomp/*`` scalars back from the TensorBoard event files and draws the panels a user looks at: the
total compression error, the relative error per step, bytes sent against dense, and the estimated
communication time against the time spent compressing. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = {"Top-k 1% (50x)": "0.01", "Top-k 0.1% (500x)": "0.001"}
PANELS = [
    ("gradcomp/total_error", "total compression error Σ‖e‖² (cumulative)"),
    ("gradcomp/relative_error", "relative error ‖p − C(p)‖² / ‖p‖² per step"),
    ("gradcomp/bytes_sent_total", "bytes sent per worker (cumulative)"),
    ("gradcomp/comm_ms_est", "estimated communication per step (ms)"),
    ("gradcomp/compress_ms", "compression + error feedback per step (ms)"),
    ("train_loss", "training loss"),
]


def run(label: str, density: str, save_dir: Path, epochs: int) -> Path:
    name = label.split(" (")[0].replace(" ", "_").replace("%", "pct")
    command = [sys.executable, "-m", "lightning_gradcomp", "fit", "--config", str(ROOT / "recipes" / "quickstart_digits.yaml"),
               f"--trainer.logger.init_args.save_dir={save_dir}", f"--trainer.logger.init_args.name={name}",
               f"--trainer.max_epochs={epochs}", f"--trainer.strategy.init_args.compressor.init_args.density={density}",
               "--trainer.enable_progress_bar=false"]
    subprocess.run(command, check=True, cwd=ROOT / "recipes")
    (events,) = sorted((save_dir / name).rglob("events.out.tfevents.*"))[-1:]
    return events


def scalars(events: Path) -> dict[str, tuple[list[int], list[float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    found = {}
    for tag in accumulator.Tags()["scalars"]:
        values = accumulator.Scalars(tag)
        found[tag] = ([v.step for v in values], [v.value for v in values])
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "docs" / "figures"))
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        series = {label: scalars(run(label, density, Path(tmp), args.epochs)) for label, density in RUNS.items()}
    figure, axes = plt.subplots(3, 2, figsize=(11, 10))
    for axis, (tag, title) in zip(axes.flat, PANELS):
        for label, found in series.items():
            if tag in found:
                steps, values = found[tag]
                axis.plot(steps, values, label=label)
        axis.set_title(title, fontsize=10)
        axis.set_xlabel("step")
        if tag in ("gradcomp/relative_error", "gradcomp/bytes_sent_total"):
            axis.set_yscale("log")
        axis.legend(fontsize=8)
    figure.suptitle("gradcomp/* in TensorBoard: quick-start recipe, 2 CPU processes, digits", fontsize=11)
    figure.tight_layout()
    path = out / "tensorboard_gradcomp.png"
    figure.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
