"""No host synchronisation inside the hook for fixed-size compressors, checked on CPU along the
accelerator path (tests/_host_sync.py): the in-process driver here, the real driver in gloo processes
(exchange thread on and off). On a GPU, tests/test_cuda.py checks the same with
``torch.cuda.set_sync_debug_mode("error")``."""

from __future__ import annotations

import pytest
import torch

from lightning_gradcomp.compressors import TopK
from lightning_gradcomp.simulation import SimulatedExchange

from tests._host_sync import HostReadError, checking_the_exchange
from tests._processes import run_gloo
from tests._sync_workers import fixed_size_variants, reference_path

SHAPES = {"conv.weight": (16, 8, 3, 3), "fc.weight": (40, 64), "fc.bias": (40,)}


def _grads(worker: int, step: int) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 * step + worker)
    grads = [(name, torch.randn(shape, generator=generator)) for name, shape in SHAPES.items()]
    if step == 2 and worker == 1:  # a non-finite gradient takes the poison path too
        grads[1][1][0, 0] = float("inf")
    return grads


def _simulate(compressor, steps: int = 4) -> list[dict[str, torch.Tensor]]:
    exchange = SimulatedExchange(compressor, workers=2, min_compress_numel=100)
    exchange.telemetry = True
    exchange.telemetry_due = False
    results = []
    for step in range(steps):
        for worker in range(2):
            exchange.add_worker(worker, _grads(worker, step))
        with pytest.warns(RuntimeWarning, match="non-finite") if step == 2 else _nothing():
            results.append(exchange.finish_step())
    exchange.read_measurements()
    assert exchange.totals.grad_sq > 0
    return results


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None


@pytest.mark.parametrize("label,compressor", fixed_size_variants(), ids=[label for label, _ in fixed_size_variants()])
def test_the_in_process_driver_reads_nothing_on_the_host(label: str, compressor) -> None:
    with checking_the_exchange():
        accelerated = _simulate(compressor)
    with reference_path(label):
        reference = _simulate(compressor)
    for step, (fast, slow) in enumerate(zip(accelerated, reference)):
        for name in slow:
            torch.testing.assert_close(fast[name], slow[name], rtol=1e-5, atol=1e-6, equal_nan=True,
                                       msg=lambda m: f"{label} step {step} {name}: {m}")


def test_the_check_catches_a_host_read() -> None:
    class Reads(TopK):
        name = ""

        def compress(self, tensor, ctx):
            if tensor.abs().max().item() > 1e9:  # a host read
                raise AssertionError
            return super().compress(tensor, ctx)

    with pytest.raises(HostReadError, match="_local_scalar_dense"), checking_the_exchange():
        _simulate(Reads(0.05), steps=1)


@pytest.mark.multiprocess
def test_the_real_hook_reads_nothing_on_the_host_with_and_without_the_exchange_thread() -> None:
    from tests._sync_workers import check_no_host_reads_in_the_hook

    run_gloo(check_no_host_reads_in_the_hook, 2)
