"""Local updates on an FSDP2 model: ours (``local_updates(..., mesh=)``) side by side with torchft's ``DiLoCo``.

    sudo python benchmarks/torchft_side_by_side.py --rate 100mbit --steps 60 --sync-every 10
    python benchmarks/torchft_side_by_side.py --rate none --steps 60          # loopback: no root, no shaping
    python benchmarks/torchft_side_by_side.py --rate none --inside ddp        # DDP inside each group

Two replica groups of 2 processes, each sharding the byte-level text model (``examples/text.py``:
``ByteTransformer``, ``--width``/``--layers``) with FSDP2 over its 2 ranks. With ``--rate`` the groups are two
"nodes" (the network namespaces of ``two_level_link.py``, joined by a veth pair shaped to the rate), and
only the exchange between the groups crosses the shaped link. Methods, each in 4 fresh processes:

* ``bound``: FSDP inside each group, nothing between the groups (the time per inner step where
  synchronisations cost nothing);
* ``torchft``: torchft's ``DiLoCo`` (its ``Manager`` with ``use_async_quorum=False``, its ``ProcessGroupGloo``
  between the groups, the lighthouse in rank 0's process): each group its own ``torch.distributed`` world, as
  torchft's jobs are; its outer gradients go dense in fp32 (its quantised all-reduce needs Triton and CUDA);
  ``torchft_bucketized``: the same with ``use_bucketization=True``;
* ``ours``, ``ours_int8``, ``ours_sparseloco``: one world of 4 ranks, a ``("replicate", "shard")`` mesh and
  ``local_updates(model, optimizer, H, compressor, mesh=mesh)``; SparseLoCo with outer SGD at lr 1 (its
  paper's), the others with DiLoCo's Nesterov SGD (lr 0.7, momentum 0.9), as torchft's.

Every method trains the same model from the same seed on the same batches (each rank its own) with AdamW.
Printed per method: the time per inner step (mean over the run, synchronisations included, validation
excluded), the bytes each rank hands to the collectives per synchronisation (torchft's counted at its
``Manager.allreduce``, ours by the exchange's own count), and the validation loss of ``θ_global`` after each
synchronisation (nats per byte on held-out text). Needs ``pip install torchft`` (the ``ft`` extra) and the
text (``apt-get install python3.11-doc``).

``--inside ddp``: each group's 2 processes hold the whole model under ``DistributedDataParallel`` (a gradient
all-reduce inside the group every step) instead of sharding it. torchft's ``DiLoCo`` then all-reduces the
whole model from every rank; ours runs under fault tolerance (``local_updates(ddp, ..., fault_tolerance=...)``,
the lighthouse in rank 0's process), each rank exchanging a row block of every parameter. Loopback only
(``--rate none``): torchft's checkpoint transport, which our groups' first quorum uses, advertises the host
name, and inside the benchmark's network namespaces that name resolves to each namespace's own loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
METHODS = ["bound", "torchft", "torchft_bucketized", "ours", "ours_int8", "ours_sparseloco"]
OURS = {"ours": "none", "ours_int8": "int8", "ours_sparseloco": "sparseloco"}
GROUP = 2  # processes per replica group (FSDP's shard group)


def _batches(rank: int, args: argparse.Namespace):
    """This rank's training batches (a fixed draw per step) and the validation windows."""
    import torch
    from lightning_gradcomp.examples.text import DEBIAN_PYTHON_DOCS, read_corpus

    data = read_corpus(DEBIAN_PYTHON_DOCS, max_bytes=4_000_000).long()
    split = int(len(data) * 0.95)
    train, held_out = data[:split], data[split:]
    context = args.context

    def windows(source, starts):
        rows = torch.stack([source[s:s + context + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]

    def batch(step: int):
        generator = torch.Generator().manual_seed(1000 * step + rank)
        return windows(train, torch.randint(0, len(train) - context - 1, (args.batch,), generator=generator))

    validation = windows(held_out, torch.arange(0, 64 * (context + 1), context + 1))
    return batch, validation


def _model(args: argparse.Namespace, mesh):
    """The text model, sharded over ``mesh`` (``None``: whole)."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from lightning_gradcomp.examples.text import ByteTransformer

    torch.manual_seed(0)
    model = ByteTransformer(context=args.context, width=args.width, layers=args.layers, heads=4)
    if mesh is None:
        return model
    for block in model.blocks.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def worker(rank: int, method: str, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    replica, group_rank = divmod(rank, GROUP)
    own_address = args.addresses[replica]
    lighthouse = None
    inside_ddp = args.inside == "ddp"
    if method.startswith("torchft") or method == "bound" or inside_ddp:  # a world per replica group
        if method != "bound" and rank == 0:
            from torchft._torchft import LighthouseServer

            lighthouse = LighthouseServer(bind=f"[::]:{args.port + 9}", min_replicas=2)
        os.environ.update(MASTER_ADDR=own_address, MASTER_PORT=str(args.port + 1 + replica))
        dist.init_process_group("gloo", rank=group_rank, world_size=GROUP)
        shard_mesh = None if inside_ddp else init_device_mesh("cpu", (GROUP,))
        mesh = None
    else:
        os.environ.update(MASTER_ADDR=args.addresses[0], MASTER_PORT=str(args.port))
        dist.init_process_group("gloo", rank=rank, world_size=2 * GROUP)
        mesh = init_device_mesh("cpu", (2, GROUP), mesh_dim_names=("replicate", "shard"))
        shard_mesh = mesh["shard"]
    model = _model(args, shard_mesh)
    forward = torch.nn.parallel.DistributedDataParallel(model) if inside_ddp else model
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95))
    batch, (val_x, val_y) = _batches(rank, args)
    sent = [0]
    handle = manager = diloco = None
    if method.startswith("torchft"):
        from datetime import timedelta

        from torchft import Manager, ProcessGroupGloo
        from torchft.local_sgd import DiLoCo

        manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=600)), min_replica_size=2,
                          use_async_quorum=False, load_state_dict=None, state_dict=None, init_sync=False,
                          replica_id=f"replica{replica}", store_addr=own_address, store_port=args.port + 1 + replica,
                          rank=group_rank, world_size=GROUP, lighthouse_addr=f"http://{args.addresses[0]}:{args.port + 9}",
                          hostname=own_address, timeout=timedelta(seconds=600), quorum_timeout=timedelta(seconds=600))
        allreduce = manager.allreduce

        def counted(tensor, *a, **k):  # the bytes handed to the collective (an all-reduce sends its input)
            sent[0] += tensor.numel() * tensor.element_size()
            return allreduce(tensor, *a, **k)

        manager.allreduce = counted
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        diloco = DiLoCo(manager, [model], inner, outer, sync_every=args.sync_every,
                        use_bucketization=method == "torchft_bucketized").__enter__()
    elif method in OURS:
        import functools

        import lightning_gradcomp

        outer = (functools.partial(torch.optim.SGD, lr=1.0) if method == "ours_sparseloco" else None)
        if inside_ddp:  # a world per group, torchft between them: every rank exchanges a row block
            fault_tolerance = lightning_gradcomp.FaultTolerance(
                lighthouse=f"http://{args.addresses[0]}:{args.port + 9}", replica_id=f"replica{replica}", timeout=600,
                quorum_timeout=600)
            handle = lightning_gradcomp.local_updates(forward, inner, args.sync_every, OURS[method],
                                                      outer_optimizer=outer, fault_tolerance=fault_tolerance)
        else:
            handle = lightning_gradcomp.local_updates(model, inner, args.sync_every, OURS[method], mesh=mesh,
                                                      outer_optimizer=outer)

    def validate() -> float:
        with torch.no_grad():
            return float(F.cross_entropy(model(val_x).reshape(-1, 256), val_y.reshape(-1)))

    losses, train_seconds = [], 0.0
    for step in range(args.steps):
        x, y = batch(step)
        dist.barrier()
        began = time.perf_counter()
        F.cross_entropy(forward(x).reshape(-1, 256), y.reshape(-1)).backward()
        inner.step()  # the synchronisation runs from the step's hook (ours and torchft's)
        inner.zero_grad()
        train_seconds += time.perf_counter() - began
        if handle is not None:
            sent[0] += handle.hook_state.take_step_stats().bytes_sent
        if (step + 1) % args.sync_every == 0:
            if handle is not None:
                with handle.global_weights():
                    losses.append(validate())
            else:
                losses.append(validate())  # torchft: the parameters are θ_global after a synchronisation
    syncs = args.steps // args.sync_every
    record = {"step_ms": 1e3 * train_seconds / args.steps, "bytes_per_sync": sent[0] / syncs if syncs else 0.0,
              "val_losses": losses}
    if manager is not None:
        record["commits"] = manager.current_step()
    if rank == 0:
        Path(args.out).with_suffix(f".{method}.json").write_text(json.dumps(record))
    dist.barrier()
    if diloco is not None:
        diloco.__exit__(None, None, None)
        manager.shutdown(wait=False)
    if handle is not None:
        handle.close()
    dist.destroy_process_group()
    if lighthouse is not None:
        lighthouse.shutdown()


def run_method(method: str, args: argparse.Namespace, shaped: bool) -> tuple[dict, str]:
    from slow_link import _free_port
    from two_level_link import NODES

    out = Path(args.out).with_suffix(f".{method}.json")
    out.unlink(missing_ok=True)
    port = _free_port()
    addresses = [NODES["A"][2], NODES["B"][2]] if shaped else ["127.0.0.1", "127.0.0.1"]
    procs = []
    for rank in range(2 * GROUP):
        node = "A" if rank < GROUP else "B"
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
        command = [sys.executable, __file__, "--worker", str(rank), "--port", str(port), "--methods", method,
                   "--addresses", *addresses, "--out", args.out, "--steps", str(args.steps), "--sync-every",
                   str(args.sync_every), "--width", str(args.width), "--layers", str(args.layers), "--context",
                   str(args.context), "--batch", str(args.batch), "--lr", str(args.lr), "--inside", args.inside]
        if shaped:
            env["GLOO_SOCKET_IFNAME"] = NODES[node][1]
            command = ["ip", "netns", "exec", NODES[node][0], *command]
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [p.communicate(timeout=args.timeout)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        return {}, f"timed out after {args.timeout} s"
    if any(p.returncode for p in procs) or not out.exists():
        lines = [line for text in outputs for line in text.splitlines() if line.strip()]
        reason = next((line for line in reversed(lines) if "Error" in line), lines[-1] if lines else "")
        return {}, f"crashed (exit codes {[p.returncode for p in procs]}): {reason.strip()[-300:]}"
    return json.loads(out.read_text()), ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="100mbit", help="between the two nodes, or 'none' (loopback, unshaped)")
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--inside", choices=["fsdp", "ddp"], default="fsdp",
                        help="inside each group: FSDP2 shards (default) or DDP replicas (loopback only)")
    parser.add_argument("--out", default="/tmp/gradcomp_torchft")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--addresses", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    if args.worker is not None:
        worker(args.worker, args.methods[0], args)
        return
    shaped = args.rate != "none"
    if shaped and args.inside == "ddp":
        parser.error("--inside ddp runs on loopback only (--rate none); see the module's docstring")
    if shaped:
        from two_level_link import create_nodes

        create_nodes(args.rate)
    results = {}
    for method in args.methods:
        record, failure = run_method(method, args, shaped)
        results[method] = (record, failure)
        print(f"{method}: {failure or json.dumps(record)}", flush=True)
    bound = results.get("bound", ({}, ""))[0].get("step_ms", float("nan"))
    torchft = results.get("torchft", ({}, ""))[0].get("step_ms", float("nan"))
    inside = "FSDP2 shards" if args.inside == "fsdp" else "DDP processes"
    print(f"\n# 2 replica groups x {GROUP} {inside}, gloo, 1 thread each; {args.rate} between the groups; "
          f"ByteTransformer width {args.width}, {args.layers} layers; {args.steps} inner steps, H = {args.sync_every}, "
          f"AdamW lr {args.lr}, batch {args.batch} x {args.context} bytes per rank\n")
    print("| method | ms / inner step | / bound | vs torchft | bytes / rank / sync | val loss after each sync |")
    print("|---|---|---|---|---|---|")
    for method, (record, failure) in results.items():
        if not record:
            print(f"| {method} | {failure} | | | | |")
            continue
        ms = record["step_ms"]
        losses = ", ".join(f"{loss:.3f}" for loss in record["val_losses"])
        print(f"| {method} | {ms:.1f} | {ms / bound:.2f} | {torchft / ms:.2f}x | {record['bytes_per_sync']:,.0f} | "
              f"{losses} |")


if __name__ == "__main__":
    main()
