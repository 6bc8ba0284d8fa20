"""Whole-bucket compression (core/segments.py) against the per-tensor protocols it replaces, and the
issue's budget of ATen operations per bucket (tests/_op_count.py).

The per-tensor protocols are the reference (the conformance suite and the oracle check them); a
compressor's ``exchange_segments`` must give the same results, residuals, state and counts, step after
step, on tensors whose sizes leave gaps between segments, through a non-finite step and a checkpoint.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_gradcomp.compressors import COMPRESSORS, Compressor
from lightning_gradcomp.core.device import accelerator_path
from lightning_gradcomp.exchange.engine import Entry
from lightning_gradcomp.simulation import SimulatedExchange

from tests._op_count import bound, count_bucket_ops, count_step_ops, layout_constant_bytes

#: sizes that leave gaps after most segments, a tensor below the size threshold, a 1-D tensor
SHAPES = {"a.weight": (33, 17), "b.weight": (1000,), "c.weight": (64, 64), "d.bias": (40,), "e.weight": (7, 300)}

#: (label, factory) of every compressor with a whole-bucket exchange, at settings that exercise both
#: the pruned and the unpruned rows of the block selection
SEGMENTED = [
    ("topk-0.001", lambda: COMPRESSORS["topk"](density=0.001)),
    ("topk-0.05", lambda: COMPRESSORS["topk"](density=0.05)),
    ("topk-sampled", lambda: COMPRESSORS["topk"](density=0.01, selection="sampled")),
    ("dgc", lambda: COMPRESSORS["dgc"](density=0.01)),
    ("dgc-nesterov-clipped", lambda: COMPRESSORS["dgc"](density=0.002, nesterov=True, clip_norm=1.0)),
    ("efsignsgd", lambda: COMPRESSORS["efsignsgd"]()),
    ("signsgd", lambda: COMPRESSORS["signsgd"]()),
    ("signum", lambda: COMPRESSORS["signsgd"](momentum=0.9, scale="none")),
    ("qsgd", lambda: COMPRESSORS["qsgd"]()),
    ("qsgd-4bit-bucket-96", lambda: COMPRESSORS["qsgd"](bits=4, bucket_size=96)),
    ("qsgd-tensor-scale", lambda: COMPRESSORS["qsgd"](levels=3, bucket_size=100_000)),
    ("terngrad", lambda: COMPRESSORS["terngrad"]()),
    ("terngrad-blocks", lambda: COMPRESSORS["terngrad"](block_size=256)),
    ("int8", lambda: COMPRESSORS["int8"]()),
    ("int8-no-owner-feedback", lambda: COMPRESSORS["int8"](block_size=64, owner_error_feedback=False)),
    ("int4", lambda: COMPRESSORS["int4"]()),
    ("fp8-e5m2", lambda: COMPRESSORS["fp8"](format="e5m2", block_size=32)),
    ("fp8", lambda: COMPRESSORS["fp8"]()),
    ("fp4", lambda: COMPRESSORS["fp4"]()),
    ("fp4-e2m1-no-owner-feedback", lambda: COMPRESSORS["fp4"](format="e2m1", block_size=64,
                                                               owner_error_feedback=False)),
    ("int4-blocks-of-6", lambda: COMPRESSORS["int4"](block_size=6)),
    ("powersgd", lambda: COMPRESSORS["powersgd"]()),
    ("sparseloco", lambda: COMPRESSORS["sparseloco"](chunk=128, k=8)),
    ("sparseloco-values-all", lambda: COMPRESSORS["sparseloco"](chunk=256, k=4, bits=None, aggregate="all")),
    ("sparseloco-3-bit-all-padded", lambda: COMPRESSORS["sparseloco"](chunk=100, k=7, bits=3, aggregate="all")),
    ("sparseloco-four-chunk-lengths", lambda: COMPRESSORS["sparseloco"](chunk=1024, k=16)),
    ("demo-groups-out-of-order", lambda: COMPRESSORS["demo"](chunk=4, k=2)),
    ("demo", lambda: COMPRESSORS["demo"](chunk=8, k=4)),
    ("demo-bf16-unsigned", lambda: COMPRESSORS["demo"](chunk=16, k=8, sign=False, value_dtype="bfloat16")),
    ("powersgd-rank-4-cold-late", lambda: COMPRESSORS["powersgd"](rank=4, warm_start=False, start_step=2)),
    ("none", lambda: COMPRESSORS["none"]()),
    ("fp16", lambda: COMPRESSORS["fp16"]()),
    ("bf16-with-error-feedback", lambda: _with_feedback(COMPRESSORS["bf16"]())),
    ("randomk", lambda: COMPRESSORS["randomk"](density=0.05)),
    ("randomk-own-indices", lambda: COMPRESSORS["randomk"](density=0.01, shared_indices=False)),
    ("randomk-above-1/8", lambda: COMPRESSORS["randomk"](density=0.3)),
    ("threshold", lambda: COMPRESSORS["threshold"](threshold=1.5)),
    ("threshold-zero", lambda: COMPRESSORS["threshold"](threshold=0.0)),
]


def _grads(worker: int, step: int, device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1000 * step + worker)
    grads = [(name, torch.randn(shape, generator=generator)) for name, shape in SHAPES.items()]
    if step == 2 and worker == 1:
        grads[2][1][3, 5] = float("nan")
    return [(name, grad.to(device)) for name, grad in grads]


def _run(make, segmented: bool, steps: range, workers: int = 3, exchange: SimulatedExchange | None = None,
         device: str = "cpu"):
    exchange = exchange or SimulatedExchange(make(), workers=workers, min_compress_numel=100)
    exchange.telemetry = True
    for engine in exchange.engines:
        engine.segmented = segmented
    results = []
    for step in steps:
        for worker in range(exchange.workers):
            exchange.add_worker(worker, _grads(worker, step, device))
        if step == 2:
            with pytest.warns(RuntimeWarning, match="non-finite"):
                results.append(exchange.finish_step())
        else:
            results.append(exchange.finish_step())
        results[-1]["bytes"] = torch.tensor(exchange.step_stats.bytes_sent)
        results[-1]["sent"] = torch.tensor(exchange.step_stats.elements_sent)
    return exchange, results


#: Bucket-wise paths that reduce in another order than the per-tensor ones (a scale from a multi-tensor
#: norm or from a row's norm with the gap's zeros, the workers averaged in one reduction): equal up to
#: float rounding, and for the stochastic quantisers a rounding may land a code on the other side of a
#: level (as the conformance oracle allows, at most 1% of the elements). Everything else: bit for bit.
ROUNDED = ("efsignsgd", "qsgd", "terngrad", "powersgd", "demo")


def _assert_same(expected: list[dict], actual: list[dict], label: str, rounded: bool | None = None) -> None:
    rounded = label.startswith(ROUNDED) if rounded is None else rounded
    for step, (want, got) in enumerate(zip(expected, actual)):
        for name in want:
            if name == "bytes":  # segments are gathered as one payload: alignment may differ by a few bytes
                assert abs(float(got[name]) - float(want[name])) <= 64 * len(SHAPES), (label, step)
                continue
            if not rounded:
                assert torch.equal(got[name], want[name]) or torch.allclose(got[name], want[name], equal_nan=True,
                                                                            rtol=0, atol=0), (label, step, name)
                continue
            close = torch.isclose(got[name], want[name], rtol=1e-5, atol=1e-6, equal_nan=True)
            assert float(close.double().mean()) >= 0.99, (label, step, name, float(close.double().mean()))


@pytest.mark.filterwarnings("ignore:DeMo. parameter 'a.weight'")  # 33 x 17 in tiles of 3 x 1: sent whole, on purpose
@pytest.mark.parametrize("label,make", SEGMENTED, ids=[label for label, _ in SEGMENTED])
def test_the_whole_bucket_exchange_equals_the_per_tensor_protocols(label: str, make) -> None:
    """Along the accelerator path (where compressors compress whole buckets), against the per-tensor
    protocols on the same path (tests/test_cuda.py runs the same on a GPU)."""
    with accelerator_path():
        compare_paths(label, make, "cpu")


def compare_paths(label: str, make, device: str, exchange_type: type = SimulatedExchange) -> None:
    """Five steps of 3 simulated workers on ``device``, whole buckets against per-tensor protocols:
    results, counts, bytes, residuals, compressor state and telemetry. On a GPU to float rounding for
    every compressor (its scatter-adds sum in no fixed order). ``exchange_type``: the whole buckets'."""
    rounded = label.startswith(ROUNDED) or device != "cpu"
    reference, expected = _run(make, segmented=False, steps=range(5), device=device)
    fast, actual = _run(make, segmented=True, steps=range(5), device=device,
                        exchange=exchange_type(make(), workers=3, min_compress_numel=100))
    assert fast.pipelines[0].compressor.segment_alignment(torch.device(device)) is not None
    _assert_same(expected, actual, label, rounded)
    for ours, theirs in zip(fast.pipelines, reference.pipelines):
        assert ours.memory.residuals.keys() == theirs.memory.residuals.keys()
        if rounded:
            for name, residual in theirs.memory.residuals.items():
                close = torch.isclose(ours.memory.residuals[name], residual, rtol=1e-5, atol=1e-5)
                assert float(close.double().mean()) >= 0.99, (label, name)
            for name, states in theirs.memory.states.items():
                for key, value in states.items():
                    assert ours.memory.states[name][key].shape == value.shape, (label, name, key)
                    close = torch.isclose(ours.memory.states[name][key], value, rtol=1e-5, atol=1e-5)
                    assert float(close.double().mean()) >= 0.99, (label, name, key)
            assert fast.totals.error_sq == pytest.approx(reference.totals.error_sq, rel=1e-2)
            continue
        for name, residual in theirs.memory.residuals.items():
            assert torch.equal(ours.memory.residuals[name], residual), (label, name)
        for name, states in theirs.memory.states.items():
            for key, value in states.items():
                assert torch.equal(ours.memory.states[name][key], value), (label, name, key)
        assert fast.totals.error_sq == pytest.approx(reference.totals.error_sq, rel=1e-9)


class _IntoTheGradients(SimulatedExchange):
    """DDP's way (``ddp/hook.py``): worker 0's results go into its gradients themselves (each ``Entry``'s
    ``out`` is its ``grad``), which hold the gradient, not zeros, when the results are written."""

    def add_worker(self, worker: int, named_grads: list, shapes=None) -> None:
        entries = [Entry(name, tuple(grad.shape), grad.reshape(-1), grad.reshape(-1) if worker == 0 else None)
                   for name, grad in named_grads]
        if worker == 0:
            self._aggregate = {name: grad.reshape(-1) for name, grad in named_grads}
        self.driver.start(worker, self.engines[worker].bucket(entries, self.step, worker, self.workers))


@pytest.mark.filterwarnings("ignore:DeMo. parameter")
@pytest.mark.parametrize("label,make", SEGMENTED, ids=[label for label, _ in SEGMENTED])
def test_a_lone_compressed_tensor_is_written_straight_into_its_gradient(label: str, make, monkeypatch) -> None:
    """A bucket whose one compressed tensor fills the layout (a large layer alone in a DDP bucket) has its
    result written straight into the gradient, as DDP hands it over (holding the gradient, not zeros), with
    no flat buffer and no copy: the same results, residuals and state as the per-tensor protocols. Layouts
    with a gap after the tensor (alignments that do not divide 64 x 64) take the buffer and the copy."""
    from lightning_gradcomp.exchange import pipeline

    monkeypatch.setitem(globals(), "SHAPES", {"a.bias": (40,), "b.bias": (50,), "c.weight": (64, 64)})
    direct: list[bool] = []
    whole_layout = pipeline._whole_layout

    def spy(*args):
        found = whole_layout(*args)
        direct.append(found is not None)
        return found

    monkeypatch.setattr(pipeline, "_whole_layout", spy)
    with accelerator_path():
        compare_paths(label, make, "cpu", exchange_type=_IntoTheGradients)
        align = make().segment_alignment(torch.device("cpu"))
    assert any(direct) == (64 * 64 % align == 0), (label, align)


@pytest.mark.parametrize("label,make", SEGMENTED[:2], ids=[label for label, _ in SEGMENTED[:2]])
def test_a_checkpoint_taken_from_flat_buffers_resumes_either_way(label: str, make) -> None:
    """The per-name residuals are views of the flat buffer: a checkpoint of a bucket-wise run resumes
    bucket-wise and per tensor alike, bit for bit."""
    with accelerator_path():
        whole, _ = _run(make, segmented=True, steps=range(3))
        states = whole.state_dicts()
        _, expected = _run(make, segmented=True, steps=range(3, 6), exchange=whole)
        for segmented in (True, False):
            restored = SimulatedExchange(make(), workers=3, min_compress_numel=100)
            restored.load_state_dicts(states, torch.device("cpu"))
            _, actual = _run(make, segmented=segmented, steps=range(3, 6), exchange=restored)
            _assert_same(expected, actual, f"{label} resumed segmented={segmented}")
    # and a CPU run (per-tensor protocols there) resumes from the same checkpoint identically
    restored = SimulatedExchange(make(), workers=3, min_compress_numel=100)
    restored.load_state_dicts(states, torch.device("cpu"))
    _, actual = _run(make, segmented=True, steps=range(3, 6), exchange=restored)
    _assert_same(expected, actual, f"{label} resumed on the CPU path")


OP_BUDGET = ["topk", "dgc", "qsgd", "terngrad", "efsignsgd", "signsgd", "int8", "fp8", "powersgd", "demo", "none",
             "fp16", "bf16"]


@pytest.mark.parametrize("name", OP_BUDGET)
@pytest.mark.parametrize("tensors", [1, 10, 100])
@pytest.mark.parametrize("shape", [(128, 128), (100, 129)], ids=["whole-rows", "gaps"])
def test_a_bucket_costs_at_most_40_plus_3_ops_per_tensor(name: str, tensors: int, shape: tuple[int, int]) -> None:
    """One worker's compress + exchange + decode of a bucket of P compressed tensors, along the
    accelerator path: at most 40 + 3·P non-view ATen operations (the GPU's kernel launches), whether the
    tensors fill whole rows or leave gaps between segments."""
    counted = count_bucket_ops(lambda: _default(name), tensors, shape=shape)
    total = sum(counted.ops.values())
    assert total <= bound(tensors), f"{name}, P={tensors}: {total} ops > {bound(tensors)}: {dict(counted.ops)}"


def test_powersgd_orthogonalises_one_batch_per_shape_where_padding_would_be_large(monkeypatch) -> None:
    """Below the padding limits (a tall matrix among short ones), one Gram–Schmidt per group of one
    shape, with the same results."""
    from lightning_gradcomp.compressors import powersgd

    monkeypatch.setattr(powersgd, "PAD_LIMIT", 0)
    monkeypatch.setattr(powersgd, "PAD_RATIO", 0)
    with accelerator_path():
        compare_paths("powersgd-unpadded", lambda: COMPRESSORS["powersgd"](), "cpu")


@pytest.mark.parametrize("tensors", [1, 10, 100])
def test_powersgd_with_a_shape_per_matrix_stays_within_the_budget(tensors: int) -> None:
    """Matrices of distinct shapes cannot share a batched product: three per shape (``P = MQ``, ``Q = MᵀP̂``,
    ``P̂Qᵀ``), everything else (gathering, Gram–Schmidt of one zero-padded batch, writing back) once per
    bucket."""
    bucket = {f"layer{index:03d}.weight": (64 + index, 96 + 2 * index) for index in range(tensors)}
    total = sum(count_step_ops(lambda: _default("powersgd"), [bucket]).ops.values())
    assert total <= bound(tensors), total


@pytest.mark.parametrize("name", ["int4", "fp4"])
@pytest.mark.parametrize("tensors", [1, 10, 100])
def test_the_4_bit_codecs_stay_within_the_budget_for_whole_rows(name: str, tensors: int) -> None:
    """int4 and fp4 need a few more element-wise operations than int8 (a conversion and a table lookup per
    decoding, the packing of nibbles): within 40 + 3·P all the same where the tensors fill whole blocks."""
    total = sum(count_bucket_ops(lambda: _default(name), tensors).ops.values())
    assert total <= bound(tensors), total


@pytest.mark.parametrize("name,shape,ceiling", [("int4", (100, 129), 51), ("fp4", (100, 129), 53),
                                                ("sparseloco", (128, 128), 64)])
def test_a_few_compressors_cost_more_at_one_tensor_but_the_same_for_any_number(name: str, shape, ceiling) -> None:
    """Over the budget at P = 1 only: a lone 4-bit-coded tensor with a gap after it (its zero blocks joined on,
    its result through a buffer), SparseLoCo (per group of chunks a selection, per-tensor statistics, a lookup and
    two scatter-adds; every H steps, as the outer compressor of local updates). Checked here: no per-tensor op
    (the same count for 10 and 100 tensors), within the budget from P = 10, no regression past today's counts
    (fusing each codec's element-wise chain on a GPU is the way further down)."""
    counts = [sum(count_bucket_ops(lambda: _default(name), tensors, shape=shape).ops.values())
              for tensors in (1, 10, 100)]
    assert counts[0] <= counts[1] == counts[2] <= ceiling, counts
    assert counts[1] <= bound(10)


#: configurations whose constants are per block of a few elements by their nature
_TINY_BLOCKS = {"int4-blocks-of-6"}


@pytest.mark.parametrize("label,make", [case for case in SEGMENTED if case[0] not in _TINY_BLOCKS],
                         ids=[label for label, _ in SEGMENTED if label not in _TINY_BLOCKS])
@pytest.mark.parametrize("shape", [(300, 301), (128, 128), (40, 1001)], ids=["odd", "whole-rows", "odd-by-8"])
def test_a_bucket_layout_keeps_well_under_a_byte_of_constants_per_element(label: str, make, shape) -> None:
    """The indices, masks and plans kept per bucket layout live in GPU memory for as long as the buckets
    do: at most 5/8 of a byte per gradient element (an int64 index per element would be 8 bytes: 8 GB for a
    1B-parameter model; blocks, rows, groups of elements and joined views are indexed instead; the most is
    QSGD's int32 index per group of 8 codes where the tensors' sizes are odd multiples of 8, 40 x 1001),
    plus, for the sparsifiers, 8 bytes per coordinate sent (their plan of the selection is as long as their
    payload), with 8 workers and tensors sent dense beside."""
    tensors = 10 if shape == (128, 128) else 4
    held = layout_constant_bytes(make, tensors, shape=shape, workers=8, dense_tensors=3)
    elements = tensors * math.prod(shape)
    allowed = elements * (0.625 + 8 * getattr(make(), "density", 0.0))
    assert held <= allowed, f"{label}: {held} bytes for {elements} elements"


@pytest.mark.parametrize("name", ["topk", "int8", "signsgd", "demo"])
def test_a_bucket_costs_the_same_ops_for_any_number_of_workers(name: str) -> None:
    """Nothing is done once per worker: the received rows are read as one strided view and the workers'
    verdict flags summed by one reduction (8 workers on one GPU node: no 7 additions per bucket)."""
    counts = [sum(count_bucket_ops(lambda: _default(name), 10, workers=workers).ops.values()) for workers in (2, 8)]
    assert counts[0] == counts[1], counts


@pytest.mark.parametrize("name", ["dgc", "fp16", "topk", "qsgd", "demo"])
def test_tensors_sent_dense_cost_a_fixed_number_of_ops(name: str) -> None:
    """Biases and norms below the size threshold are one flat buffer too (DGC's momentum on them, the
    casts' cast): 30 of them beside 10 compressed tensors add a few operations, not a few per tensor."""
    alone = sum(count_bucket_ops(lambda: _default(name), 10).ops.values())
    with_small = sum(count_bucket_ops(lambda: _default(name), 10, dense_tensors=30).ops.values())
    assert with_small - alone <= 12, (alone, with_small)


#: whole-bucket writes that make a void bucket's results NaN themselves: a buffer filled with the verdict flag
#: for those that scatter-add, the flag added to the scales, norms or means the others multiply or write
FOLD_THE_VERDICT = [("topk", {}), ("dgc", {}), ("sparseloco", {"aggregate": "all"}), ("sparseloco", {}),
                    ("demo", {"sign": False}),
                    ("int8", {}), ("int4", {}), ("fp8", {}), ("fp4", {}), ("qsgd", {}), ("terngrad", {}),
                    ("signsgd", {}), ("efsignsgd", {}), ("none", {}), ("fp16", {}), ("bf16", {})]


@pytest.mark.parametrize("name,options", FOLD_THE_VERDICT,
                         ids=[f"{name}-{'-'.join(map(str, options.values()))}" for name, options in FOLD_THE_VERDICT])
def test_a_void_bucket_needs_no_pass_over_its_results(name: str, options: dict, monkeypatch) -> None:
    """A bucket not finite on some worker has NaN results on every worker (checked with the per-tensor path's
    results in every comparison above, step 2): the engine's multi-tensor add of the verdict flag over every
    result (a read and a write of the whole bucket on a GPU) is left to these compressors' writes, which fold
    the flag in where it costs a small tensor's op."""
    from lightning_gradcomp.exchange.engine import BucketVerdict

    poisoned: list[int] = []
    original = BucketVerdict.poison

    def spy(self, outs, summed) -> None:
        poisoned.append(len(outs))
        original(self, outs, summed)

    monkeypatch.setattr(BucketVerdict, "poison", spy)
    count_bucket_ops(lambda: COMPRESSORS[name](**options), 10)
    assert poisoned and not any(poisoned), poisoned


def test_the_traffic_estimate_reads_and_writes_what_each_op_touches() -> None:
    """The memory-traffic estimate of benchmarks/op_count.py: an element-wise op reads its inputs and writes its
    output, a fill only writes, a scatter-add moves its rows and index, not the whole destination."""
    from tests._op_count import OpCounter

    x, rows, values = torch.zeros(1000, 100), torch.tensor([3, 5]), torch.ones(2, 100)
    with OpCounter() as counter:
        x.add_(1.0)
        x.zero_()
        x.index_add_(0, rows, values)
        torch.index_select(x, 0, rows)
    assert dict(counter.traffic) == {"add_": 800_000, "zero_": 400_000, "index_add_": 2 * 800 + 800 + 16,
                                     "index_select": 2 * 800 + 16}


def test_the_op_count_sees_a_per_tensor_loop() -> None:
    """The counter is not blind: the per-tensor protocols of the same compressor exceed the budget."""
    from lightning_gradcomp.exchange.engine import ExchangeEngine

    original = ExchangeEngine.__init__

    def per_tensor(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        self.segmented = False

    ExchangeEngine.__init__ = per_tensor  # type: ignore[method-assign]
    try:
        counted = count_bucket_ops(lambda: _default("topk"), 100)
    finally:
        ExchangeEngine.__init__ = original  # type: ignore[method-assign]
    assert sum(counted.ops.values()) > bound(100)


def _with_feedback(compressor: Compressor) -> Compressor:
    compressor.default_error_feedback = True  # this instance only
    return compressor


def _default(name: str) -> Compressor:
    return COMPRESSORS[name]()



def test_a_new_bucket_layout_takes_the_residuals_along_and_drops_the_old_buffer() -> None:
    """DDP rebuilds its buckets after the first step: the residuals move to the new layout's flat
    buffer (per name, gaps zero) and the old buffer is released."""
    from lightning_gradcomp.core.segments import Segments
    from lightning_gradcomp.exchange.memory import CompressionMemory

    memory = CompressionMemory()
    first = Segments(("a", "b"), ((70,), (30,)), 64)
    grads = [torch.randn(70), torch.randn(30)]
    corrected = memory.compensate_bucket(first, grads)
    memory.update_bucket(first, corrected, lambda flat: flat.mul_(0.5))
    before = {name: memory.residuals[name].clone() for name in ("a", "b")}
    second = Segments(("a", "b", "c"), ((70,), (30,), (10,)), 64)
    corrected = memory.compensate_bucket(second, grads + [torch.zeros(10)])
    for name, view in zip(second.names, second.views(corrected)):
        expected = before[name] + (grads[0] if name == "a" else grads[1]) if name in before else torch.zeros(10)
        assert torch.equal(view, expected), name
    memory.update_bucket(second, corrected, lambda flat: None)
    assert len(memory._flats) == 1 and next(iter(memory._flats))[-1] == second.key
    assert torch.count_nonzero(corrected[70:128]) == 0, "the gaps stay zero"
