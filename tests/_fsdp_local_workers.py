"""Ranks of the tests of local updates on FSDP2 shards (tests/test_fsdp_local_updates.py): gloo, 2 replicas x 2
shards. The oracle is the replicated loop (:class:`SimulatedLocalUpdates`, two replicas of the whole model in
one process) on a copy of the model whose every parameter is stored as the row blocks FSDP2 cuts it into, so
that each compressor sees the tensors a shard holds."""

from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import lightning_gradcomp
from lightning_gradcomp import LocalUpdates, SimulatedLocalUpdates
from lightning_gradcomp.compressors import DeMo
from tests._fsdp_workers import _batch, _model, _shard

SHARDS = 2
SYNC_EVERY = 3


class RowBlocks(nn.Module):
    """A ``Linear`` whose weight and bias are kept as the row blocks ``torch.chunk`` cuts them into (FSDP2's
    dim-0 sharding), named ``weight_parts.s`` and ``bias_parts.s``."""

    def __init__(self, linear: nn.Linear, shards: int) -> None:
        super().__init__()
        self.weight_parts = nn.ParameterList([nn.Parameter(part.detach().clone())
                                              for part in torch.chunk(linear.weight, shards)])
        self.bias_parts = nn.ParameterList([nn.Parameter(part.detach().clone())
                                            for part in torch.chunk(linear.bias, shards)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, torch.cat(list(self.weight_parts)), torch.cat(list(self.bias_parts)))


def _row_block_model(shards: int = SHARDS) -> nn.Module:
    """The test model (same seed), every Linear replaced by its :class:`RowBlocks`."""
    model = copy.deepcopy(_model())
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, RowBlocks(child, shards))
    return model


def _oracle_part(named: dict[str, torch.Tensor], name: str, shard: int) -> torch.Tensor:
    """The oracle's row block ``shard`` of the sharded model's parameter ``name``."""
    module, kind = name.rsplit(".", 1)
    return named[f"{module}.{kind}_parts.{shard}"]


def _inner_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _outer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def _replica_batch(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the two ranks of ``replica`` train on at ``step``, as one batch."""
    parts = [_batch(step, replica * SHARDS + shard) for shard in range(SHARDS)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def _mesh():
    return init_device_mesh("cpu", (2, SHARDS), mesh_dim_names=("replicate", "shard"))


def _train_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    rank = dist.get_rank()
    for step in steps:
        x, y = _batch(step, rank)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def _sharded_run(mesh, compressor, steps: int, sync_every: int = SYNC_EVERY, **options):
    model = _shard(_model(), mesh["shard"])
    optimizer = _inner_optimizer(model.parameters())
    handle = lightning_gradcomp.local_updates(model, optimizer, sync_every, compressor, mesh=mesh,
                                              outer_optimizer=_outer, min_compress_numel=64, **options)
    _train_sharded(model, optimizer, range(steps))
    return model, optimizer, handle


def _oracle_run(compressor, steps: int) -> SimulatedLocalUpdates:
    model = _row_block_model()
    optimizer = _inner_optimizer(model.parameters())
    sim = SimulatedLocalUpdates(model, [optimizer], LocalUpdates(SYNC_EVERY, outer_optimizer=_outer), workers=2,
                                compressor=compressor, min_compress_numel=64)
    for step in range(steps):
        for replica in range(2):
            with sim.worker(replica):
                x, y = _replica_batch(step, replica)
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
        sim.step()
    return sim


def check_every_method_equals_the_replicated_loop(rank: int, world_size: int) -> None:
    """Uncompressed DiLoCo, int8, SparseLoCo and DeMo on 2 replicas x 2 shards, 3 synchronisations of H = 3:
    each rank's shard of θ_global and of its replica equal the replicated loop's (within 1e-5), and no rank
    allocated more than its shard for θ_global and the outer optimizer's state."""
    mesh = _mesh()
    replica, shard = divmod(rank, SHARDS)
    steps = 3 * SYNC_EVERY
    for compressor in ["none", "int8", "sparseloco", DeMo(decay=0.95, sign=False)]:
        model, _, handle = _sharded_run(mesh, compressor, steps)
        oracle = _oracle_run(compressor if isinstance(compressor, str) else DeMo(decay=0.95, sign=False), steps)
        assert handle.loop.outer.syncs == 3
        expected_global = dict(zip(oracle.names, oracle.outer.global_params))
        expected_replica = dict(zip(oracle.names, oracle.replicas[replica].params))
        for name, glob, local in zip(handle.loop.names, handle.loop.outer.global_params, handle.loop.params):
            torch.testing.assert_close(glob, _oracle_part(expected_global, name, shard), atol=1e-5, rtol=0,
                                       msg=lambda m: f"{compressor} θ_global {name}: {m}")
            torch.testing.assert_close(local, _oracle_part(expected_replica, name, shard), atol=1e-5, rtol=0,
                                       msg=lambda m: f"{compressor} replica {name}: {m}")
        # per shard: θ_global and the outer momentum hold this rank's rows only
        whole = sum(p.numel() for p in _model().parameters())
        held = sum(glob.numel() for glob in handle.loop.outer.global_params)
        momentum = sum(value.numel() for state in handle.loop.outer.optimizer.state.values()
                       for value in state.values() if isinstance(value, torch.Tensor))
        local = sum(p.numel() for p in handle.loop.params)
        assert held == local == momentum and held < 0.6 * whole, (held, local, momentum, whole)
        handle.close()


def check_one_step_windows_equal_compressed_hsdp(rank: int, world_size: int) -> None:
    """H = 1 with outer SGD at lr 1 and inner SGD ends where per-step compressed HSDP of the same compressor
    does (within 1e-6): Δ is then the inner step, averaged compressed."""
    mesh = _mesh()
    for compressor in ["none", "topk"]:
        per_step = _shard(_model(), mesh["shard"])
        optimizer = torch.optim.SGD(per_step.parameters(), lr=0.1)
        hsdp = lightning_gradcomp.register_fsdp(per_step, mesh, compressor, min_compress_numel=64)
        _train_sharded(per_step, optimizer, range(4))
        hsdp.close()
        local = _shard(_model(), mesh["shard"])
        inner = torch.optim.SGD(local.parameters(), lr=0.1)
        handle = lightning_gradcomp.local_updates(local, inner, 1, compressor, mesh=mesh, min_compress_numel=64,
                                                  outer_optimizer=lambda params: torch.optim.SGD(params, lr=1.0))
        _train_sharded(local, inner, range(4))
        for (name, expected), got in zip(per_step.named_parameters(), local.parameters()):
            torch.testing.assert_close(got.to_local(), expected.to_local(), atol=1e-6, rtol=0,
                                       msg=lambda m: f"{compressor} {name}: {m}")
        handle.close()


def _entry_on_every_rank(handle) -> dict:
    entry = [handle.state_dict()]
    dist.broadcast_object_list(entry, src=0)
    return entry[0]


def check_resume_views_sync_and_refusals(rank: int, world_size: int) -> None:
    """A resume in the middle of a window (with delay = 1 in flight) continues bit for bit; global_weights()
    shows θ_global on every rank and gives the replica back; sync() ends every rank on θ_global; another mesh
    drops the local-update state, saying so; bad setups are refused."""
    mesh = _mesh()
    options = dict(fragments=[["embed", "blocks.0"], ["blocks.1", "head"]], delay=1, sync_every=4)
    steps, cut = 10, 5
    straight, _, straight_handle = _sharded_run(mesh, "int8", steps, **options)
    expected = {name: p.to_local().clone() for name, p in straight.named_parameters()}
    expected_global = [glob.clone() for glob in straight_handle.loop.outer.global_params]
    straight_handle.close()

    first, first_optimizer, first_handle = _sharded_run(mesh, "int8", cut, **options)
    entry = _entry_on_every_rank(first_handle)
    with first_handle.global_weights():  # the model's checkpoint: θ_global, through the sharded state dict
        saved_model = {name: p.to_local().clone() for name, p in first.state_dict().items()}
    first_handle.close()
    resumed = _shard(_model(), mesh["shard"])
    with torch.no_grad():
        for name, p in resumed.state_dict().items():
            p.to_local().copy_(saved_model[name])
    optimizer = _inner_optimizer(resumed.parameters())
    handle = lightning_gradcomp.local_updates(resumed, optimizer, compressor="int8", mesh=mesh, outer_optimizer=_outer,
                                              min_compress_numel=64, **options)
    handle.load_state_dict(entry)
    _train_sharded(resumed, optimizer, range(cut, steps))
    for name, p in resumed.named_parameters():
        assert torch.equal(p.to_local(), expected[name]), name
    for glob, want in zip(handle.loop.outer.global_params, expected_global):
        assert torch.equal(glob, want)

    # θ_global shown by copy: every replica sees the same full tensors; the replica comes back afterwards
    replica_before = {name: p.full_tensor().clone() for name, p in resumed.named_parameters()}
    with handle.global_weights():
        shown = {name: p.full_tensor() for name, p in resumed.named_parameters()}
    seen = [None, None]
    dist.all_gather_object(seen, {k: v for k, v in shown.items()}, group=mesh["replicate"].get_group())
    for name in shown:
        assert torch.equal(seen[0][name], seen[1][name]), name
    for name, p in resumed.named_parameters():
        assert torch.equal(p.full_tensor(), replica_before[name]), name
    handle.sync()
    ended = {name: p.full_tensor() for name, p in resumed.named_parameters()}
    every = [None] * world_size
    dist.all_gather_object(every, ended)
    for name in ended:
        assert all(torch.equal(other[name], ended[name]) for other in every), name
    handle.close()

    # another replica count: the local-update state is dropped, with a warning on rank 0
    other = init_device_mesh("cpu", (1, 4), mesh_dim_names=("replicate", "shard"))
    model = _shard(_model(), other["shard"])
    other_handle = lightning_gradcomp.local_updates(model, _inner_optimizer(model.parameters()), SYNC_EVERY, "int8",
                                                    mesh=other, min_compress_numel=64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other_handle.load_state_dict(entry)
    if rank == 0:
        assert any("local-update state" in str(w.message) for w in caught), [str(w.message) for w in caught]
    other_handle.close()

    # refusals (each with a real inner optimizer: an empty list is refused first)
    def refused(model, words: str, **kwargs) -> None:
        _raises(lambda: lightning_gradcomp.local_updates(model, _inner_optimizer(model.parameters()), 3, **kwargs),
                words)

    refused(_shard(_model(), mesh), "native HSDP", mesh=mesh)
    sharded = _shard(_model(), mesh["shard"])
    refused(sharded, "pass the 2-D mesh")
    refused(sharded, "group", mesh=mesh, group=dist.group.WORLD)
    refused(sharded, "global_device", mesh=mesh, global_device="cuda:0")
    partly = _model()
    for block in partly.blocks:
        fully_shard(block, mesh=mesh["shard"])
    refused(partly, "not sharded by any fully_shard", mesh=mesh)


def _raises(call, words: str) -> None:
    try:
        call()
    except (ValueError, RuntimeError) as error:
        assert words in str(error), str(error)
    else:
        raise AssertionError(f"no error mentioning {words!r}")


def check_a_non_finite_outer_gradient_is_skipped(rank: int, world_size: int) -> None:
    """A NaN in one rank's shard: the synchronisation is skipped with a warning on every rank, θ_global stays,
    and every rank restarts from it; host memory for θ_global (``global_device="cpu"``) trains the same."""
    mesh = _mesh()
    model, optimizer, handle = _sharded_run(mesh, "none", SYNC_EVERY - 1, global_device="cpu")
    before = [glob.clone() for glob in handle.loop.outer.global_params]
    x, y = _batch(99, rank)
    nn.functional.cross_entropy(model(x), y).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if rank == 3:
            with torch.no_grad():
                handle.loop.params[0].view(-1)[0] = float("nan")
        optimizer.step()  # the window's last step: the synchronisation runs from the step's hook
    optimizer.zero_grad()
    assert handle.loop.outer.syncs == 1 and handle.loop.outer.last_norm != handle.loop.outer.last_norm
    assert any("not finite" in str(w.message) for w in caught), [str(w.message) for w in caught]
    for glob, was, local in zip(handle.loop.outer.global_params, before, handle.loop.params):
        assert torch.equal(glob, was) and torch.equal(local, was)
    handle.close()


def check_time_boxed_windows_on_shards(rank: int, world_size: int) -> None:
    """Replica 1 (ranks 2, 3) at a third of replica 0's speed under window_seconds='auto': each replica's two shards
    take the same number of inner steps (FSDP2's collectives inside the replica would hang otherwise), replica 0
    more than replica 1, and both end at the same synchronisation with the same θ_global."""
    import time

    mesh = _mesh()
    replica = mesh["replicate"].get_local_rank()
    model = _shard(_model(), mesh["shard"])
    optimizer = _inner_optimizer(model.parameters())
    handle = lightning_gradcomp.local_updates(model, optimizer, 4, "int8", mesh=mesh, outer_optimizer=_outer,
                                              min_compress_numel=64, window_seconds="auto")
    handle.run_for(40)
    steps = 0
    while not handle.finished:
        x, y = _batch(steps, rank)
        nn.functional.cross_entropy(model(x), y).backward()
        time.sleep(0.01 if replica == 0 else 0.03)
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
    handle.sync()
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(counts, torch.tensor([steps]))
    counts = [int(count) for count in counts]
    assert counts[0] == counts[1] and counts[2] == counts[3], counts
    # (4 processes on 2 cores: FSDP2's own collectives take a share of every step, so less than 3x apart)
    assert counts[0] == 40 and 0.15 * (counts[0] - 4) <= counts[2] - 4 <= 0.85 * (counts[0] - 4), counts
    flat = torch.cat([glob.reshape(-1) for glob in handle.loop.outer.global_params])
    theirs = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(theirs, flat, group=mesh["replicate"].get_group())
    assert torch.equal(theirs[0], theirs[1])
    handle.close()
