"""Lost replicas: fault-tolerant local updates on torchft against torchrun's restart-from-checkpoint.

    python benchmarks/fault_tolerance.py --failures 0 1 2 --steps 200 --sync-every 10 --step-seconds 0.05

Three replicas train the digits MLP with local updates (int8 outer gradients, H = ``--sync-every``, inner SGD
with momentum, outer SGD at lr 1: the replicas' average), each inner step
padded to ``--step-seconds`` (the MLP's own step takes a millisecond; a real model's takes longer), on
127.0.0.1. ``--failures K`` kills a replica K times, at fixed steps inside windows (steps 55 and 125 of 200,
scaled with ``--steps``):

* **ours** (``local_updates(..., fault_tolerance=FaultTolerance(...))``): each replica its own job, torchft's
  lighthouse (``min_replicas=1``) in this process; a killed replica is replaced one second later by a new
  process with the same name, which joins at the next synchronisation and receives θ_global from a peer;
* **torchrun**: the three replicas as one job, ``torchrun --nproc-per-node 3 --max-restarts K``, the
  checkpoint (every replica's state, ``handle.state_dict()``) written at every synchronisation; a failure
  restarts every worker, which resume from the last checkpoint.

Printed per run: the wall time to finish, the steps of work lost (ours: the killed replica's steps since
its last synchronisation; torchrun: every replica's steps since the last checkpoint), and the final
validation loss of θ_global on the digits held out (the last 20%).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

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


def _train(handle, model, optimizer, replica: int, args: argparse.Namespace, die_at, on_sync=None) -> float:
    """Inner steps until the replicas' step count reaches ``--steps``; the final validation loss of θ_global."""
    import torch
    import torch.nn.functional as F

    (images, labels), (val_x, val_y) = _data()
    while handle.optimizer_steps < args.steps:
        step = handle.optimizer_steps
        began = time.perf_counter()
        generator = torch.Generator().manual_seed(1000 * step + replica)
        order = torch.randint(0, len(labels), (32,), generator=generator)
        F.cross_entropy(model(images[order]), labels[order]).backward()
        optimizer.step()  # the synchronisation runs from the step's hook
        optimizer.zero_grad()
        time.sleep(max(0.0, args.step_seconds - (time.perf_counter() - began)))
        if on_sync is not None and handle.loop.synced:
            on_sync(step + 1)
        if die_at(step + 1):
            os._exit(1)
    handle.sync()
    with handle.global_weights(), torch.no_grad():
        return float(F.cross_entropy(model(val_x), val_y))


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
        lighthouse=args.lighthouse, replica_id=f"replica{args.replica}", timeout=30, quorum_timeout=120))
    kills = {step for step, victim in zip(_kill_steps(args), (2, 1)) if victim == args.replica and not args.replacement}
    loss = _train(handle, model, optimizer, args.replica, args, lambda step: step in kills)
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

    loss = _train(handle, model, optimizer, rank, args, die_at, on_sync=save)
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
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=2000, heartbeat_timeout_ms=2000)
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def start(replica: int, replacement: bool = False) -> subprocess.Popen:
        command = [sys.executable, str(HERE), "--worker", "ours", "--replica", str(replica), "--lighthouse",
                   lighthouse.address(), "--port", str(_free_port()), "--out", str(out), *_common(args)]
        log = open(f"{out}.replica{replica}{'.replacement' if replacement else ''}.log", "w")
        return subprocess.Popen(command + (["--replacement"] if replacement else []), env=env, stdout=log,
                                stderr=subprocess.STDOUT)

    began = time.perf_counter()
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
    return {"seconds": seconds, "steps_lost": lost, **record}


def run_torchrun(args: argparse.Namespace) -> dict:
    out = Path(f"/tmp/gradcomp_ft_torchrun_{args.failures_now}.json")
    for stale in out.parent.glob(out.name + "*"):
        stale.unlink()
    out.with_suffix(".ckpt").unlink(missing_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(REPLICAS), "--max-restarts",
               str(max(args.failures_now, 0)), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
               str(HERE), "--worker", "torchrun", "--out", str(out), *_common(args)]
    began = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seconds = time.perf_counter() - began
    lost = []
    for number, kill_step in enumerate(_kill_steps(args)):
        resumed = int(Path(f"{out}.failed{number}").read_text())
        last_checkpoint = max(resumed, kill_step // args.sync_every * args.sync_every)
        lost.append(REPLICAS * (kill_step - last_checkpoint))
    return {"seconds": seconds, "steps_lost": lost, **json.loads(out.read_text())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--failures", type=int, nargs="+", default=[0, 1, 2], choices=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--step-seconds", type=float, default=0.05)
    parser.add_argument("--lr", type=float, default=0.05, help="the inner SGD's (momentum 0.9)")
    parser.add_argument("--compressor", default="int8")
    parser.add_argument("--methods", nargs="+", default=["ours", "torchrun"], choices=["ours", "torchrun"])
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
            print(f"{method} {failures}: {json.dumps(record)}", flush=True)
    print(f"\n# 3 replicas, digits MLP 64-256-256-10, local updates ({args.compressor}, outer SGD lr 1), H = {args.sync_every}, {args.steps} inner steps of "
          f"{args.step_seconds * 1e3:.0f} ms, 127.0.0.1; failures at steps {[round(args.steps * f) for f in (0.275, 0.625)]}\n")
    print("| method | failures | wall time (s) | steps of work lost per failure | final val loss | vs 0 failures |")
    print("|---|---|---|---|---|---|")
    base = {method: record["val_loss"] for method, failures, record in rows if failures == 0}
    for method, failures, record in rows:
        ratio = f"{record['val_loss'] / base[method]:.3f}" if method in base else "-"
        print(f"| {method} | {failures} | {record['seconds']:.1f} | {record['steps_lost'] or '-'} | "
              f"{record['val_loss']:.4f} | {ratio} |")


if __name__ == "__main__":
    main()
