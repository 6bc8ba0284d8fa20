"""Two "nodes" of 2 processes joined by a slow link: flat against hierarchical compressed exchange.

    sudo python benchmarks/two_level_link.py --rate 100mbit [--model mlp|resnet18] [--methods ...]

Creates two private network namespaces, ``gcnodeA`` and ``gcnodeB``, joined by a veth pair whose ends
(10.77.0.1 and 10.77.0.2, nothing else is addressed) are shaped by ``tc tbf`` to ``--rate`` in each
direction. Ranks 0-1 run in A and ranks 2-3 in B (``GLOO_SOCKET_IFNAME`` is the veth end, so traffic
between the processes of one node stays on its unshaped loopback, and only traffic between nodes crosses
the shaped link). Every method runs in its own 4 processes (gloo, one CPU thread each; the machine's 2
cores are shared, so compute is slower than in ``slow_link.py``), one after the other: plain DDP,
PyTorch's PowerSGD hook (rank 2), gradcomp flat (every rank exchanges compressed with every rank) and
hierarchical (``hierarchy="node"``: dense inside the node, compressed between nodes), and ``noop_hook``,
the bound where communication costs nothing. With ``--methods hsdp...`` the model is sharded with FSDP2
inside each node instead (a ``("replicate", "shard")`` mesh): native HSDP all-reducing the shards between
the nodes in fp32 (``hsdp``) or bf16 (``hsdp_bf16``, ``MixedPrecisionPolicy(reduce_dtype=bf16)``),
``register_fsdp`` with Top-k 0.1%, int8 or PowerSGD rank 2 (``hsdp_topk``, ``hsdp_int8``,
``hsdp_powersgd``), and ``hsdp_noop``, FSDP inside the node with nothing between the nodes (the bound);
``hsdp_diloco``, ``hsdp_diloco_int8`` and ``hsdp_diloco_sparseloco`` train with local updates on the shards
(``local_updates(..., mesh=mesh)``, ``H = --sync-every``, each exchange overlapped with ``--delay`` inner
steps), timed per inner step over ``--steps // H`` whole windows after one, synchronisations included. Printed: median step time over ``--steps`` steps after
warm-up, ratios to DDP and to the bound, and the communication time the network model predicts for
the collectives rank 0 logged (``Network(rate, local_size=2, intra_bandwidth_gbps=--intra-gbps)``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

NODES = {"A": ("gcnodeA", "vgcA", "10.77.0.1"), "B": ("gcnodeB", "vgcB", "10.77.0.2")}
METHODS = ["ddp", "noop", "torch_powersgd", "topk", "topk_hier", "powersgd", "powersgd_hier", "dgc", "dgc_hier"]
#: sharded models: FSDP2 inside a node, native HSDP (fp32, bf16 reduce) or register_fsdp between the nodes
HSDP_METHODS = ["hsdp", "hsdp_bf16", "hsdp_noop", "hsdp_bf16c", "hsdp_int8", "hsdp_topk", "hsdp_topk1",
                "hsdp_sparseloco", "hsdp_powersgd"]
#: local updates on the shards (``local_updates(..., mesh=)``): DiLoCo uncompressed, int8, SparseLoCo, every
#: ``--sync-every`` steps; timed per inner step over whole windows (their synchronisation included)
LOCAL_HSDP_METHODS = {"hsdp_diloco": "none", "hsdp_diloco_int8": "int8", "hsdp_diloco_sparseloco": "sparseloco"}
LOCAL_SIZE = 2


def _ip(*args: str, netns: str = "") -> None:
    prefix = ["ip", "netns", "exec", netns] if netns else []
    subprocess.run([*prefix, *args], check=True)


def create_nodes(rate: str) -> None:
    """Two namespaces joined by a veth pair shaped to ``rate`` each way (recreated; root only)."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        raise SystemExit("two_level_link: needs `ip` and `tc` (apt-get install iproute2) and root")
    existing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for netns, _, _ in NODES.values():
        if netns in existing:
            _ip("ip", "netns", "del", netns)
        _ip("ip", "netns", "add", netns)
        _ip("ip", "link", "set", "lo", "up", netns=netns)
    (ns_a, dev_a, _), (ns_b, dev_b, _) = NODES["A"], NODES["B"]
    _ip("ip", "link", "add", dev_a, "netns", ns_a, "type", "veth", "peer", "name", dev_b, "netns", ns_b)
    for netns, dev, address in NODES.values():
        _ip("ip", "addr", "add", f"{address}/24", "dev", dev, netns=netns)
        _ip("ip", "link", "set", dev, "up", netns=netns)
        _ip("tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "256kb", "latency", "100ms",
            netns=netns)


def worker(rank: int, port: int, steps: int, warmup: int, method: str, model_name: str, out: str,
           sync_every: int = 10, delay: int = 0) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, powerSGD_hook

    from lightning_gradcomp.compressors import DGC, PowerSGD, TopK
    from lightning_gradcomp.ddp.hierarchy import HierarchicalHookState, node_groups
    from lightning_gradcomp.ddp.hook import GradCompHookState, gradcomp_hook
    from _timing import ddp_step_times
    from slow_link import build_model

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR=NODES["A"][2], MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2 * LOCAL_SIZE)
    if method.startswith("hsdp"):
        hsdp_worker(rank, steps, warmup, method, model_name, out, sync_every, delay)
        return
    hierarchical = method.endswith("_hier")
    groups = node_groups(2, LOCAL_SIZE) if hierarchical else None  # every rank creates the groups
    method = method.removesuffix("_hier")
    model, batch_shape = build_model(model_name)
    ddp = nn.parallel.DistributedDataParallel(model)
    names = {id(p): n for n, p in model.named_parameters()}
    state = None
    if method == "noop":
        ddp.register_comm_hook(None, debugging_hooks.noop_hook)
    elif method == "torch_powersgd":
        torch_state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2)
        ddp.register_comm_hook(torch_state, powerSGD_hook.powerSGD_hook)
    elif method != "ddp":
        compressor = {"topk": TopK(0.001), "dgc": DGC(0.001, momentum=0.9), "powersgd": PowerSGD(rank=2)}[method]
        if groups is not None:
            state = HierarchicalHookState(compressor, names, intra_group=groups[0], cross_group=groups[1])
        else:
            state = GradCompHookState(compressor, names)
        ddp.register_comm_hook(state, gradcomp_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch_shape, generator=generator), torch.randint(0, 10, (batch_shape[0],), generator=generator)
    collectives: list = []

    def keep_collectives() -> None:  # the last step's collectives, for the network model
        nonlocal collectives
        if state is not None:
            collectives = state.take_step_stats().collectives

    step_times = ddp_step_times(ddp, optimizer, x, y, steps, warmup, keep_collectives)
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    if rank == 0:
        Path(out).write_text(json.dumps({"times": step_times, "collectives": collectives, "dense": dense}))
    dist.destroy_process_group()


def hsdp_worker(rank: int, steps: int, warmup: int, method: str, model_name: str, out: str,
                sync_every: int = 10, delay: int = 0) -> None:
    """One rank of a sharded method: FSDP2 over the node's 2 processes, the nodes as replicas."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy

    import lightning_gradcomp
    from lightning_gradcomp.compressors import PowerSGD, TopK
    from _timing import ddp_step_times, window_step_times
    from slow_link import build_model

    mesh = init_device_mesh("cpu", (2, LOCAL_SIZE), mesh_dim_names=("replicate", "shard"))
    model, batch_shape = build_model(model_name)
    native = method in ("hsdp", "hsdp_bf16")
    policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16 if method == "hsdp_bf16" else None)
    shard_mesh = mesh if native else mesh["shard"]  # native: a 2-D mesh, FSDP all-reduces the replicas itself
    blocks = [m for m in model.modules() if type(m).__name__ in ("BasicBlock", "TransformerEncoderLayer")] or \
        [m for m in model.modules() if isinstance(m, nn.Linear)]
    for block in blocks:
        fully_shard(block, mesh=shard_mesh, mp_policy=policy)
    fully_shard(model, mesh=shard_mesh, mp_policy=policy)
    handle = None
    if method == "hsdp_noop":
        for module in [*blocks, model]:
            module.set_all_reduce_hook(lambda reduce_output: None)
    elif method in LOCAL_HSDP_METHODS:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        local = lightning_gradcomp.local_updates(model, optimizer, sync_every, LOCAL_HSDP_METHODS[method], mesh=mesh,
                                                 delay=delay)
        generator = torch.Generator().manual_seed(rank)
        x = torch.randn(batch_shape, generator=generator)
        y = torch.randint(0, 10, (batch_shape[0],), generator=generator)
        taken: list = []  # every step's figures (an overlapped exchange is counted when it completes)

        def outer_step() -> None:
            local.step()
            taken.append(local.hook_state.take_step_stats())

        windows = max(1, steps // sync_every)
        times = window_step_times(model, optimizer, x, y, outer_step, sync_every, windows)
        local.close()
        per_step = sum(stats.bytes_sent for stats in taken) / len(taken)
        synced = next(stats for stats in reversed(taken) if stats.bytes_sent)
        if rank == 0:
            Path(out).write_text(json.dumps({"times": times, "collectives": synced.collectives, "sharded": True,
                                             "dense": sum(p.to_local().numel() * 4 for p in model.parameters()),
                                             "bytes_sent": per_step, "bytes_per_sync": per_step * sync_every,
                                             "sync_every": sync_every}))
        dist.destroy_process_group()
        return
    elif not native:
        compressor = {"hsdp_topk": TopK(0.001), "hsdp_topk1": TopK(0.01), "hsdp_int8": "int8", "hsdp_bf16c": "bf16",
                      "hsdp_sparseloco": "sparseloco", "hsdp_powersgd": PowerSGD(rank=2)}[method]
        handle = lightning_gradcomp.register_fsdp(model, mesh, compressor)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch_shape, generator=generator), torch.randint(0, 10, (batch_shape[0],), generator=generator)
    collectives: list = []
    bytes_sent = 0.0

    def keep_collectives() -> None:
        nonlocal collectives, bytes_sent
        if handle is not None:
            stats = handle.hook_state.take_step_stats()
            collectives, bytes_sent = stats.collectives, stats.bytes_sent

    step_times = ddp_step_times(model, optimizer, x, y, steps, warmup, keep_collectives)
    # what one rank's shard of the gradients weighs in fp32: what native HSDP all-reduces between the nodes
    dense = sum(p.to_local().numel() * 4 for p in model.parameters())
    if native:
        bytes_sent = dense / (2 if method == "hsdp_bf16" else 1)
    if rank == 0:
        Path(out).write_text(json.dumps({"times": step_times, "collectives": collectives, "dense": dense,
                                         "sharded": True, "bytes_sent": bytes_sent}))
    dist.destroy_process_group()


def run_method(method: str, args: argparse.Namespace) -> tuple[dict, str]:
    """Four worker processes (two per node) for one method; rank 0's record, or why they failed."""
    out = Path(args.out).with_suffix(f".{method}.json")
    out.unlink(missing_ok=True)
    from slow_link import _free_port  # any free port of this host is free on the veth address too

    port = _free_port()
    here = str(Path(__file__).resolve())
    procs = []
    for rank in range(2 * LOCAL_SIZE):
        netns, dev, _ = NODES["A" if rank < LOCAL_SIZE else "B"]
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=dev,
                   PYTHONPATH=os.pathsep.join(filter(None, [str(Path(here).parent), os.environ.get("PYTHONPATH")])))
        command = ["ip", "netns", "exec", netns, sys.executable, here, "--worker", str(rank), "--port", str(port),
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", str(out), "--methods", method,
                   "--model", args.model, "--sync-every", str(args.sync_every), "--delay", str(args.delay)]
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [p.communicate(timeout=args.timeout)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        return {}, f"timed out after {args.timeout} s"
    if any(p.returncode for p in procs) or not out.exists():
        lines = [line for text in outputs for line in text.splitlines() if line.strip()]
        reason = next((line for line in reversed(lines) if "Error" in line or "error" in line), lines[-1] if lines else "")
        return {}, f"crashed (exit codes {[p.returncode for p in procs]}): {reason.strip()[-200:]}"
    return json.loads(out.read_text()), ""


def _rate_gbps(rate: str) -> float:
    from lightning_gradcomp.tools.estimate import parse_bandwidth

    return parse_bandwidth(rate)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--model", default="mlp", choices=["mlp", "resnet18", "transformer"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--intra-gbps", type=float, default=10.0,
                        help="the network model's bandwidth inside a node (this VM's TCP loopback)")
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS + HSDP_METHODS + list(LOCAL_HSDP_METHODS))
    parser.add_argument("--sync-every", type=int, default=10, help="H of the hsdp_diloco* methods")
    parser.add_argument("--delay", type=int, default=0,
                        help="the hsdp_diloco* methods' delay: each exchange overlapped with this many inner steps")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="/tmp/gradcomp_two_level", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.port, args.steps, args.warmup, args.methods[0], args.model, args.out, args.sync_every,
               args.delay)
        return
    from lightning_gradcomp.metrics.netmodel import Network

    create_nodes(args.rate)
    network = Network(_rate_gbps(args.rate), 50.0, local_size=LOCAL_SIZE, intra_bandwidth_gbps=args.intra_gbps,
                      intra_latency_us=10.0)
    results = {}
    for method in args.methods:
        record, failure = run_method(method, args)
        results[method] = (record, failure)
        median = statistics.median(record["times"]) * 1e3 if record else float("nan")
        print(f"{method}: {failure or f'{median:.1f} ms'}", flush=True)
    medians = {m: statistics.median(r["times"]) * 1e3 for m, (r, f) in results.items() if r}
    print(f"\n# 2 nodes x {LOCAL_SIZE} processes, gloo, 1 thread each, {args.rate} between nodes (veth, tc tbf), "
          f"loopback inside a node; {args.model}; median of {args.steps} steps after {args.warmup} warm-up; "
          f"model: {network}\n")
    print("| method | step (ms) | speed-up vs DDP (hsdp_*: vs native HSDP fp32) | vs native HSDP bf16 | "
          "time / noop bound | bytes sent / rank / step | predicted communication (ms) | "
          "measured step - bound (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    for method, (record, failure) in results.items():
        if not record:
            print(f"| {method} | {failure} | | | | | | |")
            continue
        median = medians[method]
        if record.get("sharded"):  # the replicas' exchange of a shard between the 2 nodes, LOCAL_SIZE at once
            cross = Network(_rate_gbps(args.rate) / LOCAL_SIZE, 50.0)
            kept = [tuple(c) for c in record["collectives"]]
            predicted = (cross.all_reduce_time(record["dense"] / (2 if method == "hsdp_bf16" else 1), 2)
                         if method in ("hsdp", "hsdp_bf16") else cross.step_time(kept, 2) if kept else 0.0) * 1e3
            predicted /= record.get("sync_every", 1)  # local updates: one synchronisation per window
        elif method == "ddp":
            predicted = network.all_reduce_time(record["dense"], 2 * LOCAL_SIZE) * 1e3
        elif record["collectives"]:
            predicted = network.step_time([tuple(c) for c in record["collectives"]], 2 * LOCAL_SIZE) * 1e3
        else:
            predicted = float("nan")
        bound = medians.get("hsdp_noop" if method.startswith("hsdp") else "noop", float("nan"))
        baseline = medians.get("hsdp" if method.startswith("hsdp") else "ddp", float("nan"))
        versus_bf16 = f"{medians['hsdp_bf16'] / median:.2f}x" if method.startswith("hsdp") and "hsdp_bf16" in medians \
            else "-"
        sent = f"{record['bytes_sent']:,.0f}" if record.get("sharded") else "-"
        print(f"| {method} | {median:.1f} | {baseline / median:.2f}x | {versus_bf16} | {median / bound:.2f} | {sent} | "
              f"{predicted:.1f} | {median - bound:.1f} |")


if __name__ == "__main__":
    main()
