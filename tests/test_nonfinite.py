"""Non-finite gradients: the same semantics for every compressor and both drivers.

A NaN/Inf in one worker's gradient makes its bucket's result NaN on every worker (as DDP's all-reduce
would), the step is void for every worker's residuals, that worker warns naming the parameter and step
and keeps its state for that parameter, and the telemetry stays finite (the bad step adds no error)."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_gradcomp.compressors import COMPRESSORS
from lightning_gradcomp.simulation import SimulatedExchange
from tests._gloo_workers import conformance_settings
from tests._processes import run_gloo

NAMES = sorted(COMPRESSORS)
SHAPES = {"a.weight": (32, 40), "b.weight": (24, 30), "b.bias": (24,)}


def _grads(worker: int, step: int, poison: bool = False) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(10 * step + worker)
    grads = [(name, torch.randn(shape, generator=generator)) for name, shape in SHAPES.items()]
    if poison:
        grads[0][1][3, 4] = float("nan")
        grads[0][1][5, 6] = float("inf")
    return grads


def _memory(exchange: SimulatedExchange, worker: int) -> dict[str, torch.Tensor]:
    memory = exchange.pipelines[worker].memory
    state = {f"residual/{n}": r.clone() for n, r in memory.residuals.items()}
    state.update({f"{n}/{k}": v.clone() for n, s in memory.states.items() for k, v in s.items()})
    return state


@pytest.mark.parametrize("name", NAMES)
def test_a_nan_on_one_worker_is_nan_everywhere_warned_and_leaves_its_memory_alone(name: str) -> None:
    compressor = COMPRESSORS[name](**conformance_settings().get(name, {}))
    exchange = SimulatedExchange(compressor, workers=2, min_compress_numel=100)
    exchange.telemetry = True
    for worker in range(2):
        exchange.add_worker(worker, _grads(worker, 0))
    exchange.finish_step()
    before = [_memory(exchange, worker) for worker in range(2)]
    for worker in range(2):
        exchange.add_worker(worker, _grads(worker, 1, poison=worker == 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        aggregate = exchange.finish_step()
    messages = [str(w.message) for w in caught if "non-finite" in str(w.message)]
    assert len(messages) == 1 and "on rank 1 at step 2 in a.weight" in messages[0], messages
    assert all(torch.isnan(value).all() for value in aggregate.values()), "the bucket is NaN on every worker"
    after = [_memory(exchange, worker) for worker in range(2)]
    for worker in range(2):
        for key, value in before[worker].items():
            # the step is void for every worker's residuals; the worker that saw the NaN keeps its state for a.weight
            if key.startswith("residual/") or (worker == 1 and key.startswith("a.weight/")):
                assert torch.equal(after[worker][key], value), f"{name}: {key} of worker {worker} changed"
        assert all(torch.isfinite(v).all() for v in after[worker].values()), f"{name}: memory turned non-finite"
    stats = exchange.step_stats
    assert all(map(lambda x: x == x and abs(x) != float("inf"), (stats.error_sq, stats.grad_sq)))
    for worker in range(2):  # the next step is clean again
        exchange.add_worker(worker, _grads(worker, 2))
    assert all(torch.isfinite(v).all() for v in exchange.finish_step().values())


@pytest.mark.multiprocess
def test_real_driver_has_the_same_semantics() -> None:
    from tests._gloo_workers import check_nonfinite_propagates

    run_gloo(check_nonfinite_propagates, 2, ["none", "topk", "threshold", "dgc", "powersgd"])


def test_the_engine_leaves_the_check_to_compressors_that_find_it_and_refuses_one_that_does_not(monkeypatch) -> None:
    """Top-k reads finiteness from its block peaks, so the engine's pass over the gradient is skipped for
    the tensors it compresses (not for those sent dense, nor for DGC, whose state update needs it first);
    a compressor that declares it but does not set ``ctx.finite`` is an error naming the parameter."""
    from lightning_gradcomp.compressors import DGC, TopK
    from lightning_gradcomp.exchange import engine as engine_module

    checked: list[int] = []
    real = engine_module.all_finite_many
    monkeypatch.setattr(engine_module, "all_finite_many",
                        lambda tensors: checked.extend(tensor.numel() for tensor in tensors) or real(tensors))
    for compressor, expected in [(TopK(0.01), [24]), (DGC(0.01), [1280, 720, 24])]:
        checked.clear()
        exchange = SimulatedExchange(compressor, workers=1, min_compress_numel=100)
        exchange.add_worker(0, _grads(0, 0))
        exchange.finish_step()
        assert sorted(checked, reverse=True) == expected, type(compressor).__name__

    class Forgetful(TopK):
        def compress(self, tensor, ctx):
            payload = super().compress(tensor, ctx)
            ctx.finite = None
            return payload

    assert COMPRESSORS["topk"] is TopK, "a subclass that does not name itself registers nothing"
    exchange = SimulatedExchange(Forgetful(0.01), workers=1, min_compress_numel=100)
    with pytest.raises(RuntimeError, match="declares checks_finite but its compress did not set ctx.finite for 'a.weight'"):
        exchange.add_worker(0, _grads(0, 0))  # the simulated worker compresses at once
