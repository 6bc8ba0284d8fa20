"""Regenerate every figure of the documentation: one command runs each benchmark with its ``--plot``.

    sudo python benchmarks/make_figures.py [--out docs/figures] [--quick] [--only NAME ...] [--epochs E] [--seeds S ...]

Each benchmark runs as a subprocess from the repository root, one after the other (they time themselves:
running them side by side would skew their numbers); its printed tables stream here and, with its stderr
(progress lines, torchft's logs), go to ``--logs`` (default ``/tmp/gradcomp_figures``), one ``<name>.out``
and ``<name>.err`` per figure. Written under ``--out``:

* ``accuracy_vs_bytes.png``: ``accuracy_vs_bytes.py`` (suite ``grid``, Fashion-MNIST: ``apt-get install
  dataset-fashion-mnist``), final test accuracy against MB sent per worker, mean ± std over 3 seeds. By
  default 1 epoch, so that the whole command fits in about half an hour here; ``--epochs 3`` gives the
  setting of the table in docs/benchmarks.md (about three times as long);
* ``step_time_vs_bandwidth.png``: ``slow_link.py --rates 20mbit 100mbit 1gbit 10gbit``, median step time
  of 2 gloo processes against the bandwidth of their shaped loopback, one line per method. **It needs root**
  (a network namespace shaped with ``tc``; ``apt-get install iproute2``): without root it is skipped, said
  so, and the others still run;
* ``fault_tolerance.png``: ``fault_tolerance.py --failures 0 1 2``, validation loss and replica groups over
  wall-clock time, ours against torchrun's restart (torchft and scikit-learn needed);
* ``time_boxed_windows.png``: ``time_boxed_windows.py`` with the settings of docs/benchmarks.md.

Run time on this project's 2-core CPU machine (shared with other work, so only indicative): 28 minutes
for the default settings (accuracy 14 min, 9.5 when run alone; slow link 8.3; fault tolerance 2.7;
time-boxed windows 2.8) and
5.3 minutes for ``--quick``, whose smaller settings (fewer seeds, methods, rates and steps) are a fast
check that every script still draws, written to ``/tmp/gradcomp_figures/quick`` unless ``--out`` is given.
The exit status is 1 when a benchmark failed (its log says why).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
#: the slow-link methods drawn: DDP fp32, its bf16/fp16 hooks, the noop bound, PyTorch's PowerSGD (one bucket:
#: with the default buckets it aborts or hangs, see docs/benchmarks.md) and gradcomp's compressors
SLOW_LINK_METHODS = ["ddp", "bf16", "fp16", "noop", "torch_powersgd_1b", "powersgd", "topk", "dgc", "threshold",
                     "qsgd", "int8", "demo"]


@dataclass
class Figure:
    """One PNG: the benchmark that draws it, with its settings in full and for ``--quick``."""

    name: str
    script: str
    arguments: list[str]
    quick: list[str]
    needs_root: bool = False


FIGURES = [
    Figure("accuracy_vs_bytes", "accuracy_vs_bytes.py", ["--suite", "grid", "--workers", "4"],
           ["--suite", "grid", "--workers", "4", "--only", "none", "topk"]),
    Figure("step_time_vs_bandwidth", "slow_link.py",
           ["--rates", "20mbit", "100mbit", "1gbit", "10gbit", "--steps", "5", "--warmup", "3", "--methods",
            *SLOW_LINK_METHODS],
           ["--rates", "100mbit", "1gbit", "--steps", "2", "--warmup", "1", "--methods", "ddp", "bf16", "noop",
            "topk"], needs_root=True),
    Figure("fault_tolerance", "fault_tolerance.py",
           ["--failures", "0", "1", "2", "--steps", "200", "--sync-every", "10", "--step-seconds", "0.05"],
           ["--failures", "0", "1", "--steps", "100", "--sync-every", "10", "--step-seconds", "0.03"]),
    Figure("time_boxed_windows", "time_boxed_windows.py",
           ["--steps", "200", "--sync-every", "20", "--step-seconds", "0.05", "--grace", "0.1"],
           ["--steps", "40", "--sync-every", "10", "--step-seconds", "0.02", "--grace", "0.1"]),
]
NAMES = [figure.name for figure in FIGURES]


def command(figure: Figure, out: Path, args: argparse.Namespace) -> list[str]:
    """The benchmark's command line: its settings, the accuracy's epochs and seeds, and its plot option."""
    arguments = list(figure.quick if args.quick else figure.arguments)
    if figure.name == "accuracy_vs_bytes":
        epochs = args.epochs if args.epochs is not None else 1
        seeds = args.seeds or ([0, 1] if args.quick else [0, 1, 2])
        arguments += ["--epochs", str(epochs), "--seeds", *map(str, seeds)]
    return [sys.executable, str(BENCHMARKS / figure.script), *arguments, "--plot", str(out / f"{figure.name}.png")]


def run(figure: Figure, out: Path, logs: Path, args: argparse.Namespace) -> tuple[int, float]:
    """Run one benchmark from the repository root, its stdout echoed here and both streams logged: its exit
    status and seconds."""
    line = command(figure, out, args)
    print(f"\n## {figure.name}: {' '.join(line[1:])}", flush=True)
    began = time.perf_counter()
    with open(logs / f"{figure.name}.out", "w") as stdout_log, open(logs / f"{figure.name}.err", "w") as stderr_log:
        process = subprocess.Popen(line, cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr_log, text=True,
                                   env=dict(os.environ, PYTHONUNBUFFERED="1"))
        assert process.stdout is not None
        for text in process.stdout:
            stdout_log.write(text)
            print(text, end="", flush=True)
        code = process.wait()
    return code, time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None,
                        help="folder of the PNGs (default docs/figures; with --quick /tmp/gradcomp_figures/quick)")
    parser.add_argument("--quick", action="store_true", help="smaller settings: a fast check that every figure draws")
    parser.add_argument("--only", nargs="+", choices=NAMES, default=None, help="these figures only")
    parser.add_argument("--epochs", type=int, default=None, help="accuracy_vs_bytes: epochs (default 1)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="accuracy_vs_bytes: seeds (default 0 1 2; with --quick 0 1)")
    parser.add_argument("--logs", type=Path, default=Path("/tmp/gradcomp_figures"),
                        help="folder of each benchmark's stdout and stderr")
    args = parser.parse_args()
    out = (args.out or (Path("/tmp/gradcomp_figures/quick") if args.quick else ROOT / "docs" / "figures")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    args.logs.mkdir(parents=True, exist_ok=True)
    chosen = [figure for figure in FIGURES if args.only is None or figure.name in args.only]
    outcomes: dict[str, str] = {}
    for figure in chosen:
        if figure.needs_root and os.geteuid() != 0:
            outcomes[figure.name] = "skipped: needs root (run this command with sudo)"
            print(f"\n## {figure.name}: {outcomes[figure.name]}", flush=True)
            continue
        code, seconds = run(figure, out, args.logs, args)
        minutes = f"{seconds / 60:.1f} min"
        outcomes[figure.name] = (f"{out / figure.name}.png, {minutes}" if code == 0 else
                                 f"FAILED (exit {code}) after {minutes}: see {args.logs / figure.name}.err")
    print("\n## figures")
    for name, outcome in outcomes.items():
        print(f"{name}: {outcome}")
    sys.exit(1 if any(outcome.startswith("FAILED") for outcome in outcomes.values()) else 0)


if __name__ == "__main__":
    main()
