"""One replica group (one process) of a fault-tolerant local-updates job on the digits MLP (run by
tests/test_fault_tolerance.py; the test starts torchft's lighthouse on 127.0.0.1).

    python ft_replica.py --replica 0 --lighthouse http://127.0.0.1:PORT --port STORE_PORT --out /tmp/r0

Trains until the outer loop's step counter reaches ``--steps`` (a replacement that healed from a peer starts
from the peer's position), ``--die-at K``: leaves with ``os._exit`` right after inner step K (inside a window).
Writes ``<out>.pt``: the per-step losses, θ_global after each synchronisation (by synchronisation number),
the fault-tolerance figures and the final parameters.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn

import lightning_gradcomp
from lightning_gradcomp import FaultTolerance


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replica", required=True)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--compressor", default="int8")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--sync-every", type=int, default=4)
    parser.add_argument("--fragments", type=int, default=1)
    parser.add_argument("--delay", type=int, default=0)
    parser.add_argument("--die-at", type=int, default=None)
    parser.add_argument("--die-in-sync", type=int, default=None,
                        help="leave right after joining the quorum of synchronisation K, before its exchange")
    parser.add_argument("--disagree-in-sync", type=int, default=None,
                        help="claim another fragment in the agreement check of synchronisation K (once)")
    parser.add_argument("--expected-groups", type=int, default=None, help="FaultTolerance(expected_groups=...)")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="a longer inner step (the digits MLP's takes 1 ms)")
    parser.add_argument("--window-seconds", default=None, help="time-boxed windows: 'auto' or seconds")
    parser.add_argument("--stall", type=float, nargs=2, default=None, metavar=("STEP", "SECONDS"),
                        help="stall once, for SECONDS, after inner step STEP")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)  # this replica group's own world

    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target)
    torch.manual_seed(int(args.replica) + 100)  # every group its own initial weights: the quorum agrees on one
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    handle = lightning_gradcomp.local_updates(
        model, optimizer, args.sync_every, args.compressor, min_compress_numel=256, fragments=args.fragments,
        delay=args.delay, window_seconds=args.window_seconds if args.window_seconds in (None, "auto") else float(args.window_seconds),
        fault_tolerance=FaultTolerance(lighthouse=args.lighthouse, replica_id=f"group{args.replica}", timeout=20,
                                       quorum_timeout=60, connect_timeout=10, expected_groups=args.expected_groups,
                                       start_timeout=60))
    loop = handle.loop
    if args.die_in_sync is not None:  # the others' exchange of that synchronisation fails: they roll it back
        quorum = loop.membership.quorum

        def quorum_then_die():
            taken = quorum()
            if loop.outer.syncs + 1 == args.die_in_sync:
                os._exit(0)
            return taken

        loop.membership.quorum = quorum_then_die
    if args.disagree_in_sync is not None:  # every participant's check fails: all roll that synchronisation back
        agree, disagreed = loop.membership.agree, []

        def agree_or_not(fragment: int, merge_at: int) -> None:
            if loop.outer.syncs + 1 == args.disagree_in_sync and not disagreed:
                disagreed.append(True)
                fragment += 1
            agree(fragment, merge_at)

        loop.membership.agree = agree_or_not
    result: dict = {"losses": [], "global": {}, "first_step": loop.outer.optimizer_steps}

    def keep_global() -> None:
        result["global"][loop.outer.syncs] = [glob.detach().clone() for glob in loop.outer.global_params]

    keep_global()  # a replacement: θ_global as received and synchronised at its first quorum
    if args.window_seconds is not None:
        handle.run_for(args.steps)  # the groups take different numbers of steps: the run ends where they plan it
    while handle.optimizer_steps < args.steps and not handle.finished:
        step = handle.optimizer_steps
        generator = torch.Generator().manual_seed(1000 * step + int(args.replica))
        order = torch.randint(0, len(labels), (32,), generator=generator)
        loss = nn.functional.cross_entropy(model(images[order]), labels[order])
        loss.backward()
        optimizer.step()  # the synchronisation runs from the step's hook, every --sync-every steps
        optimizer.zero_grad()
        result["losses"].append((step + 1, float(loss)))
        time.sleep(args.step_seconds)
        if args.stall is not None and step + 1 == int(args.stall[0]):
            time.sleep(args.stall[1])
        if loop.synced:
            result.setdefault("synced_at", []).append(time.monotonic())
            keep_global()
        if args.die_at is not None and step + 1 == args.die_at:
            os._exit(0)
    figures = handle.fault_tolerance
    result.update(participants=list(figures.participants), commits=figures.commits, rollbacks=figures.rollbacks,
                  heals=figures.heals, syncs=loop.outer.syncs, summary=handle.summary(), windows=loop.outer.windows,
                  finished=handle.finished,
                  params=[p.detach().clone() for p in model.parameters()])
    torch.save(result, f"{args.out}.pt")
    handle.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
