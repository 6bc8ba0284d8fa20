"""Ranks of tests/test_agreement.py: every entry point given different settings on two ranks."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import lightning_gradcomp
from lightning_gradcomp.compressors import TopK
from lightning_gradcomp.exchange.agreement import SettingsMismatch


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))


def _ddp(compressor: Any, **kwargs: Any) -> Any:
    return lightning_gradcomp.register(nn.parallel.DistributedDataParallel(_model()), compressor, **kwargs)


def _local(compressor: Any = "none", **kwargs: Any) -> Any:
    model = _model()
    return lightning_gradcomp.local_updates(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                            kwargs.pop("sync_every", 4), compressor, **kwargs)


def _sharded(**kwargs: Any) -> tuple[nn.Module, Any]:
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    model = _model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    return model, mesh


def _fsdp(compressor: Any, **kwargs: Any) -> Any:
    model, mesh = _sharded()
    return lightning_gradcomp.register_fsdp(model, mesh, compressor, **kwargs)


def _sharded_local(**kwargs: Any) -> Any:
    model, mesh = _sharded()
    return lightning_gradcomp.local_updates(model, torch.optim.SGD(model.parameters(), lr=0.1), 4, "none",
                                            mesh=mesh, **kwargs)


#: (what, setting named, rank 0's call, rank 1's call): each pair differs in one setting
MISMATCHES: list[tuple[str, str, Callable[[], Any], Callable[[], Any]]] = [
    ("register density", "compressor", lambda: _ddp(TopK(0.01)), lambda: _ddp(TopK(0.5))),
    ("register method", "compressor", lambda: _ddp("topk"), lambda: _ddp("qsgd")),
    ("register min_compress_numel", "min_compress_numel", lambda: _ddp("topk", min_compress_numel=0),
     lambda: _ddp("topk", min_compress_numel=10**6)),
    ("register seed", "seed", lambda: _ddp("randomk", seed=0), lambda: _ddp("randomk", seed=1)),
    ("register error feedback", "error_feedback", lambda: _ddp("topk"), lambda: _ddp("topk", error_feedback=False)),
    ("local compressor", "compressor", lambda: _local("none"), lambda: _local("int8")),
    ("local H", "sync_every", lambda: _local(sync_every=4), lambda: _local(sync_every=8)),
    ("local fragments", "fragments", lambda: _local(fragments=1), lambda: _local(fragments=2)),
    ("local outer lr", "outer_optimizer",
     lambda: _local(outer_optimizer=_sgd(0.7)), lambda: _local(outer_optimizer=_sgd(1.0))),
    ("fsdp method", "compressor", lambda: _fsdp("topk"), lambda: _fsdp("int8")),
    ("fsdp min_compress_numel", "min_compress_numel", lambda: _fsdp("topk", min_compress_numel=0),
     lambda: _fsdp("topk", min_compress_numel=10**6)),
    ("sharded local alpha", "alpha", lambda: _sharded_local(alpha=0.0, delay=1), lambda: _sharded_local(alpha=0.5, delay=1)),
]


def _sgd(lr: float) -> Any:
    import functools

    return functools.partial(torch.optim.SGD, lr=lr)


def check_every_mismatch_is_an_error_on_every_rank(rank: int, world_size: int) -> None:
    """Each case on both ranks in turn: rank 1's settings differ in one; every rank raises
    :class:`SettingsMismatch` naming it, with both ranks' values; equal settings pass."""
    for what, setting, first, second in MISMATCHES:
        try:
            (first if rank == 0 else second)()
        except SettingsMismatch as error:
            message = str(error)
            assert f"`{setting}`" in message and "on rank 0" in message and "on rank 1" in message, (what, message)
        else:
            raise AssertionError(f"{what}: different settings on the two ranks were accepted on rank {rank}")
    for agreed in (lambda: _ddp(TopK(0.01)), lambda: _local(fragments=2), lambda: _fsdp("int8"), _sharded_local):
        agreed().close()


def check_a_rank_out_of_step_is_an_error_on_every_rank(rank: int, world_size: int, delay: int) -> None:
    """Rank 1 calls ``sync()`` alone after 2 inner steps, while rank 0 trains on to its scheduled
    synchronisation at step 4: both raise :class:`ScheduleMismatch` there, before any payload moves, with
    every rank's step; then a ``sync()`` on both ranks at the same step works."""
    from lightning_gradcomp.exchange.agreement import ScheduleMismatch

    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = lightning_gradcomp.local_updates(model, optimizer, 4, "int8", delay=delay)
    generator = torch.Generator().manual_seed(rank)
    try:
        for step in range(4):
            x, y = torch.randn(8, 32, generator=generator), torch.randint(0, 4, (8,), generator=generator)
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            if rank == 1 and step == 1:
                handle.sync()
    except ScheduleMismatch as error:
        message = str(error)
        assert "rank 0: step 4, fragment 0" in message and "rank 1: step 2, fragment 0" in message, message
    else:
        raise AssertionError(f"rank {rank}: a sync() on one rank alone went unnoticed")
    handle.close()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = lightning_gradcomp.local_updates(model, optimizer, 4, "int8", delay=delay)
    nn.functional.cross_entropy(model(torch.randn(8, 32)), torch.zeros(8, dtype=torch.long)).backward()
    optimizer.step()
    assert handle.sync()  # every rank at step 1: agreed
    handle.close()


def check_a_second_exchange_on_one_model_is_refused(rank: int, world_size: int) -> None:
    """A second handle of any kind on a model whose first is open is refused on every rank, naming the first
    and the fix; after close() the model takes another."""
    def refused(make: Callable[[], Any], first: str) -> None:
        try:
            make()
        except ValueError as error:
            assert f"made by {first}" in str(error) and "close()" in str(error), str(error)
        else:
            raise AssertionError(f"a second exchange after {first} was accepted")

    model, mesh = _sharded()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    first = lightning_gradcomp.register_fsdp(model, mesh, "int8")
    refused(lambda: lightning_gradcomp.register_fsdp(model, mesh, "topk"), "register_fsdp()")
    refused(lambda: lightning_gradcomp.local_updates(model, optimizer, 4, mesh=mesh), "register_fsdp()")
    first.close()
    lightning_gradcomp.local_updates(model, optimizer, 4, mesh=mesh).close()

    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    first = lightning_gradcomp.local_updates(model, optimizer, 4)
    refused(lambda: lightning_gradcomp.local_updates(model, optimizer, 4, "int8"), "local_updates()")
    refused(lambda: lightning_gradcomp.register(nn.parallel.DistributedDataParallel(model), "topk"), "local_updates()")
    first.close()
    lightning_gradcomp.register(nn.parallel.DistributedDataParallel(model), "topk").close()


# ---------------------------------------------------------------------- FSDP2's pitfalls
def _raises(call: Callable[[], Any], *phrases: str) -> None:
    try:
        call()
    except ValueError as error:
        assert all(phrase in str(error) for phrase in phrases), str(error)
        return
    raise AssertionError(f"accepted: {phrases}")


def check_fsdp2_pitfalls_are_caught(rank: int, world_size: int) -> None:
    """An optimizer built before fully_shard is refused at its first step under register_fsdp and at
    local_updates(mesh=); model.to() after register_fsdp works (no weak reference to a parameter)."""
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))

    def sharded_with_an_optimizer_from_before() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = _model()
        stale = torch.optim.SGD(model.parameters(), lr=0.1)
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
        return model, stale

    model, stale = sharded_with_an_optimizer_from_before()
    handle = lightning_gradcomp.register_fsdp(model, mesh, "int8")
    model.to("cpu")  # torch's swap_tensors refused this while the handle held weak references to the parameters
    model.cpu()
    model(torch.ones(2, 32)).sum().backward()
    _raises(stale.step, "optimizer.step()", "before fully_shard", "Build the optimizer after fully_shard")
    fresh = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [parameter.detach().clone() for parameter in model.parameters()]
    fresh.step()  # the right optimizer trains
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    handle.close()

    model, stale = sharded_with_an_optimizer_from_before()
    _raises(lambda: lightning_gradcomp.local_updates(model, stale, 4, "none", mesh=mesh),
            "local_updates()", "before fully_shard")
    other = torch.optim.SGD(nn.Linear(3, 3).parameters(), lr=0.1)
    _raises(lambda: lightning_gradcomp.local_updates(model, other, 4, "none", mesh=mesh),
            "steps none of the model's parameters")

    # a model cast after local_updates(): every synchronisation would round it back to θ_global's dtype
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = lightning_gradcomp.local_updates(model, optimizer, 2, "none")
    model.double()
    model(torch.ones(2, 32, dtype=torch.float64)).sum().backward()
    optimizer.step()
    try:
        optimizer.step()  # the second step synchronises
    except RuntimeError as error:
        assert "is now torch.float64" in str(error) and "before local_updates()" in str(error), str(error)
    else:
        raise AssertionError("a model cast after local_updates() was synchronised")
    handle.close()
