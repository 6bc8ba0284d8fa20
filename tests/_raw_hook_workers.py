"""Worker functions: the raw hook and ``register()`` on their own (nobody takes the figures)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

import lightning_gradcomp
from lightning_gradcomp.compressors import TopK
from lightning_gradcomp.ddp.hook import GradCompHookState, gradcomp_hook


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512),
                         nn.ReLU(), nn.Linear(512, 10))


def check_the_raw_hook_keeps_one_step(rank: int, world_size: int, steps: int) -> None:
    """``GradCompHookState`` + ``gradcomp_hook`` with telemetry on, exchange thread on and off, and a
    NaN in rank 1's gradient at one step: the per-step lists (collective log, telemetry entries and
    events, non-finite flags) stay at one step's worth, the totals count every step, the NaN is reported."""
    for thread in (False, True):
        model = _model()
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.5)
        state = GradCompHookState(TopK(0.01), {id(p): n for n, p in model.named_parameters()},
                                  min_compress_numel=256, exchange_thread=thread)
        state.telemetry = True
        ddp.register_comm_hook(state, gradcomp_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        generator = torch.Generator().manual_seed(rank)
        x, y = torch.randn(16, 64, generator=generator), torch.randint(0, 10, (16,), generator=generator)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(steps):
                optimizer.zero_grad()
                poison = float("nan") if step == steps // 2 and rank == 1 else 0.0
                (nn.functional.cross_entropy(ddp(x), y) + poison * model[0].weight.sum()).backward()
                if step != steps // 2:
                    optimizer.step()
                buckets, parameters = state.hook_calls // (step + 1), len(list(model.parameters()))
                logged = len(state.driver._log) + (len(state._thread_driver._log) if state._thread_driver else 0)
                assert logged <= 4 * buckets, (thread, step, logged)  # a few collectives per bucket
                assert len(state.pipeline.recorder._entries) <= parameters, (thread, step)
                assert len(state.pipeline.nonfinite._pending) <= buckets, (thread, step)
                clocks = (state.engine.compress_clock, state.engine.decompress_clock)
                assert all(len(clock._earlier.events) + len(clock._current.events) <= 4 * buckets for clock in clocks)
        warned = [str(w.message) for w in caught if "non-finite" in str(w.message)]
        assert (len(warned) == 1 and f"at step {steps // 2 + 1}" in warned[0]) if rank == 1 else not warned, warned
        totals = state.totals
        assert totals.steps == steps - 1 and totals.grad_sq > 0  # the last step closes with the next bucket
        state.close()


def check_register_refuses_what_it_cannot_run(rank: int, world_size: int) -> None:
    """``load_state_dict(None)`` (what ``state_dict()`` returns on other ranks than 0) says what to pass;
    compiled autograd's Python reducer is refused before training, and a hook called with a
    ``(gradient, parameter)`` pair says why."""
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model)
    handle = lightning_gradcomp.register(ddp, TopK(0.01))
    entry = handle.state_dict()
    assert (entry is None) == (rank != 0)
    if rank != 0:
        with pytest.raises(ValueError, match=r"state_dict\(\) returns None on the other ranks.*map_location='cpu'"):
            handle.load_state_dict(entry)
    with pytest.raises(RuntimeError, match="python_reducer"):
        handle.hook_state.exchange_bucket((torch.zeros(3), torch.zeros(3)))
    handle.close()
    from torch._dynamo import config as dynamo_config

    with dynamo_config.patch(optimize_ddp="python_reducer"):
        compiled = nn.parallel.DistributedDataParallel(_model())
    with pytest.raises(ValueError, match=r"optimize_ddp='python_reducer'.*allowed: optimize_ddp='ddp_optimizer'"):
        lightning_gradcomp.register(compiled, TopK(0.01))


def _train(handle: "lightning_gradcomp.GradCompHandle", ddp: nn.Module, rank: int, steps: int) -> None:
    generator = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x, y = torch.randn(16, 64, generator=generator), torch.randint(0, 10, (16,), generator=generator)
        nn.functional.cross_entropy(ddp(x), y).backward()


def check_summary_and_counters_span_every_step(rank: int, world_size: int) -> None:
    """``summary()`` read first thing after training counts the last step too; a resume that keeps
    only the counters (another compressor) continues them: steps, bytes and collectives of the run
    before and of this one, so the summary prices every step."""
    ddp = nn.parallel.DistributedDataParallel(_model())
    handle = lightning_gradcomp.register(ddp, "topk")
    _train(handle, ddp, rank, 3)
    text = handle.summary()
    assert re.search(r"workers, steps +2, 3\n", text), text
    first = handle.totals
    assert first.steps == 3 and first.buckets > 0
    entry = handle.state_dict()
    collectives = sum(handle.hook_state.tally.counts.values())
    handle.close()

    entry = [entry]
    torch.distributed.broadcast_object_list(entry, src=0)
    ddp = nn.parallel.DistributedDataParallel(_model())
    handle = lightning_gradcomp.register(ddp, "dgc")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle.load_state_dict(entry[0])
    assert any("Kept: the step counter (3" in str(w.message) for w in caught) == (rank == 0)
    assert handle.hook_state.step == 3 and handle.totals.steps == 3
    assert sum(handle.hook_state.tally.counts.values()) == collectives > 0
    _train(handle, ddp, rank, 2)
    totals = handle.totals
    assert totals.steps == 5, totals.steps
    assert totals.bytes_dense == first.bytes_dense / 3 * 5
    assert re.search(r"workers, steps +2, 5\n", handle.summary())
    handle.close()


def check_register_refuses_sharded_and_second_registrations(rank: int, world_size: int) -> None:
    """A second ``register()`` on one DDP model and a ``fully_shard``-ed model are refused with what to do
    instead; ``use_compressor`` switches the compressor between steps (issue 36, item 6)."""
    import pytest
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import lightning_gradcomp

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    handle = lightning_gradcomp.register(ddp, "topk", min_compress_numel=16)
    with pytest.raises(ValueError, match=r"already has a communication hook.*use_compressor"):
        lightning_gradcomp.register(ddp, "qsgd")
    handle.use_compressor("qsgd")
    assert type(handle.hook_state.compressor).__name__ == "QSGD"
    ddp(torch.randn(8, 64)).sum().backward()
    assert handle.step_stats.bytes_sent > 0
    handle.use_compressor(None)
    assert type(handle.hook_state.compressor).__name__ == "NoCompression"
    sharded = fully_shard(torch.nn.Linear(64, 64), mesh=init_device_mesh("cpu", (world_size,)))
    with pytest.raises(ValueError, match=r"sharded model.*register_fsdp\(model, mesh, compressor\).*DistributedDataParallel"):
        lightning_gradcomp.register(sharded, "topk")


def check_each_rank_saves_and_loads_its_own_part(rank: int, world_size: int, folder: str) -> None:
    """``rank_state_dict()`` (no collective) saved by each rank to its own file, loaded back by each rank:
    the residuals, step and totals as they were; another rank's part is refused on every rank; the parts
    merged offline hold every rank's state. Ranks saving under different paths are refused on every rank."""
    from lightning_gradcomp.exchange.agreement import SettingsMismatch
    from lightning_gradcomp.exchange.checkpoint import agree_on_the_save, gather_parts, parts_stub, resolve_entry, save_part

    checkpoint = f"{folder}/model.pt"
    with pytest.raises(SettingsMismatch, match="checkpoint path"):  # the parts would be scattered
        agree_on_the_save(f"{folder}/rank{rank}.pt", None, "fabric.save")
    agree_on_the_save(checkpoint, None, "fabric.save")
    ddp = nn.parallel.DistributedDataParallel(_model())
    handle = lightning_gradcomp.register(ddp, "topk")
    _train(handle, ddp, rank, 3)
    part = handle.rank_state_dict()
    assert part["part"] == rank and [state is not None for state in part["ranks"]] == [r == rank for r in range(2)]
    save_part(checkpoint, rank, part)
    residuals = {name: value.clone() for name, value in handle.hook_state.memory.state_dict()["residuals"].items()}
    totals = handle.totals
    handle.close()

    ddp = nn.parallel.DistributedDataParallel(_model())
    handle = lightning_gradcomp.register(ddp, "topk")
    other = resolve_entry(parts_stub(part), checkpoint, 1 - rank, world_size)
    with pytest.raises(ValueError, match=f"rank {1 - rank}'s part of the exchange state, loaded on rank {rank}"):
        handle.load_state_dict(other)
    handle.load_state_dict(resolve_entry(parts_stub(part), checkpoint, rank, world_size))
    assert handle.hook_state.step == 3 and handle.totals == totals
    restored = handle.hook_state.memory.state_dict()["residuals"]
    assert restored.keys() == residuals.keys() and all(torch.equal(restored[n], residuals[n]) for n in residuals)
    handle.close()
    torch.distributed.barrier()
    merged = gather_parts(checkpoint)
    assert merged["world_size"] == 2 and "part" not in merged
    assert all(torch.equal(merged["ranks"][rank]["memory"]["residuals"][n], residuals[n]) for n in residuals)
    assert not torch.equal(*(merged["ranks"][r]["memory"]["residuals"]["0.weight"] for r in (0, 1)))
