"""Exit stress: many short 2-process jobs with the gradcomp hook must all end cleanly (exit status 0,
no "terminate called" abort).

    python tests/scripts/stress_exit.py --torchrun 50 --lightning 10   # the full check, by hand
    python tests/scripts/stress_exit.py --torchrun 2 --lightning 0    # what CI runs (tests/test_exit.py)

``--torchrun`` runs ``torchrun --standalone --nproc-per-node 2 tests/scripts/torchrun_hook.py
--no-destroy`` (a script that leaves its process group alive at exit, the worst case); ``--lightning``
runs the quick-start recipe for two steps. Prints one line per failure and a summary; exits 1 on any.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _torchrun() -> list[str]:
    exe = shutil.which("torchrun")
    return [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]


def run(command: list[str], cwd: str) -> tuple[int, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=cwd, env=env)
    return proc.returncode, proc.stdout + proc.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--torchrun", type=int, default=50)
    parser.add_argument("--lightning", type=int, default=10)
    parser.add_argument("--compressor", default="topk")
    args = parser.parse_args()
    # half the torchrun jobs exchange on the hook's thread, half on gradcomp's exchange thread
    jobs = [[*_torchrun(), "--standalone", "--nproc-per-node", "2", str(HERE / "torchrun_hook.py"), "--no-destroy",
             "--compressor", args.compressor, *(["--thread"] if index % 2 else [])] for index in range(args.torchrun)]
    jobs += [[sys.executable, "-m", "lightning_gradcomp", "fit", "--config", str(ROOT / "recipes" / "quickstart_digits.yaml"),
              "--trainer.max_steps=2", "--trainer.logger=false", "--trainer.enable_checkpointing=false",
              "--trainer.callbacks=[]"]] * args.lightning
    failures = 0
    with tempfile.TemporaryDirectory() as workdir:
        for index, command in enumerate(jobs):
            code, output = run(command, workdir)
            aborted = "terminate called" in output
            if code != 0 or aborted:
                failures += 1
                reason = next((line for line in output.splitlines() if "terminate" in line or "Error" in line), "")
                print(f"run {index + 1} ({'torchrun' if index < args.torchrun else 'lightning'}): exit {code} {reason}")
    print(f"{len(jobs) - failures} passed, {failures} failed")
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
