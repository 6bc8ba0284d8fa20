"""A slow group: lock-step DiLoCo, time-boxed DiLoCo (``window_seconds="auto"``) and DDP, side by side.

    python benchmarks/time_boxed_windows.py --steps 200 --sync-every 10 --step-seconds 0.02
    python benchmarks/time_boxed_windows.py --simulate --steps 300 --seeds 0 1 2

**Real processes** (gloo on 127.0.0.1): three groups (one process each) train the digits MLP, each inner step
padded to ``--step-seconds`` (the MLP's own step takes about a millisecond; a real model's takes longer). Two
cases: *half speed* (the last group's steps take twice as long) and *stall* (equal speeds; the last group stalls
once, for 10 steps' time, a third of the way in). Modes: ``ddp`` (DistributedDataParallel, its fp32
all-reduce every step), ``lock-step`` (DiLoCo, every group ``H`` steps per window), ``time-boxed`` (DiLoCo with
``window_seconds="auto"``: each group the steps that fit, merged weighted by samples), and, in the stall case,
``time-boxed + grace (torchft)``: the same with each group a job of its own under fault tolerance, torchft's
lighthouse in this process, whose join timeout (``--grace`` seconds) leaves a late group out of a
synchronisation (its late window dropped; it heals at the next). Each loop runs
``--steps`` steps (time-boxed: until the first group's ``--steps`` run out). Printed: the job's samples per
second, against the sum of the groups' own speeds (each measured alone, without communication), over the whole
run and after the first window (time-boxed: the lock-step window that measures the speeds), the wall time, and
the loss of the final model on the held-out digits.

**Simulation** (``--simulate``, one process, deterministic): ``SimulatedLocalUpdates`` with speeds (1, 1, 1) and
(1, 1, 0.5), lock-step and time-boxed, each run until the workers processed the same number of samples;
printed: the held-out loss (mean ± std over ``--seeds``) and the simulated time it took.

``--plot PATH`` writes the loss against wall-clock time of the real runs (needs matplotlib).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import print_table  # noqa: E402
from fault_tolerance import _data  # noqa: E402  (the digits, 80% to train and 20% held out)

import lightning_gradcomp  # noqa: E402
from lightning_gradcomp import LocalUpdates  # noqa: E402
from lightning_gradcomp.local.simulated import SimulatedLocalUpdates  # noqa: E402

GROUPS = 3
BATCH = 32
#: the time-boxed runs under fault tolerance, whose lighthouse's join timeout is the grace period
GRACE = "time-boxed + grace (torchft)"
CASES = [("half speed", "ddp"), ("half speed", "lock-step"), ("half speed", "time-boxed"),
         ("stall", "ddp"), ("stall", "lock-step"), ("stall", "time-boxed"), ("stall", GRACE)]
OUTER = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def _batch(train, group: int, step: int, seed: int = 0):
    images, labels = train
    index = torch.randint(len(labels), (BATCH,), generator=torch.Generator().manual_seed(seed * 100_003 + group * 10_007 + step))
    return images[index], labels[index]


def _held_out_loss(model: torch.nn.Module, held_out) -> float:
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(model(held_out[0]), held_out[1]).item()


# ---------------------------------------------------------------------- real processes
def _group(rank: int, port: int, mode: str, case: str, args: argparse.Namespace, out: str,
           lighthouse: Optional[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port + 1 + rank if lighthouse else port))
    torch.set_num_threads(1)
    train, held_out = _data()
    pace = args.step_seconds * (2.0 if case == "half speed" and rank == GROUPS - 1 else 1.0)
    stall_at = args.steps // 3 if case == "stall" and rank == GROUPS - 1 else None
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)

    def inner_step(step: int, trained: torch.nn.Module) -> float:
        began = time.perf_counter()
        x, y = _batch(train, rank, step)
        loss = torch.nn.functional.cross_entropy(trained(x), y)
        loss.backward()
        time.sleep(max(0.0, pace - (time.perf_counter() - began)))
        if step == stall_at:
            time.sleep(10 * args.step_seconds)
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    own = []  # this group's own speed, alone: a few steps without communication (a copy, not trained on)
    solo = _model()
    for step in range(10):
        began = time.perf_counter()
        x, y = _batch(train, rank, step)
        torch.nn.functional.cross_entropy(solo(x), y).backward()
        time.sleep(max(0.0, pace - (time.perf_counter() - began)))
        own.append(time.perf_counter() - began)
    # under fault tolerance each group is a job of its own, joined by torchft's lighthouse
    dist.init_process_group("gloo", rank=0 if lighthouse else rank, world_size=1 if lighthouse else GROUPS)
    curve, steps, first_sync = [], 0, None  # first_sync: (seconds, steps) at the end of the first window
    sync_times: list[float] = []
    if mode == "ddp":
        trained = torch.nn.parallel.DistributedDataParallel(model)
        dist.barrier()
        start = time.perf_counter()
        for steps in range(1, args.steps + 1):
            inner_step(steps - 1, trained)
            if steps % args.sync_every == 0:
                sync_times.append(time.perf_counter() - start)
            if steps == args.sync_every:
                first_sync = (time.perf_counter() - start, steps)
            if steps % args.sync_every == 0 and rank == 0:
                curve.append((time.perf_counter() - start, _held_out_loss(model, held_out)))
        final = _held_out_loss(model, held_out)
    else:
        config = {"window_seconds": "auto"} if mode.startswith("time-boxed") else {}
        if lighthouse:
            config["fault_tolerance"] = lightning_gradcomp.FaultTolerance(
                lighthouse=lighthouse, replica_id=f"group{rank}", expected_groups=GROUPS, start_timeout=60)
        handle = lightning_gradcomp.local_updates(model, optimizer, args.sync_every, outer_optimizer=OUTER, **config)
        handle.run_for(args.steps)
        if not lighthouse:
            dist.barrier()  # (under fault tolerance the groups start together: expected_groups)
        start = time.perf_counter()
        while not handle.finished and steps < args.steps:
            inner_step(steps, model)
            steps += 1
            if handle.loop.synced:
                sync_times.append(time.perf_counter() - start)
            if handle.loop.synced and first_sync is None:
                first_sync = (time.perf_counter() - start, steps)
            if handle.loop.synced and rank == 0:
                with handle.global_weights():
                    curve.append((time.perf_counter() - start, _held_out_loss(model, held_out)))
        handle.sync()
        final = _held_out_loss(model, held_out)
    elapsed = time.perf_counter() - start
    figures = {"steps": steps, "elapsed": elapsed, "own_rate": BATCH / statistics.median(own), "final": final,
               "curve": curve, "first_sync": first_sync, "sync_times": sync_times}
    Path(out, f"{mode}-{case}-{rank}.json").write_text(json.dumps(figures))
    if lighthouse:
        handle.close()
    else:
        dist.barrier()
    dist.destroy_process_group()


def real_processes(args: argparse.Namespace) -> dict:
    results = {}
    with tempfile.TemporaryDirectory() as out:
        for case, mode in [(case, mode) for case, mode in CASES if args.case in (None, case)]:
            port = 29_500 + 10 * len(results) + int(time.time()) % 500
            server = None
            if mode == GRACE:
                from torchft._torchft import LighthouseServer

                server = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=round(1000 * args.grace),
                                          heartbeat_timeout_ms=5000)
            try:
                mp.start_processes(_group, args=(port, mode, case, args, out, server and server.address()),
                                   nprocs=GROUPS, start_method="spawn")
            finally:
                if server is not None:
                    server.shutdown()
            groups = [json.loads(Path(out, f"{mode}-{case}-{rank}.json").read_text()) for rank in range(GROUPS)]
            samples = sum(group["steps"] for group in groups) * BATCH
            elapsed = max(group["elapsed"] for group in groups)
            # after the first window (time-boxed: the lock-step one that measures the speeds)
            after = sum(group["steps"] - group["first_sync"][1] for group in groups) * BATCH
            since = elapsed - max(group["first_sync"][0] for group in groups)
            # the others' longest wait beyond a usual window: the longest gap between two of their synchronisations
            # (DDP: every H steps) less the median gap
            waits = []
            for group in groups[:-1]:
                gaps = [b - a for a, b in zip(group["sync_times"], group["sync_times"][1:])]
                waits.append(max(gaps) - statistics.median(gaps) if gaps else 0.0)
            results[(case, mode)] = {"rate": samples / elapsed, "own": sum(group["own_rate"] for group in groups),
                                     "wait": max(waits),
                                     "steady": after / since,
                                     "elapsed": elapsed, "final": groups[0]["final"], "curve": groups[0]["curve"],
                                     "steps": [group["steps"] for group in groups]}
    rows = [[case, mode, str(result["steps"]), f"{result['rate']:.0f}",
             f"{100 * result['rate'] / result['own']:.0f}%", f"{100 * result['steady'] / result['own']:.0f}%",
             f"{1000 * result['wait']:.0f}", f"{result['elapsed']:.2f}", f"{result['final']:.4f}"]
            for (case, mode), result in results.items()]
    print(f"\n{GROUPS} groups, {args.steps} steps of {args.step_seconds * 1000:.0f} ms, H = {args.sync_every}, "
          "digits MLP, gloo on 127.0.0.1")
    print_table(["case", "mode", "steps per group", "samples/s", "of the groups' own speeds",
                 "the same after the first window", "the others' longest extra wait, ms", "wall s", "held-out loss"],
                rows)
    return results


# ---------------------------------------------------------------------- simulation
def simulate(speeds: tuple[float, ...], time_boxed: bool, samples: int, seed: int, sync_every: int):
    train, held_out = _data()
    model = _model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    config = LocalUpdates(sync_every, OUTER, window_seconds="auto" if time_boxed else None)
    sim = SimulatedLocalUpdates(model, [optimizer], config, workers=len(speeds), speeds=speeds)
    while sum(sim.samples) * BATCH < samples or sim.outer.inner_steps:
        for worker in sim.stepping():
            with sim.worker(worker):
                x, y = _batch(train, worker, sim.samples[worker], seed)
                torch.nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
        sim.step()
    with sim.global_weights():
        return _held_out_loss(model, held_out), sim.elapsed, sum(sim.samples) * BATCH


def simulation(args: argparse.Namespace) -> None:
    samples = GROUPS * args.steps * BATCH
    rows = []
    for speeds, time_boxed in (((1, 1, 1), False), ((1, 1, 0.5), False), ((1, 1, 0.5), True)):
        runs = [simulate(speeds, time_boxed, samples, seed, args.sync_every) for seed in args.seeds]
        losses = [loss for loss, _, _ in runs]
        spread = statistics.stdev(losses) if len(losses) > 1 else 0.0
        rows.append([str(speeds), "time-boxed" if time_boxed else "lock-step", f"{runs[0][2]:,}",
                     f"{statistics.mean(losses):.4f} ± {spread:.4f}", f"{runs[0][1]:.0f}"])
    print(f"\nSimulation: {GROUPS} workers, H = {args.sync_every}, equal samples ({samples:,}), seeds {args.seeds}; time "
          "in steps of a speed-1 worker")
    print_table(["speeds", "mode", "samples", "held-out loss (mean ± std)", "simulated time"], rows)


def plot(results: dict, args: argparse.Namespace, path: str) -> None:
    """The held-out loss of θ_global against wall-clock time, a panel per case, a line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for axis, case in zip(axes, ("half speed", "stall")):
        for mode in [mode for shown, mode in CASES if shown == case]:
            curve = results[(case, mode)]["curve"]
            axis.plot([t for t, _ in curve], [loss for _, loss in curve], marker=".", label=mode)
        axis.set_title(f"{GROUPS} groups, one {'at half speed' if case == 'half speed' else 'stalling once'}")
        axis.set_xlabel("wall-clock time since the loop started (s)")
        axis.grid(alpha=0.3)
        axis.legend(loc="upper right", fontsize=9)  # each panel its modes (the stall case has one more)
    axes[0].set_ylabel("held-out loss of θ_global (nats)")
    figure.suptitle(f"{GROUPS} groups, {args.steps} steps of {args.step_seconds * 1000:.0f} ms, H = {args.sync_every}, "
                    "digits MLP, gloo on 127.0.0.1", fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"\nwrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--step-seconds", type=float, default=0.02)
    parser.add_argument("--grace", type=float, default=0.2,
                        help="the grace period of the fault-tolerant runs: the lighthouse's join timeout, seconds")
    parser.add_argument("--case", choices=["half speed", "stall"], default=None, help="run this case only")
    parser.add_argument("--simulate", action="store_true", help="the deterministic simulation instead")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--plot", default=None, help="write loss against wall-clock time to this PNG (matplotlib)")
    args = parser.parse_args()
    if args.simulate:
        simulation(args)
        return
    results = real_processes(args)
    if args.plot and args.case is None:
        plot(results, args, args.plot)


if __name__ == "__main__":
    main()
