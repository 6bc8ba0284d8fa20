"""Ranks of the side-by-side test of our sharded DiLoCo and torchft's ``DiLoCo`` (tests/test_torchft_diloco.py):
4 processes, 2 replica groups x 2 FSDP2 shards, torchft's lighthouse on 127.0.0.1 (started by the test)."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import lightning_gradcomp
from tests._fsdp_workers import _batch, _model, _shard

SYNC_EVERY = 3
STEPS = 3 * SYNC_EVERY


def _optimizers(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    return inner, outer


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> None:
    for step in range(STEPS):
        x, y = _batch(step, rank)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def _torchft_run(rank: int, ports: list[int], lighthouse: str) -> dict[str, torch.Tensor]:
    """torchft's DiLoCo, as its users run it: each replica group its own torch.distributed world (FSDP2 over
    its 2 ranks), torchft's Manager and process group between the groups."""
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    replica, group_rank = divmod(rank, 2)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[1 + replica]))
    dist.init_process_group("gloo", rank=group_rank, world_size=2)
    model = _shard(_model(), init_device_mesh("cpu", (2,)))
    inner, outer = _optimizers(model)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=60)), min_replica_size=2, use_async_quorum=False,
                      load_state_dict=None, state_dict=None, init_sync=False, replica_id=f"replica{replica}",
                      store_addr="127.0.0.1", store_port=ports[1 + replica], rank=group_rank, world_size=2,
                      lighthouse_addr=lighthouse, timeout=timedelta(seconds=60))
    try:
        with DiLoCo(manager, [model], inner, outer, sync_every=SYNC_EVERY):
            _train(model, inner, rank)
        assert manager.current_step() == STEPS // SYNC_EVERY, manager.current_step()
        return {name: p.to_local().detach().clone() for name, p in model.named_parameters()}
    finally:
        manager.shutdown(wait=False)
        dist.destroy_process_group()


def check_diloco_equals_torchft(rank: int, world_size: int, ports: list[int], lighthouse: str) -> None:
    """After 3 synchronisations of H = 3 (inner SGD with momentum, outer Nesterov SGD), each rank's shard of our
    uncompressed DiLoCo equals torchft's bit for bit (the issue asks 1e-6; with 2 replicas halving is exact, so
    our average, each Δ divided by N and then summed, and torchft's, summed and then divided, agree)."""
    theirs = _torchft_run(rank, ports, lighthouse)
    ours = _mesh_run(rank, ports, "none")
    assert sorted(theirs) == sorted(ours)
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], atol=0, rtol=0, msg=lambda m: f"{name}: {m}")


def _fault_tolerant_sharded_run(rank: int, ports: list[int], lighthouse: str, compressor: str) -> dict[str, torch.Tensor]:
    """Ours under torchft: each replica group its own world of 2 ranks sharding the model, the groups joined by
    torchft's lighthouse and process group (``local_updates(..., fault_tolerance=...)``, no mesh)."""
    from lightning_gradcomp import FaultTolerance

    replica, group_rank = divmod(rank, 2)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[1 + replica]))
    dist.init_process_group("gloo", rank=group_rank, world_size=2)
    try:
        model = _shard(_model(), init_device_mesh("cpu", (2,)))
        inner, _ = _optimizers(model)
        handle = lightning_gradcomp.local_updates(
            model, inner, SYNC_EVERY, compressor, min_compress_numel=64,
            outer_optimizer=lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True),
            fault_tolerance=FaultTolerance(lighthouse=lighthouse, replica_id=f"group{replica}", timeout=30))
        _train(model, inner, rank)
        figures = handle.fault_tolerance
        assert handle.loop.outer.syncs == STEPS // SYNC_EVERY == figures.commits and figures.participants[-1] == 2
        shards = {name: p.to_local().detach().clone() for name, p in model.named_parameters()}
        handle.close()
        return shards
    finally:
        dist.destroy_process_group()


def _mesh_run(rank: int, ports: list[int], compressor: str) -> dict[str, torch.Tensor]:
    """Ours: one world of the 4 ranks, a ("replicate", "shard") mesh, ``local_updates(..., mesh=mesh)``; a whole
    model under fault tolerance on a job of 4 processes without DDP inside is refused (at the first step)."""
    import pytest

    from lightning_gradcomp.local.handle import require_gradient_all_reduce

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        model = _shard(_model(), mesh["shard"])
        inner, _ = _optimizers(model)
        handle = lightning_gradcomp.local_updates(
            model, inner, SYNC_EVERY, compressor, mesh=mesh, min_compress_numel=64,
            outer_optimizer=lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True))
        _train(model, inner, rank)
        assert handle.loop.outer.syncs == STEPS // SYNC_EVERY
        shards = {name: p.to_local().detach().clone() for name, p in model.named_parameters()}
        handle.close()
        whole = nn.Linear(4, 2)
        with pytest.raises(ValueError, match="4 processes, which must train one model: wrap it in DistributedDataParallel"):
            require_gradient_all_reduce(whole)
        return shards
    finally:
        dist.destroy_process_group()


def check_fault_tolerant_shards_equal_the_mesh(rank: int, world_size: int, ports: list[int], lighthouse: str) -> None:
    """Two replica groups of 2 FSDP2 ranks joined by torchft, int8: each rank's shard ends bit for bit where the
    same rank of a 2 x 2 mesh's ``local_updates(..., mesh=mesh)`` does (no faults: the same exchange, over
    torchft's group instead of ``mesh["replicate"]``)."""
    theirs = _fault_tolerant_sharded_run(rank, ports, lighthouse, "int8")
    ours = _mesh_run(rank, ports, "int8")
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), (name, (ours[name] - theirs[name]).abs().max())


def _group_batch(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A replica group's batch at ``step``: its two ranks' batches (DDP averages their gradients)."""
    (x0, y0), (x1, y1) = _batch(step, 2 * replica), _batch(step, 2 * replica + 1)
    return torch.cat([x0, x1]), torch.cat([y0, y1])


def _ddp_group_run(rank: int, ports: list[int], lighthouse: str, compressor: str) -> dict:  # ports[1], [2]: the groups
    """Ours under torchft with a whole model on replica groups of 2 processes, DDP inside each group: group 0
    passes the DDP wrapper to ``local_updates``, group 1 the bare model (its wrapper made after); rank 1 of
    each group starts from other weights (made equal at ``local_updates``)."""
    from torch.nn.parallel import DistributedDataParallel

    from lightning_gradcomp import FaultTolerance

    replica, group_rank = divmod(rank, 2)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[1 + replica]))
    dist.init_process_group("gloo", rank=group_rank, world_size=2)
    try:
        model = _model()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(group_rank)
        inner, _ = _optimizers(model)
        ft = FaultTolerance(lighthouse=lighthouse, replica_id=f"ddp-group{replica}", timeout=30)
        outer = lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)  # noqa: E731
        if replica == 0:
            ddp = DistributedDataParallel(model)
            handle = lightning_gradcomp.local_updates(ddp, inner, SYNC_EVERY, compressor, min_compress_numel=64,
                                                      outer_optimizer=outer, fault_tolerance=ft)
        else:
            handle = lightning_gradcomp.local_updates(model, inner, SYNC_EVERY, compressor, min_compress_numel=64,
                                                      outer_optimizer=outer, fault_tolerance=ft)
            ddp = DistributedDataParallel(model)
        for step in range(STEPS):
            x, y = _batch(step, rank)
            nn.functional.cross_entropy(ddp(x), y).backward()
            inner.step()
            inner.zero_grad()
        assert handle.loop.outer.syncs == STEPS // SYNC_EVERY == handle.fault_tolerance.commits
        result = {"params": [p.detach().clone() for p in model.parameters()], "totals": handle.totals,
                  "global": [g.detach().clone() for g in handle.loop.outer.global_params]}
        handle.close()
        return result
    finally:
        dist.destroy_process_group()


def _one_process_per_group_run(replica: int, port: int) -> dict:
    """The reference: one process per group (a world of 2, replicated local updates), each on its group's
    two batches at once."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=replica, world_size=2)
    try:
        model = _model()
        inner, _ = _optimizers(model)
        handle = lightning_gradcomp.local_updates(
            model, inner, SYNC_EVERY, "none", min_compress_numel=64,
            outer_optimizer=lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True))
        for step in range(STEPS):
            x, y = _group_batch(step, replica)
            nn.functional.cross_entropy(model(x), y).backward()
            inner.step()
            inner.zero_grad()
        result = {"params": [p.detach().clone() for p in model.parameters()], "totals": handle.totals}
        handle.close()
        return result
    finally:
        dist.destroy_process_group()


def check_ddp_groups_split_the_exchange(rank: int, world_size: int, ports: list[int], lighthouse: str,
                                        second_lighthouse: str) -> None:
    """Two replica groups of 2 DDP processes joined by torchft, uncompressed: every process ends where one
    process per group on the group's whole batch does (within float rounding: DDP averages the two halves'
    gradients), and the group's two ranks split the bytes between groups (together one model's, as one
    process per group sends); with int8 too, all four end equal."""
    ours = _ddp_group_run(rank, ports, lighthouse, "none")
    replica, group_rank = divmod(rank, 2)
    gathered: list = [None] * 2
    if group_rank == 0:
        reference = _one_process_per_group_run(replica, ports[0])
        for mine, theirs in zip(ours["params"], reference["params"]):
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
        gathered[0] = reference["totals"].bytes_dense
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[4]))
    dist.init_process_group("gloo", rank=rank, world_size=4)  # to compare the four ranks' figures
    try:
        figures = [None] * 4
        dist.all_gather_object(figures, (ours["totals"].bytes_dense, gathered[0],
                                         [p.sum().item() for p in ours["params"]]))
    finally:
        dist.destroy_process_group()
    for group in (0, 1):
        split = [figures[2 * group][0], figures[2 * group + 1][0]]
        whole = figures[2 * group][1]
        assert min(split) > 0.3 * whole and abs(sum(split) - whole) <= 0.01 * whole, (split, whole)
    assert all(f[2] == figures[0][2] for f in figures), "every process of every group ends on the same weights"
    compressed = _ddp_group_run(rank, ports[5:], second_lighthouse, "int8")  # new stores: no manager of before
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[8]))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    try:
        everyone = [None] * 4
        dist.all_gather_object(everyone, compressed["params"])
    finally:
        dist.destroy_process_group()
    for params in everyone[1:]:
        assert all(torch.equal(a, b) for a, b in zip(params, everyone[0]))


def _streaming_run(rank: int, port: int, lighthouse: Optional[str]) -> dict:
    """Streaming DiLoCo (2 fragments, delay 1, int8) on a whole model, 2 workers: under fault tolerance (each its
    own world of one process, ``lighthouse`` given) or in one world of 2."""
    from lightning_gradcomp import FaultTolerance

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0 if lighthouse else rank, world_size=1 if lighthouse else 2)
    try:
        model = _model()
        inner, _ = _optimizers(model)
        ft = FaultTolerance(lighthouse=lighthouse, replica_id=f"stream{rank}", timeout=30) if lighthouse else None
        handle = lightning_gradcomp.local_updates(
            model, inner, 4, "int8", fragments=2, delay=1, min_compress_numel=64, fault_tolerance=ft,
            global_device="cpu" if ft else None,  # θ_global in host memory under fault tolerance, on the device without
            outer_optimizer=lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True))
        for step in range(13):  # the last fragment's exchange, started after step 12, merged after step 13
            x, y = _batch(step, rank)
            nn.functional.cross_entropy(model(x), y).backward()
            inner.step()
            inner.zero_grad()
        result = {"params": [p.detach().clone() for p in model.parameters()], "syncs": handle.loop.outer.syncs,
                  "global": [g.detach().clone() for g in handle.loop.outer.global_params]}
        if ft is not None:
            result["commits"] = handle.fault_tolerance.commits
        handle.close()
        return result
    finally:
        dist.destroy_process_group()


def check_streaming_groups_equal_the_world(rank: int, world_size: int, ports: list[int], lighthouse: str) -> None:
    """Streaming DiLoCo under fault tolerance (a quorum and a commit per fragment, the exchange overlapping an
    inner step on the exchange thread, over torchft's group; ``global_device="cpu"``) ends bit for bit where
    the same run in one world does, after 6 fragment synchronisations."""
    theirs = _streaming_run(rank, ports[1 + rank], lighthouse)
    ours = _streaming_run(rank, ports[0], None)
    assert theirs["syncs"] == ours["syncs"] == theirs["commits"] == 6, (theirs["syncs"], ours["syncs"])
    for mine, other in zip(ours["global"] + ours["params"], theirs["global"] + theirs["params"]):
        assert torch.equal(mine, other), (mine - other).abs().max()
