"""Every rank decodes the same bucket to the same bits, whatever order a GPU's atomic adds take.

DDP never re-synchronises its replicas: their parameters stay equal only while every rank applies the
same averaged gradient. Each rank decodes the gathered payloads itself, so a decode whose sums depend on
the order of atomic adds (``index_add_``/``scatter_add_`` on a GPU, wherever several workers chose one
coordinate) would let the replicas drift apart, silently. tests/_atomic_order.py emulates that order on
the CPU; here two decodes under two different orders must agree bit for bit, on the accelerator path
(whole buckets) and on the per-tensor protocols, for every compressor — the second in PyTorch's
deterministic mode with uninitialised memory filled, which must change nothing either.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from lightning_gradcomp.compressors import COMPRESSORS
from lightning_gradcomp.core.device import accelerator_path
from lightning_gradcomp.core.tensors import index_sum_, row_scatter_sum_
from lightning_gradcomp.simulation import SimulatedExchange

from tests._atomic_order import AtomicOrder, deterministic_algorithms
from tests._gloo_workers import conformance_settings
from tests.test_segments import SEGMENTED, SHAPES

WORKERS = 5
#: besides the path-equality suite's configurations: DeMo's means unsigned in fp32 (signs hide the last bits),
#: and every registered compressor that suite does not name (a new one), at the conformance suite's settings
MORE = [("demo-unsigned", lambda: COMPRESSORS["demo"](chunk=8, k=4, sign=False))] + [
    (name, functools.partial(lambda name: COMPRESSORS[name](**conformance_settings().get(name, {})), name))
    for name in sorted(COMPRESSORS) if name not in {label.split("-")[0] for label, _ in SEGMENTED}]
EVERY = SEGMENTED + MORE
#: (label, factory, segmented): every configuration's whole buckets (the path a GPU runs), and the per-tensor
#: protocols of each compressor's first configuration (each name once)
CASES = [(label, make, True) for label, make in EVERY] + [
    (label, make, False) for index, (label, make) in enumerate(EVERY)
    if label.split("-")[0] not in {other.split("-")[0] for other, _ in EVERY[:index]}]


def _grads(worker: int, step: int, device: str) -> list[tuple[str, torch.Tensor]]:
    """A component every worker shares and a little of each worker's own: the workers choose mostly the
    same coordinates, with values that differ in their last bits."""
    common = torch.Generator().manual_seed(step)
    own = torch.Generator().manual_seed(1000 * step + worker + 1)
    return [(name, (torch.randn(shape, generator=common) + 0.01 * torch.randn(shape, generator=own)).to(device))
            for name, shape in SHAPES.items()]


def decode(make, segmented: bool, device: str = "cpu",
           order: AtomicOrder | None = None) -> list[dict[str, torch.Tensor]]:
    """Two steps of :data:`WORKERS` simulated workers on ``device`` (the second with the state the first left):
    the averaged gradients of each step (under ``order``, the emulated order of atomic adds, where given)."""
    exchange = SimulatedExchange(make(), workers=WORKERS, min_compress_numel=100)
    for engine in exchange.engines:
        engine.segmented = segmented
    results = []
    with order or contextlib.nullcontext():
        for step in range(2):
            for worker in range(WORKERS):
                exchange.add_worker(worker, _grads(worker, step, device))
            results.append(exchange.finish_step())
    return results


def assert_identical(first: list[dict[str, torch.Tensor]], second: list[dict[str, torch.Tensor]], label: str) -> None:
    """The same gradients bit for bit, step by step."""
    for step, (one, other) in enumerate(zip(first, second)):
        for name in one:
            assert torch.equal(one[name], other[name]), (label, step, name)


@pytest.mark.filterwarnings("ignore:DeMo. parameter 'a.weight'")  # 33 x 17 in tiles of 3 x 1: sent whole, on purpose
@pytest.mark.parametrize("label,make,segmented", CASES, ids=[
    f"{label}-{'whole-buckets' if segmented else 'per-tensor'}" for label, _, segmented in CASES])
def test_every_rank_decodes_the_same_gradient_whatever_the_order_of_atomic_adds(label: str, make,
                                                                               segmented: bool) -> None:
    """Two decodes under two orders of atomic adds; the second also as ``Trainer(deterministic=True)`` runs
    it (``torch.use_deterministic_algorithms``, which fills uninitialised memory with NaN: a buffer from
    ``torch.empty`` that is not wholly written shows)."""
    with accelerator_path():
        first = decode(make, segmented, order=AtomicOrder(1))
        with deterministic_algorithms():
            second = decode(make, segmented, order=AtomicOrder(2))
    assert_identical(first, second, label)


def test_the_emulated_atomic_order_changes_a_plain_scatter_sum() -> None:
    """The check can fail: five workers' values of one coordinate, summed by ``index_add_`` under two orders,
    round differently; :func:`index_sum_` on the accelerator path gives one sum."""
    index = torch.zeros(5 * 64, dtype=torch.int64).add_(torch.arange(64).repeat(5))
    values = torch.randn(5 * 64, generator=torch.Generator().manual_seed(0), dtype=torch.float32) * 1e3 + 1e-3
    sums = []
    for seed in (1, 2):
        with AtomicOrder(seed) as order:
            sums.append(torch.zeros(64).index_add_(0, index, values, alpha=0.2))
        assert order.shuffled == 1
    assert not torch.equal(*sums)
    with accelerator_path():
        fixed = []
        for seed in (1, 2):
            with AtomicOrder(seed):
                fixed.append(index_sum_(torch.zeros(64), index, values, alpha=0.2))
    assert torch.equal(*fixed)


@pytest.mark.parametrize("operation", [
    lambda: torch.zeros(4).index_put_((torch.tensor([1, 1]),), torch.ones(2)),
    lambda: torch.zeros(4).index_copy_(0, torch.tensor([2, 2]), torch.ones(2)),
    lambda: torch.zeros(2, 4).scatter_(1, torch.tensor([[0, 0]]), torch.ones(1, 2)),
    lambda: torch.zeros(4).scatter_reduce(0, torch.tensor([1, 2]), torch.ones(2), "sum"),
    lambda: torch.arange(4.0).cumsum(0),
], ids=["index_put-repeated", "index_copy-repeated", "scatter-repeated", "scatter_reduce", "cumsum"])
def test_the_emulation_refuses_what_no_order_makes_deterministic(operation) -> None:
    """Writes to a repeated index, and operations that are not deterministic on a GPU whatever their inputs,
    fail inside :class:`AtomicOrder` (code that used them would pass the order check by luck)."""
    with pytest.raises(AssertionError, match="GPU"), AtomicOrder(0):
        operation()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("workers", [2, 3, 4, 8])
def test_the_sums_on_both_paths_are_those_of_index_add_worker_after_worker(dtype: torch.dtype, workers: int) -> None:
    """:func:`index_sum_` on the CPU and on the accelerator path against each worker's ``index_add_`` in turn (the
    per-tensor protocols): equal, except that the accelerator path rounds a scaled 16-bit value to its dtype
    before adding it (at most half a unit in the last place of each scaled value, where ``1/N`` is inexact;
    on the CPU, that is — CUDA's kernel sums a coordinate's repeats in fp32 and rounds once)."""
    generator = torch.Generator().manual_seed(workers)
    index = torch.randint(0, 50, (workers, 40), generator=generator)
    values = torch.randn(workers, 40, generator=generator).to(dtype)
    alpha = 1.0 / workers
    expected = torch.zeros(50, dtype=dtype)
    for worker in range(workers):
        expected.index_add_(0, index[worker], values[worker], alpha=alpha)
    for accelerator in (False, True):
        with accelerator_path() if accelerator else contextlib.nullcontext():
            got = index_sum_(torch.zeros(50, dtype=dtype), index.view(-1), values.view(-1), alpha=alpha)
        if accelerator and dtype in (torch.bfloat16, torch.float16) and workers & (workers - 1):
            # each term's product rounded once more: half an ulp of the largest term per term, and the sum's
            # own roundings (one ulp of the largest partial sum per add) on either side
            largest = values.float().abs().max() * alpha
            terms = torch.zeros(50).index_add_(0, index.view(-1), torch.ones(index.numel()))
            bound = 2 * terms * torch.finfo(dtype).eps * (largest + got.float().abs() + expected.float().abs())
            assert ((got.float() - expected.float()).abs() <= bound).all(), (dtype, workers)
        else:
            assert torch.equal(got, expected), (accelerator, dtype, workers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_row_sums_on_both_paths_are_those_of_scatter_add(dtype: torch.dtype) -> None:
    """:func:`row_scatter_sum_` (DeMo's sums of every worker's coefficients, in fp32 or fp64) on the CPU and on the
    accelerator path against ``scatter_add_`` along rows: equal."""
    generator = torch.Generator().manual_seed(0)
    index = torch.randint(0, 50, (6, 40), generator=generator)
    values = torch.randn(6, 40, generator=generator, dtype=dtype)
    expected = torch.zeros(6, 50, dtype=dtype).scatter_add_(1, index, values)
    for accelerator in (False, True):
        with accelerator_path() if accelerator else contextlib.nullcontext():
            assert torch.equal(row_scatter_sum_(torch.zeros(6, 50, dtype=dtype), index, values), expected)
