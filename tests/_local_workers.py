"""Ranks of the local-update tests (real gloo processes, run by tests/test_local_updates.py) and the
single-process twins they are compared with."""

from __future__ import annotations

import functools

import torch
from torch import nn

from lightning_gradcomp import local_updates
from lightning_gradcomp.local import LocalUpdates, SimulatedLocalUpdates

SYNC_EVERY = 3
STEPS = 10  # three synchronisations and a window left open


def small_model() -> nn.Module:
    """An MLP with a BatchNorm (buffers averaged at each synchronisation) and a frozen layer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.BatchNorm1d(64), nn.Linear(64, 40), nn.ReLU(),
                          nn.Linear(40, 10))
    model[5].bias.requires_grad_(False)
    return model


def batch(step: int, worker: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1009 * step + worker)
    return torch.randn(16, 32, generator=generator) * (1 + worker), torch.randint(0, 10, (16,), generator=generator)


def inner_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.1)


def inner_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, worker: int) -> None:
    x, y = batch(step, worker)
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


#: Streaming DiLoCo in the tests: 3 fragments staggered over windows of 6, merged 1 step late, half kept
STREAMING = {"sync_every": 6, "fragments": 3, "delay": 1, "alpha": 0.5}


def simulate(workers: int, compressor: str, steps: int = STEPS, sync_every: int = SYNC_EVERY,
             outer_optimizer=None, **streaming) -> tuple[nn.Module, SimulatedLocalUpdates]:
    """``steps`` inner steps of ``workers`` simulated workers; the module holds worker 0's values."""
    model = small_model()
    optimizer = inner_optimizer(model)
    config = LocalUpdates(streaming.pop("sync_every", sync_every), outer_optimizer, **streaming)
    sim = SimulatedLocalUpdates(model, [optimizer], config, workers=workers,
                                compressor=compressor, min_compress_numel=256)
    for step in range(steps):
        for worker in range(workers):
            with sim.worker(worker):
                model.train()
                inner_step(model, optimizer, step, worker)
        sim.step()
    return model, sim


def check_real_equals_simulated(rank: int, world_size: int, cases: list[tuple[str, str, dict]], out: str) -> None:
    """Per case ``(label, compressor, streaming options)``: ``STEPS`` steps in real processes (a sync every
    ``SYNC_EVERY``, or the streaming schedule, its exchanges on the exchange thread); rank r's parameters,
    buffers and the global parameters for the simulation to compare with worker r's, and the bytes."""
    results = {}
    for label, name, streaming in cases:
        model = small_model()
        optimizer = inner_optimizer(model)
        handle = local_updates(model, optimizer, sync_every=streaming.get("sync_every", SYNC_EVERY), compressor=name,
                               min_compress_numel=256, **{k: v for k, v in streaming.items() if k != "sync_every"})
        synced = []
        for step in range(STEPS):
            inner_step(model, optimizer, step, rank)
            synced.append(handle.step())
            handle.hook_state.take_step_stats()
        if not streaming:
            assert synced == [(step + 1) % SYNC_EVERY == 0 for step in range(STEPS)]
        handle.loop.close()
        results[label] = {"state": {k: v.clone() for k, v in model.state_dict().items()},
                         "global": [g.detach().clone() for g in handle.loop.outer.global_params],
                         "bytes": handle.totals.bytes_sent, "syncs": handle.totals.steps}
    torch.save(results, f"{out}.rank{rank}.pt")


def check_resume_mid_window(rank: int, world_size: int, out: str, cases: list[tuple[dict, int]]) -> None:
    """Per case ``(streaming options, saved_at)``: ``saved_at`` steps, checkpoint (inside a window; with
    streaming options, an exchange in flight), 5 more; against a fresh model, optimizer and loop restored
    from the checkpoint for the same 5 steps: bit for bit."""
    for streaming, saved_at in cases:
        _check_resume(rank, streaming, saved_at)


def _check_resume(rank: int, streaming: dict, saved_at: int) -> None:
    def build():
        model = small_model()
        optimizer = inner_optimizer(model)
        outer = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
        options = dict(streaming)
        return model, optimizer, local_updates(model, optimizer, sync_every=options.pop("sync_every", SYNC_EVERY),
                                               compressor="topk", outer_optimizer=outer, min_compress_numel=256,
                                               **options)

    model, optimizer, handle = build()
    for step in range(saved_at):
        inner_step(model, optimizer, step, rank)
        handle.step()
    if streaming:
        assert handle.loop.pending, "an exchange is in flight at the checkpoint"
    entry = handle.state_dict()
    entry = [entry]
    torch.distributed.broadcast_object_list(entry, 0)  # what every rank loads from rank 0's file
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    for step in range(saved_at, saved_at + 5):
        inner_step(model, optimizer, step, rank)
        handle.step()

    twin, twin_optimizer, twin_handle = build()
    twin.load_state_dict(saved_model if rank == 0 else twin.state_dict())  # Lightning restores rank 0's model
    twin_handle.load_state_dict(entry[0])
    for step in range(saved_at, saved_at + 5):
        inner_step(twin, twin_optimizer, step, rank)
        twin_handle.step()
    for (name, a), (_, b) in zip(model.state_dict().items(), twin.state_dict().items()):
        assert torch.equal(a, b), (rank, name)
    for a, b in zip(handle.loop.outer.global_params, twin_handle.loop.outer.global_params):
        assert torch.equal(a, b)
    assert handle.totals.bytes_sent == twin_handle.totals.bytes_sent


def check_the_optimizer_step_counts_iterations(rank: int, world_size: int) -> None:
    """A loop that never calls ``handle.step()`` synchronises on the same schedule, to the same bits, as one
    that calls it after every optimizer step (issue 36, item 15); a skipped optimizer step (as a GradScaler
    skips one) is counted by ``handle.step()``."""
    results = []
    for explicit in (True, False):
        model = small_model()
        optimizer = inner_optimizer(model)
        handle = local_updates(model, optimizer, sync_every=SYNC_EVERY, compressor="topk", min_compress_numel=256)
        synced = []
        for step in range(STEPS):
            inner_step(model, optimizer, step, rank)
            if explicit:
                synced.append(handle.step())
        assert handle.loop.outer.optimizer_steps == STEPS and handle.loop.outer.syncs == STEPS // SYNC_EVERY
        if explicit:
            assert synced == [(step + 1) % SYNC_EVERY == 0 for step in range(STEPS)]
        results.append(torch.cat([g.reshape(-1) for g in handle.loop.outer.global_params]))
        if explicit:
            handle.step()  # an iteration whose optimizer step was skipped
            assert handle.loop.outer.optimizer_steps == STEPS + 1
        handle.close()
    assert torch.equal(results[0], results[1])


def check_the_global_model_and_the_final_sync(rank: int, world_size: int) -> None:
    """The plain handle (issue 36, item 1): inside a window ``global_weights()`` shows θ_global, the same on
    every rank, without communicating (rank 0 alone enters it here), and puts the replica back;
    ``sync()`` merges the open window and leaves θ_global in every rank's model; a second one exchanges
    nothing."""
    import torch.distributed as dist

    model = small_model()
    optimizer = inner_optimizer(model)
    handle = local_updates(model, optimizer, sync_every=SYNC_EVERY, compressor="topk", min_compress_numel=256)
    for step in range(STEPS):  # three synchronisations, one step into the fourth window
        inner_step(model, optimizer, step, rank)
    replica = {name: value.clone() for name, value in model.state_dict().items()}
    seen = None
    if rank == 0:
        with handle.global_weights():
            seen = {name: value.clone() for name, value in model.state_dict().items()}
        for name, glob in zip(handle.loop.names, handle.loop.outer.global_params):
            assert torch.equal(seen[name], glob), name
        assert any(not torch.equal(seen[name], value) for name, value in replica.items())
    for name, value in model.state_dict().items():
        assert torch.equal(value, replica[name]), f"the replica is back: {name}"
    replicas = [None] * world_size
    dist.all_gather_object(replicas, replica)
    assert any(not torch.equal(replicas[0][name], replicas[1][name]) for name in replica), "apart inside a window"
    with handle.global_weights():  # every rank: the same weights; a checkpoint taken inside holds the replica
        views = [None] * world_size
        dist.all_gather_object(views, {name: value.clone() for name, value in model.state_dict().items()})
        entry = handle.state_dict()
    if rank == 0:
        for name, value in entry["ranks"][0]["local"]["params"].items():
            assert torch.equal(value, replica[name]), name
    for name in replica:
        assert torch.equal(views[0][name], views[1][name]), name
        if seen is not None:
            assert torch.equal(views[0][name], seen[name]), name

    # the evaluation rule: a forward pass in eval mode without gradients sees θ_global (what LitGPT's and
    # nanoGPT's validate() do), any other pass the replica again (eval mode with gradients is training)
    x, _ = batch(0, rank)
    model.eval()  # (its BatchNorm then normalises by the running statistics)
    with torch.no_grad(), handle.global_weights():
        on_global = model(x)
    on_replica = model(x).detach()  # gradients on: training in eval mode, on the replica
    assert not torch.equal(on_global, on_replica)
    with torch.no_grad():
        assert torch.equal(model(x), on_global), "an evaluation sees θ_global"
        assert torch.equal(model(x), on_global), "for the whole evaluation"
    model.train()
    with torch.no_grad():
        model(x)  # a forward pass in train mode (it updates BatchNorm's statistics): the replica again
    for name, value in model.named_parameters():
        assert torch.equal(value, replica[name]), f"the replica is back after the evaluation: {name}"
    # the same through torch.compile (LitGPT compiles its model): the rule's hook leaves the graph and runs at
    # every call (traced into the graph, it ran once, when compiling, and evaluation saw the replica)
    compiled = torch.compile(model, backend="eager")
    compiled.eval()
    with torch.no_grad():
        assert torch.equal(compiled(x), on_global), "a compiled evaluation sees θ_global"
    compiled.train()
    with torch.no_grad():
        compiled(x)
    for name, value in model.named_parameters():
        assert torch.equal(value, replica[name]), f"the replica is back after the compiled evaluation: {name}"
    model.eval()
    with torch.no_grad():
        model(x)  # evaluating when the window ends: sync() takes the replica's steps, not θ_global

    assert handle.sync() is True and handle.loop.outer.syncs == STEPS // SYNC_EVERY + 1
    final = [None] * world_size
    dist.all_gather_object(final, {name: value.clone() for name, value in model.state_dict().items()})
    for name in replica:
        assert torch.equal(final[0][name], final[1][name]), f"every rank ends on θ_global: {name}"
    for name, glob in zip(handle.loop.names, handle.loop.outer.global_params):
        assert torch.equal(model.state_dict()[name], glob), name
    assert handle.sync() is False and handle.loop.outer.syncs == STEPS // SYNC_EVERY + 1, "nothing moved since"
    handle.close()


def check_a_model_still_driven_through_ddp_is_refused(rank: int, world_size: int) -> None:
    """Issue 36, item 2: ``local_updates(ddp.module, ...)`` while the loop calls the DDP wrapper used to
    all-reduce every step in silence. Now the wrapper's first all-reduce raises, naming the fix; a wrapper
    that is kept but not called, or made after ``local_updates()`` and called, is handled alike."""
    import pytest
    from torch.nn.parallel import DistributedDataParallel

    model = small_model()
    optimizer = inner_optimizer(model)
    ddp = DistributedDataParallel(model)
    handle = local_updates(ddp.module, optimizer, sync_every=SYNC_EVERY)
    inner_step(model, optimizer, 0, rank)  # the bare model: nothing all-reduced, no error
    x, y = batch(1, rank)
    with pytest.raises(RuntimeError, match="local updates need no DDP|Local updates need no DDP"):
        nn.functional.cross_entropy(ddp(x), y).backward()
    handle.close()

    model = small_model()
    optimizer = inner_optimizer(model)
    handle = local_updates(model, optimizer, sync_every=SYNC_EVERY)
    late = DistributedDataParallel(model)
    nn.functional.cross_entropy(late(x), y).backward()  # not yet known: the first step finds it
    optimizer.step()
    optimizer.zero_grad()
    with pytest.raises(RuntimeError, match="Local updates need no DDP"):
        nn.functional.cross_entropy(late(x), y).backward()
    handle.close()


def check_a_rank_0_only_state_dict_raises_with_advice(rank: int, world_size: int) -> None:
    """Issue 36, item 3: ``state_dict()`` inside ``if rank == 0:`` used to hang with no message. It raises
    after the handle's ``timeout``, with the fix; the fixed pattern (every rank gathers, rank 0 saves the
    model inside ``global_weights()``) works."""
    import pytest
    import torch.distributed as dist

    from lightning_gradcomp.exchange.checkpoint import CheckpointTimeout

    model = small_model()
    optimizer = inner_optimizer(model)
    handle = local_updates(model, optimizer, sync_every=SYNC_EVERY, timeout=1.5)
    for step in range(SYNC_EVERY + 1):
        inner_step(model, optimizer, step, rank)
    if rank == 0:
        with pytest.raises(CheckpointTimeout, match=r"waited 1.5 s .* call it on every rank first"):
            handle.state_dict()
    dist.barrier()
    # the gathers are out of step for good: rank 0 says so at once, rank 1's gather fails, saying why
    out_of_step = "an earlier state_dict\\(\\) (timed out|called on some ranks)|waited 1.5 s"
    with pytest.raises(RuntimeError, match=out_of_step):
        handle.state_dict()
    dist.barrier()
    handle.close()

    model = small_model()
    optimizer = inner_optimizer(model)
    handle = local_updates(model, optimizer, sync_every=SYNC_EVERY, timeout=60)
    for step in range(SYNC_EVERY + 1):
        inner_step(model, optimizer, step, rank)
    entry = handle.state_dict()
    assert (entry is not None) == (rank == 0)
    if rank == 0:
        with handle.global_weights():
            saved = {name: value.clone() for name, value in model.state_dict().items()}
        for name, glob in zip(handle.loop.names, handle.loop.outer.global_params):
            assert torch.equal(saved[name], glob)
        assert len(entry["ranks"]) == world_size
    handle.close()
