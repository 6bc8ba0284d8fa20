"""Workers of the time-boxed windows and weighted merging tests (``tests/test_windows.py``), run in real gloo
processes by :func:`tests._processes.run_gloo`, and by ``benchmarks/time_boxed_windows.py``."""

from __future__ import annotations

import functools
import json
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

import lightning_gradcomp


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _batch(rank: int, step: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(size, 16, generator=generator)
    return x, (x[:, :4] * 0.5).tanh()


def time_boxed_run(rank: int, world: int, step_seconds: list[float], options: dict[str, Any], total_steps: int,
                   out: str, stall: Optional[tuple[int, float]] = None) -> None:
    """Rank ``rank`` trains with each inner step lasting about ``step_seconds[rank]`` (a sleep: a slower
    machine), until the run's planned end (``finished``) or, lock-step, ``total_steps``; ``stall``: (the inner
    step after which this rank's group stalls once, seconds), on the last rank. Writes its figures and final
    parameters to ``out/rank<R>.json`` / ``.pt``."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    handle = lightning_gradcomp.local_updates(model, optimizer, compressor=options.pop("compressor", "none"),
                                              outer_optimizer=functools.partial(torch.optim.SGD, lr=1.0),
                                              **options)
    handle.run_for(total_steps)
    losses, steps, synced_at = [], 0, []
    dist.barrier()
    start = time.perf_counter()
    while not handle.finished and steps < total_steps:
        x, y = _batch(rank, steps)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        time.sleep(step_seconds[rank])
        if stall is not None and rank == world - 1 and steps == stall[0]:
            time.sleep(stall[1])
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
        losses.append(loss.item())
        if handle.loop.synced:
            synced_at.append(round(time.perf_counter() - start, 4))
    handle.sync()
    elapsed = time.perf_counter() - start
    with handle.global_weights():
        x, y = _batch(99, 0, 256)
        final_loss = torch.nn.functional.mse_loss(model(x), y).item()
    figures = {"rank": rank, "steps": steps, "samples": steps * 8, "elapsed": elapsed, "losses": losses,
               "final_loss": final_loss, "synced_at": synced_at, "windows": handle.loop.outer.windows}
    Path(out, f"rank{rank}.json").write_text(json.dumps(figures))
    torch.save({name: p.detach().clone() for name, p in model.named_parameters()}, Path(out, f"rank{rank}.pt"))
    handle.close()


def weighted_merge(rank: int, world: int, counts: list[int], compressor: str) -> None:
    """One synchronisation after two inner steps whose samples are reported unequally (``counts[rank]`` per
    step): with outer SGD at lr 1, θ_global must be the counts-weighted average of the replicas. A compressor
    that averages each coordinate over the workers that sent it (DeMo) weights only approximately: it warns."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = lightning_gradcomp.local_updates(model, optimizer, 2, compressor,
                                              outer_optimizer=functools.partial(torch.optim.SGD, lr=1.0),
                                              min_compress_numel=0 if compressor != "none" else 1024)
    start = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            x, y = _batch(rank, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            handle.count(counts[rank])
            if step == 1:  # the replica before the synchronisation, from every rank
                with torch.no_grad():
                    replica = [p - 0.1 * p.grad for p in model.parameters()]
                gathered = [[torch.empty_like(p) for _ in range(world)] for p in replica]
                for parts, p in zip(gathered, replica):
                    dist.all_gather(parts, p)
            optimizer.step()
            optimizer.zero_grad()
    assert handle.loop.synced
    inexact = [str(w.message) for w in caught if "undoes part of the weights" in str(w.message)]
    assert len(inexact) == (compressor == "demo"), (compressor, inexact)
    if compressor == "demo":
        handle.close()
        return
    weights = [count / sum(counts) for count in counts]
    for p, theta0, parts in zip(model.parameters(), start, gathered):
        expected = theta0 - sum(w * (theta0 - part) for w, part in zip(weights, parts))
        if compressor == "none":
            torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=1e-6)
        else:  # compressed: the weighted average up to the compressor's error, not the plain one
            plain = sum(parts) / world
            assert (p.detach() - expected).norm() < 0.5 * (plain - expected).norm(), (rank, compressor)
    handle.close()


def mixed_reporting(rank: int, world: int) -> None:
    """Rank 0 reports samples with count(), rank 1 does not: every rank raises at the synchronisation."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = lightning_gradcomp.local_updates(model, optimizer, 2)
    try:
        for step in range(2):
            x, y = _batch(rank, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            if rank == 0:
                handle.count(8)
            optimizer.step()
            optimizer.zero_grad()
    except RuntimeError as error:
        assert "count their samples differently" in str(error), error
    else:
        raise AssertionError("mixed counting was not refused")
    handle.close()
