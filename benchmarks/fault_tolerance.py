"""Lost replicas: fault-tolerant local updates on torchft against torchrun's restart-from-checkpoint.

    python benchmarks/fault_tolerance.py --failures 0 1 2 --steps 200 --sync-every 10 --step-seconds 0.05

Three replicas train the digits MLP with local updates (int8 outer gradients, H = ``--sync-every``, inner SGD
with momentum, outer SGD at lr 1: the replicas' average), each inner step
padded to ``--step-seconds`` (the MLP's own step takes a millisecond; a real model's takes longer), on
127.0.0.1. ``--failures K`` kills a replica K times, at fixed steps inside windows (steps 55 and 125 of 200,
scaled with ``--steps``):

* **ours** (``local_updates(..., fault_tolerance=FaultTolerance(...))``): each replica its own job, torchft's
  lighthouse (``min_replicas=1``) in this process; the three start together (``expected_groups=3``, as
  torchrun's rendezvous makes its workers do); a killed replica is replaced one second later by a new
  process with the same name, which joins at the next synchronisation and receives θ_global from a peer;
* **torchrun**: the three replicas as one job, ``torchrun --nproc-per-node 3 --max-restarts K``, the
  checkpoint (every replica's state, ``handle.state_dict()``) written at every synchronisation; a failure
  restarts every worker, which resume from the last checkpoint.

Printed per run: the wall time to finish, the steps of work lost (ours: the killed replica's steps since
its last synchronisation; torchrun: every replica's steps since the last checkpoint), and the final
validation loss of θ_global on the digits held out (the last 20%).

Every run also logs its events, with their wall-clock times, to ``<out>.events.jsonl`` (one JSON object a
line, appended, so that it survives torchrun's restarts): each worker's ``start``, each ``kill``, and at every
synchronisation of replica 0 a ``sync`` with the validation loss of θ_global and the replica groups that
took part (ours: the quorum's; torchrun: its world size). ``--plot PATH`` draws them (needs matplotlib):
the validation loss against wall-clock time and the replica groups taking part (torchrun: none while the
job restarts), one column per failure count, the kills marked.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

HERE = Path(__file__).resolve()
REPLICAS = 3


def _data():
    import torch
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target)
    split = int(0.8 * len(labels))
    return (images[:split], labels[:split]), (images[split:], labels[split:])


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def _outer(params):
    """Outer SGD at lr 1 (the replicas' average): DiLoCo's Nesterov momentum oscillates on this small problem."""
    import torch

    return torch.optim.SGD(params, lr=1.0)


def _kill_steps(args: argparse.Namespace) -> list[int]:
    return [round(args.steps * fraction) for fraction in (0.275, 0.625)][:args.failures_now]


class Events:
    """A run's events, one JSON object a line with its wall-clock time ``t`` (``time.time()``), appended to
    ``<out>.events.jsonl`` by every worker of the run: the file outlives the processes that a failure ends."""

    def __init__(self, out: str) -> None:
        self.path = Path(f"{out}.events.jsonl")

    def log(self, kind: str, **fields) -> None:
        with open(self.path, "a") as log:  # one short line per write: appends from several processes stay whole
            log.write(json.dumps({"kind": kind, "t": time.time(), **fields}) + "\n")

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def _val_loss(handle, model, val_x, val_y) -> float:
    """The validation loss of θ_global."""
    import torch
    import torch.nn.functional as F

    with handle.global_weights(), torch.no_grad():
        return float(F.cross_entropy(model(val_x), val_y))


def _train(handle, model, optimizer, replica: int, args: argparse.Namespace, die_at, events: Events,
           groups: Callable[[], Optional[int]], on_sync: Optional[Callable[[int], None]] = None) -> float:
    """Inner steps until the replicas' step count reaches ``--steps``; the final validation loss of θ_global.
    Every replica logs its start and its kill; replica 0 adds, at its start and at each synchronisation, the
    validation loss of θ_global and ``groups()``, the replica groups that took part (inside the step's padding)."""
    import torch
    import torch.nn.functional as F

    (images, labels), (val_x, val_y) = _data()
    recorder = replica == 0
    events.log("start", replica=replica, step=handle.optimizer_steps,
               **({"val_loss": _val_loss(handle, model, val_x, val_y), "groups": groups()} if recorder else {}))
    while handle.optimizer_steps < args.steps:
        step = handle.optimizer_steps
        began = time.perf_counter()
        generator = torch.Generator().manual_seed(1000 * step + replica)
        order = torch.randint(0, len(labels), (32,), generator=generator)
        F.cross_entropy(model(images[order]), labels[order]).backward()
        optimizer.step()  # the synchronisation runs from the step's hook
        optimizer.zero_grad()
        if recorder and handle.loop.synced:
            events.log("sync", step=step + 1, val_loss=_val_loss(handle, model, val_x, val_y), groups=groups())
        time.sleep(max(0.0, args.step_seconds - (time.perf_counter() - began)))
        if on_sync is not None and handle.loop.synced:
            on_sync(step + 1)
        if die_at(step + 1):
            events.log("kill", replica=replica, step=step + 1)
            os._exit(1)
    handle.sync()
    return _val_loss(handle, model, val_x, val_y)


def ours_worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import lightning_gradcomp
    from lightning_gradcomp import FaultTolerance

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    handle = lightning_gradcomp.local_updates(model, optimizer, args.sync_every, args.compressor, outer_optimizer=_outer,
                                              fault_tolerance=FaultTolerance(
        lighthouse=args.lighthouse, replica_id=f"replica{args.replica}", timeout=30, quorum_timeout=120,
        expected_groups=REPLICAS, start_timeout=60))  # launched together, they start together (as torchrun's do)
    kills = {step for step, victim in zip(_kill_steps(args), (2, 1)) if victim == args.replica and not args.replacement}
    loss = _train(handle, model, optimizer, args.replica, args, lambda step: step in kills, Events(args.out),
                  groups=lambda: (handle.fault_tolerance.participants or [None])[-1])
    if args.replica == 0:
        figures = handle.fault_tolerance
        Path(args.out).write_text(json.dumps({"val_loss": loss, "commits": figures.commits, "rollbacks": figures.rollbacks,
                                              "participants": figures.participants, "heals": figures.heals,
                                              "quorum_seconds": figures.quorum_seconds}))
    handle.close()
    dist.destroy_process_group()


def torchrun_worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import lightning_gradcomp

    torch.set_num_threads(1)
    # the agent's store outlives a restart: each attempt's groups under a prefix of their own, so that the restarted
    # workers do not find the dead attempt's addresses
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{attempt}/", store), rank=rank, world_size=world)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    handle = lightning_gradcomp.local_updates(model, optimizer, args.sync_every, args.compressor, outer_optimizer=_outer)
    checkpoint = Path(args.out).with_suffix(".ckpt")
    resumed_from = 0
    if checkpoint.exists():
        saved = torch.load(checkpoint, weights_only=False)
        model.load_state_dict(saved["model"])
        handle.load_state_dict(saved["gradcomp"])
        resumed_from = handle.optimizer_steps

    def save(step: int) -> None:
        entry = handle.state_dict()  # every rank: a collective
        if rank == 0:
            with handle.global_weights():
                torch.save({"model": model.state_dict(), "gradcomp": entry}, f"{checkpoint}.tmp")
            os.replace(f"{checkpoint}.tmp", checkpoint)

    def die_at(step: int) -> bool:  # each failure once: a marker file survives the restart
        for number, (kill_step, victim) in enumerate(zip(_kill_steps(args), (2, 1))):
            marker = Path(f"{args.out}.failed{number}")
            if step == kill_step and rank == victim and not marker.exists():
                marker.write_text(str(resumed_from))
                return True
        return False

    loss = _train(handle, model, optimizer, rank, args, die_at, Events(args.out), groups=lambda: world, on_sync=save)
    if rank == 0:
        Path(args.out).write_text(json.dumps({"val_loss": loss}))
    handle.close()
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _common(args: argparse.Namespace) -> list[str]:
    return ["--steps", str(args.steps), "--sync-every", str(args.sync_every), "--step-seconds", str(args.step_seconds),
            "--lr", str(args.lr), "--compressor", args.compressor,
            "--failures-now", str(args.failures_now)]


def run_ours(args: argparse.Namespace) -> dict:
    from torchft._torchft import LighthouseServer

    out = Path(f"/tmp/gradcomp_ft_ours_{args.failures_now}.json")
    out.unlink(missing_ok=True)
    Events(str(out)).path.unlink(missing_ok=True)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=2000, heartbeat_timeout_ms=2000)
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def start(replica: int, replacement: bool = False) -> subprocess.Popen:
        command = [sys.executable, str(HERE), "--worker", "ours", "--replica", str(replica), "--lighthouse",
                   lighthouse.address(), "--port", str(_free_port()), "--out", str(out), *_common(args)]
        log = open(f"{out}.replica{replica}{'.replacement' if replacement else ''}.log", "w")
        return subprocess.Popen(command + (["--replacement"] if replacement else []), env=env, stdout=log,
                                stderr=subprocess.STDOUT)

    started, began = time.time(), time.perf_counter()
    running = {replica: start(replica) for replica in range(REPLICAS)}
    done: set[int] = set()
    while len(done) < REPLICAS:
        for replica, process in list(running.items()):
            code = process.poll()
            if code is None:
                continue
            del running[replica]
            if code == 0:
                done.add(replica)
            else:  # killed: the scheduler starts a replacement a second later
                time.sleep(1.0)
                running[replica] = start(replica, replacement=True)
        time.sleep(0.05)
    seconds = time.perf_counter() - began
    lighthouse.shutdown()
    record = json.loads(out.read_text())
    lost = [step - step // args.sync_every * args.sync_every for step in _kill_steps(args)]
    return {"seconds": seconds, "steps_lost": lost, **record, "started": started, "events": Events(str(out)).read()}


def run_torchrun(args: argparse.Namespace) -> dict:
    out = Path(f"/tmp/gradcomp_ft_torchrun_{args.failures_now}.json")
    for stale in out.parent.glob(out.name + "*"):
        stale.unlink()
    out.with_suffix(".ckpt").unlink(missing_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(REPLICAS), "--max-restarts",
               str(max(args.failures_now, 0)), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
               str(HERE), "--worker", "torchrun", "--out", str(out), *_common(args)]
    started, began = time.time(), time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seconds = time.perf_counter() - began
    lost = []
    for number, kill_step in enumerate(_kill_steps(args)):
        resumed = int(Path(f"{out}.failed{number}").read_text())
        last_checkpoint = max(resumed, kill_step // args.sync_every * args.sync_every)
        lost.append(REPLICAS * (kill_step - last_checkpoint))
    return {"seconds": seconds, "steps_lost": lost, **json.loads(out.read_text()), "started": started,
            "events": Events(str(out)).read()}


#: how each method is drawn by ``--plot``
STYLES = {"ours": {"color": "tab:blue", "label": "fault tolerance (ours): replaced replica rejoins"},
          "torchrun": {"color": "tab:orange", "label": "torchrun: every worker restarts from the checkpoint"}}


def _groups_series(method: str, events: list[dict], started: float) -> tuple[list[float], list[int]]:
    """The replica groups taking part over time, a step function: at replica 0's start and each of its
    synchronisations the groups that took part; torchrun's job has none from a kill until its workers are back."""
    times, counts = [], []
    for event in sorted(events, key=lambda event: event["t"]):
        if event.get("groups") is not None:
            count = event["groups"]
        elif method == "torchrun" and event["kind"] == "kill":
            count = 0
        else:
            continue
        times.append(event["t"] - started)
        counts.append(count)
    return times, counts


def _draw_run(loss_axis, groups_axis, method: str, record: dict) -> None:
    """One run on a column: its validation loss and replica groups over time, its kills and its end."""
    style = STYLES[method]
    events, started = record["events"], record["started"]
    curve = sorted((event["t"] - started, event["val_loss"]) for event in events if "val_loss" in event)
    loss_axis.plot([t for t, _ in curve], [loss for _, loss in curve], marker=".", markersize=4, linewidth=1.4,
                   color=style["color"], label=style["label"])
    loss_axis.plot([record["seconds"]], [record["val_loss"]], marker="o", color=style["color"], markersize=7,
                   markerfacecolor="white")
    times, counts = _groups_series(method, events, started)
    times, counts = times + [record["seconds"]], counts + counts[-1:]
    groups_axis.step(times, counts, where="post", color=style["color"], linewidth=1.6)
    for event in events:
        if event["kind"] == "kill":
            for axis in (loss_axis, groups_axis):
                axis.axvline(event["t"] - started, color=style["color"], linestyle=":", linewidth=1.3)


def plot(rows: list[tuple[str, int, dict]], args: argparse.Namespace, path: str) -> None:
    """Per failure count a column: the validation loss of θ_global (top) and the replica groups taking part
    (bottom) against the wall-clock seconds since the run started, ours and torchrun; kills dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    counts = sorted({failures for _, failures, _ in rows})
    figure, axes = plt.subplots(2, len(counts), figsize=(4.4 * len(counts) + 0.6, 6.4), sharex="col", sharey="row",
                                squeeze=False, gridspec_kw={"height_ratios": [2.2, 1]})
    for column, count in enumerate(counts):
        loss_axis, groups_axis = axes[0][column], axes[1][column]
        walls = []
        for method, failures, record in rows:
            if failures == count:
                _draw_run(loss_axis, groups_axis, method, record)
                walls.append(f"{method} {record['seconds']:.1f} s")
        loss_axis.set_title(f"{count} failure{'' if count == 1 else 's'}: " + ", ".join(walls), fontsize=10)
        groups_axis.set_xlabel("wall-clock time since the run started (s)")
        groups_axis.set_xlim(left=0)  # the processes' start-up is part of the wall time
        for axis in (loss_axis, groups_axis):
            axis.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation loss of θ_global (nats)")
    axes[1][0].set_ylabel("replica groups\ntaking part")
    axes[1][0].set_yticks(range(REPLICAS + 1))
    axes[1][0].set_ylim(-0.3, REPLICAS + 0.5)
    handles = [Line2D([], [], color=style["color"], label=style["label"]) for method, style in STYLES.items()
               if any(method == row[0] for row in rows)]
    handles += [Line2D([], [], color="0.3", linestyle=":", label="a replica killed"),
                Line2D([], [], color="0.3", marker="o", markerfacecolor="white", linestyle="none",
                       label="finished: final loss")]
    figure.legend(handles=handles, loc="lower center", ncol=2, fontsize=9, frameon=False)
    figure.suptitle(f"{REPLICAS} replicas, digits MLP, local updates ({args.compressor}, H = {args.sync_every}), "
                    f"{args.steps} inner steps of {args.step_seconds * 1e3:.0f} ms, 127.0.0.1", fontsize=11)
    figure.tight_layout(rect=(0, 0.1, 1, 1))
    figure.savefig(path, dpi=120)
    print(f"\nplot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--failures", type=int, nargs="+", default=[0, 1, 2], choices=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--step-seconds", type=float, default=0.05)
    parser.add_argument("--lr", type=float, default=0.05, help="the inner SGD's (momentum 0.9)")
    parser.add_argument("--compressor", default="int8")
    parser.add_argument("--methods", nargs="+", default=["ours", "torchrun"], choices=["ours", "torchrun"])
    parser.add_argument("--plot", default=None,
                        help="write the validation loss and the replica groups against wall-clock time to this PNG")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--replica", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--replacement", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--failures-now", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "ours":
        ours_worker(args)
        return
    if args.worker == "torchrun":
        torchrun_worker(args)
        return
    rows = []
    for failures in args.failures:
        args.failures_now = failures
        for method in args.methods:
            record = run_ours(args) if method == "ours" else run_torchrun(args)
            rows.append((method, failures, record))
            shown = {key: value for key, value in record.items() if key not in ("started", "events")}
            print(f"{method} {failures}: {json.dumps(shown)}", flush=True)
    print(f"\n# 3 replicas, digits MLP 64-256-256-10, local updates ({args.compressor}, outer SGD lr 1), H = {args.sync_every}, {args.steps} inner steps of "
          f"{args.step_seconds * 1e3:.0f} ms, 127.0.0.1; failures at steps {[round(args.steps * f) for f in (0.275, 0.625)]}\n")
    print("| method | failures | wall time (s) | steps of work lost per failure | final val loss | vs 0 failures |")
    print("|---|---|---|---|---|---|")
    base = {method: record["val_loss"] for method, failures, record in rows if failures == 0}
    for method, failures, record in rows:
        ratio = f"{record['val_loss'] / base[method]:.3f}" if method in base else "-"
        print(f"| {method} | {failures} | {record['seconds']:.1f} | {record['steps_lost'] or '-'} | "
              f"{record['val_loss']:.4f} | {ratio} |")
    if args.plot:
        plot(rows, args, args.plot)


if __name__ == "__main__":
    main()
